// onebit CUDA kernels: 1-bit sign quantization with a per-block mean-|c|
// scale and fused error feedback. The wire format is compress_math.h; the
// oracle is pycomm/compressors/onebit.py (compress_reference).
//
// compress is one pass over memory: each element of grad and residual is read
// once (kept in registers while the block's scale is reduced) and the new
// residual is written once, unless block_size exceeds what one thread block
// holds in registers (see kTileElems).
//
// Error feedback reads the residual from `residual_in` and writes the new one
// to `residual_out`: the same pointer updates in place (onebit_compress), two
// separate buffers leave the input as it was (onebit_compress_into). The
// kernels never read residual_out, so the bits are the same either way.
#include "pycomm_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cub/block/block_reduce.cuh>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "pycomm/compress_math.h"

namespace pycomm {
namespace cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;


// One 32-element word: lanes hold elements 32w .. 32w+31 in lane order, so a
// ballot is the packed word. Out-of-range lanes vote 0 (bits past n are 0);
// lane 0 holds the word's first element, so it is in range iff any lane is.
// With error feedback (residual_in != nullptr: residual_out is then set too)
// the new residual goes to residual_out. Testing residual_in, not residual_out,
// leaves the kernels one uniform condition (ptxas kept both paths otherwise).
__device__ __forceinline__ void emit_word(float c, bool valid, float scale, int64_t i, uint32_t* bits,
                                          const float* residual_in, float* residual_out) {
  const uint32_t bit = valid ? onebit_sign_bit(c) : 0u;
  const uint32_t word = __ballot_sync(kFullMask, bit != 0u);
  if ((threadIdx.x & 31) == 0 && valid) bits[i >> 5] = word;
  if (residual_in != nullptr && valid) residual_out[i] = c - onebit_decode(bit, scale);
}

// ---------------------------------------------------------------------------
// Small blocks (block_size <= 256): one warp per compression block, reduced
// with shuffles. A thread block per compression block would leave most
// threads idle and need a __syncthreads per 32..256 elements.
constexpr int kWarpKernelMaxWords = 8;  // block_size <= 8 * 32
constexpr int kWarpKernelWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kWarpKernelWarps * 32)
    onebit_compress_warp_kernel(const T* grad, const float* residual_in, float* residual_out, uint32_t* bits,
                                float* scales, int64_t n, int64_t block_size, int64_t num_blocks) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // The loop bound depends only on the warp, so every lane takes part in
  // every shuffle and ballot below.
  for (int64_t blk = (int64_t)blockIdx.x * kWarpKernelWarps + warp; blk < num_blocks;
       blk += (int64_t)gridDim.x * kWarpKernelWarps) {
    const int64_t begin = blk * block_size;
    const int64_t len = onebit_block_len(n, block_size, blk);
    float c[kWarpKernelMaxWords];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kWarpKernelMaxWords; ++j) {
      const int64_t off = j * 32 + lane;
      c[j] = off < len ? load_c(grad, residual_in, begin + off) : 0.0f;
      acc += fabsf(c[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(kFullMask, acc, o);
    // Every lane must use the very scale that is stored: take lane 0's.
    const float scale = __shfl_sync(kFullMask, acc, 0) / (float)len;
    if (lane == 0) scales[blk] = scale;
#pragma unroll
    for (int j = 0; j < kWarpKernelMaxWords; ++j) {
      const int64_t off = j * 32 + lane;
      emit_word(c[j], off < len, scale, begin + off, bits, residual_in, residual_out);
    }
  }
}

// ---------------------------------------------------------------------------
// Large blocks: one thread block per compression block. Element j*TPB + t of
// a tile goes to thread t (striped), which keeps global loads coalesced and
// makes each warp's item j exactly one aligned 32-bit word (TPB and the block
// start are multiples of 32).
constexpr int kBlockThreads = 256;
constexpr int kBlockItems = 8;
constexpr int64_t kTileElems = (int64_t)kBlockThreads * kBlockItems;  // 2048, the default block_size

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    onebit_compress_block_kernel(const T* grad, const float* residual_in, float* residual_out, uint32_t* bits,
                                 float* scales, int64_t n, int64_t block_size, int64_t num_blocks) {
  using BlockReduce = cub::BlockReduce<float, kBlockThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ float block_scale;
  const int t = threadIdx.x;

  for (int64_t blk = blockIdx.x; blk < num_blocks; blk += gridDim.x) {  // uniform per thread block
    const int64_t begin = blk * block_size;
    const int64_t len = onebit_block_len(n, block_size, blk);
    // This thread's item at tile offset `at` is element begin + at + t, in
    // range iff at < rem. Comparing so keeps no 64-bit at + t per item live:
    // with separate residual buffers `at + t < len` cost ptxas 12 registers.
    const int64_t rem = len - t;

    // Pass 1: |c| sum. The first tile stays in registers for pass 2.
    float c[kBlockItems];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockItems; ++j) {
      const int64_t at = (int64_t)j * kBlockThreads;
      c[j] = at < rem ? load_c(grad, residual_in, begin + at + t) : 0.0f;
      acc += fabsf(c[j]);
    }
    // Blocks longer than a tile are read twice (c is recomputed bit-identically
    // in pass 2); the second read of a block just touched mostly hits L2.
    for (int64_t tile = kTileElems; tile < len; tile += kTileElems) {
#pragma unroll
      for (int j = 0; j < kBlockItems; ++j) {
        const int64_t at = tile + (int64_t)j * kBlockThreads;
        if (at < rem) acc += fabsf(load_c(grad, residual_in, begin + at + t));
      }
    }
    const float total = BlockReduce(reduce_storage).Sum(acc);  // valid in thread 0 only
    if (t == 0) {
      const float scale = total / (float)len;
      block_scale = scale;
      scales[blk] = scale;
    }
    __syncthreads();
    const float scale = block_scale;

    // Pass 2: bits and residual. Tiles past the first re-read c from grad +
    // residual_in. In place (residual_in == residual_out) each thread rereads
    // only elements it read itself and has not written yet, so that is
    // race-free; with separate buffers residual_in is never written. Items
    // past len still vote (all zeros, nothing written): an early exit here
    // made ptxas spill.
#pragma unroll
    for (int j = 0; j < kBlockItems; ++j) {
      const int64_t at = (int64_t)j * kBlockThreads;
      emit_word(c[j], at < rem, scale, begin + at + t, bits, residual_in, residual_out);
    }
    for (int64_t tile = kTileElems; tile < len; tile += kTileElems) {
#pragma unroll
      for (int j = 0; j < kBlockItems; ++j) {
        const int64_t at = tile + (int64_t)j * kBlockThreads;
        const bool valid = at < rem;
        const float cj = valid ? load_c(grad, residual_in, begin + at + t) : 0.0f;
        emit_word(cj, valid, scale, begin + at + t, bits, residual_in, residual_out);
      }
    }
    // reduce_storage and block_scale are reused by the next iteration.
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Decompress: a group of G threads per compression block (G = 32..256, a
// power of two that divides the thread block) so the scale is loaded once per
// block and no per-element 64-bit division is needed. No shared state, so
// groups need no synchronization.
constexpr int kDecompressThreads = 256;

__global__ void __launch_bounds__(kDecompressThreads)
    onebit_decompress_kernel(const uint32_t* bits, const float* scales, int64_t n, int64_t block_size,
                             int64_t num_blocks, int group_threads, float* out, bool accumulate) {
  const int groups = kDecompressThreads / group_threads;
  const int g = threadIdx.x / group_threads;
  const int t = threadIdx.x % group_threads;
  for (int64_t blk = (int64_t)blockIdx.x * groups + g; blk < num_blocks; blk += (int64_t)gridDim.x * groups) {
    const float scale = scales[blk];
    const int64_t begin = blk * block_size;
    const int64_t len = onebit_block_len(n, block_size, blk);
    for (int64_t off = t; off < len; off += group_threads) {
      const int64_t i = begin + off;
      const float v = onebit_decode((bits[i >> 5] >> (i & 31)) & 1u, scale);
      out[i] = accumulate ? out[i] + v : v;
    }
  }
}

int grid_for(int64_t work_units) {
  return (int)(work_units < (int64_t)INT_MAX ? work_units : (int64_t)INT_MAX);
}

template <typename T>
void launch_compress(const T* grad, const float* residual_in, float* residual_out, uint32_t* bits, float* scales,
                     int64_t n, int64_t block_size, cudaStream_t stream) {
  const int64_t num_blocks = onebit_num_blocks(n, block_size);
  if (block_size <= 32 * kWarpKernelMaxWords) {
    onebit_compress_warp_kernel<T><<<grid_for(ceil_div(num_blocks, kWarpKernelWarps)), kWarpKernelWarps * 32, 0,
                                     stream>>>(grad, residual_in, residual_out, bits, scales, n, block_size,
                                               num_blocks);
  } else {
    onebit_compress_block_kernel<T><<<grid_for(num_blocks), kBlockThreads, 0, stream>>>(
        grad, residual_in, residual_out, bits, scales, n, block_size, num_blocks);
  }
  check(cudaGetLastError(), "onebit_compress kernel launch");
}

void check_block_size(int64_t block_size) {
  if (block_size <= 0 || block_size % kOnebitWordBits != 0) {
    throw std::invalid_argument("pycomm onebit: block_size must be a positive multiple of 32, got " +
                                std::to_string(block_size));
  }
}

}  // namespace

void onebit_compress_into(const void* grad, DType dtype, const float* residual_in, float* residual_out,
                          uint32_t* bits, float* scales, int64_t n, int64_t block_size, cudaStream_t stream) {
  check_block_size(block_size);
  if (n < 0) throw std::invalid_argument("pycomm onebit_compress: n must be >= 0");
  check_residuals("onebit_compress_into", residual_in, residual_out, n);
  if (n == 0) return;  // a zero-sized grid is a launch error
  switch (dtype) {
    case DType::kFloat32:
      launch_compress(static_cast<const float*>(grad), residual_in, residual_out, bits, scales, n, block_size,
                      stream);
      break;
    case DType::kFloat16:
      launch_compress(static_cast<const __half*>(grad), residual_in, residual_out, bits, scales, n, block_size,
                      stream);
      break;
    case DType::kBFloat16:
      launch_compress(static_cast<const __nv_bfloat16*>(grad), residual_in, residual_out, bits, scales, n,
                      block_size, stream);
      break;
    default:
      throw std::invalid_argument("pycomm onebit_compress: unsupported dtype");
  }
}

void onebit_compress(const void* grad, DType dtype, float* residual, uint32_t* bits, float* scales, int64_t n,
                     int64_t block_size, cudaStream_t stream) {
  onebit_compress_into(grad, dtype, residual, residual, bits, scales, n, block_size, stream);
}

void onebit_decompress(const uint32_t* bits, const float* scales, int64_t n, int64_t block_size, float* out,
                       bool accumulate, cudaStream_t stream) {
  check_block_size(block_size);
  if (n < 0) throw std::invalid_argument("pycomm onebit_decompress: n must be >= 0");
  if (n == 0) return;
  const int64_t num_blocks = onebit_num_blocks(n, block_size);
  int group_threads = kDecompressThreads;
  while (group_threads > 32 && group_threads > block_size) group_threads >>= 1;
  const int groups = kDecompressThreads / group_threads;
  onebit_decompress_kernel<<<grid_for(ceil_div(num_blocks, groups)), kDecompressThreads, 0, stream>>>(
      bits, scales, n, block_size, num_blocks, group_threads, out, accumulate);
  check(cudaGetLastError(), "onebit_decompress kernel launch");
}

}  // namespace cuda
}  // namespace pycomm
