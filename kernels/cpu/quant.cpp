// quant CPU kernel: int8 / int4 block quantization with fused error feedback.
//
// Two passes per block: pass 1 forms c = grad + residual (written to the
// residual buffer, so pass 2 re-reads it from cache) and its absmax; pass 2
// quantizes, packs and writes the new residual. Without error feedback pass
// 2 re-reads grad instead. The rules are compress_math.h's, element by
// element, so every block can run on any thread in any order.
#include <math.h>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"
#include "load.h"

namespace pycomm {
namespace cpu {
namespace {

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
    auto c_of = [&](int64_t i) { return r ? r[i] : g(i); };
    auto emit = [&](int64_t i, float c) {
      const int q = quant_level(c, inv, qmax, seed, (uint32_t)i);
      if (r) r[i] = c - (float)q * scale;
      return q;
    };
    if (bits == 8) {
      for (int64_t i = begin; i < end; ++i) data[i] = (uint8_t)(int8_t)emit(i, c_of(i));
    } else {
      // begin is even (block_size is): byte i/2 holds elements i and i+1.
      for (int64_t i = begin; i < end; i += 2) {
        const int lo = emit(i, c_of(i));
        const int hi = i + 1 < end ? emit(i + 1, c_of(i + 1)) : 0;
        data[i / 2] = (uint8_t)((lo & 0xf) | ((hi & 0xf) << 4));
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
      for (int64_t i = begin; i < end; ++i) {
        // Sign-extend the nibble: shift it to the top of an int8, then back.
        const int nib = (data[i / 2] >> ((i & 1) * 4)) & 0xf;
        const float v = (float)((int8_t)(nib << 4) >> 4) * scale;
        out[i] = accumulate ? out[i] + v : v;
      }
    }
  }
}

}  // namespace cpu
}  // namespace pycomm
