// Helpers shared by the op registrations in csrc/ops/<name>.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "pycomm/cpu.h"

namespace pycomm {
namespace ops {

inline cpu::DType cpu_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return cpu::DType::kFloat32;
    case at::kHalf:
      return cpu::DType::kFloat16;
    case at::kBFloat16:
      return cpu::DType::kBFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// Checks shared by every compress op: a flat, contiguous, non-empty float
// gradient and an optional residual (float32, same numel and device,
// contiguous because it is updated in place).
inline void check_compress_inputs(const at::Tensor& grad,
                                  const std::optional<at::Tensor>& residual) {
  cpu_dtype(grad, "grad");
  TORCH_CHECK(grad.numel() > 0, "grad is empty: there is nothing to compress");
  TORCH_CHECK(grad.is_contiguous(), "grad must be contiguous");
  TORCH_CHECK(grad.numel() < (int64_t(1) << 31),
              "grad has ", grad.numel(), " elements; the payload uses int32 indices, so at most 2^31 - 1");
  if (!residual.has_value()) return;
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.scalar_type() == at::kFloat, "residual must be float32, got ", r.scalar_type());
  TORCH_CHECK(r.numel() == grad.numel(), "residual has ", r.numel(), " elements but grad has ",
              grad.numel());
  TORCH_CHECK(r.device() == grad.device(), "residual is on ", r.device(), " but grad is on ",
              grad.device());
  TORCH_CHECK(r.is_contiguous(), "residual must be contiguous: it is updated in place");
  // The kernels read grad while they write the residual: no shared bytes.
  const auto* g0 = static_cast<const char*>(grad.const_data_ptr());
  const auto* r0 = static_cast<const char*>(r.const_data_ptr());
  const char* g1 = g0 + grad.numel() * grad.element_size();
  const char* r1 = r0 + r.numel() * r.element_size();
  TORCH_CHECK(g1 <= r0 || r1 <= g0, "grad and residual overlap in memory: the residual is "
              "written while grad is read, so they must be separate tensors");
}

// The pair of a compress_into: both checked as residuals of grad, and one
// tensor (in place) or disjoint: the kernels read residual while they write
// residual_out, so a partial overlap would read values already written.
inline void check_residual_pair(const at::Tensor& grad, const at::Tensor& residual,
                                const at::Tensor& residual_out) {
  check_compress_inputs(grad, residual);
  check_compress_inputs(grad, residual_out);
  const float* r_in = residual.const_data_ptr<float>();
  const float* r_out = residual_out.const_data_ptr<float>();
  const int64_t n = grad.numel();
  TORCH_CHECK(r_in == r_out || r_in + n <= r_out || r_out + n <= r_in,
              "residual and residual_out must be the same tensor or not overlap");
}

inline void check_out(const at::Tensor& out, const at::Device& device) {
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out must be float32, got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous: it is written in place");
  TORCH_CHECK(out.device() == device, "out is on ", out.device(), " but the payload is on ",
              device);
}

// torch's intra-op pool as the kernels' parallel_for. The grain is one
// item: callers pass coarse items (blocks or 64K-element chunks).
inline cpu::ParallelFor torch_parallel_for() {
  return [](int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn) {
    at::parallel_for(begin, end, 1, fn);
  };
}

}  // namespace ops
}  // namespace pycomm
