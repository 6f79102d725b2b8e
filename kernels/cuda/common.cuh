// Device helpers shared by the CUDA kernel families (kernels/cuda/*.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <stdexcept>
#include <string>

namespace pycomm {
namespace cuda {

// Every CUDA call is checked: an error becomes an exception naming the call.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("pycomm CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// residual_in and residual_out are both null (no error feedback) or both set,
// and then one buffer (in place) or disjoint: with a partial overlap a block
// could read residual that another block has already written.
inline void check_residuals(const char* fn, const float* residual_in, const float* residual_out, int64_t n) {
  if ((residual_in == nullptr) != (residual_out == nullptr)) {
    throw std::invalid_argument(std::string("pycomm ") + fn +
                                ": residual_in and residual_out must both be null or both be set");
  }
  if (residual_in == residual_out) return;
  const uintptr_t in = reinterpret_cast<uintptr_t>(residual_in);
  const uintptr_t out = reinterpret_cast<uintptr_t>(residual_out);
  const uintptr_t bytes = (uintptr_t)n * sizeof(float);
  if (in < out + bytes && out < in + bytes) {
    throw std::invalid_argument(std::string("pycomm ") + fn +
                                ": residual_in and residual_out must be the same buffer or not overlap");
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// c exactly as the reference computes it: grad.float() + residual, or
// grad.float() alone. Adding 0.0f when there is no residual would turn -0.0
// into +0.0, so the branch is needed (it is uniform across the grid).
template <typename T>
__device__ __forceinline__ float load_c(const T* grad, const float* residual, int64_t i) {
  const float g = to_float(grad[i]);
  return residual != nullptr ? g + residual[i] : g;
}

}  // namespace cuda
}  // namespace pycomm
