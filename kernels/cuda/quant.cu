// quant CUDA kernels: int8 / int4 block quantization with a per-block absmax
// scale and fused error feedback. The rules and the wire format are
// compress_math.h's (section "quant"); the oracle is
// pycomm/compressors/quant.py (compress_reference).
//
// Threads work on element pairs (2j, 2j+1 of a block): an int4 byte holds
// one pair, so no two threads ever write the same byte. compress is one pass
// over memory (c kept in registers while the block's max is reduced) unless a
// block is longer than a thread block's tile (see kTilePairs).
//
// Error feedback reads the residual from `residual_in` and writes the new one
// to `residual_out`: the same pointer updates in place (quant_compress), two
// separate buffers leave the input as it was (quant_compress_into). The
// kernels never read residual_out, so the bits are the same either way.
//
// Bit-exactness: every float operation of the rules is rounded once. nvcc
// contracts a multiply followed by an add into an FMA (one rounding instead
// of two) unless the product is spelled with explicit rounding, so products
// go through compress_math.h's mul_rn / add_rn (as quant_level does);
// divisions are IEEE (nvcc's default -prec-div=true, as in quant_inv).
#include "pycomm_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "pycomm/compress_math.h"

namespace pycomm {
namespace cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// quant_level (inv is finite by quant_inv's rule, so c * inv is too).
__device__ __forceinline__ int level(float c, float inv, int qmax, int64_t seed, uint32_t i) {
  return quant_level(c, inv, qmax, seed, i);
}

// The block's scale and inv from max |c| over its non-NaN elements and
// whether it holds a NaN (kept apart: fmaxf drops NaN).
struct ScaleInv {
  float scale;
  float inv;
};
__device__ __forceinline__ ScaleInv scale_inv(float amax, bool has_nan, int qmax) {
  if (has_nan) amax = __int_as_float(0x7fc00000);
  return {amax / (float)qmax, quant_inv(amax, qmax)};
}

// Quantize the pair of elements begin + off, begin + off + 1, where elements
// before begin + len are in range (off < len; off + 1 may be past it); write
// levels and, with error feedback (residual_in != nullptr: residual_out is
// then set too), the new residual to residual_out.
template <int kBits>
__device__ __forceinline__ void emit_pair(float c_lo, float c_hi, int64_t begin, int64_t off, int64_t len,
                                          float scale, float inv, int qmax, int64_t seed,
                                          const float* residual_in, float* residual_out, uint8_t* data) {
  const int64_t i = begin + off;
  const bool has_hi = off + 1 < len;
  const int q_lo = level(c_lo, inv, qmax, seed, (uint32_t)i);
  const int q_hi = has_hi ? level(c_hi, inv, qmax, seed, (uint32_t)(i + 1)) : 0;
  if (residual_in != nullptr) {
    // The product is rounded on its own (mul_rn): the subtraction cannot fuse with it.
    residual_out[i] = c_lo - mul_rn((float)q_lo, scale);
    if (has_hi) residual_out[i + 1] = c_hi - mul_rn((float)q_hi, scale);
  }
  if constexpr (kBits == 8) {
    data[i] = (uint8_t)(int8_t)q_lo;
    if (has_hi) data[i + 1] = (uint8_t)(int8_t)q_hi;
  } else {
    // i is even (callers pass even begin and off; block_size is even): byte
    // i / 2 is this pair's alone.
    data[i >> 1] = (uint8_t)((q_lo & 0xf) | ((q_hi & 0xf) << 4));
  }
}

template <typename T>
__device__ __forceinline__ void load_pair(const T* grad, const float* residual, int64_t begin, int64_t off,
                                          int64_t len, float& c_lo, float& c_hi) {
  c_lo = off < len ? load_c(grad, residual, begin + off) : 0.0f;
  c_hi = off + 1 < len ? load_c(grad, residual, begin + off + 1) : 0.0f;
}

__device__ __forceinline__ void track(float c, float& amax, bool& has_nan) {
  amax = fmaxf(amax, fabsf(c));  // fmaxf returns the other operand for NaN
  has_nan |= c != c;
}

// ---------------------------------------------------------------------------
// Small blocks (block_size <= 2 * kGroupMaxPairs): a group of G lanes per
// compression block, G = next power of two >= the block's pairs, at most 32,
// so a warp holds 32 / G blocks (block_size 2: 32 blocks per warp) and the
// max is reduced with shuffles inside the group.
constexpr int kGroupItems = 4;                   // pairs per lane
constexpr int kGroupMaxPairs = 32 * kGroupItems;  // block_size <= 256
constexpr int kGroupWarps = 8;

template <typename T, int kBits>
__global__ void __launch_bounds__(kGroupWarps * 32)
    quant_compress_group_kernel(const T* grad, const float* residual_in, float* residual_out, uint8_t* data,
                                float* scales, int64_t n, int64_t block_size, int64_t num_blocks, int group,
                                int64_t seed) {
  const int qmax = quant_qmax(kBits);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int per_warp = 32 / group;
  const int t = lane % group;
  // The loop bound depends only on the warp, so every lane takes part in
  // every shuffle; lanes of a group past the last block see len == 0.
  for (int64_t w = (int64_t)blockIdx.x * kGroupWarps + warp; w * per_warp < num_blocks;
       w += (int64_t)gridDim.x * kGroupWarps) {
    const int64_t blk = w * per_warp + lane / group;
    const int64_t begin = blk * block_size;
    const int64_t len = blk < num_blocks ? (begin + block_size < n ? block_size : n - begin) : 0;
    // This lane's pair j is elements mine + at, mine + at + 1 with at = 2 * j *
    // group, in range below rem. Passed so, no 64-bit 2 * (j * group + t) per
    // pair stays live: with separate residual buffers that cost ptxas up to
    // 22 registers.
    const int64_t mine = begin + 2 * t;
    const int64_t rem = len - 2 * t;
    float lo[kGroupItems], hi[kGroupItems];
    float amax = 0.0f;
    bool has_nan = false;
#pragma unroll
    for (int j = 0; j < kGroupItems; ++j) {
      load_pair(grad, residual_in, mine, 2 * (int64_t)j * group, rem, lo[j], hi[j]);
      track(lo[j], amax, has_nan);
      track(hi[j], amax, has_nan);
    }
    // Groups are aligned powers of two: xor offsets below G stay inside.
    // max is exact, so every lane of the group ends with the same amax.
    int nan_flag = has_nan;
    for (int o = group >> 1; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
      nan_flag |= __shfl_xor_sync(kFullMask, nan_flag, o);
    }
    const ScaleInv si = scale_inv(amax, nan_flag != 0, qmax);
    if (t == 0 && blk < num_blocks) scales[blk] = si.scale;
#pragma unroll
    for (int j = 0; j < kGroupItems; ++j) {
      const int64_t at = 2 * (int64_t)j * group;
      if (at < rem) {
        emit_pair<kBits>(lo[j], hi[j], mine, at, rem, si.scale, si.inv, qmax, seed, residual_in, residual_out,
                         data);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Large blocks: one thread block per compression block, tiles of
// kBlockThreads * kBlockItems pairs (pair j * kBlockThreads + t of a tile goes
// to thread t). Blocks longer than a tile are read twice: c is recomputed
// bit-identically in pass 2 from grad + residual_in: in place (residual_in ==
// residual_out) each thread rereads only elements it read itself and has
// not written yet, so that is race-free; with separate buffers residual_in is
// never written.
constexpr int kBlockThreads = 256;
constexpr int kBlockItems = 4;
constexpr int64_t kTilePairs = (int64_t)kBlockThreads * kBlockItems;  // 2048 elements

template <typename T, int kBits>
__global__ void __launch_bounds__(kBlockThreads)
    quant_compress_block_kernel(const T* grad, const float* residual_in, float* residual_out, uint8_t* data,
                                float* scales, int64_t n, int64_t block_size, int64_t num_blocks, int64_t seed) {
  __shared__ float warp_max[kBlockThreads / 32];
  __shared__ ScaleInv block_si;
  const int qmax = quant_qmax(kBits);
  const int t = threadIdx.x;

  for (int64_t blk = blockIdx.x; blk < num_blocks; blk += gridDim.x) {  // uniform per thread block
    const int64_t begin = blk * block_size;
    const int64_t len = begin + block_size < n ? block_size : n - begin;
    // Pair j of a tile at `tile` is elements mine + at, mine + at + 1 with at =
    // tile + 2 * j * kBlockThreads, in range below rem (as in the group kernel).
    const int64_t mine = begin + 2 * t;
    const int64_t rem = len - 2 * t;

    // Pass 1: max |c| and NaN. The first tile stays in registers.
    float lo[kBlockItems], hi[kBlockItems];
    float amax = 0.0f;
    bool has_nan = false;
#pragma unroll
    for (int j = 0; j < kBlockItems; ++j) {
      load_pair(grad, residual_in, mine, 2 * (int64_t)j * kBlockThreads, rem, lo[j], hi[j]);
      track(lo[j], amax, has_nan);
      track(hi[j], amax, has_nan);
    }
    for (int64_t tile = 2 * kTilePairs; tile < len; tile += 2 * kTilePairs) {
#pragma unroll
      for (int j = 0; j < kBlockItems; ++j) {
        float a, b;
        load_pair(grad, residual_in, mine, tile + 2 * (int64_t)j * kBlockThreads, rem, a, b);
        track(a, amax, has_nan);
        track(b, amax, has_nan);
      }
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    if ((t & 31) == 0) warp_max[t >> 5] = amax;
    has_nan = __syncthreads_or(has_nan);  // also orders the warp_max writes
    if (t == 0) {
      float m = warp_max[0];
      for (int w = 1; w < kBlockThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
      block_si = scale_inv(m, has_nan, qmax);
      scales[blk] = block_si.scale;
    }
    __syncthreads();
    const ScaleInv si = block_si;

    // Pass 2: levels and residual.
#pragma unroll
    for (int j = 0; j < kBlockItems; ++j) {
      const int64_t at = 2 * (int64_t)j * kBlockThreads;
      if (at < rem) {
        emit_pair<kBits>(lo[j], hi[j], mine, at, rem, si.scale, si.inv, qmax, seed, residual_in, residual_out,
                         data);
      }
    }
    for (int64_t tile = 2 * kTilePairs; tile < len; tile += 2 * kTilePairs) {
#pragma unroll
      for (int j = 0; j < kBlockItems; ++j) {
        const int64_t at = tile + 2 * (int64_t)j * kBlockThreads;
        if (at < rem) {
          float a, b;
          load_pair(grad, residual_in, mine, at, rem, a, b);
          emit_pair<kBits>(a, b, mine, at, rem, si.scale, si.inv, qmax, seed, residual_in, residual_out,
                           data);
        }
      }
    }
    // warp_max and block_si are reused by the next iteration.
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Decompress: a thread per element pair (an int4 byte), grid-stride. The
// block index needs a division per element: 32-bit when n < 2^31 (then no
// index, nor index + stride, overflows; block_size <= 2^30 always fits).
constexpr int kDecompressThreads = 256;

template <int kBits, typename Index>
__global__ void __launch_bounds__(kDecompressThreads)
    quant_decompress_kernel(const uint8_t* data, const float* scales, Index n, Index block_size, float* out,
                            bool accumulate) {
  const Index pairs = n / 2 + (n & 1);
  for (Index p = (Index)blockIdx.x * kDecompressThreads + threadIdx.x; p < pairs;
       p += (Index)gridDim.x * kDecompressThreads) {
    const Index i = 2 * p;
    int q[2];
    if constexpr (kBits == 8) {
      q[0] = (int8_t)data[i];
      q[1] = i + 1 < n ? (int8_t)data[i + 1] : 0;
    } else {
      // Sign-extend each nibble: shift it to the top of an int8, then back.
      const uint8_t byte = data[p];
      q[0] = (int8_t)(uint8_t)(byte << 4) >> 4;
      q[1] = (int8_t)(byte & 0xf0) >> 4;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const Index e = i + k;
      if (e < n) {
        const float v = mul_rn((float)q[k], scales[e / block_size]);
        out[e] = accumulate ? out[e] + v : v;
      }
    }
  }
}

int grid_for(int64_t work_units) {
  return (int)(work_units < (int64_t)INT_MAX ? work_units : (int64_t)INT_MAX);
}

template <typename T, int kBits>
void launch_compress(const T* grad, const float* residual_in, float* residual_out, uint8_t* data, float* scales,
                     int64_t n, int64_t block_size, int64_t seed, cudaStream_t stream) {
  const int64_t num_blocks = ceil_div(n, block_size);
  const int64_t pairs = (block_size + 1) / 2;
  if (pairs <= kGroupMaxPairs) {
    int group = 1;
    while (group < pairs && group < 32) group <<= 1;
    const int64_t warps = ceil_div(num_blocks, 32 / group);
    quant_compress_group_kernel<T, kBits><<<grid_for(ceil_div(warps, kGroupWarps)), kGroupWarps * 32, 0, stream>>>(
        grad, residual_in, residual_out, data, scales, n, block_size, num_blocks, group, seed);
  } else {
    quant_compress_block_kernel<T, kBits><<<grid_for(num_blocks), kBlockThreads, 0, stream>>>(
        grad, residual_in, residual_out, data, scales, n, block_size, num_blocks, seed);
  }
  check(cudaGetLastError(), "quant_compress kernel launch");
}

template <typename T>
void launch_compress_bits(const T* grad, const float* residual_in, float* residual_out, uint8_t* data,
                          float* scales, int64_t n, int bits, int64_t block_size, int64_t seed, cudaStream_t stream) {
  if (bits == 8) {
    launch_compress<T, 8>(grad, residual_in, residual_out, data, scales, n, block_size, seed, stream);
  } else {
    launch_compress<T, 4>(grad, residual_in, residual_out, data, scales, n, block_size, seed, stream);
  }
}

void check_args(const char* fn, int bits, int64_t block_size) {
  if (bits != 8 && bits != 4) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": bits must be 8 or 4, got " + std::to_string(bits));
  }
  if (block_size <= 0 || block_size > kMaxBlockSize) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": block_size must be in [1, 2^30], got " +
                                std::to_string(block_size));
  }
  if (bits == 4 && block_size % 2 != 0) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": block_size must be even for int4, got " +
                                std::to_string(block_size));
  }
}

template <int kBits>
void launch_decompress(const uint8_t* data, const float* scales, int64_t n, int64_t block_size, float* out,
                       bool accumulate, cudaStream_t stream) {
  const int grid = grid_for(ceil_div(ceil_div(n, 2), kDecompressThreads));
  if (n <= (int64_t)INT_MAX) {
    quant_decompress_kernel<kBits, uint32_t><<<grid, kDecompressThreads, 0, stream>>>(
        data, scales, (uint32_t)n, (uint32_t)block_size, out, accumulate);
  } else {
    quant_decompress_kernel<kBits, uint64_t><<<grid, kDecompressThreads, 0, stream>>>(
        data, scales, (uint64_t)n, (uint64_t)block_size, out, accumulate);
  }
  check(cudaGetLastError(), "quant_decompress kernel launch");
}

}  // namespace

void quant_compress_into(const void* grad, DType dtype, const float* residual_in, float* residual_out,
                         uint8_t* data, float* scales, int64_t n, int bits, int64_t block_size, int64_t seed,
                         cudaStream_t stream) {
  check_args("quant_compress", bits, block_size);
  if (n < 0) throw std::invalid_argument("pycomm quant_compress: n must be >= 0");
  check_residuals("quant_compress_into", residual_in, residual_out, n);
  if (n == 0) return;  // a zero-sized grid is a launch error
  switch (dtype) {
    case DType::kFloat32:
      launch_compress_bits(static_cast<const float*>(grad), residual_in, residual_out, data, scales, n, bits,
                           block_size, seed, stream);
      break;
    case DType::kFloat16:
      launch_compress_bits(static_cast<const __half*>(grad), residual_in, residual_out, data, scales, n, bits,
                           block_size, seed, stream);
      break;
    case DType::kBFloat16:
      launch_compress_bits(static_cast<const __nv_bfloat16*>(grad), residual_in, residual_out, data, scales, n,
                           bits, block_size, seed, stream);
      break;
    default:
      throw std::invalid_argument("pycomm quant_compress: unsupported dtype");
  }
}

void quant_compress(const void* grad, DType dtype, float* residual, uint8_t* data, float* scales, int64_t n,
                    int bits, int64_t block_size, int64_t seed, cudaStream_t stream) {
  quant_compress_into(grad, dtype, residual, residual, data, scales, n, bits, block_size, seed, stream);
}

void quant_decompress(const uint8_t* data, const float* scales, int64_t n, int bits, int64_t block_size,
                      float* out, bool accumulate, cudaStream_t stream) {
  check_args("quant_decompress", bits, block_size);
  if (n < 0) throw std::invalid_argument("pycomm quant_decompress: n must be >= 0");
  if (n == 0) return;
  if (bits == 8) {
    launch_decompress<8>(data, scales, n, block_size, out, accumulate, stream);
  } else {
    launch_decompress<4>(data, scales, n, block_size, out, accumulate, stream);
  }
}

}  // namespace cuda
}  // namespace pycomm
