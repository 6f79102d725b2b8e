// The spec of the compressed collectives, C++ side: a mirror of
// pycomm/distributed/spec.py (method names and codes, call-check fields,
// chunk and segment layout). pycomm._C.spec() exports these and
// tests/test_spec.py compares them with the Python spec.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "pycomm/compress_math.h"

namespace pycomm {
namespace dist {

// Index = the method's code in call descriptors (spec.METHODS).
inline constexpr const char* kMethods[] = {"onebit", "topk", "fp16", "bf16", "none"};
inline constexpr int kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);
inline constexpr int64_t kDefaultChunkNumel = int64_t(1) << 20;

inline int64_t method_code(const std::string& m) {
  for (int64_t i = 0; i < kNumMethods; ++i)
    if (m == kMethods[i]) return i;
  return -1;
}
inline bool known_method(const std::string& m) { return method_code(m) >= 0; }

// The code of a compressor registered in Python: kPluginCode plus a hash of
// its name and options, so that ranks running different ones disagree.
inline constexpr int64_t kPluginCode = 1000;
inline int64_t plugin_code(const std::string& name, const std::string& options) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name + "|" + options) h = (h ^ c) * 1099511628211ull;
  return kPluginCode + int64_t(h >> 34);
}

// The descriptor of a compressed call that ranks compare (spec.CALL_FIELDS).
enum Field {
  kNumel, kDtype, kOp, kKey, kMethod, kChunk, kBlock, kDensity, kApprox, kDevice, kCollective, kFields
};
inline constexpr const char* kFieldNames[kFields] = {"numel", "dtype", "op", "key", "compressor",
                                                     "chunk_numel", "block_size", "density",
                                                     "approx", "device type", "collective"};
// Index = the collective's code in call descriptors (spec.COLLECTIVES).
inline constexpr const char* kCollectives[] = {"all_reduce", "reduce_scatter"};
// Error-feedback residuals of a compressed reduce-scatter are kept under the
// method's name with this suffix (no server residual; never mixed with an
// all-reduce's under the same key).
inline constexpr const char* kReduceScatterSuffix = "/reduce_scatter";

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

// Segment layout of one onebit chunk (spec.onebit_segments): segment j, a
// whole number of blocks, is reduced by rank j.
struct OnebitLayout {
  int64_t m, seg, block;
  std::vector<int64_t> len, words, blocks, size;  // per segment; size in int32s

  OnebitLayout(int64_t m_, int world, int64_t block_size) : m(m_), block(block_size) {
    seg = ceil_div(ceil_div(m, world), block) * block;
    for (int j = 0; j < world; ++j) {
      const int64_t b = std::min(m, j * seg), e = std::min(m, (j + 1) * seg);
      len.push_back(e - b);
      words.push_back(onebit_num_words(e - b));
      blocks.push_back(onebit_num_blocks(e - b, block));
      size.push_back(words.back() + blocks.back());
    }
  }
};

// int32 elements of a topk chunk payload [count, indices, values] padded to
// 1 + 2 cap (spec.topk_wire_numel).
inline int64_t topk_wire_numel(int64_t m, double density, bool approx) {
  const int64_t k = topk_k(m, density);
  return 1 + 2 * (approx ? topk_capacity(k) : k);
}

}  // namespace dist
}  // namespace pycomm
