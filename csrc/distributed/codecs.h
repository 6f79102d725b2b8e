// The compressors as the engine uses them: the kernels through the
// dispatcher (csrc/ops, or a compressor registered in Python), a block
// codec's segments of a chunk (the two-phase all-reduce), and one payload
// format for every method (what the gathered all-reduce, the
// reduce-scatter and the all-gather exchange).
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "spec.h"

namespace pycomm {
namespace dist {

struct Config;

// Whether a codec runs the torch-free CPU kernels (kernels/cpu) on t over
// raw pointers, no tensor made but the payload: a contiguous float32 CPU
// tensor. The same kernels as the ops, so the same bits; a small call's
// host time is mostly the ops' tensor bookkeeping.
inline bool direct_cpu(const at::Tensor& t) {
  return t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Any other method name is a compressor registered in Python.
inline bool is_plugin(const std::string& m) { return !m.empty() && !known_method(m) && m != "auto"; }

// A block codec (a row of kind "block": onebit or a quant width) as the engine uses it: compress a
// whole chunk, cut a segment's wire words out of its payload, decode a
// segment's wire words. Segments start at whole blocks (BlockLayout), and
// blocks at multiples of 32 elements, so a segment's data starts at a whole
// word or byte of the chunk's.
struct BlockCodec {
  bool quant;  // the quant kernels (levels of `bits` bits), else onebit's
  int bits;
  int64_t block;

  // The codec of block method `m` (its row's family and bits).
  static BlockCodec of(const std::string& m, int64_t block_size) {
    return {method_family(m) == "quant", block_bits(m), block_size};
  }

  // `seed`: a quant codec's stochastic rounding seed, -1 to nearest (onebit
  // has no rounding).
  std::tuple<at::Tensor, at::Tensor> compress(const at::Tensor& g,
                                              const std::optional<at::Tensor>& r,
                                              int64_t seed) const;
  // The new residual into r_out, r left as it was.
  std::tuple<at::Tensor, at::Tensor> compress_into(const at::Tensor& g, const at::Tensor& r,
                                                   const at::Tensor& r_out, int64_t seed) const;
  // Wire words (int32: data, then scales) of elements [lo, lo + len) of a payload.
  std::vector<at::Tensor> segment(const at::Tensor& data, const at::Tensor& scales, int64_t lo,
                                  int64_t len) const;
  // The scales of the len-element segment at `offset` of an int32 buffer.
  at::Tensor scales_at(const at::Tensor& buf, int64_t offset, int64_t len) const;
  // Whether segments with these scales (contiguous float32 views) decode
  // to finite values only: their largest value is +-scale (onebit) or
  // qmax * scale (quant; the product can overflow even where the scale
  // does not). A 0-dim bool.
  at::Tensor finite(const std::vector<at::Tensor>& scales) const;
  // Decodes the len-element segment at `offset` of an int32 buffer into out.
  void decompress(const at::Tensor& out, const at::Tensor& buf, int64_t offset,
                  bool accumulate) const;

  // On a CPU (direct_cpu), with the torch-free kernels over raw pointers:
  // The payload of g (wire words, then `tag`) in one new byte buffer;
  // r_in/r_out as the kernels take them (both null: no error feedback).
  at::Tensor encode_direct(const at::Tensor& g, const float* r_in, float* r_out, int64_t seed,
                           const at::Tensor& tag) const;
  // Decodes n elements from the wire words at `words` into out (added with
  // `accumulate`).
  void decode_direct(const int32_t* words, int64_t n, float* out, bool accumulate) const;
};

// One segment's payload as bytes, a fixed size for a given length (every
// method and registered compressor), followed by the call's tag, and its
// decoding. Parts start 8-byte aligned, so the receiver views them in place.
struct PayloadCodec {
  std::string method;
  const Config& cfg;
  BlockCodec block;

  PayloadCodec(const std::string& m, const Config& c, int64_t block_size)
      : method(m), cfg(c), block(BlockCodec::of(m, block_size)) {}

  // The payload of `seg` (with error feedback when `r` is given, updated in
  // place, or, a block codec's given `r_out`, written there with r left as
  // it was), then `tag` (int32 words). `layout`: a registered compressor's
  // payload parts (dtypes and shapes), learned from the first payload of a
  // chunk when empty (its segments are alike).
  at::Tensor encode(const at::Tensor& seg, const std::optional<at::Tensor>& r,
                    const at::Tensor* r_out, int64_t seed, const at::Tensor& tag,
                    std::vector<at::Tensor>& layout) const;
  // Decodes the payloads of a received buffer of `slot`-byte slots (one per
  // rank, payload first, tag last): slot j into dst[j] (written), or, given
  // one tensor, all of them into it, added in rank order.
  void decode(const at::Tensor& buf, int64_t slot, const std::vector<at::Tensor>& layout,
              const std::vector<at::Tensor>& dst) const;

 private:
  // Rank j's top-k payload (`words` int32s at w) into out (direct_cpu).
  void decode_topk_direct(const int32_t* w, int64_t words, int64_t j, const at::Tensor& out,
                          bool accumulate) const;
};

}  // namespace dist
}  // namespace pycomm
