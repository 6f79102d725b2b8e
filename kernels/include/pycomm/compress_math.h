// Shared math of every pycomm compressor: the one place that defines the
// wire format (bit order, scale rule, top-k key and sampling rule).
//
// Included by the CPU kernels (kernels/cpu), the CUDA kernels (kernels/cuda)
// and mirrored line by line in the pure-torch references
// (pycomm/compressors/*.py), so the CPU tests cover the math the GPU runs.
// Torch-free on purpose: it must compile under g++ and nvcc alike.
#pragma once

#include <stdint.h>
#include <math.h>
#include <string.h>

#if defined(__CUDACC__)
#define PYCOMM_HD __host__ __device__ __forceinline__
#else
#define PYCOMM_HD inline
#endif

namespace pycomm {

PYCOMM_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The largest block_size of every block codec (onebit, int8, int4): block
// counts and offsets then never overflow, for any tensor size.
constexpr int64_t kMaxBlockSize = int64_t(1) << 30;

// A product and a sum rounded on their own, never fused into one fma (which
// rounds once): the references compute them apart, and so must every layer
// to agree bit for bit. nvcc fuses by default; the CPU kernels are built with
// -ffp-contract=off.
PYCOMM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PYCOMM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// ---------------------------------------------------------------- onebit ---
// Payload: sign bits packed 32 per 32-bit word (bit i of word w is element
// 32*w + i; 1 = non-negative, so -0.0 -> 1 and NaN -> 0; bits past numel are
// 0) plus one float32 scale per block of block_size elements:
// scale = mean |c| over the block, a final partial block using its own length.
// block_size must be a positive multiple of 32 so that no word straddles two
// blocks (blocks can then be processed independently, in any order).
constexpr int64_t kOnebitWordBits = 32;

PYCOMM_HD int64_t onebit_num_words(int64_t n) { return ceil_div(n, kOnebitWordBits); }
PYCOMM_HD int64_t onebit_num_blocks(int64_t n, int64_t block_size) { return ceil_div(n, block_size); }
PYCOMM_HD int64_t onebit_block_len(int64_t n, int64_t block_size, int64_t block) {
  const int64_t begin = block * block_size;
  const int64_t end = begin + block_size < n ? begin + block_size : n;
  return end - begin;
}
// Comparison, not the sign bit: NaN maps to 0 so it is never "positive".
PYCOMM_HD uint32_t onebit_sign_bit(float c) { return c >= 0.0f ? 1u : 0u; }
PYCOMM_HD float onebit_decode(uint32_t bit, float scale) { return bit ? scale : -scale; }
// Exact wire size: words + scales, both 4 bytes.
PYCOMM_HD int64_t onebit_payload_nbytes(int64_t n, int64_t block_size) {
  return 4 * onebit_num_words(n) + 4 * onebit_num_blocks(n, block_size);
}

// ------------------------------------------------------------------ topk ---
// Magnitude key: the float's bits with the sign cleared. For non-negative
// floats the unsigned bit order is the numeric order, so selection can run on
// integers (radix select). Every NaN is mapped to one canonical key above
// +Inf: a non-finite gradient is always selected, never silently dropped.
constexpr uint32_t kTopkNanKey = 0x7fc00000u;
constexpr uint32_t kTopkInfKey = 0x7f800000u;

PYCOMM_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

PYCOMM_HD uint32_t topk_key(float c) {
  const uint32_t a = float_bits(c) & 0x7fffffffu;
  return a > kTopkInfKey ? kTopkNanKey : a;
}

// k = max(1, ceil(density * n)), computed in double exactly like Python's
// math.ceil(density * n).
PYCOMM_HD int64_t topk_k(int64_t n, double density) {
  int64_t k = (int64_t)ceil(density * (double)n);
  if (k < 1) k = 1;
  if (k > n) k = n;
  return k;
}

// Approximate mode returns between k and topk_capacity(k) = floor(1.25 k)
// entries; a collective reserves the capacity.
PYCOMM_HD int64_t topk_capacity(int64_t k) { return k + k / 4; }

// Sampling rule of approximate mode (Deep Gradient Compression style, but
// deterministic so that every implementation selects the same entries).
// Aim for ~kTopkSampleHits sampled elements above the threshold: the
// relative error of the count estimate is ~1/sqrt(hits).
constexpr int64_t kTopkSampleHits = 256;
constexpr int64_t kTopkSampleMin = 4096;

// Sample positions are j * stride + stride / 2 for j in [0, s).
PYCOMM_HD int64_t topk_sample_stride(int64_t n, int64_t k) {
  int64_t target = kTopkSampleHits * ceil_div(n, k);
  if (target < kTopkSampleMin) target = kTopkSampleMin;
  const int64_t stride = n / target;
  return stride < 1 ? 1 : stride;
}
PYCOMM_HD int64_t topk_sample_count(int64_t n, int64_t stride) { return n / stride; }

// Rank (1-based, among the s sample keys sorted descending) whose key is the
// threshold: aims at 1.125 k selected, the middle of [k, 1.25 k].
PYCOMM_HD int64_t topk_sample_rank(int64_t n, int64_t k, int64_t s) {
  int64_t r = (int64_t)ceil(1.125 * (double)k * (double)s / (double)n);
  if (r < 1) r = 1;
  if (r > s) r = s;
  return r;
}

// One correction after the full count: scale the rank by target / count.
PYCOMM_HD int64_t topk_retry_rank(int64_t rank, int64_t k, int64_t count, int64_t s) {
  int64_t r = (int64_t)ceil((double)rank * 1.125 * (double)k / (double)count);
  if (r < 1) r = 1;
  if (r > s) r = s;
  return r;
}

PYCOMM_HD bool topk_accept(int64_t count, int64_t k) {
  return count >= k && count <= topk_capacity(k);
}

// ----------------------------------------------------------------- quant ---
// Block quantization to `bits`-bit levels (the block codecs of the method
// table whose kernel family is "quant": int8, int4, int2). bits is data, not
// a branch: every rule below is a function of it, for any bits dividing 8
// from 2 up (quant_bits_ok). Per block of block_size elements of
// c = grad + residual (the last one partial):
//   amax  = max |c|, NaN if any c is NaN
//   scale = amax / qmax       (qmax = 2^(bits-1) - 1: 127, 7, 1; sent)
//   inv   = qmax / amax if amax > 0 and that quotient is finite, else 0
//           (0 for NaN or Inf blocks, and for blocks so tiny, amax below
//           qmax / FLT_MAX, that the quotient overflows: they send zeros
//           and keep everything in the residual)
//   q     = inv == 0 ? 0 : clamp(round(c * inv), -qmax, qmax)
//   decoded = q * scale, residual = c - decoded
// (2 bits: the ternary levels -1/0/+1 of TernGrad, scaled by the block's
// absmax.) round is round-half-to-even, or with a seed (stochastic
// rounding) floor(c * inv + u) with u = quant_uniform(seed, i) in [0, 1), i
// the element's index in the tensor. A block holding NaN or Inf sends q = 0
// and a non-finite scale, so it decodes to NaN: never a silently finite
// result.
// Wire: `data` bytes holding quant_per_byte(bits) = 8 / bits levels each,
// two's complement in `bits` bits, element i at bit (i % per) * bits of
// byte i / per (int8: one byte per element; int4: element 2j in the low
// nibble; missing last levels are 0); then one float32 scale per block.
// block_size must be a multiple of per so that no byte straddles two blocks.

PYCOMM_HD bool quant_bits_ok(int bits) { return bits == 2 || bits == 4 || bits == 8; }
PYCOMM_HD int quant_qmax(int bits) { return (1 << (bits - 1)) - 1; }
PYCOMM_HD int quant_per_byte(int bits) { return 8 / bits; }
PYCOMM_HD int64_t quant_num_bytes(int64_t n, int bits) { return ceil_div(n, (int64_t)quant_per_byte(bits)); }
PYCOMM_HD int64_t quant_payload_nbytes(int64_t n, int bits, int64_t block_size) {
  return quant_num_bytes(n, bits) + 4 * ceil_div(n, block_size);
}
// Level q in its `bits`-bit field at `shift` of a byte, and back
// (sign-extended by shifting the field to the top of an int8, then down).
PYCOMM_HD uint8_t quant_pack(int q, int bits, int shift) {
  return (uint8_t)(((unsigned)q & ((1u << bits) - 1u)) << shift);
}
PYCOMM_HD int quant_unpack(uint8_t byte, int bits, int shift) {
  return (int8_t)(uint8_t)(byte << (8 - bits - shift)) >> (8 - bits);
}

// A 32-bit integer hash with good avalanche (Chris Wellons' lowbias32),
// written with wrapping 32-bit products so every layer computes the same.
PYCOMM_HD uint32_t quant_hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// Stochastic rounding's uniform number for element i: 24 random bits, an
// exact float in [0, 1).
PYCOMM_HD float quant_uniform(uint32_t seed, uint32_t i) {
  return (float)(quant_hash(i ^ quant_hash(seed)) >> 8) * 5.9604644775390625e-08f;  // 2^-24
}
PYCOMM_HD float quant_inv(float amax, int qmax) {
  if (!(amax > 0.0f)) return 0.0f;  // zero or NaN
  const float inv = (float)qmax / amax;
  return inv <= 3.402823466e+38f ? inv : 0.0f;  // amax Inf gives 0 already
}
// The quantized value of c (inv from quant_inv; seed < 0: round to nearest).
// Written as float selects and one conversion, so that loops over it
// vectorize (GCC left a loop over the earlier integer selects scalar):
// where inv is 0 (x may be NaN there: c NaN or Inf) the level is 0;
// elsewhere x is finite (|c| <= amax) and clamped before the conversion.
PYCOMM_HD int quant_level(float c, float inv, int qmax, int64_t seed, uint32_t i) {
  const float x = mul_rn(c, inv);
  const float v = seed < 0 ? rintf(x) : floorf(add_rn(x, quant_uniform((uint32_t)seed, i)));
  const float top = (float)qmax;
  const float clamped = v > top ? top : (v < -top ? -top : v);
  return (int)(inv == 0.0f ? 0.0f : clamped);
}

// ------------------------------------------------------- half precision ---
// Bit-exact conversions to float, branch-free so loops over them vectorize.
PYCOMM_HD float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

PYCOMM_HD float fp16_bits_to_float(uint16_t h) {
  // Normals: the bits shifted into place, the exponent rebiased by adding
  // (127 - 15) << 23. Subnormals: mantissa * 2^-24, an exact int-to-float
  // conversion whose product is a normal float32. No step goes through a
  // float32 denormal, which a denormals-are-zero mode (e.g. after
  // torch.set_flush_denormal(True)) would read as 0. Inf/NaN get the
  // maximal exponent.
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t em = (uint32_t)(h & 0x7fffu);
  const float sub = (float)em * 5.9604644775390625e-08f;  // 2^-24
  uint32_t sub_bits;
  memcpy(&sub_bits, &sub, sizeof(sub_bits));
  uint32_t out = em < 0x400u ? sub_bits : (em << 13) + (112u << 23);
  out = em >= 0x7c00u ? (0x7f800000u | (em << 13)) : out;
  out |= sign;
  float f;
  memcpy(&f, &out, sizeof(f));
  return f;
}

}  // namespace pycomm
