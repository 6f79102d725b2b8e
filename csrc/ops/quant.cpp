// torch.ops.pycomm.quant_*: schema, input checks, CPU (and CUDA) kernels of
// block quantization to `bits`-bit levels (rules: kernels/include/pycomm/compress_math.h).
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

void check_quant_args(int64_t bits, int64_t block_size, int64_t seed) {
  TORCH_CHECK(quant_bits_ok(int(bits)), "bits must be one of [2, 4, 8], got ", bits);
  TORCH_CHECK(block_size > 0 && block_size <= kMaxBlockSize,
              "block_size must be in [1, 2^30], got ", block_size);
  const int per = quant_per_byte(int(bits));
  TORCH_CHECK(block_size % per == 0, "block_size must be a multiple of ", per, " for ", bits,
              "-bit levels (a byte holds ", per, "), got ", block_size);
  TORCH_CHECK(seed >= -1 && seed <= int64_t(UINT32_MAX),
              "seed must be -1 (round to nearest) or in [0, 2^32), got ", seed);
}

std::tuple<at::Tensor, at::Tensor> alloc_payload(const at::Tensor& grad, int64_t bits,
                                                 int64_t block_size) {
  const int64_t n = grad.numel();
  auto opts = grad.options();
  return {at::empty({quant_num_bytes(n, int(bits))}, opts.dtype(at::kByte)),
          at::empty({ceil_div(n, block_size)}, opts.dtype(at::kFloat))};
}

void check_decompress(const at::Tensor& out, const at::Tensor& data, const at::Tensor& scales,
                      int64_t bits, int64_t block_size) {
  check_quant_args(bits, block_size, -1);
  check_out(out, data.device());
  const int64_t n = out.numel();
  TORCH_CHECK(n > 0, "out is empty");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(),
              "data must be a contiguous uint8 tensor, got ", data.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be a contiguous float32 tensor, got ", scales.scalar_type());
  TORCH_CHECK(data.numel() == quant_num_bytes(n, int(bits)), "data has ", data.numel(),
              " bytes; ", n, " int", bits, " elements need ", quant_num_bytes(n, int(bits)));
  TORCH_CHECK(scales.numel() == ceil_div(n, block_size), "scales has ", scales.numel(),
              " entries; ", n, " elements in blocks of ", block_size, " need ",
              ceil_div(n, block_size));
  TORCH_CHECK(scales.device() == data.device(), "scales and data are on different devices");
}


std::tuple<at::Tensor, at::Tensor> compress_cpu(const at::Tensor& grad, const float* r_in,
                                                float* r_out, int64_t bits, int64_t block_size,
                                                int64_t seed) {
  auto [data, scales] = alloc_payload(grad, bits, block_size);
  const int64_t n = grad.numel();
  const cpu::DType dtype = cpu_dtype(grad, "grad");
  const void* g = grad.const_data_ptr();
  uint8_t* d = data.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, ceil_div(n, block_size), cpu::block_grain(block_size), [&](int64_t b, int64_t e) {
    cpu::quant_compress_blocks(g, dtype, r_in, r_out, d, s, n, int(bits), block_size, seed, b, e);
  });
  return {data, scales};
}

std::tuple<at::Tensor, at::Tensor> quant_compress_cpu(const at::Tensor& grad,
                                                      const std::optional<at::Tensor>& residual,
                                                      int64_t bits, int64_t block_size,
                                                      int64_t seed) {
  check_compress_inputs(grad, residual);
  check_quant_args(bits, block_size, seed);
  float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  return compress_cpu(grad, r, r, bits, block_size, seed);
}

// The checks of quant_compress_into on every device: grad and both residuals
// as for quant_compress, and residual_out either residual itself (in place)
// or apart from it.
void check_compress_into(const at::Tensor& grad, const at::Tensor& residual,
                         const at::Tensor& residual_out, int64_t bits, int64_t block_size,
                         int64_t seed) {
  check_residual_pair(grad, residual, residual_out);
  check_quant_args(bits, block_size, seed);
}

// grad + residual compressed, the new residual written to residual_out and
// residual left as it was (the engine's double-buffered error feedback).
std::tuple<at::Tensor, at::Tensor> quant_compress_into_cpu(const at::Tensor& grad,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& residual_out,
                                                           int64_t bits, int64_t block_size,
                                                           int64_t seed) {
  check_compress_into(grad, residual, residual_out, bits, block_size, seed);
  return compress_cpu(grad, residual.const_data_ptr<float>(), residual_out.data_ptr<float>(), bits,
                      block_size, seed);
}

void quant_decompress_cpu(const at::Tensor& out, const at::Tensor& data, const at::Tensor& scales,
                          int64_t bits, int64_t block_size, bool accumulate) {
  check_decompress(out, data, scales, bits, block_size);
  const int64_t n = out.numel();
  const uint8_t* d = data.const_data_ptr<uint8_t>();
  const float* s = scales.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, ceil_div(n, block_size), cpu::block_grain(block_size), [&](int64_t b, int64_t e) {
    cpu::quant_decompress_blocks(d, s, n, int(bits), block_size, o, accumulate, b, e);
  });
}

#ifdef PYCOMM_WITH_CUDA
cuda::DType cuda_dtype(const at::Tensor& t) {
  return static_cast<cuda::DType>(static_cast<int>(cpu_dtype(t, "grad")));
}

std::tuple<at::Tensor, at::Tensor> quant_compress_cuda(const at::Tensor& grad,
                                                       const std::optional<at::Tensor>& residual,
                                                       int64_t bits, int64_t block_size,
                                                       int64_t seed) {
  check_compress_inputs(grad, residual);
  check_quant_args(bits, block_size, seed);
  const c10::cuda::CUDAGuard guard(grad.device());
  auto [data, scales] = alloc_payload(grad, bits, block_size);
  cuda::quant_compress(grad.const_data_ptr(), cuda_dtype(grad),
                       residual.has_value() ? residual->data_ptr<float>() : nullptr,
                       data.data_ptr<uint8_t>(), scales.data_ptr<float>(), grad.numel(), int(bits),
                       block_size, seed, c10::cuda::getCurrentCUDAStream());
  return {data, scales};
}

std::tuple<at::Tensor, at::Tensor> quant_compress_into_cuda(const at::Tensor& grad,
                                                            const at::Tensor& residual,
                                                            const at::Tensor& residual_out,
                                                            int64_t bits, int64_t block_size,
                                                            int64_t seed) {
  check_compress_into(grad, residual, residual_out, bits, block_size, seed);
  const c10::cuda::CUDAGuard guard(grad.device());
  auto [data, scales] = alloc_payload(grad, bits, block_size);
  cuda::quant_compress_into(grad.const_data_ptr(), cuda_dtype(grad),
                            residual.const_data_ptr<float>(), residual_out.data_ptr<float>(),
                            data.data_ptr<uint8_t>(), scales.data_ptr<float>(), grad.numel(),
                            int(bits), block_size, seed, c10::cuda::getCurrentCUDAStream());
  return {data, scales};
}

void quant_decompress_cuda(const at::Tensor& out, const at::Tensor& data, const at::Tensor& scales,
                           int64_t bits, int64_t block_size, bool accumulate) {
  check_decompress(out, data, scales, bits, block_size);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::quant_decompress(data.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                         out.numel(), int(bits), block_size, out.data_ptr<float>(), accumulate,
                         c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pycomm, m) {
  m.def(
      "quant_compress(Tensor grad, Tensor(a!)? residual, int bits, int block_size, int seed) "
      "-> (Tensor, Tensor)");
  m.def(
      "quant_compress_into(Tensor grad, Tensor residual, Tensor(a!) residual_out, int bits, "
      "int block_size, int seed) -> (Tensor, Tensor)");
  m.def(
      "quant_decompress(Tensor(a!) out, Tensor data, Tensor scales, int bits, int block_size, "
      "bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("quant_compress", &quant_compress_cpu);
  m.impl("quant_compress_into", &quant_compress_into_cpu);
  m.impl("quant_decompress", &quant_decompress_cpu);
}

#ifdef PYCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("quant_compress", &quant_compress_cuda);
  m.impl("quant_compress_into", &quant_compress_into_cuda);
  m.impl("quant_decompress", &quant_decompress_cuda);
}
#endif

}  // namespace ops
}  // namespace pycomm
