// The compressors through the dispatcher: the CPU kernels for CPU tensors,
// the CUDA ones for CUDA tensors (csrc/ops), no Python involved except for
// a compressor registered in Python.
#include "codecs.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "pycomm/cpu.h"

#include "config.h"
#include "ops/common.h"

namespace pycomm {
namespace dist {
namespace {

std::tuple<at::Tensor, at::Tensor> onebit_compress(const at::Tensor& g,
                                                   const std::optional<at::Tensor>& r,
                                                   int64_t block_size) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pycomm::onebit_compress", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                    const std::optional<at::Tensor>&, int64_t)>();
  return op.call(g, r, block_size);
}

std::tuple<at::Tensor, at::Tensor> onebit_compress_into(const at::Tensor& g, const at::Tensor& r,
                                                        const at::Tensor& r_out,
                                                        int64_t block_size) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::onebit_compress_into", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(g, r, r_out, block_size);
}

void onebit_decompress(const at::Tensor& out, const at::Tensor& bits, const at::Tensor& scales,
                       int64_t block_size, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::onebit_decompress", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   int64_t, bool)>();
  op.call(out, bits, scales, block_size, accumulate);
}

std::tuple<at::Tensor, at::Tensor> quant_compress(const at::Tensor& g,
                                                  const std::optional<at::Tensor>& r, int64_t bits,
                                                  int64_t block_size, int64_t seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_compress", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                           int64_t)>();
  return op.call(g, r, bits, block_size, seed);
}

std::tuple<at::Tensor, at::Tensor> quant_compress_into(const at::Tensor& g, const at::Tensor& r,
                                                       const at::Tensor& r_out, int64_t bits,
                                                       int64_t block_size, int64_t seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_compress_into", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           int64_t, int64_t)>();
  return op.call(g, r, r_out, bits, block_size, seed);
}

void quant_decompress(const at::Tensor& out, const at::Tensor& data, const at::Tensor& scales,
                      int64_t bits, int64_t block_size, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::quant_decompress", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   int64_t, int64_t, bool)>();
  op.call(out, data, scales, bits, block_size, accumulate);
}

std::tuple<at::Tensor, at::Tensor> topk_compress(const at::Tensor& g,
                                                 const std::optional<at::Tensor>& r, int64_t k,
                                                 bool approx) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::topk_compress", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool)>();
  return op.call(g, r, k, approx);
}

void topk_decompress(const at::Tensor& out, const at::Tensor& indices, const at::Tensor& values,
                     bool accumulate) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pycomm::topk_decompress", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  op.call(out, indices, values, accumulate);
}

// A compressor registered in Python (pycomm/compressors/plugin.py), through
// its two ops; boxed calls, since the payload is a list of tensors.
std::vector<at::Tensor> plugin_compress(const std::string& name, const std::string& options,
                                        const at::Tensor& g, const std::optional<at::Tensor>& r) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pycomm::plugin_compress", "");
  torch::jit::Stack stack{c10::IValue(name), c10::IValue(options), c10::IValue(g),
                          r ? c10::IValue(*r) : c10::IValue()};
  op.callBoxed(&stack);
  return stack.at(0).toTensorVector();
}

void plugin_decompress(const std::string& name, const std::string& options,
                       const std::vector<at::Tensor>& payload, const at::Tensor& out,
                       bool accumulate) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pycomm::plugin_decompress", "");
  torch::jit::Stack stack{c10::IValue(name), c10::IValue(options), c10::IValue(payload),
                          c10::IValue(out), c10::IValue(accumulate)};
  op.callBoxed(&stack);
}

// A top-k payload of `words` int32s from rank j holds `count` entries:
// one that does not fit says the ranks compressed different tensors.
void check_topk_count(int64_t count, int64_t words, int64_t j) {
  const int64_t cap = (words - 1) / 2;
  TORCH_CHECK(count >= 0 && count <= cap, "rank ", j, " sent a top-k payload of ", count,
              " entries, capacity ", cap, ": ranks disagree on the tensor or density");
}

// Bytes of a payload part on the wire: rounded up to a multiple of 8.
int64_t padded_nbytes(int64_t n) { return (n + 7) / 8 * 8; }

}  // namespace

// ------------------------------------------------------------ BlockCodec ---
std::tuple<at::Tensor, at::Tensor> BlockCodec::compress(const at::Tensor& g,
                                                        const std::optional<at::Tensor>& r,
                                                        int64_t seed) const {
  return quant ? quant_compress(g, r, bits, block, seed) : onebit_compress(g, r, block);
}

std::tuple<at::Tensor, at::Tensor> BlockCodec::compress_into(const at::Tensor& g,
                                                             const at::Tensor& r,
                                                             const at::Tensor& r_out,
                                                             int64_t seed) const {
  return quant ? quant_compress_into(g, r, r_out, bits, block, seed)
              : onebit_compress_into(g, r, r_out, block);
}

std::vector<at::Tensor> BlockCodec::segment(const at::Tensor& data, const at::Tensor& scales,
                                            int64_t lo, int64_t len) const {
  const int64_t words = BlockLayout::data_words(len, bits);
  at::Tensor d;
  if (!quant) {
    d = data.narrow(0, lo / kOnebitWordBits, words);
  } else {
    d = data.narrow(0, lo / quant_per_byte(bits), quant_num_bytes(len, bits));
    if (const int64_t pad = 4 * words - d.numel(); pad > 0) d = at::cat({d, at::zeros({pad}, d.options())});
    d = d.view(at::kInt);
  }
  return {d, scales.narrow(0, lo / block, ceil_div(len, block)).view(at::kInt)};
}

at::Tensor BlockCodec::scales_at(const at::Tensor& buf, int64_t offset, int64_t len) const {
  return buf.narrow(0, offset + BlockLayout::data_words(len, bits), ceil_div(len, block))
      .view(at::kFloat);
}

at::Tensor BlockCodec::finite(const std::vector<at::Tensor>& scales) const {
  const float qmax = quant ? float(quant_qmax(bits)) : 1.0f;
  if (scales.empty() || !scales[0].is_cpu()) {
    const at::Tensor s = at::cat(scales);
    return at::isfinite(quant ? s * qmax : s).all();
  }
  // On a CPU a read of the scales where they are: no concatenation, no
  // product tensor (the same float32 product as above).
  bool ok = true;
  for (const at::Tensor& s : scales) {
    const float* p = s.const_data_ptr<float>();
    for (int64_t i = 0, n = s.numel(); i < n && ok; ++i) ok = std::isfinite(p[i] * qmax);
  }
  return at::scalar_tensor(ok, at::kBool);
}

void BlockCodec::decompress(const at::Tensor& out, const at::Tensor& buf, int64_t offset,
                            bool accumulate) const {
  const int64_t len = out.numel(), words = BlockLayout::data_words(len, bits);
  const at::Tensor d = buf.narrow(0, offset, words), s = scales_at(buf, offset, len);
  if (!quant) {
    onebit_decompress(out, d, s, block, accumulate);
  } else {
    quant_decompress(out, d.view(at::kByte).narrow(0, 0, quant_num_bytes(len, bits)), s, bits,
                     block, accumulate);
  }
}

at::Tensor BlockCodec::encode_direct(const at::Tensor& g, const float* r_in, float* r_out,
                                     int64_t seed, const at::Tensor& tag) const {
  const int64_t n = g.numel(), words = BlockLayout::data_words(n, bits), blocks = ceil_div(n, block);
  at::Tensor buf = at::empty({4 * (words + blocks + kTagWords)}, g.options().dtype(at::kByte));
  auto* w = reinterpret_cast<int32_t*>(buf.data_ptr<uint8_t>());
  float* s = reinterpret_cast<float*>(w + words);
  const float* x = g.const_data_ptr<float>();
  constexpr cpu::DType f32 = cpu::DType::kFloat32;
  if (!quant) {
    auto* bitw = reinterpret_cast<uint32_t*>(w);
    at::parallel_for(0, blocks, cpu::block_grain(block), [&](int64_t b, int64_t e) {
      if (r_in == r_out) {
        cpu::onebit_compress_blocks(x, f32, r_out, bitw, s, n, block, b, e);
      } else {
        cpu::onebit_compress_blocks_into(x, f32, r_in, r_out, bitw, s, n, block, b, e);
      }
    });
  } else {
    // The level bytes, zero-padded to whole words (the wire's bytes are the
    // same on every rank and in every run).
    auto* d = reinterpret_cast<uint8_t*>(w);
    const int64_t nbytes = quant_num_bytes(n, bits);
    std::memset(d + nbytes, 0, 4 * words - nbytes);
    at::parallel_for(0, blocks, cpu::block_grain(block), [&](int64_t b, int64_t e) {
      cpu::quant_compress_blocks(x, f32, r_in, r_out, d, s, n, bits, block, seed, b, e);
    });
  }
  std::memcpy(w + words + blocks, tag.const_data_ptr<int32_t>(), kTagBytes);
  return buf;
}

void BlockCodec::decode_direct(const int32_t* words, int64_t n, float* out,
                               bool accumulate) const {
  const float* s = reinterpret_cast<const float*>(words + BlockLayout::data_words(n, bits));
  if (!quant) {
    const auto* w = reinterpret_cast<const uint32_t*>(words);
    at::parallel_for(0, BlockLayout::data_words(n, bits), 2048, [&](int64_t b, int64_t e) {
      cpu::onebit_decompress_words(w, s, n, block, out, accumulate, b, e);
    });
  } else {
    const auto* d = reinterpret_cast<const uint8_t*>(words);
    at::parallel_for(0, ceil_div(n, block), cpu::block_grain(block), [&](int64_t b, int64_t e) {
      cpu::quant_decompress_blocks(d, s, n, bits, block, out, accumulate, b, e);
    });
  }
}

// ---------------------------------------------------------- PayloadCodec ---
void PayloadCodec::decode_topk_direct(const int32_t* w, int64_t words, int64_t j,
                                      const at::Tensor& out, bool accumulate) const {
  const int64_t count = w[0], n = out.numel();
  check_topk_count(count, words, j);
  float* o = out.data_ptr<float>();
  if (!accumulate) {  // then added to, as the ops' path does (-0.0 entries become +0.0)
    at::parallel_for(0, n, int64_t(1) << 16, [&](int64_t b, int64_t e) { std::fill(o + b, o + e, 0.0f); });
  }
  const bool ok = cpu::topk_decompress(w + 1, reinterpret_cast<const float*>(w + 1 + count), count,
                                       o, n, /*accumulate=*/true, ops::torch_parallel_for());
  TORCH_CHECK(ok, "rank ", j, " sent top-k indices that are not strictly ascending in [0, ", n,
              "): ranks disagree on the tensor");
}

at::Tensor PayloadCodec::encode(const at::Tensor& seg, const std::optional<at::Tensor>& r,
                                const at::Tensor* r_out, int64_t seed, const at::Tensor& tag,
                                std::vector<at::Tensor>& layout) const {
  const int64_t len = seg.numel();
  TORCH_INTERNAL_ASSERT(!r_out || (r && (is_block_method(method) ||
                                          (method_is(method, "sparse") && direct_cpu(seg)))),
                        "a second residual buffer is a built-in codec's with error feedback");
  if (is_block_method(method)) {
    if (direct_cpu(seg)) {
      float* r_in = r ? r->data_ptr<float>() : nullptr;
      return block.encode_direct(seg, r_in, r_out ? r_out->data_ptr<float>() : r_in, seed, tag);
    }
    auto [data, scales] = r_out ? block.compress_into(seg, *r, *r_out, seed)
                                : block.compress(seg, r, seed);
    std::vector<at::Tensor> parts = block.segment(data, scales, 0, len);
    parts.push_back(tag);
    return at::cat(parts).view(at::kByte);
  }
  if (method == "topk") {
    // [count, indices, values as float bits], zero-padded to 1 + 2 cap.
    const int64_t words = topk_wire_numel(len, cfg.density, cfg.approx);
    if (direct_cpu(seg)) {
      at::Tensor buf = at::empty({4 * words}, seg.options().dtype(at::kByte));
      auto* w = reinterpret_cast<int32_t*>(buf.data_ptr<uint8_t>());
      const int64_t cap = (words - 1 - kTagWords) / 2;
      // The values land after the indices, whose count the selection tells.
      std::unique_ptr<float[]> values(new float[cap]);
      // c: the new residual (into r_out when given, the old one kept), or
      // scratch without error feedback.
      std::unique_ptr<float[]> scratch(r ? nullptr : new float[len]);
      float* c = r_out ? r_out->data_ptr<float>() : r ? r->data_ptr<float>() : scratch.get();
      const int64_t count = cpu::topk_compress(
          seg.const_data_ptr<float>(), cpu::DType::kFloat32, r ? r->const_data_ptr<float>() : nullptr,
          c, len, topk_k(len, cfg.density), cfg.approx, w + 1, values.get(),
          ops::torch_parallel_for());
      w[0] = int32_t(count);
      std::memcpy(w + 1 + count, values.get(), 4 * count);
      std::memset(w + 1 + 2 * count, 0, 4 * (2 * (cap - count)));
      std::memcpy(w + words - kTagWords, tag.const_data_ptr<int32_t>(), kTagBytes);
      return buf;
    }
    auto [idx, vals] = topk_compress(seg, r, topk_k(len, cfg.density), cfg.approx);
    const int64_t count = idx.numel();
    at::Tensor buf = at::zeros({words}, seg.options().dtype(at::kInt));
    buf.narrow(0, 0, 1).fill_(count);
    buf.narrow(0, 1, count).copy_(idx);
    buf.narrow(0, 1 + count, count).copy_(vals.view(at::kInt));
    buf.narrow(0, words - kTagWords, kTagWords).copy_(tag);
    return buf.view(at::kByte);
  }
  std::vector<at::Tensor> parts;
  const bool learn = layout.empty();
  for (auto& p : plugin_compress(method, cfg.plugin_options, seg, r)) {
    TORCH_CHECK(p.device() == seg.device(), "compressor '", method, "' returned a payload on ",
                p.device(), " for a tensor on ", seg.device());
    if (learn) layout.push_back(p);
    const at::Tensor b = p.contiguous().reshape({-1}).view(at::kByte);
    parts.push_back(b);
    if (const int64_t pad = padded_nbytes(b.numel()) - b.numel(); pad > 0)
      parts.push_back(at::zeros({pad}, b.options()));
  }
  parts.push_back(tag.view(at::kByte));
  return at::cat(parts);
}

void PayloadCodec::decode(const at::Tensor& buf, int64_t slot,
                          const std::vector<at::Tensor>& layout,
                          const std::vector<at::Tensor>& dst) const {
  const int64_t world = buf.numel() / slot, nbytes = slot - kTagBytes;
  const bool sum = dst.size() == 1;
  bool direct = buf.is_cpu() && (is_block_method(method) || method == "topk");
  for (const at::Tensor& d : dst) direct = direct && direct_cpu(d);
  at::Tensor counts;  // top-k: every rank's entry count, read at once
  if (method == "topk" && !direct)
    counts = buf.view(at::kInt).view({world, slot / 4}).select(1, 0).cpu();
  for (int64_t j = 0; j < world; ++j) {
    const at::Tensor& out = dst[sum ? 0 : j];
    const bool accumulate = sum && j > 0;
    if (direct) {
      const auto* w = reinterpret_cast<const int32_t*>(buf.const_data_ptr<uint8_t>() + j * slot);
      if (is_block_method(method)) {
        block.decode_direct(w, out.numel(), out.data_ptr<float>(), accumulate);
        continue;
      }
      decode_topk_direct(w, nbytes / 4, j, out, accumulate);
      continue;
    }
    const at::Tensor bytes = buf.narrow(0, j * slot, nbytes);
    if (is_block_method(method)) {
      block.decompress(out, bytes.view(at::kInt), 0, accumulate);
    } else if (method == "topk") {
      const at::Tensor w = bytes.view(at::kInt);
      const int64_t count = counts[j].item<int32_t>();
      check_topk_count(count, w.numel(), j);
      if (!accumulate) out.zero_();
      topk_decompress(out, w.narrow(0, 1, count), w.narrow(0, 1 + count, count).view(at::kFloat),
                      true);
    } else {
      std::vector<at::Tensor> payload;
      int64_t off = 0;
      for (const auto& p : layout) {
        const int64_t nb = p.numel() * p.element_size();
        payload.push_back(bytes.narrow(0, off, nb).view(p.scalar_type()).view(p.sizes()));
        off += padded_nbytes(nb);
      }
      plugin_decompress(method, cfg.plugin_options, payload, out, accumulate);
    }
  }
}

}  // namespace dist
}  // namespace pycomm
