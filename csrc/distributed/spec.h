// The spec of the compressed collectives, C++ side: a mirror of
// pycomm/distributed/spec.py (the method table, call-check fields, chunk and
// segment layout). pycomm._C.spec() exports these and
// tests/test_spec.py compares them with the Python spec.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "pycomm/compress_math.h"

namespace pycomm {
namespace dist {

// One row per method: spec.METHOD_TABLE, every field (pycomm._C.spec()
// exports the rows and tests/test_spec.py compares them field by field).
// The row's index is the method's code in call descriptors. `kind`: "block"
// (a scale per block, all-reduced in two phases: segment j reduced by rank
// j, then gathered), "sparse" (top-k), "cast" (a ring all-reduce of a
// narrower float) or "exact". `family`: the kernels that code it ("onebit",
// "quant", "topk"; "" for a cast or the exact all-reduce). `bits`: bits per
// element on the wire (0 for top-k, whose payload is per kept entry); the
// quant kernels take it as data. `block_size`: the block length when none
// is given (0: no blocks). `rounds`: takes stochastic rounding.
// `residuals`: keeps error-feedback residuals. `error_feedback`: on by
// default. `dtype`: a cast's wire dtype ("" otherwise). `auto_candidate`:
// measured by compressor="auto".
struct MethodRow {
  const char* name;
  const char* kind;
  const char* family;
  int bits;
  int64_t block_size;
  bool rounds;
  bool residuals;
  bool error_feedback;
  const char* dtype;
  bool auto_candidate;
};
inline constexpr MethodRow kMethodTable[] = {
    {"onebit", "block", "onebit", 1, 2048, false, true, true, "", true},
    {"topk", "sparse", "topk", 0, 0, false, true, true, "", true},
    {"fp16", "cast", "", 16, 0, false, false, false, "float16", true},
    {"bf16", "cast", "", 16, 0, false, false, false, "bfloat16", false},
    {"none", "exact", "", 32, 0, false, false, false, "", true},
    {"int8", "block", "quant", 8, 256, true, true, false, "", true},
    {"int4", "block", "quant", 4, 256, true, true, false, "", true},
    {"int2", "block", "quant", 2, 256, true, true, true, "", false},
};
inline constexpr int kNumMethods = sizeof(kMethodTable) / sizeof(kMethodTable[0]);

// The names alone, in code order (spec.METHODS), derived from the table.
template <size_t... I>
constexpr std::array<const char*, sizeof...(I)> method_names(std::index_sequence<I...>) {
  return {kMethodTable[I].name...};
}
inline constexpr std::array<const char*, kNumMethods> kMethods =
    method_names(std::make_index_sequence<kNumMethods>{});
inline constexpr int64_t kDefaultChunkNumel = int64_t(1) << 20;

inline int64_t method_code(const std::string& m) {
  for (int64_t i = 0; i < kNumMethods; ++i)
    if (m == kMethodTable[i].name) return i;
  return -1;
}
inline bool known_method(const std::string& m) { return method_code(m) >= 0; }
// The row of a known method, nullptr for any other name ("auto", a
// registered compressor).
inline const MethodRow* method_row(const std::string& m) {
  const int64_t c = method_code(m);
  return c < 0 ? nullptr : &kMethodTable[c];
}
inline bool method_is(const std::string& m, const char* kind) {
  const MethodRow* r = method_row(m);
  return r != nullptr && std::string(r->kind) == kind;
}

// The block codecs (spec.BLOCK_METHODS), and a block codec's bits (0 for
// any other method).
inline bool is_block_method(const std::string& m) { return method_is(m, "block"); }
inline int block_bits(const std::string& m) {
  const MethodRow* r = method_row(m);
  return r != nullptr && std::string(r->kind) == "block" ? r->bits : 0;
}
// The kernel family of a known method ("" for casts, exact and unknown names).
inline std::string method_family(const std::string& m) {
  const MethodRow* r = method_row(m);
  return r != nullptr ? r->family : "";
}
// block_size when none is given (spec.DEFAULT_BLOCK_SIZE); 0 without blocks.
inline int64_t default_block_size(const std::string& m) {
  const MethodRow* r = method_row(m);
  return r != nullptr ? r->block_size : 0;
}
// Takes stochastic rounding (spec.ROUNDING_METHODS).
inline bool method_rounds(const std::string& m) {
  const MethodRow* r = method_row(m);
  return r != nullptr && r->rounds;
}
// Keeps error-feedback residuals (spec.EF_METHODS).
inline bool method_residuals(const std::string& m) {
  const MethodRow* r = method_row(m);
  return r != nullptr && r->residuals;
}

// A block codec's all-reduce of n elements over `world` ranks runs the
// gathered algorithm (one all-gather of every rank's payload, decoded and
// added by every rank) when n * world <= kGatherNumel, else the two-phase
// one (spec.GATHER_NUMEL, spec.all_reduce_gathers; docs/allreduce.md,
// "Small tensors"): such a call waits for one collective instead of two.
// Top-k's and a registered compressor's all-reduce is always gathered, a
// cast's or the exact one never.
inline constexpr int64_t kGatherNumel = int64_t(1) << 14;
inline bool all_reduce_gathers(const std::string& m, int64_t n, int world) {
  if (is_block_method(m)) return n <= kGatherNumel / std::max(1, world);
  return method_is(m, "sparse") || (!known_method(m) && !m.empty() && m != "auto");
}

// FNV-1a: bytes hashed into `h` (start from kFnvOffset), and the bytes of
// int64 fields, little end first (as spec.py hashes them).
inline constexpr uint64_t kFnvOffset = 1469598103934665603ull;
inline uint64_t fnv1a_byte(uint64_t h, unsigned char c) { return (h ^ c) * 1099511628211ull; }
inline uint64_t hash_fields(std::initializer_list<int64_t> fields, uint64_t h = kFnvOffset) {
  for (int64_t v : fields)
    for (int b = 0; b < 8; ++b) h = fnv1a_byte(h, (uint64_t(v) >> (8 * b)) & 0xff);
  return h;
}

// The code of a registered compressor: kPluginCode plus a hash of
// its name and options, so that ranks running different ones disagree.
inline constexpr int64_t kPluginCode = 1000;
inline int64_t plugin_code(const std::string& name, const std::string& options) {
  uint64_t h = kFnvOffset;
  for (unsigned char c : name + "|" + options) h = fnv1a_byte(h, c);
  return kPluginCode + int64_t(h >> 34);
}

// The descriptor of a compressed call that ranks compare (spec.CALL_FIELDS).
enum Field {
  kNumel, kDtype, kOp, kKey, kMethod, kChunk, kBlock, kDensity, kApprox, kDevice, kCollective,
  kRounding, kFields
};
inline constexpr const char* kFieldNames[kFields] = {"numel", "dtype", "op", "key", "compressor",
                                                     "chunk_numel", "block_size", "density",
                                                     "approx", "device type", "collective",
                                                     "rounding seed"};
// The numel a rank sends in the call check for a call it refuses (a bad
// dtype, an empty tensor): no valid call has it, so every rank raises.
inline constexpr int64_t kRefusedNumel = -1;
// Index = the collective's code in call descriptors (spec.COLLECTIVES).
inline constexpr const char* kCollectives[] = {"all_reduce", "reduce_scatter", "all_gather"};
inline constexpr int kNumCollectives = sizeof(kCollectives) / sizeof(kCollectives[0]);
// Error-feedback residuals of a compressed reduce-scatter are kept under the
// method's name with this suffix (no server residual; never mixed with an
// all-reduce's under the same key).
inline constexpr const char* kReduceScatterSuffix = "/reduce_scatter";
inline constexpr const char* kAllGatherSuffix = "/all_gather";

// Every compressed payload that a rank all-gathers, or sends to every rank
// in an all_to_all, ends with the call's tag: kTagWords int32 words
// (spec.TAG_WORDS) of a hash of what the ranks' calls at one position must
// share (collective, key, size, dtype, op). Each rank receives every rank's
// tag in the same exchange, so when the ranks ran different calls there
// (calls submitted from two threads in a different order on each rank),
// every rank sees a tag that is not its own and raises.
inline constexpr int64_t kTagWords = 2;
inline constexpr int64_t kTagBytes = 4 * kTagWords;
inline uint64_t call_tag(int collective, int64_t key, int64_t numel, int dtype, bool average) {
  return hash_fields({int64_t(collective), key, numel, int64_t(dtype), int64_t(average)});
}

// Stochastic rounding (spec.rounding_seed): the kernel seed of one compress
// of a call, a hash of the group's seed, the call's stream (its key, or -1
// for keyless calls) and number on that stream, the collective, the global
// rank, the chunk and the part (all-reduce: 0 worker, 1 server;
// reduce-scatter: the destination shard; all-gather: 0). Every compress of
// a run draws its own numbers, and the same ones when the run is repeated
// or resumed with its saved call counts.
inline uint32_t rounding_seed(int64_t seed, int64_t stream, int64_t call, int collective,
                              int64_t rank, int64_t chunk, int64_t part) {
  const uint64_t h = hash_fields({seed, stream, call, int64_t(collective), rank, chunk, part});
  return uint32_t(h ^ (h >> 32));
}

// Length of the chunks an n-element tensor is cut into (spec.chunk_length):
// round(n / chunk_numel) chunks, at least one, all of this length but the
// last. No sliver of a tail chunk costing a full chunk's collectives.
// Written as q + (r >= c - r) = floor(n / c + 1/2), which cannot overflow
// for any chunk_numel up to INT64_MAX ("never chunk").
inline int64_t chunk_length(int64_t n, int64_t chunk_numel) {
  const int64_t q = n / chunk_numel, r = n % chunk_numel;
  const int64_t count = std::max<int64_t>(1, q + (r >= chunk_numel - r ? 1 : 0));
  return std::max<int64_t>(1, ceil_div(n, count));
}

// Segment layout of one chunk of a block codec (spec.block_segments):
// segment j, a whole number of blocks, is reduced by rank j. Its payload is
// `words` = ceil(len * bits / 32) int32s of data (onebit: sign words; a
// quant codec: the level bytes, zero-padded to 4) followed by one float32
// scale per block.
struct BlockLayout {
  int64_t m, seg, block;
  int bits;
  std::vector<int64_t> len, words, blocks, size;  // per segment; size in int32s

  static int64_t data_words(int64_t len, int bits) { return ceil_div(len * bits, 32); }

  BlockLayout(int64_t m_, int world, int64_t block_size, int bits_)
      : m(m_), block(block_size), bits(bits_) {
    seg = ceil_div(ceil_div(m, world), block) * block;
    for (int j = 0; j < world; ++j) {
      const int64_t b = std::min(m, j * seg), e = std::min(m, (j + 1) * seg);
      len.push_back(e - b);
      words.push_back(data_words(e - b, bits));
      blocks.push_back(ceil_div(e - b, block));
      size.push_back(words.back() + blocks.back());
    }
  }
};

// int32 elements of a topk chunk payload [count, indices, values] padded to
// 1 + 2 cap, then the call's tag (spec.topk_wire_numel).
inline int64_t topk_wire_numel(int64_t m, double density, bool approx) {
  const int64_t k = topk_k(m, density);
  return 1 + 2 * (approx ? topk_capacity(k) : k) + kTagWords;
}

}  // namespace dist
}  // namespace pycomm
