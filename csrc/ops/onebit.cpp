// torch.ops.pycomm.onebit_*: schema, input checks, CPU (and CUDA) kernels.
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

void check_block_size(int64_t block_size) {
  TORCH_CHECK(block_size > 0 && block_size % kOnebitWordBits == 0 && block_size <= kMaxBlockSize,
              "block_size must be a positive multiple of 32 up to 2^30, got ", block_size);
}

std::tuple<at::Tensor, at::Tensor> alloc_payload(const at::Tensor& grad, int64_t block_size) {
  const int64_t n = grad.numel();
  auto opts = grad.options();
  return {at::empty({onebit_num_words(n)}, opts.dtype(at::kInt)),
          at::empty({onebit_num_blocks(n, block_size)}, opts.dtype(at::kFloat))};
}

void check_decompress(const at::Tensor& out, const at::Tensor& bits, const at::Tensor& scales,
                      int64_t block_size) {
  check_block_size(block_size);
  check_out(out, bits.device());
  const int64_t n = out.numel();
  TORCH_CHECK(n > 0, "out is empty");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.is_contiguous(),
              "bits must be a contiguous int32 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be a contiguous float32 tensor");
  TORCH_CHECK(bits.numel() == onebit_num_words(n), "bits has ", bits.numel(),
              " words; out of ", n, " elements needs ", onebit_num_words(n));
  TORCH_CHECK(scales.numel() == onebit_num_blocks(n, block_size), "scales has ", scales.numel(),
              " entries; ", n, " elements in blocks of ", block_size, " need ",
              onebit_num_blocks(n, block_size));
  TORCH_CHECK(scales.device() == bits.device(), "scales and bits are on different devices");
}

std::tuple<at::Tensor, at::Tensor> onebit_compress_cpu(const at::Tensor& grad,
                                                       const std::optional<at::Tensor>& residual,
                                                       int64_t block_size) {
  check_compress_inputs(grad, residual);
  check_block_size(block_size);
  auto [bits, scales] = alloc_payload(grad, block_size);
  const int64_t n = grad.numel();
  const cpu::DType dtype = cpu_dtype(grad, "grad");
  float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const void* g = grad.const_data_ptr();
  auto* w = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, onebit_num_blocks(n, block_size), cpu::block_grain(block_size), [&](int64_t b, int64_t e) {
    cpu::onebit_compress_blocks(g, dtype, r, w, s, n, block_size, b, e);
  });
  return {bits, scales};
}

// The checks of onebit_compress_into on every device: grad and both residuals
// as for onebit_compress, and residual_out either residual itself (in place)
// or apart from it.
void check_compress_into(const at::Tensor& grad, const at::Tensor& residual,
                         const at::Tensor& residual_out, int64_t block_size) {
  check_residual_pair(grad, residual, residual_out);
  check_block_size(block_size);
}

// grad + residual compressed, the new residual written to residual_out and
// residual left as it was (the backend's double-buffered error feedback).
std::tuple<at::Tensor, at::Tensor> onebit_compress_into_cpu(const at::Tensor& grad,
                                                            const at::Tensor& residual,
                                                            const at::Tensor& residual_out,
                                                            int64_t block_size) {
  check_compress_into(grad, residual, residual_out, block_size);
  const float* r_in = residual.const_data_ptr<float>();
  float* r_out = residual_out.data_ptr<float>();
  const int64_t n = grad.numel();
  auto [bits, scales] = alloc_payload(grad, block_size);
  const cpu::DType dtype = cpu_dtype(grad, "grad");
  const void* g = grad.const_data_ptr();
  auto* w = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, onebit_num_blocks(n, block_size), cpu::block_grain(block_size), [&](int64_t b, int64_t e) {
    cpu::onebit_compress_blocks_into(g, dtype, r_in, r_out, w, s, n, block_size, b, e);
  });
  return {bits, scales};
}

void onebit_decompress_cpu(const at::Tensor& out, const at::Tensor& bits,
                           const at::Tensor& scales, int64_t block_size, bool accumulate) {
  check_decompress(out, bits, scales, block_size);
  const int64_t n = out.numel();
  const auto* w = reinterpret_cast<const uint32_t*>(bits.const_data_ptr<int32_t>());
  const float* s = scales.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, onebit_num_words(n), 2048, [&](int64_t b, int64_t e) {
    cpu::onebit_decompress_words(w, s, n, block_size, o, accumulate, b, e);
  });
}

#ifdef PYCOMM_WITH_CUDA
cuda::DType cuda_dtype(const at::Tensor& t) {
  return static_cast<cuda::DType>(static_cast<int>(cpu_dtype(t, "grad")));
}

std::tuple<at::Tensor, at::Tensor> onebit_compress_cuda(const at::Tensor& grad,
                                                        const std::optional<at::Tensor>& residual,
                                                        int64_t block_size) {
  check_compress_inputs(grad, residual);
  check_block_size(block_size);
  const c10::cuda::CUDAGuard guard(grad.device());
  auto [bits, scales] = alloc_payload(grad, block_size);
  cuda::onebit_compress(grad.const_data_ptr(), cuda_dtype(grad),
                        residual.has_value() ? residual->data_ptr<float>() : nullptr,
                        reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>()),
                        scales.data_ptr<float>(), grad.numel(), block_size,
                        c10::cuda::getCurrentCUDAStream());
  return {bits, scales};
}

std::tuple<at::Tensor, at::Tensor> onebit_compress_into_cuda(const at::Tensor& grad,
                                                             const at::Tensor& residual,
                                                             const at::Tensor& residual_out,
                                                             int64_t block_size) {
  check_compress_into(grad, residual, residual_out, block_size);
  const c10::cuda::CUDAGuard guard(grad.device());
  auto [bits, scales] = alloc_payload(grad, block_size);
  cuda::onebit_compress_into(grad.const_data_ptr(), cuda_dtype(grad),
                             residual.const_data_ptr<float>(), residual_out.data_ptr<float>(),
                             reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>()),
                             scales.data_ptr<float>(), grad.numel(), block_size,
                             c10::cuda::getCurrentCUDAStream());
  return {bits, scales};
}

void onebit_decompress_cuda(const at::Tensor& out, const at::Tensor& bits,
                            const at::Tensor& scales, int64_t block_size, bool accumulate) {
  check_decompress(out, bits, scales, block_size);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::onebit_decompress(reinterpret_cast<const uint32_t*>(bits.const_data_ptr<int32_t>()),
                          scales.const_data_ptr<float>(), out.numel(), block_size,
                          out.data_ptr<float>(), accumulate, c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pycomm, m) {
  m.def("onebit_compress(Tensor grad, Tensor(a!)? residual, int block_size) -> (Tensor, Tensor)");
  m.def(
      "onebit_compress_into(Tensor grad, Tensor residual, Tensor(a!) residual_out, "
      "int block_size) -> (Tensor, Tensor)");
  m.def(
      "onebit_decompress(Tensor(a!) out, Tensor bits, Tensor scales, int block_size, "
      "bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("onebit_compress", &onebit_compress_cpu);
  m.impl("onebit_compress_into", &onebit_compress_into_cpu);
  m.impl("onebit_decompress", &onebit_decompress_cpu);
}

#ifdef PYCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("onebit_compress", &onebit_compress_cuda);
  m.impl("onebit_compress_into", &onebit_compress_into_cuda);
  m.impl("onebit_decompress", &onebit_decompress_cuda);
}
#endif

}  // namespace ops
}  // namespace pycomm
