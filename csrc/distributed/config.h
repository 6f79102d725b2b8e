// A group's settings, and what one compressed call runs over: its ranks
// and its rounding seeds.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spec.h"

namespace c10d {
class Backend;
}

namespace pycomm {
namespace dist {

struct Config {
  std::string method = "onebit";  // one of kMethods, or "auto"
  int64_t min_compress_numel = 65536;
  int64_t chunk_numel = kDefaultChunkNumel;
  int64_t block_size = 0;  // 0: each block method's default (default_block_size)
  double density = 0.01;
  bool approx = true;
  // Cross-rank check of compressed calls (docs/reliability.md): 0 never,
  // 1 at the first use of each key / keyless signature, 2 every call.
  int check_calls = 1;
  // method "auto": the method of a tensor of n elements is that of the first
  // entry whose bound exceeds n (set from the calibration, docs/auto.md).
  std::vector<std::pair<int64_t, std::string>> size_methods;
  // The calibration the table came from (JSON, kept for reports).
  std::string calibration;
  // A method that is not one of kMethods names a compressor registered in
  // Python (pycomm.register_compressor): the engine reaches it through the
  // ops pycomm::plugin_compress / plugin_decompress, with these options
  // (JSON, passed to its constructor).
  std::string plugin_options = "{}";
  // int8/int4 rounding: -1 to nearest; else stochastic, with the seeds of
  // rounding_seed (spec.h) drawn from this group seed in [0, 2^32).
  int64_t rounding_seed = -1;
};

// The block size a group runs block method `method` with: its setting, or
// the method's default.
inline int64_t block_for(const Config& c, const std::string& method) {
  return c.block_size > 0 ? c.block_size : default_block_size(method);
}

// Config's fields, listed once: the Python binding reports the settings a
// group runs with (pycomm.distributed.options_of) field by field from it.
#define PYCOMM_CONFIG_FIELDS(X)                                                                   \
  X(method) X(min_compress_numel) X(chunk_numel) X(block_size) X(density) X(approx) X(check_calls) \
  X(size_methods) X(calibration) X(plugin_options) X(rounding_seed)

// The seeds of one call's compresses (stochastic rounding; spec.h,
// rounding_seed): at(chunk, part) is -1 when the group rounds to nearest.
struct CallSeeds {
  int64_t seed = -1, stream = -1, call = 0;
  int collective = 0;
  int64_t rank = 0;
  int64_t at(int64_t chunk, int64_t part) const {
    return seed < 0 ? -1 : int64_t(rounding_seed(seed, stream, call, collective, rank, chunk, part));
  }
};

// The ranks one compressed step runs over: every rank (flat), or the ranks
// holding the same shard on every node (hierarchical, docs/hierarchy.md).
struct Group {
  c10d::Backend* pg;
  int rank;
  int world;
};

}  // namespace dist
}  // namespace pycomm
