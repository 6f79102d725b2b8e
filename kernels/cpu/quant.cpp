// quant CPU kernel: block quantization to `bits`-bit levels (8, 4 or 2
// bits) with fused error feedback.
//
// Two passes per block: pass 1 forms c = grad + residual (written to the
// residual buffer, so pass 2 re-reads it from cache) and its absmax; pass 2
// quantizes a tile of 256 at a time (levels and new residual in one loop,
// then packed, per = 8 / bits levels a byte). The width is a template
// parameter (with_bits), so packing loops have constant shifts and
// vectorize; nothing below names a width. Without error feedback pass 2 loads grad into a scratch
// tile instead. The rules are compress_math.h's, element by element, so
// every block can run on any thread in any order; every loop vectorizes
// (tests/test_vectorized.py).
#include <math.h>
#include <string.h>

#include <type_traits>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"
#include "load.h"

namespace pycomm {
namespace cpu {
namespace {

// Elements quantized per tile of pass 2 (a multiple of every per, so bytes
// never straddle two tiles); + 8 leaves room for the zero levels that fill
// a partial last byte.
constexpr int64_t kTile = 256;

// fn(std::integral_constant<int, bits>) for the widths quant_bits_ok
// accepts (the ops check bits first).
template <typename Fn>
void with_bits(int bits, Fn&& fn) {
  switch (bits) {
    case 8: return fn(std::integral_constant<int, 8>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    default: return fn(std::integral_constant<int, 2>{});
  }
}

// The levels of a tile of c (in rt, len elements at element t) and the new
// residual in place, rt[i] = c - level * scale. Out of line, one instance
// per width and rounding, inv and scale by value: only so does GCC run a
// vectorized loop for round-to-nearest (inlined, or with the rounding or
// the width a variable, the data reached a scalar copy, 5-8x slower). The
// stochastic instance still runs scalar.
template <int kQmax, bool kNearest>
__attribute__((noinline)) void tile_levels(float* rt, int8_t* q, int64_t len, float inv,
                                           float scale, int64_t seed, int64_t t) {
  constexpr int qmax = kQmax;
  const int64_t s = kNearest ? -1 : seed;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float c = rt[i];
    const int level = quant_level(c, inv, qmax, s, (uint32_t)(t + i));
    rt[i] = c - (float)level * scale;
    q[i] = (int8_t)level;
  }
}

template <int kBits, typename Load>
void compress_blocks(Load g, const float* r_in, float* r, uint8_t* data, float* scales, int64_t n,
                     int64_t block_size, int64_t seed, int64_t block_begin, int64_t block_end) {
  constexpr int qmax = (1 << (kBits - 1)) - 1;  // quant_qmax, as a constant
  constexpr int per = 8 / kBits;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * block_size;
    const int64_t end = begin + block_size < n ? begin + block_size : n;
    // max |c| ignoring NaN (a comparison: NaN never wins), NaN flagged apart.
    float amax = 0.0f;
    int nan = 0;
    if (r) {
#pragma omp simd reduction(max : amax) reduction(| : nan)
      for (int64_t i = begin; i < end; ++i) {
        const float c = g(i) + r_in[i];
        r[i] = c;
        nan |= c != c;
        const float a = fabsf(c);
        amax = a > amax ? a : amax;
      }
    } else {
#pragma omp simd reduction(max : amax) reduction(| : nan)
      for (int64_t i = begin; i < end; ++i) {
        const float c = g(i);
        nan |= c != c;
        const float a = fabsf(c);
        amax = a > amax ? a : amax;
      }
    }
    if (nan) amax = NAN;  // kept out of the loop so that it vectorizes
    const float scale = amax / (float)qmax;
    const float inv = quant_inv(amax, qmax);
    scales[b] = scale;
    // Pass 2, a tile at a time: the levels (and the new residual) in a loop
    // without branches that vectorizes, then packed into bytes.
    int8_t q[kTile + 8];
    for (int64_t t = begin; t < end; t += kTile) {
      const int64_t len = end - t < kTile ? end - t : kTile;
      // Without error feedback the tile is loaded into a scratch residual
      // first: one loop shape for both (it vectorizes; the scratch
      // residual it writes is thrown away).
      float scratch[kTile];
      float* rt = r ? r + t : scratch;
      if (!r) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) scratch[i] = g(t + i);
      }
      if (seed < 0) {
        tile_levels<qmax, true>(rt, q, len, inv, scale, seed, t);
      } else {
        tile_levels<qmax, false>(rt, q, len, inv, scale, seed, t);
      }
      if (per == 1) {
        memcpy(data + t, q, (size_t)len);
      } else {
        // t is a multiple of per (block_size and kTile are): byte j of the
        // tile holds levels per*j .. per*j + per - 1; a partial last byte's
        // missing levels are 0.
        for (int64_t i = len; i < len + per; ++i) q[i] = 0;
        uint8_t* d = data + t / per;
        const int64_t bytes = (len + per - 1) / per;
#pragma omp simd
        for (int64_t j = 0; j < bytes; ++j) {
          unsigned byte = 0;
          for (int k = 0; k < per; ++k) byte |= quant_pack(q[per * j + k], kBits, k * kBits);
          d[j] = (uint8_t)byte;
        }
      }
    }
  }
}

template <int kBits>
void decompress_blocks(const uint8_t* data, const float* scales, int64_t n, int64_t block_size,
                       float* out, bool accumulate, int64_t block_begin, int64_t block_end) {
  constexpr int per = 8 / kBits;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * block_size;
    const int64_t end = begin + block_size < n ? begin + block_size : n;
    const float scale = scales[b];
    // A byte at a time (begin is a multiple of per): all its levels; a
    // partial last byte level by level.
    const int64_t whole = (end - begin) / per;
    const uint8_t* d = data + begin / per;
    float* o = out + begin;
    if (accumulate) {
#pragma omp simd
      for (int64_t j = 0; j < whole; ++j) {
        for (int k = 0; k < per; ++k) o[per * j + k] += (float)quant_unpack(d[j], kBits, k * kBits) * scale;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < whole; ++j) {
        for (int k = 0; k < per; ++k) o[per * j + k] = (float)quant_unpack(d[j], kBits, k * kBits) * scale;
      }
    }
    for (int64_t i = begin + whole * per; i < end; ++i) {
      const float v = (float)quant_unpack(data[i / per], kBits, (int)(i % per) * kBits) * scale;
      out[i] = accumulate ? out[i] + v : v;
    }
  }
}

}  // namespace

void quant_compress_blocks(const void* grad, DType dtype, const float* residual_in,
                           float* residual_out, uint8_t* data, float* scales, int64_t n, int bits,
                           int64_t block_size, int64_t seed, int64_t block_begin,
                           int64_t block_end) {
  with_bits(bits, [&](auto width) {
    with_loader(grad, dtype, [&](auto load) {
      compress_blocks<decltype(width)::value>(load, residual_in, residual_out, data, scales, n,
                                              block_size, seed, block_begin, block_end);
    });
  });
}

void quant_decompress_blocks(const uint8_t* data, const float* scales, int64_t n, int bits,
                             int64_t block_size, float* out, bool accumulate, int64_t block_begin,
                             int64_t block_end) {
  with_bits(bits, [&](auto width) {
    decompress_blocks<decltype(width)::value>(data, scales, n, block_size, out, accumulate,
                                              block_begin, block_end);
  });
}

}  // namespace cpu
}  // namespace pycomm
