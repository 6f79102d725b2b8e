// onebit CPU kernel: one fused pass per block of grad + residual.
//
// A block (2048 floats = 8 KiB by default) is read from memory once: pass 1
// folds grad into the residual and sums |c|, pass 2 re-reads the block from
// L1/L2 to pack signs and write the new residual. So the kernel moves the
// minimum 12.125 bytes/element (read g, read r, write r, 1/8 byte of bits).
// The inner loops are written so GCC vectorizes them (#pragma omp simd needs
// only -fopenmp-simd: no OpenMP runtime is linked).
#include <math.h>
#include <string.h>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"
#include "load.h"

namespace pycomm {
namespace cpu {
namespace {

// c is the block's values after pass 1 (the residual, or the grad itself
// when there is no error feedback). Packs signs and, with EF, writes
// residual = c - decoded.
template <bool kEF, typename Load>
void pack_block(Load c_of, float* r, uint32_t* bits, float scale, int64_t begin, int64_t len) {
  const int64_t full_words = len / kOnebitWordBits;
  for (int64_t w = 0; w < full_words; ++w) {
    const int64_t base = begin + w * kOnebitWordBits;
    uint32_t word = 0;
#pragma omp simd reduction(| : word)
    for (int i = 0; i < 32; ++i) word |= onebit_sign_bit(c_of(base + i)) << i;
    bits[base / kOnebitWordBits] = word;
    if (kEF) {
#pragma omp simd
      for (int i = 0; i < 32; ++i) {
        const float c = r[base + i];
        r[base + i] = c - onebit_decode(onebit_sign_bit(c), scale);
      }
    }
  }
  const int64_t tail = len - full_words * kOnebitWordBits;
  if (tail) {  // the last, partial word of the tensor: bits past n stay 0
    const int64_t base = begin + full_words * kOnebitWordBits;
    uint32_t word = 0;
    for (int64_t i = 0; i < tail; ++i) {
      const float c = c_of(base + i);
      const uint32_t bit = onebit_sign_bit(c);
      word |= bit << i;
      if (kEF) r[base + i] = c - onebit_decode(bit, scale);
    }
    bits[base / kOnebitWordBits] = word;
  }
}

// r_in: the residual read (r_in == r: updated in place); r: where c and
// then the new residual are written.
template <typename Load>
void compress_blocks(Load g, const float* r_in, float* r, uint32_t* bits, float* scales, int64_t n,
                     int64_t block_size, int64_t block_begin, int64_t block_end) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * block_size;
    const int64_t len = onebit_block_len(n, block_size, b);
    float sum = 0.0f;
    if (r) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = begin; i < begin + len; ++i) {
        const float c = g(i) + r_in[i];
        r[i] = c;
        sum += fabsf(c);
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = begin; i < begin + len; ++i) sum += fabsf(g(i));
    }
    const float scale = sum / (float)len;
    scales[b] = scale;
    if (r) {
      pack_block<true>(LoadF32{r}, r, bits, scale, begin, len);
    } else {
      pack_block<false>(g, nullptr, bits, scale, begin, len);
    }
  }
}

}  // namespace

void onebit_compress_blocks(const void* grad, DType dtype, float* residual, uint32_t* bits,
                            float* scales, int64_t n, int64_t block_size, int64_t block_begin,
                            int64_t block_end) {
  onebit_compress_blocks_into(grad, dtype, residual, residual, bits, scales, n, block_size,
                              block_begin, block_end);
}

void onebit_compress_blocks_into(const void* grad, DType dtype, const float* residual_in,
                                 float* residual_out, uint32_t* bits, float* scales, int64_t n,
                                 int64_t block_size, int64_t block_begin, int64_t block_end) {
  with_loader(grad, dtype, [&](auto load) {
    compress_blocks(load, residual_in, residual_out, bits, scales, n, block_size, block_begin,
                    block_end);
  });
}

void onebit_decompress_words(const uint32_t* bits, const float* scales, int64_t n,
                             int64_t block_size, float* out, bool accumulate, int64_t word_begin,
                             int64_t word_end) {
  for (int64_t w = word_begin; w < word_end; ++w) {
    const int64_t base = w * kOnebitWordBits;
    // block_size is a multiple of 32, so one word lies in one block.
    const float scale = scales[base / block_size];
    const uint32_t word = bits[w];
    float* o = out + base;
    if (base + kOnebitWordBits <= n) {
      if (accumulate) {
#pragma omp simd
        for (int i = 0; i < 32; ++i) o[i] += onebit_decode((word >> i) & 1u, scale);
      } else {
#pragma omp simd
        for (int i = 0; i < 32; ++i) o[i] = onebit_decode((word >> i) & 1u, scale);
      }
    } else {
      for (int64_t i = 0; i < n - base; ++i) {
        const float v = onebit_decode((word >> i) & 1u, scale);
        o[i] = accumulate ? o[i] + v : v;
      }
    }
  }
}

}  // namespace cpu
}  // namespace pycomm
