// Torch-free CPU kernels of every compressor family (kernels/cpu/<name>.cpp).
//
// The op layer (csrc/ops) validates tensors, allocates outputs and supplies a
// parallel_for (torch's intra-op pool, so torch.set_num_threads is honoured
// and no second thread pool competes for the cores); these functions only
// compute, over raw pointers, on the ranges they are given.
#pragma once

#include <stdint.h>

#include <functional>

namespace pycomm {
namespace cpu {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// parallel_for(begin, end, fn): calls fn(b, e) on disjoint sub-ranges covering
// [begin, end), possibly from several threads at once.
using ParallelFor =
    std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)>;

// Blocks per parallel_for task of a block codec's kernels: at least ~64K
// elements of whole blocks a thread, so that small tensors run on one.
inline int64_t block_grain(int64_t block_size) {
  const int64_t g = (int64_t(1) << 16) / block_size;
  return g > 1 ? g : 1;
}

// ---- onebit (kernels/cpu/onebit.cpp) ----
// c = grad + residual (residual may be null: no error feedback). For every
// block in [block_begin, block_end): scales[b] = mean |c|, sign bits into
// bits[], and residual = c - decoded. block_size % 32 == 0.
void onebit_compress_blocks(const void* grad, DType dtype, float* residual, uint32_t* bits,
                            float* scales, int64_t n, int64_t block_size, int64_t block_begin,
                            int64_t block_end);
// The same with the residual read from residual_in and the new one written
// to residual_out (both non-null; equal, or not overlapping): the old
// residual survives, for a caller that may have to keep it.
void onebit_compress_blocks_into(const void* grad, DType dtype, const float* residual_in,
                                 float* residual_out, uint32_t* bits, float* scales, int64_t n,
                                 int64_t block_size, int64_t block_begin, int64_t block_end);

// out[i] = (or += when accumulate) +-scale for the 32-bit words in [word_begin, word_end).
void onebit_decompress_words(const uint32_t* bits, const float* scales, int64_t n,
                             int64_t block_size, float* out, bool accumulate, int64_t word_begin,
                             int64_t word_end);

// ---- topk (kernels/cpu/topk.cpp) ----
// Selects from c = grad + residual the entries topk_compress's rule picks
// (see compress_math.h and pycomm/compressors/topk.py), writes their indices
// (ascending) and values, zeroes them in c, and returns how many it wrote.
// c (n floats) receives grad + residual, the new residual once the picked
// entries are zeroed; `residual` is null (no error feedback), c itself, or
// n floats apart from it (the old residual kept: a call that fails can be
// rolled back without a copy). `indices`/`values` hold topk_capacity(k)
// entries in approximate mode, k in exact mode.
int64_t topk_compress(const void* grad, DType dtype, const float* residual, float* c, int64_t n,
                      int64_t k, bool approx, int32_t* indices, float* values,
                      const ParallelFor& parallel_for);

// out = 0 then out[idx] = values (accumulate: out[idx] += values). Returns
// false, writing nothing, unless the indices are strictly ascending in [0, n).
bool topk_decompress(const int32_t* indices, const float* values, int64_t count, float* out,
                     int64_t n, bool accumulate, const ParallelFor& parallel_for);

// ---- quant (kernels/cpu/quant.cpp) ----
// block quantization to bits 8, 4 or 2 (quant_bits_ok) of c = grad + residual_in
// for the blocks in [block_begin, block_end) (rules: compress_math.h).
// residual_in/out: both null (no error feedback), or both non-null, equal
// or not overlapping; c and then the new residual are written to
// residual_out. seed < 0: round to nearest, else stochastic rounding.
void quant_compress_blocks(const void* grad, DType dtype, const float* residual_in,
                           float* residual_out, uint8_t* data, float* scales, int64_t n, int bits,
                           int64_t block_size, int64_t seed, int64_t block_begin,
                           int64_t block_end);
// out[i] = (or += when accumulate) q_i * scale for the blocks in [block_begin, block_end).
void quant_decompress_blocks(const uint8_t* data, const float* scales, int64_t n, int bits,
                             int64_t block_size, float* out, bool accumulate, int64_t block_begin,
                             int64_t block_end);

}  // namespace cpu
}  // namespace pycomm
