// The compressors through the dispatcher: the CPU kernels for CPU tensors,
// the CUDA ones for CUDA tensors (csrc/ops), no Python involved except for
// a compressor registered in Python.
#include "codecs.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#include "config.h"

namespace pycomm {
namespace dist {
namespace {

std::tuple<at::Tensor, at::Tensor> onebit_compress(const at::Tensor& g,
                                                   const std::optional<at::Tensor>& r,
                                                   int64_t block_size) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pycomm::onebit_compress", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                    const std::optional<at::Tensor>&, int64_t)>();
  return op.call(g, r, block_size);
}

std::tuple<at::Tensor, at::Tensor> onebit_compress_into(const at::Tensor& g, const at::Tensor& r,
                                                        const at::Tensor& r_out,
                                                        int64_t block_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::onebit_compress_into", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(g, r, r_out, block_size);
}

void onebit_decompress(const at::Tensor& out, const at::Tensor& bits, const at::Tensor& scales,
                       int64_t block_size, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::onebit_decompress", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   int64_t, bool)>();
  op.call(out, bits, scales, block_size, accumulate);
}

std::tuple<at::Tensor, at::Tensor> quant_compress(const at::Tensor& g,
                                                  const std::optional<at::Tensor>& r, int64_t bits,
                                                  int64_t block_size, int64_t seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_compress", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                           int64_t)>();
  return op.call(g, r, bits, block_size, seed);
}

std::tuple<at::Tensor, at::Tensor> quant_compress_into(const at::Tensor& g, const at::Tensor& r,
                                                       const at::Tensor& r_out, int64_t bits,
                                                       int64_t block_size, int64_t seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_compress_into", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           int64_t, int64_t)>();
  return op.call(g, r, r_out, bits, block_size, seed);
}

void quant_decompress(const at::Tensor& out, const at::Tensor& data, const at::Tensor& scales,
                      int64_t bits, int64_t block_size, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_decompress", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   int64_t, int64_t, bool)>();
  op.call(out, data, scales, bits, block_size, accumulate);
}

std::tuple<at::Tensor, at::Tensor> topk_compress(const at::Tensor& g,
                                                 const std::optional<at::Tensor>& r, int64_t k,
                                                 bool approx) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::topk_compress", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool)>();
  return op.call(g, r, k, approx);
}

void topk_decompress(const at::Tensor& out, const at::Tensor& indices, const at::Tensor& values,
                     bool accumulate) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pycomm::topk_decompress", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  op.call(out, indices, values, accumulate);
}

// A compressor registered in Python (pycomm/compressors/plugin.py), through
// its two ops; boxed calls, since the payload is a list of tensors.
std::vector<at::Tensor> plugin_compress(const std::string& name, const std::string& options,
                                        const at::Tensor& g, const std::optional<at::Tensor>& r) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pycomm::plugin_compress", "");
  torch::jit::Stack stack{c10::IValue(name), c10::IValue(options), c10::IValue(g),
                          r ? c10::IValue(*r) : c10::IValue()};
  op.callBoxed(&stack);
  return stack.at(0).toTensorVector();
}

void plugin_decompress(const std::string& name, const std::string& options,
                       const std::vector<at::Tensor>& payload, const at::Tensor& out,
                       bool accumulate) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pycomm::plugin_decompress", "");
  torch::jit::Stack stack{c10::IValue(name), c10::IValue(options), c10::IValue(payload),
                          c10::IValue(out), c10::IValue(accumulate)};
  op.callBoxed(&stack);
}

// Bytes of a payload part on the wire: rounded up to a multiple of 8.
int64_t padded_nbytes(int64_t n) { return (n + 7) / 8 * 8; }

}  // namespace

// ------------------------------------------------------------ BlockCodec ---
std::tuple<at::Tensor, at::Tensor> BlockCodec::compress(const at::Tensor& g,
                                                        const std::optional<at::Tensor>& r,
                                                        int64_t seed) const {
  return quant ? quant_compress(g, r, bits, block, seed) : onebit_compress(g, r, block);
}

std::tuple<at::Tensor, at::Tensor> BlockCodec::compress_into(const at::Tensor& g,
                                                             const at::Tensor& r,
                                                             const at::Tensor& r_out,
                                                             int64_t seed) const {
  return quant ? quant_compress_into(g, r, r_out, bits, block, seed)
              : onebit_compress_into(g, r, r_out, block);
}

std::vector<at::Tensor> BlockCodec::segment(const at::Tensor& data, const at::Tensor& scales,
                                            int64_t lo, int64_t len) const {
  const int64_t words = BlockLayout::data_words(len, bits);
  at::Tensor d;
  if (!quant) {
    d = data.narrow(0, lo / kOnebitWordBits, words);
  } else {
    d = data.narrow(0, lo / quant_per_byte(bits), quant_num_bytes(len, bits));
    if (const int64_t pad = 4 * words - d.numel(); pad > 0) d = at::cat({d, at::zeros({pad}, d.options())});
    d = d.view(at::kInt);
  }
  return {d, scales.narrow(0, lo / block, ceil_div(len, block)).view(at::kInt)};
}

at::Tensor BlockCodec::scales_at(const at::Tensor& buf, int64_t offset, int64_t len) const {
  return buf.narrow(0, offset + BlockLayout::data_words(len, bits), ceil_div(len, block))
      .view(at::kFloat);
}

at::Tensor BlockCodec::finite(const std::vector<at::Tensor>& scales) const {
  const float qmax = quant ? float(quant_qmax(bits)) : 1.0f;
  if (scales.empty() || !scales[0].is_cpu()) {
    const at::Tensor s = at::cat(scales);
    return at::isfinite(quant ? s * qmax : s).all();
  }
  // On a CPU a read of the scales where they are: no concatenation, no
  // product tensor (the same float32 product as above).
  bool ok = true;
  for (const at::Tensor& s : scales) {
    const float* p = s.const_data_ptr<float>();
    for (int64_t i = 0, n = s.numel(); i < n && ok; ++i) ok = std::isfinite(p[i] * qmax);
  }
  return at::scalar_tensor(ok, at::kBool);
}

void BlockCodec::decompress(const at::Tensor& out, const at::Tensor& buf, int64_t offset,
                            bool accumulate) const {
  const int64_t len = out.numel(), words = BlockLayout::data_words(len, bits);
  const at::Tensor d = buf.narrow(0, offset, words), s = scales_at(buf, offset, len);
  if (!quant) {
    onebit_decompress(out, d, s, block, accumulate);
  } else {
    quant_decompress(out, d.view(at::kByte).narrow(0, 0, quant_num_bytes(len, bits)), s, bits,
                     block, accumulate);
  }
}

// ---------------------------------------------------------- PayloadCodec ---
at::Tensor PayloadCodec::encode(const at::Tensor& seg, const std::optional<at::Tensor>& r,
                                int64_t seed, const at::Tensor& tag,
                                std::vector<at::Tensor>& layout) const {
  const int64_t len = seg.numel();
  if (is_block_method(method)) {
    auto [data, scales] = block.compress(seg, r, seed);
    std::vector<at::Tensor> parts = block.segment(data, scales, 0, len);
    parts.push_back(tag);
    return at::cat(parts).view(at::kByte);
  }
  if (method == "topk") {
    // [count, indices, values as float bits], zero-padded to 1 + 2 cap.
    const int64_t words = topk_wire_numel(len, cfg.density, cfg.approx);
    auto [idx, vals] = topk_compress(seg, r, topk_k(len, cfg.density), cfg.approx);
    const int64_t count = idx.numel();
    at::Tensor buf = at::zeros({words}, seg.options().dtype(at::kInt));
    buf.narrow(0, 0, 1).fill_(count);
    buf.narrow(0, 1, count).copy_(idx);
    buf.narrow(0, 1 + count, count).copy_(vals.view(at::kInt));
    buf.narrow(0, words - kTagWords, kTagWords).copy_(tag);
    return buf.view(at::kByte);
  }
  std::vector<at::Tensor> parts;
  const bool learn = layout.empty();
  for (auto& p : plugin_compress(method, cfg.plugin_options, seg, r)) {
    TORCH_CHECK(p.device() == seg.device(), "compressor '", method, "' returned a payload on ",
                p.device(), " for a tensor on ", seg.device());
    if (learn) layout.push_back(p);
    const at::Tensor b = p.contiguous().reshape({-1}).view(at::kByte);
    parts.push_back(b);
    if (const int64_t pad = padded_nbytes(b.numel()) - b.numel(); pad > 0)
      parts.push_back(at::zeros({pad}, b.options()));
  }
  parts.push_back(tag.view(at::kByte));
  return at::cat(parts);
}

void PayloadCodec::decode(const at::Tensor& buf, int64_t slot,
                          const std::vector<at::Tensor>& layout,
                          const std::vector<at::Tensor>& dst) const {
  const int64_t world = buf.numel() / slot, nbytes = slot - kTagBytes;
  const bool sum = dst.size() == 1;
  at::Tensor counts;  // top-k: every rank's entry count, read at once
  if (method == "topk") counts = buf.view(at::kInt).view({world, slot / 4}).select(1, 0).cpu();
  for (int64_t j = 0; j < world; ++j) {
    const at::Tensor bytes = buf.narrow(0, j * slot, nbytes);
    const at::Tensor& out = dst[sum ? 0 : j];
    const bool accumulate = sum && j > 0;
    if (is_block_method(method)) {
      block.decompress(out, bytes.view(at::kInt), 0, accumulate);
    } else if (method == "topk") {
      const at::Tensor w = bytes.view(at::kInt);
      const int64_t count = counts[j].item<int32_t>(), cap = (w.numel() - 1) / 2;
      TORCH_CHECK(count >= 0 && count <= cap, "rank ", j, " sent a top-k payload of ", count,
                  " entries, capacity ", cap, ": ranks disagree on the tensor or density");
      if (!accumulate) out.zero_();
      topk_decompress(out, w.narrow(0, 1, count), w.narrow(0, 1 + count, count).view(at::kFloat),
                      true);
    } else {
      std::vector<at::Tensor> payload;
      int64_t off = 0;
      for (const auto& p : layout) {
        const int64_t nb = p.numel() * p.element_size();
        payload.push_back(bytes.narrow(0, off, nb).view(p.scalar_type()).view(p.sizes()));
        off += padded_nbytes(nb);
      }
      plugin_decompress(method, cfg.plugin_options, payload, out, accumulate);
    }
  }
}

}  // namespace dist
}  // namespace pycomm
