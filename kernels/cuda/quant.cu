// quant CUDA kernels: block quantization to `bits`-bit levels (8, 4 or 2
// bits) with a per-block absmax scale and fused error feedback. The rules
// and the wire format are compress_math.h's (section "quant"); the oracle is
// pycomm/compressors/quant.py (compress_reference).
//
// The width is a template parameter (kBits in 8, 4, 2; with_bits is the one
// place that turns the runtime bits into it). A thread works on a unit of
// kUnit = max(2, 8 / kBits) consecutive elements of a block: whole bytes
// (8 bits: 2 bytes; 4 bits: 1 byte of 2 levels; 2 bits: 1 byte of 4 levels), so
// no two threads ever write the same byte, and the levels are packed with
// compress_math.h's quant_pack / quant_unpack for every width: no code path
// branches on the width, the loops over a unit's elements and bytes have
// constant trip counts and unroll. compress is one pass over memory (c
// kept in registers while the block's max is reduced) unless a block is
// longer than a thread block's tile (see kTileElems).
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
#include <type_traits>

#include "common.cuh"
#include "pycomm/compress_math.h"

namespace pycomm {
namespace cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// Elements a thread holds in registers at once, for every width: kItems
// units of kUnit (8 and 4 bits: 4 pairs, as before; 2 bits: 2 bytes of 4).
// Fixed in elements, not units, so that 2 bits' wider unit neither raises
// register pressure nor changes which kernel a block_size gets.
constexpr int kThreadElems = 8;

// What a width fixes at compile time (kPer is quant_per_byte, as a constant
// for array sizes). A unit is at least 2 elements so that 8 bits keep the pair
// geometry it always had (more work per thread than a byte per thread),
// and at least a byte so that bytes are never shared between threads.
template <int kBits>
struct Width {
  static constexpr int kPer = 8 / kBits;                // levels per byte
  static constexpr int kUnit = kPer > 2 ? kPer : 2;     // elements per thread unit
  static constexpr int kBytes = kUnit / kPer;           // bytes per unit (8 bits: 2, else 1)
  static constexpr int kItems = kThreadElems / kUnit;   // units per thread (per tile)
  static_assert(kBits == 8 || kBits == 4 || kBits == 2, "quant_bits_ok");
  static_assert(kUnit % kPer == 0 && kThreadElems % kUnit == 0, "units are whole bytes, items whole units");
};

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

// Quantize the unit of elements begin + off + k (k < kUnit), of which those
// before begin + len are in range (off < len, so the first always is); write
// their levels and, with error feedback (residual_in != nullptr:
// residual_out is then set too), the new residual to residual_out.
//
// begin + off is a multiple of kPer (a block starts at a multiple of
// block_size, which is one of kPer, and off is one of kUnit), so the unit's
// bytes start at (begin + off) / kPer and are this thread's alone. Byte b is
// written when its first element is in range: otherwise it belongs to the
// next block (8 bits with an odd block_size) or lies past the payload. In a
// written byte, levels past len are 0: that happens only at n, since
// block_size is a multiple of kPer.
template <int kBits>
__device__ __forceinline__ void emit_unit(const float (&c)[Width<kBits>::kUnit], int64_t begin, int64_t off,
                                          int64_t len, float scale, float inv, int64_t seed,
                                          const float* residual_in, float* residual_out, uint8_t* data) {
  using W = Width<kBits>;
  const int64_t i = begin + off;
  int q[W::kUnit];
#pragma unroll
  for (int k = 0; k < W::kUnit; ++k) {
    q[k] = k == 0 || off + k < len ? level(c[k], inv, quant_qmax(kBits), seed, (uint32_t)(i + k)) : 0;
  }
  if (residual_in != nullptr) {
#pragma unroll
    for (int k = 0; k < W::kUnit; ++k) {
      // The product is rounded on its own (mul_rn): the subtraction cannot fuse with it.
      if (k == 0 || off + k < len) residual_out[i + k] = c[k] - mul_rn((float)q[k], scale);
    }
  }
  uint8_t* d = data + (uint64_t)i / W::kPer;
#pragma unroll
  for (int b = 0; b < W::kBytes; ++b) {
    if (b == 0 || off + b * W::kPer < len) {
      unsigned byte = 0;
#pragma unroll
      for (int k = 0; k < W::kPer; ++k) byte |= quant_pack(q[b * W::kPer + k], kBits, k * kBits);
      d[b] = (uint8_t)byte;
    }
  }
}

// c of the unit begin + off + k (k < kUnit); 0.0f past len (no effect on the max).
template <typename T, int kUnit>
__device__ __forceinline__ void load_unit(const T* grad, const float* residual, int64_t begin, int64_t off,
                                          int64_t len, float (&c)[kUnit]) {
#pragma unroll
  for (int k = 0; k < kUnit; ++k) c[k] = off + k < len ? load_c(grad, residual, begin + off + k) : 0.0f;
}

template <int kUnit>
__device__ __forceinline__ void track(const float (&c)[kUnit], float& amax, bool& has_nan) {
#pragma unroll
  for (int k = 0; k < kUnit; ++k) {
    amax = fmaxf(amax, fabsf(c[k]));  // fmaxf returns the other operand for NaN
    has_nan |= c[k] != c[k];
  }
}

// ---------------------------------------------------------------------------
// Small blocks (block_size <= kGroupMaxElems): a group of G lanes per
// compression block, G = next power of two >= the block's units, at most 32,
// so a warp holds 32 / G blocks (block_size 2: 32 blocks per warp) and the
// max is reduced with shuffles inside the group. A lane holds kItems units:
// a group of 32 covers 32 * kThreadElems elements whatever the width.
constexpr int kGroupMaxElems = 32 * kThreadElems;  // block_size <= 256
constexpr int kGroupWarps = 8;

template <typename T, int kBits>
__global__ void __launch_bounds__(kGroupWarps * 32)
    quant_compress_group_kernel(const T* grad, const float* residual_in, float* residual_out, uint8_t* data,
                                float* scales, int64_t n, int64_t block_size, int64_t num_blocks, int group,
                                int64_t seed) {
  using W = Width<kBits>;
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
    // This lane's unit j is elements mine + at + k with at = kUnit * j *
    // group, in range below rem. Passed so, no 64-bit kUnit * (j * group +
    // t) per unit stays live: with separate residual buffers that cost
    // ptxas up to 22 registers.
    const int64_t mine = begin + W::kUnit * t;
    const int64_t rem = len - W::kUnit * t;
    float c[W::kItems][W::kUnit];
    float amax = 0.0f;
    bool has_nan = false;
#pragma unroll
    for (int j = 0; j < W::kItems; ++j) {
      load_unit(grad, residual_in, mine, W::kUnit * (int64_t)j * group, rem, c[j]);
      track(c[j], amax, has_nan);
    }
    // Groups are aligned powers of two: xor offsets below G stay inside.
    // max is exact, so every lane of the group ends with the same amax.
    int nan_flag = has_nan;
    for (int o = group >> 1; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
      nan_flag |= __shfl_xor_sync(kFullMask, nan_flag, o);
    }
    const ScaleInv si = scale_inv(amax, nan_flag != 0, quant_qmax(kBits));
    if (t == 0 && blk < num_blocks) scales[blk] = si.scale;
#pragma unroll
    for (int j = 0; j < W::kItems; ++j) {
      const int64_t at = W::kUnit * (int64_t)j * group;
      if (at < rem) {
        emit_unit<kBits>(c[j], mine, at, rem, si.scale, si.inv, seed, residual_in, residual_out, data);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Large blocks: one thread block per compression block, tiles of
// kBlockThreads * kThreadElems elements (unit j * kBlockThreads + t of a
// tile goes to thread t). Blocks longer than a tile are read twice: c is
// recomputed bit-identically in pass 2 from grad + residual_in: in place
// (residual_in == residual_out) each thread rereads only elements it read
// itself and has not written yet, so that is race-free; with separate
// buffers residual_in is never written.
constexpr int kBlockThreads = 256;
constexpr int64_t kTileElems = (int64_t)kBlockThreads * kThreadElems;  // 2048 elements

template <typename T, int kBits>
__global__ void __launch_bounds__(kBlockThreads)
    quant_compress_block_kernel(const T* grad, const float* residual_in, float* residual_out, uint8_t* data,
                                float* scales, int64_t n, int64_t block_size, int64_t num_blocks, int64_t seed) {
  using W = Width<kBits>;
  __shared__ float warp_max[kBlockThreads / 32];
  __shared__ ScaleInv block_si;
  const int t = threadIdx.x;

  for (int64_t blk = blockIdx.x; blk < num_blocks; blk += gridDim.x) {  // uniform per thread block
    const int64_t begin = blk * block_size;
    const int64_t len = begin + block_size < n ? block_size : n - begin;
    // Unit j of a tile at `tile` is elements mine + at + k with at = tile +
    // kUnit * j * kBlockThreads, in range below rem (as in the group kernel).
    const int64_t mine = begin + W::kUnit * t;
    const int64_t rem = len - W::kUnit * t;

    // Pass 1: max |c| and NaN. The first tile stays in registers.
    float c[W::kItems][W::kUnit];
    float amax = 0.0f;
    bool has_nan = false;
#pragma unroll
    for (int j = 0; j < W::kItems; ++j) {
      load_unit(grad, residual_in, mine, W::kUnit * (int64_t)j * kBlockThreads, rem, c[j]);
      track(c[j], amax, has_nan);
    }
    for (int64_t tile = kTileElems; tile < len; tile += kTileElems) {
#pragma unroll
      for (int j = 0; j < W::kItems; ++j) {
        float u[W::kUnit];
        load_unit(grad, residual_in, mine, tile + W::kUnit * (int64_t)j * kBlockThreads, rem, u);
        track(u, amax, has_nan);
      }
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    if ((t & 31) == 0) warp_max[t >> 5] = amax;
    has_nan = __syncthreads_or(has_nan);  // also orders the warp_max writes
    if (t == 0) {
      float m = warp_max[0];
      for (int w = 1; w < kBlockThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
      block_si = scale_inv(m, has_nan, quant_qmax(kBits));
      scales[blk] = block_si.scale;
    }
    __syncthreads();
    const ScaleInv si = block_si;

    // Pass 2: levels and residual.
#pragma unroll
    for (int j = 0; j < W::kItems; ++j) {
      const int64_t at = W::kUnit * (int64_t)j * kBlockThreads;
      if (at < rem) {
        emit_unit<kBits>(c[j], mine, at, rem, si.scale, si.inv, seed, residual_in, residual_out, data);
      }
    }
    for (int64_t tile = kTileElems; tile < len; tile += kTileElems) {
#pragma unroll
      for (int j = 0; j < W::kItems; ++j) {
        const int64_t at = tile + W::kUnit * (int64_t)j * kBlockThreads;
        if (at < rem) {
          float u[W::kUnit];
          load_unit(grad, residual_in, mine, at, rem, u);
          emit_unit<kBits>(u, mine, at, rem, si.scale, si.inv, seed, residual_in, residual_out, data);
        }
      }
    }
    // warp_max and block_si are reused by the next iteration.
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Decompress: a thread per unit (kUnit elements, whole bytes), grid-stride.
// The block index needs a division per element (a unit may straddle two
// blocks: 8 bits with an odd block_size): 32-bit when n < 2^31 (then no
// index, nor index + stride, overflows; block_size <= 2^30 always fits).
constexpr int kDecompressThreads = 256;

template <int kBits, typename Index>
__global__ void __launch_bounds__(kDecompressThreads)
    quant_decompress_kernel(const uint8_t* data, const float* scales, Index n, Index block_size, float* out,
                            bool accumulate) {
  using W = Width<kBits>;
  const Index units = n / W::kUnit + (n % W::kUnit != 0);
  for (Index p = (Index)blockIdx.x * kDecompressThreads + threadIdx.x; p < units;
       p += (Index)gridDim.x * kDecompressThreads) {
    const Index i = W::kUnit * p;  // a multiple of kPer: its bytes start at i / kPer
    uint8_t bytes[W::kBytes];
#pragma unroll
    for (int b = 0; b < W::kBytes; ++b) {
      // A byte past the payload (8 bits' second one at odd n) is not read.
      bytes[b] = b == 0 || i + b * W::kPer < n ? data[i / W::kPer + b] : 0;
    }
#pragma unroll
    for (int k = 0; k < W::kUnit; ++k) {
      const Index e = i + k;
      if (e < n) {
        const int q = quant_unpack(bytes[k / W::kPer], kBits, (k % W::kPer) * kBits);
        const float v = mul_rn((float)q, scales[e / block_size]);
        out[e] = accumulate ? out[e] + v : v;
      }
    }
  }
}

int grid_for(int64_t work_units) {
  return (int)(work_units < (int64_t)INT_MAX ? work_units : (int64_t)INT_MAX);
}

// fn(std::integral_constant<int, kBits>{}) for the runtime bits: the one
// place where a width becomes a template argument, for compress and
// decompress alike (check_args has accepted bits first).
template <typename Fn>
void with_bits(int bits, Fn&& fn) {
  switch (bits) {
    case 8: fn(std::integral_constant<int, 8>{}); return;
    case 4: fn(std::integral_constant<int, 4>{}); return;
    case 2: fn(std::integral_constant<int, 2>{}); return;
    default: throw std::invalid_argument("pycomm quant: no kernel for bits " + std::to_string(bits));
  }
}

template <typename T, int kBits>
void launch_compress(const T* grad, const float* residual_in, float* residual_out, uint8_t* data, float* scales,
                     int64_t n, int64_t block_size, int64_t seed, cudaStream_t stream) {
  const int64_t num_blocks = ceil_div(n, block_size);
  if (block_size <= kGroupMaxElems) {
    const int64_t units = ceil_div(block_size, Width<kBits>::kUnit);
    int group = 1;
    while (group < units && group < 32) group <<= 1;
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
  with_bits(bits, [&](auto width) {
    launch_compress<T, decltype(width)::value>(grad, residual_in, residual_out, data, scales, n, block_size, seed,
                                               stream);
  });
}

// The messages of csrc/ops/quant.cpp's check_quant_args.
void check_args(const char* fn, int bits, int64_t block_size) {
  if (!quant_bits_ok(bits)) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": bits must be one of [2, 4, 8], got " +
                                std::to_string(bits));
  }
  if (block_size <= 0 || block_size > kMaxBlockSize) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": block_size must be in [1, 2^30], got " +
                                std::to_string(block_size));
  }
  // No byte may straddle two blocks: the kernels give each block's bytes to
  // its own threads.
  const int per = quant_per_byte(bits);
  if (block_size % per != 0) {
    throw std::invalid_argument(std::string("pycomm ") + fn + ": block_size must be a multiple of " +
                                std::to_string(per) + " for " + std::to_string(bits) +
                                "-bit levels (a byte holds " + std::to_string(per) + "), got " +
                                std::to_string(block_size));
  }
}

template <int kBits>
void launch_decompress(const uint8_t* data, const float* scales, int64_t n, int64_t block_size, float* out,
                       bool accumulate, cudaStream_t stream) {
  const int grid = grid_for(ceil_div(ceil_div(n, Width<kBits>::kUnit), kDecompressThreads));
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
  with_bits(bits, [&](auto width) {
    launch_decompress<decltype(width)::value>(data, scales, n, block_size, out, accumulate, stream);
  });
}

}  // namespace cuda
}  // namespace pycomm
