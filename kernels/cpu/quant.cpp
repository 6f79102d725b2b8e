// quant CPU kernel: int8 / int4 block quantization with fused error feedback.
//
// Two passes per block: pass 1 forms c = grad + residual (written to the
// residual buffer, so pass 2 re-reads it from cache) and its absmax; pass 2
// quantizes a tile of 256 at a time (levels and new residual in one loop,
// then packed). Without error feedback pass 2 loads grad into a scratch
// tile instead. The rules are compress_math.h's, element by element, so
// every block can run on any thread in any order; every loop vectorizes
// (tests/test_vectorized.py).
#include <math.h>
#include <string.h>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"
#include "load.h"

namespace pycomm {
namespace cpu {
namespace {

// Elements quantized per tile of pass 2 (even, so int4 bytes never straddle
// two tiles); +1 leaves room for an odd tile's zero high nibble.
constexpr int64_t kTile = 256;

// Level i of an int4 payload: its nibble, sign-extended (shifted to the top
// of an int8, then back).
inline int int4_at(const uint8_t* data, int64_t i) {
  const int nib = (data[i / 2] >> ((i & 1) * 4)) & 0xf;
  return (int8_t)(nib << 4) >> 4;
}

template <typename Load>
void compress_blocks(Load g, const float* r_in, float* r, uint8_t* data, float* scales, int64_t n,
                     int bits, int64_t block_size, int64_t seed, int64_t block_begin,
                     int64_t block_end) {
  const int qmax = quant_qmax(bits);
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
    int8_t q[kTile + 1];
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
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        const float c = rt[i];
        const int level = quant_level(c, inv, qmax, seed, (uint32_t)(t + i));
        rt[i] = c - (float)level * scale;
        q[i] = (int8_t)level;
      }
      if (bits == 8) {
        memcpy(data + t, q, (size_t)len);
      } else {
        // t is even (block_size and kTile are): byte j of the tile holds
        // levels 2j and 2j+1; an odd last level leaves the high nibble 0.
        if (len & 1) q[len] = 0;
        uint8_t* d = data + t / 2;
        const uint8_t* u = reinterpret_cast<const uint8_t*>(q);
        const int64_t bytes = (len + 1) / 2;
#pragma omp simd
        for (int64_t j = 0; j < bytes; ++j) {
          d[j] = (uint8_t)((u[2 * j] & 0xf) | (u[2 * j + 1] << 4));
        }
      }
    }
  }
}

}  // namespace

void quant_compress_blocks(const void* grad, DType dtype, const float* residual_in,
                           float* residual_out, uint8_t* data, float* scales, int64_t n, int bits,
                           int64_t block_size, int64_t seed, int64_t block_begin,
                           int64_t block_end) {
  with_loader(grad, dtype, [&](auto load) {
    compress_blocks(load, residual_in, residual_out, data, scales, n, bits, block_size, seed,
                    block_begin, block_end);
  });
}

void quant_decompress_blocks(const uint8_t* data, const float* scales, int64_t n, int bits,
                             int64_t block_size, float* out, bool accumulate, int64_t block_begin,
                             int64_t block_end) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * block_size;
    const int64_t end = begin + block_size < n ? begin + block_size : n;
    const float scale = scales[b];
    if (bits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(data);
      if (accumulate) {
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) out[i] += (float)q[i] * scale;
      } else {
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) out[i] = (float)q[i] * scale;
      }
    } else {
      // A byte at a time (begin is even): both nibbles, sign-extended by
      // shifting them to the top of an int8 and back; an odd last element
      // on its own.
      const int64_t pairs = (end - begin) / 2;
      const uint8_t* d = data + begin / 2;
      float* o = out + begin;
      if (accumulate) {
#pragma omp simd
        for (int64_t j = 0; j < pairs; ++j) {
          o[2 * j] += (float)((int8_t)(d[j] << 4) >> 4) * scale;
          o[2 * j + 1] += (float)((int8_t)d[j] >> 4) * scale;
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < pairs; ++j) {
          o[2 * j] = (float)((int8_t)(d[j] << 4) >> 4) * scale;
          o[2 * j + 1] = (float)((int8_t)d[j] >> 4) * scale;
        }
      }
      if ((end - begin) & 1) {
        const float v = (float)int4_at(data, end - 1) * scale;
        out[end - 1] = accumulate ? out[end - 1] + v : v;
      }
    }
  }
}

}  // namespace cpu
}  // namespace pycomm
