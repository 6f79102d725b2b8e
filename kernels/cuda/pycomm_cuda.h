// Host API of the pycomm CUDA kernels (kernels/cuda/*.cu).
//
// Torch-free on purpose: the .cu files build with plain nvcc, and the torch
// op layer (csrc/ops) only needs raw device pointers and a stream. Every
// function enqueues on `stream` and returns without synchronizing, except
// topk_compress in approximate mode (see there).
//
// Errors: any failing CUDA call throws std::runtime_error carrying
// cudaGetErrorString; arguments that break a documented precondition throw
// std::invalid_argument (the op layer is expected to have checked them).
// Pointers are device pointers; all float buffers hold float32.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace pycomm {
namespace cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------- onebit ---
// c = grad + residual (residual may be nullptr: no error feedback). Writes
// bits[ceil(n/32)] (bit i of word w = element 32w+i, 1 = c >= 0, bits past n are 0),
// scales[ceil(n/block_size)] (mean |c| per block, last partial block over its own length),
// and, if residual != nullptr, residual = c - (bit ? scale : -scale). block_size % 32 == 0.
// n == 0 is a no-op.
void onebit_compress(const void* grad, DType dtype, float* residual, uint32_t* bits, float* scales,
                     int64_t n, int64_t block_size, cudaStream_t stream);

// onebit_compress with the residual double-buffered: c = grad + residual_in, the new residual
// is written to residual_out, and residual_in is only read. Both nullptr (no error feedback)
// or both set; residual_out == residual_in is onebit_compress in place, otherwise the two must
// not overlap (else std::invalid_argument). Same bits, scales and residual as onebit_compress.
void onebit_compress_into(const void* grad, DType dtype, const float* residual_in, float* residual_out,
                          uint32_t* bits, float* scales, int64_t n, int64_t block_size, cudaStream_t stream);

// out[i] = (or +=, if accumulate) bit ? scale : -scale for i < n.
void onebit_decompress(const uint32_t* bits, const float* scales, int64_t n, int64_t block_size,
                       float* out, bool accumulate, cudaStream_t stream);

// ------------------------------------------------------------------ topk ---
// Scratch bytes topk_compress needs for n elements, k, and whether residual is null
// (with no residual it needs n floats of scratch for c). The same size serves
// both modes. Calls the CUDA runtime (to size CUB's scan storage), so it needs
// a current device.
size_t topk_workspace_bytes(int64_t n, int64_t k, bool has_residual);

// Selects like pycomm/compressors/topk.py select_reference (exact: exactly k, ties by lowest
// index; approx: the deterministic sample/count/retry/exact-fallback rule of compress_math.h).
// Writes indices (int32, ascending) and values (float32 c[idx]) into buffers of capacity
// (approx ? topk_capacity(k) : k); if residual != nullptr, residual = c with 0 at selected entries.
// Requires 1 <= k <= n <= INT32_MAX (indices are int32) and
// workspace_bytes >= topk_workspace_bytes(n, k, residual != nullptr).
//
// Returns the count. Approximate mode synchronizes `stream` (up to twice) to
// read the full count back: its accept/retry decision is host control flow,
// mirroring select_reference. Exact mode never synchronizes: its count is k by
// construction, so it returns k while the kernels may still be running.
int64_t topk_compress(const void* grad, DType dtype, float* residual, int64_t n, int64_t k, bool approx,
                      int32_t* indices, float* values, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

// out = 0 then out[idx] = values (or out[idx] += values when accumulate); indices are unique.
// Indices must be unique (each payload's are): the update is a plain
// read-modify-write, bit-identical to the reference's index_add_. Indices
// outside [0, n) are skipped rather than written out of bounds.
void topk_decompress(const int32_t* indices, const float* values, int64_t count, float* out, int64_t n,
                     bool accumulate, cudaStream_t stream);

// ----------------------------------------------------------------- quant ---
// Block quantization to `bits`-bit levels, bits = 8, 4 or 2
// (quant_bits_ok), the rules of compress_math.h: c = grad + residual
// (residual may be nullptr), per block scales[b] = amax / qmax,
// data[quant_num_bytes(n, bits)] the levels (8 / bits per byte, element i
// at bit (i % per) * bits of byte i / per), residual = c - q * scale.
// seed < 0: round to nearest; seed >= 0: stochastic rounding with
// quant_uniform(seed, i). block_size in [1, kMaxBlockSize] and a multiple
// of 8 / bits (no byte straddles two blocks). n == 0 is a no-op.
void quant_compress(const void* grad, DType dtype, float* residual, uint8_t* data, float* scales,
                    int64_t n, int bits, int64_t block_size, int64_t seed, cudaStream_t stream);

// quant_compress with the residual double-buffered, as onebit_compress_into: c = grad +
// residual_in, the new residual to residual_out, residual_in only read; both nullptr or both
// set; residual_out == residual_in is in place, otherwise no overlap (else std::invalid_argument).
void quant_compress_into(const void* grad, DType dtype, const float* residual_in, float* residual_out,
                         uint8_t* data, float* scales, int64_t n, int bits, int64_t block_size, int64_t seed,
                         cudaStream_t stream);

// out[i] = (or +=, if accumulate) q_i * scales[i / block_size] for i < n.
void quant_decompress(const uint8_t* data, const float* scales, int64_t n, int bits,
                      int64_t block_size, float* out, bool accumulate, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
