// Reading a gradient of any supported dtype as float32, shared by the CPU
// kernels (kernels/cpu/<name>.cpp): one functor per dtype, so each kernel's
// loop is compiled (and vectorized) once per dtype.
#pragma once

#include <stdint.h>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"

namespace pycomm {
namespace cpu {

struct LoadF32 {
  const float* p;
  float operator()(int64_t i) const { return p[i]; }
};
struct LoadF16 {
  const uint16_t* p;
  float operator()(int64_t i) const { return fp16_bits_to_float(p[i]); }
};
struct LoadBF16 {
  const uint16_t* p;
  float operator()(int64_t i) const { return bf16_bits_to_float(p[i]); }
};

// fn(load) with the functor of `dtype` over `grad`.
template <typename Fn>
void with_loader(const void* grad, DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(LoadF32{static_cast<const float*>(grad)});
    case DType::kFloat16:
      return fn(LoadF16{static_cast<const uint16_t*>(grad)});
    case DType::kBFloat16:
      return fn(LoadBF16{static_cast<const uint16_t*>(grad)});
  }
}

}  // namespace cpu
}  // namespace pycomm
