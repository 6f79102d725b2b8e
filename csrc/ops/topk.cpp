// torch.ops.pycomm.topk_*: schema, input checks, CPU (and CUDA) kernels.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common.h"
#include "pycomm/compress_math.h"

#ifdef PYCOMM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "pycomm_cuda.h"
#endif

namespace pycomm {
namespace ops {
namespace {

void check_k(int64_t k, int64_t n) {
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, numel=", n, "], got ", k);
}

// Outputs sized for the most entries the mode can return; narrowed after.
std::tuple<at::Tensor, at::Tensor> alloc_payload(const at::Tensor& grad, int64_t k, bool approx) {
  const int64_t cap = approx ? topk_capacity(k) : k;
  auto opts = grad.options();
  return {at::empty({cap}, opts.dtype(at::kInt)), at::empty({cap}, opts.dtype(at::kFloat))};
}

void check_decompress(const at::Tensor& out, const at::Tensor& indices,
                      const at::Tensor& values) {
  check_out(out, values.device());
  TORCH_CHECK(indices.scalar_type() == at::kInt && indices.is_contiguous() && indices.dim() == 1,
              "indices must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.dim() == 1,
              "values must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(indices.numel() == values.numel(), "indices has ", indices.numel(),
              " entries but values has ", values.numel());
  TORCH_CHECK(indices.device() == values.device(), "indices and values are on different devices");
}

std::tuple<at::Tensor, at::Tensor> topk_compress_cpu(const at::Tensor& grad,
                                                     const std::optional<at::Tensor>& residual,
                                                     int64_t k, bool approx) {
  check_compress_inputs(grad, residual);
  const int64_t n = grad.numel();
  check_k(k, n);
  auto [indices, values] = alloc_payload(grad, k, approx);
  // c: the residual, updated in place, or scratch when there is none.
  at::Tensor c = residual.has_value() ? *residual : at::empty({n}, grad.options().dtype(at::kFloat));
  const int64_t count = cpu::topk_compress(
      grad.const_data_ptr(), cpu_dtype(grad, "grad"),
      residual.has_value() ? residual->data_ptr<float>() : nullptr, c.data_ptr<float>(), n, k, approx,
      indices.data_ptr<int32_t>(), values.data_ptr<float>(), torch_parallel_for());
  return {indices.narrow(0, 0, count), values.narrow(0, 0, count)};
}

void topk_decompress_cpu(const at::Tensor& out, const at::Tensor& indices,
                         const at::Tensor& values, bool accumulate) {
  check_decompress(out, indices, values);
  const bool ok = cpu::topk_decompress(indices.const_data_ptr<int32_t>(),
                                       values.const_data_ptr<float>(), indices.numel(),
                                       out.data_ptr<float>(), out.numel(), accumulate,
                                       torch_parallel_for());
  TORCH_CHECK(ok, "indices must be strictly ascending and lie in [0, ", out.numel(), ")");
}

#ifdef PYCOMM_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> topk_compress_cuda(const at::Tensor& grad,
                                                      const std::optional<at::Tensor>& residual,
                                                      int64_t k, bool approx) {
  check_compress_inputs(grad, residual);
  const int64_t n = grad.numel();
  check_k(k, n);
  const c10::cuda::CUDAGuard guard(grad.device());
  auto [indices, values] = alloc_payload(grad, k, approx);
  const size_t ws_bytes = cuda::topk_workspace_bytes(n, k, residual.has_value());
  at::Tensor ws = at::empty({(int64_t)ws_bytes}, grad.options().dtype(at::kByte));
  const int64_t count = cuda::topk_compress(
      grad.const_data_ptr(), static_cast<cuda::DType>(static_cast<int>(cpu_dtype(grad, "grad"))),
      residual.has_value() ? residual->data_ptr<float>() : nullptr, n, k, approx,
      indices.data_ptr<int32_t>(), values.data_ptr<float>(), ws.data_ptr(), ws_bytes,
      c10::cuda::getCurrentCUDAStream());
  return {indices.narrow(0, 0, count), values.narrow(0, 0, count)};
}

void topk_decompress_cuda(const at::Tensor& out, const at::Tensor& indices,
                          const at::Tensor& values, bool accumulate) {
  check_decompress(out, indices, values);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::topk_decompress(indices.const_data_ptr<int32_t>(), values.const_data_ptr<float>(),
                        indices.numel(), out.data_ptr<float>(), out.numel(), accumulate,
                        c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pycomm, m) {
  m.def("topk_compress(Tensor grad, Tensor(a!)? residual, int k, bool approx) -> (Tensor, Tensor)");
  m.def("topk_decompress(Tensor(a!) out, Tensor indices, Tensor values, bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("topk_compress", &topk_compress_cpu);
  m.impl("topk_decompress", &topk_decompress_cpu);
}

#ifdef PYCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("topk_compress", &topk_compress_cuda);
  m.impl("topk_decompress", &topk_decompress_cuda);
}
#endif

}  // namespace ops
}  // namespace pycomm
