// CompressedBackend: forwarding, the worker thread, and the compressed
// all-reduce algorithms of docs/allreduce.md.
#include "backend.hpp"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "pycomm/compress_math.h"
#include "spec.h"

#include <pybind11/pybind11.h>

#include <sstream>
#include <string.h>

namespace pycomm {
namespace dist {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The compressor kernels, through the dispatcher: the CPU kernels for CPU
// tensors, the CUDA ones for CUDA tensors (csrc/ops), no Python involved.
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

// A block codec (onebit, int8, int4) as the engine uses it: compress a
// whole chunk, cut a segment's wire words out of its payload, decode a
// segment's wire words. Segments start at whole blocks (BlockLayout), and
// blocks at multiples of 32 elements, so a segment's data starts at a whole
// word or byte of the chunk's.
struct BlockCodec {
  int bits;  // 0: onebit
  int64_t block;

  // `seed`: int8/int4's stochastic rounding seed, -1 to nearest (onebit
  // has no rounding).
  std::tuple<at::Tensor, at::Tensor> compress(const at::Tensor& g,
                                              const std::optional<at::Tensor>& r,
                                              int64_t seed) const {
    return bits ? quant_compress(g, r, bits, block, seed) : onebit_compress(g, r, block);
  }
  // The new residual into r_out, r left as it was (CPU only).
  std::tuple<at::Tensor, at::Tensor> compress_into(const at::Tensor& g, const at::Tensor& r,
                                                   const at::Tensor& r_out, int64_t seed) const {
    return bits ? quant_compress_into(g, r, r_out, bits, block, seed)
                : onebit_compress_into(g, r, r_out, block);
  }
  // Wire words (int32: data, then scales) of elements [lo, lo + len) of a payload.
  std::vector<at::Tensor> segment(const at::Tensor& data, const at::Tensor& scales, int64_t lo,
                                  int64_t len) const {
    const int64_t words = BlockLayout::data_words(len, bits);
    at::Tensor d;
    if (bits == 0) {
      d = data.narrow(0, lo / kOnebitWordBits, words);
    } else {
      d = data.narrow(0, lo * bits / 8, quant_num_bytes(len, bits));
      if (const int64_t pad = 4 * words - d.numel(); pad > 0) d = at::cat({d, at::zeros({pad}, d.options())});
      d = d.view(at::kInt);
    }
    return {d, scales.narrow(0, lo / block, ceil_div(len, block)).view(at::kInt)};
  }
  // The scales of the len-element segment at `offset` of an int32 buffer.
  at::Tensor scales_at(const at::Tensor& buf, int64_t offset, int64_t len) const {
    return buf.narrow(0, offset + BlockLayout::data_words(len, bits), ceil_div(len, block))
        .view(at::kFloat);
  }
  // Whether segments with these scales decode to finite values only: their
  // largest value is +-scale (onebit) or qmax * scale (int8/int4; the
  // product can overflow even where the scale does not). A 0-dim bool.
  at::Tensor finite(const at::Tensor& s) const {
    return at::isfinite(bits ? s * float(quant_qmax(bits)) : s).all();
  }
  // Decodes the len-element segment at `offset` of an int32 buffer into out.
  void decompress(const at::Tensor& out, const at::Tensor& buf, int64_t offset,
                  bool accumulate) const {
    const int64_t len = out.numel(), words = BlockLayout::data_words(len, bits);
    const at::Tensor d = buf.narrow(0, offset, words), s = scales_at(buf, offset, len);
    if (bits == 0) {
      onebit_decompress(out, d, s, block, accumulate);
    } else {
      quant_decompress(out, d.view(at::kByte).narrow(0, 0, quant_num_bytes(len, bits)), s, bits,
                       block, accumulate);
    }
  }
};

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

// Bytes of a payload part on the wire: rounded up to a multiple of 8.
int64_t padded_nbytes(int64_t n) { return (n + 7) / 8 * 8; }

// Any other method name is a compressor registered in Python.
bool is_plugin(const std::string& m) { return !m.empty() && !known_method(m) && m != "auto"; }

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

// One segment's payload as bytes, a fixed size for a given length (every
// method and registered compressor), and its decoding: what the compressed
// reduce-scatter and all-gather send.
struct PayloadCodec {
  const std::string& m;
  const Config& cfg;
  BlockCodec block;
  at::TensorOptions byte_opts;
  // A registered compressor's payload layout (dtypes and shapes), learned
  // from this rank's first payload of each chunk (its segments are alike).
  std::vector<at::Tensor> plugin_layout;

  at::Tensor encode(const at::Tensor& seg, const std::optional<at::Tensor>& r, int64_t seed) {
    const int64_t len = seg.numel();
    if (is_block_method(m)) {
      auto [data, scales] = block.compress(seg, r, seed);
      return at::cat(block.segment(data, scales, 0, len)).view(at::kByte);
    }
    if (m == "topk") {
      const int64_t k = topk_k(len, cfg.density);
      const int64_t cap = cfg.approx ? topk_capacity(k) : k;
      auto [idx, vals] = topk_compress(seg, r, k, cfg.approx);
      at::Tensor buf = at::zeros({1 + 2 * cap}, seg.options().dtype(at::kInt));
      buf.narrow(0, 0, 1).fill_(idx.numel());
      buf.narrow(0, 1, idx.numel()).copy_(idx);
      buf.narrow(0, 1 + idx.numel(), idx.numel()).copy_(vals.view(at::kInt));
      return buf.view(at::kByte);
    }
    std::vector<at::Tensor> parts;
    const bool learn = plugin_layout.empty();
    for (auto& p : plugin_compress(m, cfg.plugin_options, seg, r)) {
      if (learn) plugin_layout.push_back(p);
      const at::Tensor b = p.contiguous().reshape({-1}).view(at::kByte);
      parts.push_back(b);
      if (const int64_t pad = padded_nbytes(b.numel()) - b.numel(); pad > 0)
        parts.push_back(at::zeros({pad}, byte_opts));
    }
    return parts.empty() ? at::empty({0}, byte_opts) : at::cat(parts);
  }

  // Decodes into `dst`: written, or added when `accumulate`.
  void decode(const at::Tensor& bytes, const at::Tensor& dst, bool accumulate,
              const std::vector<at::Tensor>& layout) const {
    if (is_block_method(m)) {
      block.decompress(dst, bytes.view(at::kInt), 0, accumulate);
    } else if (m == "topk") {
      const at::Tensor w = bytes.view(at::kInt);
      const int64_t count = w[0].item<int32_t>(), cap = (w.numel() - 1) / 2;
      TORCH_CHECK(count >= 0 && count <= cap, "a top-k payload of ", count,
                  " entries, capacity ", cap, ": ranks disagree on the tensor or density");
      if (!accumulate) dst.zero_();
      topk_decompress(dst, w.narrow(0, 1, count), w.narrow(0, 1 + count, count).view(at::kFloat),
                      true);
    } else {
      std::vector<at::Tensor> payload;
      int64_t off = 0;
      for (const auto& p : layout) {
        const int64_t nb = p.numel() * p.element_size();
        payload.push_back(bytes.narrow(0, off, nb).view(p.scalar_type()).view(p.sizes()));
        off += padded_nbytes(nb);
      }
      plugin_decompress(m, cfg.plugin_options, payload, dst, accumulate);
    }
  }
};

}  // namespace

// ------------------------------------------------------------- PycommWork ---
PycommWork::PycommWork(int rank, c10d::OpType type, std::vector<at::Tensor> result)
    : c10d::Work(rank, type), result_(std::move(result)) {
  std::vector<c10::Device> devices;
  for (const auto& t : result_)
    if (t.is_cuda()) devices.push_back(t.device());
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     devices);
}

void PycommWork::complete(std::exception_ptr error, int source_rank) {
  source_rank_ = source_rank;
  finish(error);  // wakes wait()ers first, so a future callback may wait() safely
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(result_));
  }
}

// ------------------------------------------------------ CompressedBackend ---

CompressedBackend::CompressedBackend(c10::intrusive_ptr<c10d::Backend> inner, Config config,
                                     c10::intrusive_ptr<c10d::Backend> intra,
                                     c10::intrusive_ptr<c10d::Backend> inter)
    : c10d::Backend(inner->getRank(), inner->getSize()),
      inner_(std::move(inner)),
      config_(std::move(config)),
      intra_(std::move(intra)),
      inter_(std::move(inter)) {
  const auto& m = config_.method;
  TORCH_CHECK(known_method(m) || m == "auto" || is_plugin(m),
              "compressor must be one of the methods of pycomm.distributed.spec.GROUP_METHODS "
              "or a compressor registered with pycomm.register_compressor, got '", m, "'");
  TORCH_CHECK(!is_plugin(m) || c10::Dispatcher::singleton()
                                   .findSchema({"pycomm::plugin_compress", ""})
                                   .has_value(),
              "compressor '", m, "' is not one of pycomm's methods, and no registered compressor "
              "can run: import pycomm before creating the group");
  for (const auto& [bound, method] : config_.size_methods)
    TORCH_CHECK(known_method(method), "size_methods: unknown method '", method, "'");
  TORCH_CHECK(!intra_ == !inter_, "a hierarchical backend needs both the intra- and the inter-node group");
  if (intra_) {
    TORCH_CHECK(intra_->getSize() * inter_->getSize() == getSize(),
                "hierarchy: ", intra_->getSize(), " ranks per node x ", inter_->getSize(),
                " nodes is not the world size ", getSize());
  }
  TORCH_CHECK(config_.min_compress_numel >= 1, "min_compress_numel must be >= 1, got ",
              config_.min_compress_numel);
  TORCH_CHECK(config_.chunk_numel >= 1, "chunk_numel must be >= 1, got ", config_.chunk_numel);
  TORCH_CHECK(config_.block_size == 0 ||
                  (config_.block_size > 0 && config_.block_size % 32 == 0 &&
                   config_.block_size <= kMaxBlockSize),
              "block_size must be a positive multiple of 32 up to 2^30 (or 0: each method's "
              "default), got ", config_.block_size);
  TORCH_CHECK(config_.density > 0.0 && config_.density <= 1.0, "density must be in (0, 1], got ",
              config_.density);
  TORCH_CHECK(config_.rounding_seed >= -1 && config_.rounding_seed <= int64_t(UINT32_MAX),
              "rounding seed must be -1 (round to nearest) or in [0, 2^32), got ",
              config_.rounding_seed);
  TORCH_CHECK(config_.check_calls >= 0 && config_.check_calls <= 2,
              "check_calls must be 0 (off), 1 (first use) or 2 (every call), got ",
              config_.check_calls);
  // Gloo has no AVG: forwarded AVGs become SUM and a division here.
  inner_has_avg_ = inner_->getBackendName() != "gloo";
  worker_ = std::thread([this] { run_worker(); });
}

CompressedBackend::~CompressedBackend() {
  // Python may drop the last reference with the GIL held. Joining the
  // worker (which may be running a compressor registered in Python) and the
  // inner backends' threads (which may release Python objects) then needs
  // the GIL elsewhere: release it while shutting down.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  intra_.reset();
  inter_.reset();
  inner_.reset();
}

void CompressedBackend::run_worker() {
  // Collectives never record autograd history (as on the caller's side of
  // dist.all_reduce): the tensors may be Parameters that require grad.
  const c10::AutoGradMode no_grad(false);
  for (;;) {
    settle(/*wait=*/false);  // what the device has passed (on a CPU: all)
    std::optional<Task> task;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      auto ready = [this] { return stopping_ || !queue_.empty(); };
      // With calls pending, look at the device now and then: their Works
      // complete when it has passed them.
      if (pending_.empty()) {
        queue_cv_.wait(lock, ready);
      } else {
        queue_cv_.wait_for(lock, std::chrono::microseconds(50), ready);
      }
      stopping = stopping_;
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      } else if (stopping && pending_.empty()) {
        return;  // stopping, and everything submitted has run
      }
    }
    settle(/*wait=*/task ? !task->overlaps : stopping);
    if (task) task->run();
  }
}

void CompressedBackend::settle(bool wait, std::optional<int64_t> key) {
  size_t last = 0;  // finish pending_[0, last)
  if (key) {
    for (size_t i = 0; i < pending_.size(); ++i)
      if (pending_[i].key == key) last = i + 1;
  } else if (wait) {
    last = pending_.size();
  } else {
    // A device error counts as passed: finishing the call then reports it.
    auto passed = [](const PendingCall& c) {
      try {
        return !c.done || c.done->query();
      } catch (...) {
        return true;
      }
    };
    while (last < pending_.size() && passed(pending_[last])) ++last;
  }
  for (; last > 0; --last) {
    PendingCall call = std::move(pending_.front());
    pending_.pop_front();
    finish_pending(call);
  }
}

void CompressedBackend::finish_pending(PendingCall& call) {
  // The Work completes on the caller's stream (see submit).
  std::optional<c10::StreamGuard> guard;
  if (call.stream) guard.emplace(*call.stream);
  try {
    if (call.done && !call.done->query()) {
      Span span(profile_.sync_s);
      call.done->synchronize();
    }
    const bool* f = call.checks.const_data_ptr<bool>();
    call.finish(std::vector<bool>(f, f + call.checks.numel()));
    call.work->complete();
  } catch (...) {
    call.work->complete(std::current_exception());
  }
}

void CompressedBackend::defer(const std::vector<at::Tensor>& checks, std::optional<int64_t> key,
                              std::function<void(const std::vector<bool>&)> finish) {
  const at::Tensor dev = at::stack(checks);
  const c10::Device device = dev.device();
  PendingCall call{std::nullopt, dev, std::move(finish), {}, std::nullopt, key};
  if (!dev.is_cpu()) {
    call.checks = at::empty({dev.numel()}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
    call.checks.copy_(dev, /*non_blocking=*/true);
    call.done.emplace(device.type());
    call.done->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  deferred_.emplace(std::move(call));
}

WorkPtr CompressedBackend::submit(c10d::OpType type, std::vector<at::Tensor> result,
                                  std::function<void()> body, std::optional<c10::Stream> stream,
                                  bool overlaps) {
  auto work = c10::make_intrusive<PycommWork>(getRank(), type, std::move(result));
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    TORCH_CHECK(!stopping_, "pycomm backend is shutting down");
    queue_.push_back(Task{[this, work, body = std::move(body), stream,
                         queued = std::chrono::steady_clock::now()] {
      profile_.queued_s +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count();
      // The completion too is recorded on the caller's stream: the Work's
      // future makes the waiter's stream wait on an event recorded on the
      // current stream when it completes.
      std::optional<c10::StreamGuard> guard;
      if (stream) guard.emplace(*stream);
      try {
        body();
        if (deferred_) {  // finished later, by settle
          deferred_->work = work;
          deferred_->stream = stream;
          pending_.push_back(std::move(*deferred_));
          deferred_.reset();
        } else {
          work->complete();
        }
      } catch (...) {
        deferred_.reset();
        work->complete(std::current_exception());
      }
    }, overlaps});
  }
  queue_cv_.notify_one();
  return work;
}

namespace {
// Waits for an inner backend's Work. A backend may return none for a
// collective it has nothing to wait for: ProcessGroupNCCL (torch 2.11) does
// for a forwarded all-reduce of one rank.
void wait_inner(const WorkPtr& work) {
  if (work) work->wait();
}

// The caller's current stream on the device of the first accelerator
// tensor, taken on the caller's thread (the worker's current stream is
// another one).
std::optional<c10::Stream> caller_stream(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && !t.is_cpu() && !t.is_meta())
      return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
  }
  return std::nullopt;
}
}  // namespace

WorkPtr CompressedBackend::forward(c10d::OpType type, std::vector<at::Tensor> result,
                                   std::function<WorkPtr()> issue,
                                   const std::vector<at::Tensor>& tensors) {
  auto stream = caller_stream(tensors.empty() ? result : tensors);
  return submit(type, std::move(result), [this, issue = std::move(issue)] {
    ++profile_.forwarded;
    Span span(profile_.forwarded_s);
    wait_inner(issue());
  }, stream);
}

std::string CompressedBackend::method_for(int64_t numel) const {
  if (config_.method != "auto") return config_.method;
  for (const auto& [bound, method] : config_.size_methods)
    if (numel < bound) return method;
  return "none";  // not calibrated (or past every bound): exact
}

void CompressedBackend::set_size_methods(std::vector<std::pair<int64_t, std::string>> table,
                                         std::string calibration) {
  for (const auto& [bound, method] : table)
    TORCH_CHECK(known_method(method), "size_methods: unknown method '", method, "'");
  submit(c10d::OpType::UNKNOWN, {},
         [this, table = std::move(table), calibration = std::move(calibration)]() mutable {
           config_.size_methods = std::move(table);
           config_.calibration = std::move(calibration);
         })->wait();
}

bool CompressedBackend::compresses(const at::Tensor& t, const c10d::ReduceOp& op) const {
  if (method_for(t.numel()) == "none") return false;
  if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG) return false;
  const auto dt = t.scalar_type();
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) return false;
  return t.numel() >= config_.min_compress_numel;
}

// A call this rank cannot run still takes part in the call check, so that a
// peer calling with a valid tensor raises too instead of waiting for the
// group timeout (at the first use of the key or signature, or on every call
// with check_calls="every"); then it raises `why` here.
WorkPtr CompressedBackend::refuse(const at::Tensor& tensor, std::optional<int64_t> key,
                                  bool average, const std::string& m, int collective,
                                  std::string why) {
  return submit(c10d::OpType::UNKNOWN, {}, [this, tensor, key, average, m, collective, why] {
    collective_ = collective;
    struct Restore {
      int& c;
      ~Restore() { c = 0; }
    } restore{collective_};
    try {
      check_call(tensor, key, average, m, /*refused=*/true);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, why, "; ", e.what_without_backtrace());
    }
    TORCH_CHECK(false, why);
  });
}

WorkPtr CompressedBackend::allreduce_keyed(at::Tensor tensor, std::optional<int64_t> key,
                                           bool average, std::optional<std::string> method) {
  TORCH_CHECK(!method || known_method(*method), "unknown method '", *method, "'");
  const std::string m = method ? *method : method_for(tensor.numel());
  const auto dt = tensor.scalar_type();
  std::string bad;
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) {
    bad = std::string("compressed all_reduce needs a float32, float16 or bfloat16 tensor, got ") +
          c10::toString(dt);
  } else if (tensor.numel() == 0) {
    bad = "compressed all_reduce of an empty tensor";
  }
  if (!bad.empty()) return refuse(tensor, key, average, m, 0, bad);
  // On an accelerator the worker runs the kernels on the caller's current
  // stream, so they are ordered after the work that produced the tensor.
  return submit(c10d::OpType::ALLREDUCE, {tensor},
                [this, tensor, key, average, m] { run_compressed(tensor, key, average, m); },
                caller_stream({tensor}), /*overlaps=*/true);
}

WorkPtr CompressedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && compresses(tensors[0], opts.reduceOp)) {
    // Plain DDP and dist.all_reduce over a pycomm group land here, without a
    // key: nothing keeps the compression error, and the model pays for it.
    TORCH_WARN_ONCE(
        "pycomm: compressing an all-reduce without error feedback (dist.all_reduce, or DDP "
        "without a comm hook, over a \"pycomm\" group): each step's compression error is lost, "
        "which can cost final loss. With DDP, register pycomm.ddp.compressed_hook with a "
        "CompressionState (error feedback per bucket); elsewhere call "
        "pycomm.distributed.all_reduce(tensor, key=...).");
    return allreduce_keyed(tensors[0], std::nullopt, opts.reduceOp == c10d::ReduceOp::AVG);
  }
  return forward_allreduce(tensors, opts);
}

WorkPtr CompressedBackend::allreduce_plain(at::Tensor tensor, bool average) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  return forward_allreduce(tensors, opts);
}

WorkPtr CompressedBackend::forward_allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) {
  if (opts.reduceOp == c10d::ReduceOp::AVG && !inner_has_avg_) {
    auto sum_opts = opts;
    sum_opts.reduceOp = c10d::ReduceOp::SUM;
    const int world = getSize();
    auto stream = caller_stream(tensors);
    return submit(c10d::OpType::ALLREDUCE, tensors, [this, tensors, sum_opts, world]() mutable {
      ++profile_.forwarded;
      Span span(profile_.forwarded_s);
      wait_inner(inner_->allreduce(tensors, sum_opts));
      for (auto& t : tensors) {
        if (t.is_floating_point() || t.is_complex()) {
          t.div_(world);
        } else {
          t.div_(world, "floor");
        }
      }
    }, stream);
  }
  return forward(c10d::OpType::ALLREDUCE, tensors,
                 [this, tensors, opts]() mutable { return inner_->allreduce(tensors, opts); });
}

// ------------------------------------------------- compressed algorithms ---
ErrorFeedback* CompressedBackend::error_feedback_for(int64_t key, const at::Tensor& x,
                                                     const std::string& method, const Group& g) {
  settle(/*wait=*/true, key);  // its last call's residuals decided first
  auto it = error_feedback_.find(key);
  if (it == error_feedback_.end()) {
    ErrorFeedback ef;
    ef.numel = x.numel();
    ef.world_size = g.world;
    ef.chunk_numel = config_.chunk_numel;
    ef.method = method;
    auto opts = x.options().dtype(at::kFloat);
    ef.worker = at::zeros({x.numel()}, opts);
    if (is_block_method(method)) {
      const int64_t C = chunk_length(x.numel(), config_.chunk_numel);
      for (int64_t c0 = 0; c0 < x.numel(); c0 += C) {
        const BlockLayout lay(std::min(C, x.numel() - c0), g.world, block_for(method),
                              block_bits(method));
        ef.server.push_back(at::zeros({lay.len[g.rank]}, opts));
      }
    }
    it = error_feedback_.emplace(key, std::move(ef)).first;
  }
  ErrorFeedback& ef = it->second;
  ef.undoable = false;  // this call will change the residuals or fail
  // Hierarchical: x is this rank's shard and the world its inter-node group.
  TORCH_CHECK(ef.numel == x.numel() && ef.world_size == g.world &&
                  ef.chunk_numel == config_.chunk_numel && ef.method == method,
              "error-feedback key ", key, " holds residuals of a ", ef.numel,
              "-element tensor (world size ", ef.world_size, ", chunk_numel ", ef.chunk_numel,
              ", ", ef.method, "); this call has ", x.numel(), " elements (world size ",
              g.world, ", chunk_numel ", config_.chunk_numel, ", ", method,
              "). Use a different key or reset_error_feedback(", key, ").");
  TORCH_CHECK(ef.worker.device() == x.device(), "error-feedback key ", key, " lives on ",
              ef.worker.device(), " but the tensor is on ", x.device());
  return &ef;
}

namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(t);
  }
}

std::string field_value(int field, int64_t v) {
  switch (field) {
    case kDtype: return dtype_name(static_cast<at::ScalarType>(v));
    case kOp: return v ? "avg" : "sum";
    case kKey: return v < 0 ? "None" : std::to_string(v);
    case kNumel: return v == kRefusedNumel ? "a call it refused" : std::to_string(v);
    case kMethod:
      if (v >= kPluginCode) return "registered compressor #" + std::to_string(v - kPluginCode);
      return v >= 0 && v < kNumMethods ? kMethods[v] : "?";
    case kDensity: {
      double d;
      memcpy(&d, &v, sizeof(d));
      std::ostringstream o;
      o << d;
      return o.str();
    }
    case kApprox: return v ? "True" : "False";
    case kCollective: return v >= 0 && v < kNumCollectives ? kCollectives[v] : "?";
    case kRounding: return v < 0 ? "nearest" : "stochastic, seed " + std::to_string(v);
    case kDevice: return c10::DeviceTypeName(static_cast<c10::DeviceType>(v), true);
    default: return std::to_string(v);
  }
}

// Rethrows the exception being handled with `context` in front of its
// message, keeping a DistBackendError one (callers tell them apart).
[[noreturn]] void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const c10::DistBackendError& e) {
    C10_THROW_ERROR(DistBackendError, context + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, context, e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, context, e.what());
  }
  TORCH_CHECK(false, context, "unknown exception");
}

// Second buffers for the residuals, allocated at the first call (see
// onebit_with_spare).
void prepare_backup(ErrorFeedback& ef) {
  if (!ef.worker_backup.defined()) ef.worker_backup = at::empty_like(ef.worker);
  ef.server_backup.resize(ef.server.size());
  for (size_t i = 0; i < ef.server.size(); ++i) {
    if (!ef.server_backup[i].defined()) ef.server_backup[i] = at::empty_like(ef.server[i]);
  }
}

// The values of 0-dim bool tensors of one device, read together: one
// host synchronization on an accelerator, whatever their number.
std::vector<bool> read_flags(const std::vector<at::Tensor>& flags) {
  if (flags.empty()) return {};
  const at::Tensor host = at::stack(flags).to(at::kCPU);
  const bool* p = host.const_data_ptr<bool>();
  return std::vector<bool>(p, p + host.numel());
}

// Whether every element is finite: one vectorized read (a sum is finite
// only if every term is); the exact check only when the sum itself
// overflows. `sums`: float32 sums of parts of `t`, taken on the way.
bool all_finite(const std::vector<at::Tensor>& sums, const at::Tensor& t) {
  if (sums.empty() || at::isfinite(at::stack(sums)).all().item<bool>()) return true;
  return at::isfinite(t).all().item<bool>();
}

// Exchanges the residuals and their second buffers (a swap, no copy).
void swap_residuals(ErrorFeedback& ef) {
  std::swap(ef.worker, ef.worker_backup);
  for (size_t i = 0; i < ef.server.size(); ++i) std::swap(ef.server[i], ef.server_backup[i]);
}

// A call whose compressors update the residuals in place: they are copied to
// the second buffers first, and put back (a swap) if the call fails part-way,
// so that a failed call leaves them as they were, as a non-finite one does.
struct ResidualGuard {
  ErrorFeedback* ef = nullptr;
  explicit ResidualGuard(ErrorFeedback* e) : ef(e) {
    if (!ef) return;
    ef->worker_backup.copy_(ef->worker);
    for (size_t i = 0; i < ef->server.size(); ++i) ef->server_backup[i].copy_(ef->server[i]);
  }
  // Success: the caller decides what to keep.
  void release() { ef = nullptr; }
  ~ResidualGuard() {
    if (ef) swap_residuals(*ef);
  }
};

}  // namespace

bool CompressedBackend::double_buffered(const at::Tensor& x, const std::string& method) const {
  if (!is_block_method(method)) return false;
  if (x.is_cpu()) return true;
  // On a GPU when the build has the CUDA kernels of compress_into (read
  // once: the ops are registered when the extension loads).
  static const bool cuda_into = [] {
    for (const char* name : {"pycomm::onebit_compress_into", "pycomm::quant_compress_into"}) {
      auto op = c10::Dispatcher::singleton().findSchema({name, ""});
      if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) return false;
    }
    return true;
  }();
  return x.is_cuda() && cuda_into;
}

std::string CompressedBackend::describe_call(const at::Tensor& tensor, std::optional<int64_t> key,
                                             bool average, const std::string& method) const {
  std::ostringstream o;
  o << kCollectives[collective_] << " key=" << (key ? std::to_string(*key) : "None") << " "
    << tensor.numel() << " "
    << dtype_name(tensor.scalar_type()) << " " << method << " "
    << (average ? "avg" : "sum");
  return o.str();
}

void CompressedBackend::check_call(const at::Tensor& tensor, std::optional<int64_t> key,
                                   bool average, const std::string& method, bool refused) {
  if (config_.check_calls == 0) return;
  Span span(profile_.check_s);
  const int64_t numel = tensor.numel();
  const int dtype = static_cast<int>(tensor.scalar_type());
  const auto signature = std::make_tuple(numel, dtype + 256 * collective_, average);
  if (config_.check_calls == 1) {
    if (key ? checked_keys_.count(*key) > 0 : checked_signatures_.count(signature) > 0) return;
  }
  int64_t density_bits;
  memcpy(&density_bits, &config_.density, sizeof(density_bits));
  std::vector<int64_t> mine(kFields);
  mine[kNumel] = refused ? kRefusedNumel : numel;  // never equal to a peer's valid call
  mine[kDtype] = dtype;
  mine[kOp] = average;
  mine[kKey] = key ? *key : -1;
  mine[kMethod] = is_plugin(method) ? plugin_code(method, config_.plugin_options) : method_code(method);
  mine[kChunk] = config_.chunk_numel;
  mine[kBlock] = block_for(method);
  mine[kDensity] = density_bits;
  mine[kApprox] = config_.approx;
  mine[kDevice] = static_cast<int64_t>(tensor.device().type());
  mine[kCollective] = collective_;
  mine[kRounding] = block_bits(method) ? config_.rounding_seed : -1;  // onebit: no rounding
  const int world = getSize();
  const auto opts = tensor.options().dtype(at::kLong);
  at::Tensor in = at::tensor(mine, at::kLong).to(tensor.device());
  at::Tensor out = at::empty({world * kFields}, opts);
  ++profile_.collectives;  // its wait counts as the check's, not the wire's
  wait_inner(inner_->_allgather_base(out, in, c10d::AllgatherOptions()));
  const at::Tensor all = out.cpu().view({world, kFields});
  const int64_t* a = all.data_ptr<int64_t>();
  auto same = [&](int f) {
    for (int r = 1; r < world; ++r)
      if (a[r * kFields + f] != a[f]) return false;
    return true;
  };
  // Another compressor has other settings anyway: then name it alone.
  const bool same_method = same(kMethod);
  std::ostringstream diffs;
  for (int f = 0; f < kFields; ++f) {
    if (same(f) || (!same_method && f != kMethod)) continue;
    diffs << (diffs.tellp() > 0 ? "; " : "") << kFieldNames[f] << " (";
    for (int r = 0; r < world; ++r)
      diffs << (r ? ", " : "") << "rank " << r << ": " << field_value(f, a[r * kFields + f]);
    diffs << ")";
  }
  TORCH_CHECK(diffs.tellp() == 0,
              "ranks called the compressed ", kCollectives[collective_],
              " with different arguments: ", diffs.str(),
              ". Every rank must make the same compressed calls in the same order with the same "
              "settings (checked at the first use of each key and of each keyless "
              "(numel, dtype, op); PYCOMM_DEBUG=detail checks every call)");
  if (key) {
    checked_keys_.insert(*key);
  } else {
    checked_signatures_.insert(signature);
  }
}

void CompressedBackend::run_compressed(const at::Tensor& tensor, std::optional<int64_t> key,
                                       bool average, const std::string& m) {
  ++profile_.calls;
  Span span(profile_.run_s);
  try {
    check_call(tensor, key, average, m);
    set_tag(tensor, key, average);
    // Work on a flat, contiguous float32 view (a copy only when needed).
    const bool direct = tensor.scalar_type() == at::kFloat && tensor.is_contiguous();
    at::Tensor x = direct ? tensor.view({-1}) : tensor.reshape({-1}).to(at::kFloat).contiguous();
    if (m == "fp16" || m == "bf16" || m == "none") {
      if (m == "none") {
        run_exact(x, average);
      } else {
        run_cast(x, average, m);
      }
      if (!direct) tensor.copy_(x.view(tensor.sizes()));
      return;
    }
    // Hierarchical (docs/hierarchy.md): an exact reduce-scatter inside the
    // node leaves this rank one shard of the node's sum; the compressed step
    // all-reduces that shard with the same shard of every other node; an
    // exact all-gather inside the node puts the shards back together.
    // Over Gloo the node's exact steps are all-reduces of the whole tensor
    // instead: Gloo's reduce-scatter and all-gather are slower than its
    // all-reduce (2 ranks, 64 MB on loopback: 108 and 94 ms against 63).
    const int64_t n = x.numel();
    Group g{inner_.get(), getRank(), getSize()};
    at::Tensor y = x, padded, shard;
    const bool intra_allreduce = intra_ && intra_->getBackendName() == "gloo";
    int64_t lo = 0;
    if (intra_) {
      const int L = intra_->getSize(), l = intra_->getRank();
      const int64_t S = ceil_div(n, L), len = std::clamp<int64_t>(n - l * S, 0, S);
      lo = std::min(n, l * S);
      if (intra_allreduce) {
        std::vector<at::Tensor> ts{x};
        wait_wire(intra_->allreduce(ts, c10d::AllreduceOptions()));  // SUM
        y = x.narrow(0, lo, len);
      } else {
        padded = n == L * S ? x : at::cat({x, at::zeros({L * S - n}, x.options())});
        shard = at::empty({S}, x.options());
        c10d::ReduceScatterOptions rs;
        rs.reduceOp = c10d::ReduceOp::SUM;
        wait_wire(intra_->_reduce_scatter_base(shard, padded, rs));
        y = shard.narrow(0, 0, len);
      }
      g = Group{inter_.get(), inter_->getRank(), inter_->getSize()};
    }
    // A rank whose shard is empty (n < ranks per node) has nothing to send;
    // so do its peers on the other nodes, which hold the same shard.
    ErrorFeedback* ef = key.has_value() && y.numel() > 0 ? error_feedback_for(*key, y, m, g) : nullptr;
    begin_seeds(key, ef);
    if (ef) prepare_backup(*ef);
    // Double-buffered compressors never touch the residuals they read.
    ResidualGuard guard(ef && !double_buffered(y, m) ? ef : nullptr);
    // The flat block path reads nothing back inside the call: on an
    // accelerator its checks follow its kernels to the host, and the call is
    // finished (residuals kept or discarded, Work completed) once the device
    // has passed them (settle). The other paths read them here.
    if (!intra_ && direct && is_block_method(m) && y.numel() > 0 &&
        (!ef || double_buffered(y, m))) {
      std::vector<at::Tensor> checks;
      run_blocks(y, ef, average, g, m, &checks);
      defer(checks, key,
            [this, ef, context = failure_context(tensor, key, average, m)](
                const std::vector<bool>& ok) {
              try {
                require_tags(ok[0]);
              } catch (...) {
                rethrow_with_context(context);
              }
              const bool finite = ok.size() < 2 || ok[1];
              if (ef) {  // the new residuals are in the second buffers
                if (finite) swap_residuals(*ef);
                ef->undoable = finite;
                ef->calls += finite;
              }
            });
      return;
    }
    bool finite = true;
    if (y.numel() > 0) {
      finite = is_block_method(m) ? run_blocks(y, ef, average, g, m)
               : m == "topk" ? run_topk(y, ef, average, g)
                             : run_plugin(y, ef, average, g, m);
    }
    if (intra_) {
      if (average) y.div_(intra_->getSize());  // the inter step averaged over nodes
      if (intra_allreduce) {
        // Every other rank of the node adds zeros to this rank's shard: exact.
        x.narrow(0, 0, lo).zero_();
        x.narrow(0, lo + y.numel(), n - lo - y.numel()).zero_();
        std::vector<at::Tensor> ts{x};
        wait_wire(intra_->allreduce(ts, c10d::AllreduceOptions()));
      } else {
        wait_wire(intra_->_allgather_base(padded, shard, c10d::AllgatherOptions()));
        if (padded.data_ptr() != x.data_ptr()) x.copy_(padded.narrow(0, 0, n));
      }
      // Each node's shard group saw only its shard; the whole result is the
      // same on every rank, so every rank takes the rollback decision alike.
      if (key.has_value()) finite = all_finite({x.sum()}, x);
    }
    if (!direct) {
      tensor.copy_(x.view(tensor.sizes()));
      // A float32 result can still overflow the tensor's 16-bit dtype.
      if (ef && finite) finite = all_finite({tensor.sum(at::kFloat)}, tensor);
    }
    // The result is identical on every rank, so every rank decides alike:
    // a step that GradScaler will skip leaves the residuals as they were.
    // Double-buffered: the new residuals are in the second buffers, commit
    // them if finite; copied: the old ones are, restore them if not.
    guard.release();
    if (ef && finite == double_buffered(x, m)) swap_residuals(*ef);
    if (ef) {
      ef->undoable = finite;
      ef->calls += finite;  // a skipped step leaves the count as it was too
    }
  } catch (...) {
    rethrow_with_context(failure_context(tensor, key, average, m));
  }
}

std::string CompressedBackend::failure_context(const at::Tensor& tensor,
                                               std::optional<int64_t> key, bool average,
                                               const std::string& method) const {
  std::ostringstream o;
  o << "pycomm rank " << getRank() << " of " << getSize();
  // With two ranks the peer is known; with more, Gloo's own message below
  // names the peer's address when the failure is a connection.
  if (getSize() == 2) o << " (peer: rank " << 1 - getRank() << ")";
  o << ": " << describe_call(tensor, key, average, method) << " failed: ";
  return o.str();
}

void CompressedBackend::run_cast(const at::Tensor& x, bool average, const std::string& method) {
  // Divide first (as PyTorch's fp16 hook does) so the sum cannot overflow.
  at::Tensor y;
  {
    Span span(profile_.encode_s);
    y = (average ? x / getSize() : x).to(method == "fp16" ? at::kHalf : at::kBFloat16);
  }
  std::vector<at::Tensor> ts{y};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_wire(inner_->allreduce(ts, opts));
  Span span(profile_.decode_s);
  x.copy_(y);
}

void CompressedBackend::begin_seeds(std::optional<int64_t> key, ErrorFeedback* ef) {
  // Every rank runs the same calls in the same order, so the keyless count
  // is the same on all; a key's count travels with its residuals.
  seeds_ = CallSeeds{config_.rounding_seed, key ? *key : -1, 0, collective_, getRank()};
  if (ef) {
    seeds_.call = ef->calls;  // counted when the call keeps its residuals
  } else if (!key) {
    seeds_.call = keyless_calls_++;
  }
}

void CompressedBackend::run_exact(const at::Tensor& x, bool average) {
  std::vector<at::Tensor> ts{x};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_wire(inner_->allreduce(ts, opts));
  Span span(profile_.decode_s);
  if (average) x.div_(getSize());
}

// The two-phase all-reduce of a block codec (docs/allreduce.md): segment j
// of each chunk is reduced by rank j (an all_to_all of the workers'
// payloads, decoded and summed in float32, then compressed again: the
// compressed reduce-scatter), and the reduced segments are all-gathered.
bool CompressedBackend::run_blocks(const at::Tensor& x, ErrorFeedback* ef, bool average,
                                   const Group& g, const std::string& method,
                                   std::vector<at::Tensor>* deferred_checks) {
  const int world = g.world, rank = g.rank;
  const BlockCodec codec{block_bits(method), block_for(method)};
  const int64_t n = x.numel(), C = chunk_length(n, config_.chunk_numel), B = codec.block;
  const int64_t chunks = ceil_div(n, C);
  const auto int_opts = x.options().dtype(at::kInt);
  const bool spare_out = double_buffered(x, method);

  struct Chunk {
    int64_t begin;
    BlockLayout lay;
    at::Tensor recv, gathered;
    WorkPtr a2a, ag;
  };
  std::vector<Chunk> st;
  st.reserve(chunks);
  // Compress with error feedback: the new residual written to `spare`, or
  // in place (the old one copied to `spare` before the call).
  auto compress_ef = [&](const at::Tensor& grad, const at::Tensor& r, const at::Tensor& spare,
                         int64_t seed) {
    if (spare_out) return codec.compress_into(grad, r, spare, seed);
    return codec.compress(grad, r, seed);  // the old residual is in `spare` already
  };
  // The result is the decoded server payloads: it is finite exactly when
  // every gathered server scale is (a read of n / B floats; a non-finite
  // block decodes to NaN or +-Inf in every codec). Only error feedback
  // needs to know. The scales and the received tags are views, checked
  // once at the end of the call (a few launches, one host read).
  std::vector<at::Tensor> scales, tags;

  // Stage 1: worker compress, all_to_all of segment payloads.
  auto stage1 = [&](int64_t i) {
    Span span(profile_.encode_s);
    const int64_t begin = i * C, m = std::min(C, n - begin);
    st.push_back(Chunk{begin, BlockLayout(m, world, B, codec.bits), {}, {}, {}, {}});
    Chunk& ch = st.back();
    const BlockLayout& lay = ch.lay;
    const int64_t seed = seeds_.at(i, 0);
    auto [data, scales] = ef ? compress_ef(x.narrow(0, begin, m), ef->worker.narrow(0, begin, m),
                                           ef->worker_backup.narrow(0, begin, m), seed)
                             : codec.compress(x.narrow(0, begin, m), std::nullopt, seed);
    std::vector<at::Tensor> parts;
    std::vector<int64_t> in_splits, out_splits(world, lay.size[rank]);
    for (int j = 0; j < world; ++j) {
      in_splits.push_back(lay.size[j]);
      if (lay.len[j] == 0) continue;
      for (auto& p : codec.segment(data, scales, j * lay.seg, lay.len[j])) parts.push_back(p);
    }
    at::Tensor send = at::cat(parts);
    ch.recv = at::empty({world * lay.size[rank]}, int_opts);
    ch.a2a = g.pg->alltoall_base(ch.recv, send, out_splits, in_splits, c10d::AllToAllOptions());
  };

  // Stage 2: decode this rank's segment from every rank, average, server
  // compress, all_gather of the server payloads.
  auto stage2 = [&](int64_t i) {
    Chunk& ch = st[i];
    const BlockLayout& lay = ch.lay;
    wait_wire(ch.a2a);
    // This rank's server payload, padded to segment 0's, then the tag:
    // assembled by one concatenation.
    std::vector<at::Tensor> parts;
    const int64_t len = lay.len[rank];
    if (len > 0) {
      // The first payload is written, the others added: no zero-filled
      // buffer to fault in per chunk. (Starting from +0 instead would only
      // change the sign of zero sums, which encode alike.)
      at::Tensor acc = at::empty({len}, x.options().dtype(at::kFloat));
      {
        Span span(profile_.decode_s);
        for (int src = 0; src < world; ++src)
          codec.decompress(acc, ch.recv, src * lay.size[rank], /*accumulate=*/src > 0);
      }
      Span span(profile_.encode_s);
      if (average) acc.div_(world);
      const int64_t seed = seeds_.at(i, 1);
      auto [sd, ss] = ef ? compress_ef(acc, ef->server[i], ef->server_backup[i], seed)
                         : codec.compress(acc, std::nullopt, seed);
      parts = codec.segment(sd, ss, 0, len);
    }
    Span span(profile_.encode_s);
    const int64_t slot = lay.size[0] + kTagWords;
    if (const int64_t pad = lay.size[0] - (len > 0 ? lay.size[rank] : 0); pad > 0)
      parts.push_back(at::zeros({pad}, int_opts));
    parts.push_back(tag_);
    at::Tensor mine = at::cat(parts);
    ch.gathered = at::empty({world * slot}, int_opts);
    ch.ag = g.pg->_allgather_base(ch.gathered, mine, c10d::AllgatherOptions());
  };

  // Stage 3: every rank decodes every segment: identical results everywhere.
  auto stage3 = [&](int64_t i) {
    Chunk& ch = st[i];
    const BlockLayout& lay = ch.lay;
    wait_wire(ch.ag);
    Span span(profile_.decode_s);
    const int64_t slot = lay.size[0] + kTagWords;
    tags.push_back(tag_words(ch.gathered, world, slot));
    for (int j = 0; j < world; ++j) {
      if (lay.len[j] == 0) continue;
      codec.decompress(x.narrow(0, ch.begin + j * lay.seg, lay.len[j]), ch.gathered,
                       j * slot, false);
      if (ef) scales.push_back(codec.scales_at(ch.gathered, j * slot, lay.len[j]));
    }
    ch.recv = at::Tensor();
    ch.gathered = at::Tensor();
  };

  // Pipeline: chunk i+1 is compressed while chunk i is on the wire. The
  // issue order (a2a 0, a2a 1, ag 0, a2a 2, ag 1, ...) depends only on the
  // sizes, so it is the same on every rank.
  for (int64_t i = 0; i < chunks; ++i) {
    stage1(i);
    if (i >= 1) stage2(i - 1);
    if (i >= 2) stage3(i - 2);
  }
  stage2(chunks - 1);
  for (int64_t i = std::max<int64_t>(0, chunks - 2); i < chunks; ++i) stage3(i);
  std::vector<at::Tensor> checks;
  {
    Span span(profile_.decode_s);
    checks.push_back(tags_ok(tags));
    if (!scales.empty()) checks.push_back(codec.finite(at::cat(scales)));
  }
  if (deferred_checks) {
    *deferred_checks = std::move(checks);
    return true;
  }
  const std::vector<bool> ok = read_checks(checks);
  require_tags(ok[0]);
  return ok.size() < 2 || ok[1];
}

bool CompressedBackend::run_topk(const at::Tensor& x, ErrorFeedback* ef, bool average,
                                 const Group& g) {
  const int world = g.world;
  const int64_t n = x.numel(), C = chunk_length(n, config_.chunk_numel);
  const int64_t chunks = ceil_div(n, C);
  const auto int_opts = x.options().dtype(at::kInt);

  struct Chunk {
    int64_t begin, m, cap;
    at::Tensor gathered;
    WorkPtr ag;
  };
  std::vector<Chunk> st;
  st.reserve(chunks);
  // Sums of finite values can overflow, so the output itself is checked (a
  // sum per chunk, small next to the selection); only for error feedback.
  std::vector<at::Tensor> sums, tags;

  auto stage1 = [&](int64_t i) {
    Span span(profile_.encode_s);
    const int64_t begin = i * C, m = std::min(C, n - begin);
    const int64_t k = topk_k(m, config_.density);
    const int64_t cap = config_.approx ? topk_capacity(k) : k;
    std::optional<at::Tensor> residual;
    if (ef) residual = ef->worker.narrow(0, begin, m);
    auto [idx, vals] = topk_compress(x.narrow(0, begin, m), residual, k, config_.approx);
    const int64_t count = idx.numel();
    // [count, indices, values as float bits], zero-padded to 1 + 2 cap, tag.
    const int64_t slot = topk_wire_numel(m, config_.density, config_.approx);
    at::Tensor buf = at::zeros({slot}, int_opts);
    buf.narrow(0, 0, 1).fill_(count);
    buf.narrow(0, 1, count).copy_(idx);
    buf.narrow(0, 1 + count, count).copy_(vals.view(at::kInt));
    buf.narrow(0, slot - kTagWords, kTagWords).copy_(tag_);
    st.push_back(Chunk{begin, m, cap, at::empty({world * slot}, int_opts), {}});
    st.back().ag = g.pg->_allgather_base(st.back().gathered, buf, c10d::AllgatherOptions());
  };

  auto stage2 = [&](int64_t i) {
    Chunk& ch = st[i];
    wait_wire(ch.ag);
    Span span(profile_.decode_s);
    at::Tensor out = x.narrow(0, ch.begin, ch.m);
    out.zero_();
    const int64_t slot = 1 + 2 * ch.cap + kTagWords;
    tags.push_back(tag_words(ch.gathered, world, slot));
    const at::Tensor counts = ch.gathered.view({world, slot}).select(1, 0).cpu();
    for (int src = 0; src < world; ++src) {
      const int64_t off = src * slot;
      const int64_t count = counts[src].item<int32_t>();
      TORCH_CHECK(count >= 0 && count <= ch.cap, "rank ", src, " sent a top-k payload of ", count,
                  " entries, capacity ", ch.cap, ": ranks disagree on the tensor or density");
      topk_decompress(out, ch.gathered.narrow(0, off + 1, count),
                      ch.gathered.narrow(0, off + 1 + count, count).view(at::kFloat), true);
    }
    if (average) out.div_(world);
    if (ef) sums.push_back(out.sum());
    ch.gathered = at::Tensor();
  };

  for (int64_t i = 0; i < chunks; ++i) {
    stage1(i);
    if (i >= 1) stage2(i - 1);
  }
  stage2(chunks - 1);
  return checked_finite(tags, sums, x);
}

bool CompressedBackend::run_plugin(const at::Tensor& x, ErrorFeedback* ef, bool average,
                                   const Group& g, const std::string& method) {
  const int world = g.world;
  const int64_t n = x.numel(), C = chunk_length(n, config_.chunk_numel);
  const int64_t chunks = ceil_div(n, C);
  const std::string& options = config_.plugin_options;

  struct Chunk {
    int64_t begin, m;
    std::vector<at::Tensor> mine;  // this rank's payload: the layout of every rank's
    int64_t nbytes;
    at::Tensor gathered;
    WorkPtr ag;
  };
  std::vector<Chunk> st;
  st.reserve(chunks);
  std::vector<at::Tensor> sums, tags;

  // Compress (error feedback: the residual kept in the second buffer first),
  // then gather every rank's payload as bytes. A registered compressor's
  // payload has a fixed layout for a given element count (its contract), so
  // every rank's bytes split like this rank's own.
  auto stage1 = [&](int64_t i) {
    Span span(profile_.encode_s);
    const int64_t begin = i * C, m = std::min(C, n - begin);
    std::optional<at::Tensor> residual;
    if (ef) residual = ef->worker.narrow(0, begin, m);
    std::vector<at::Tensor> payload = plugin_compress(method, options, x.narrow(0, begin, m), residual);
    std::vector<at::Tensor> bytes;
    int64_t nbytes = 0;
    for (auto& p : payload) {
      TORCH_CHECK(p.device() == x.device(), "compressor '", method, "' returned a payload on ",
                  p.device(), " for a tensor on ", x.device());
      p = p.contiguous();
      bytes.push_back(p.reshape({-1}).view(at::kByte));
      nbytes += bytes.back().numel();
      // Every part starts 8-byte aligned, so the receiver views it in place.
      if (const int64_t pad = padded_nbytes(nbytes) - nbytes; pad > 0) {
        bytes.push_back(at::zeros({pad}, x.options().dtype(at::kByte)));
        nbytes += pad;
      }
    }
    bytes.push_back(tag_.view(at::kByte));  // then the call's tag
    at::Tensor send = at::cat(bytes);
    const int64_t slot = nbytes + kTagBytes;
    st.push_back(Chunk{begin, m, std::move(payload), nbytes,
                       at::empty({world * slot}, x.options().dtype(at::kByte)), {}});
    st.back().ag = g.pg->_allgather_base(st.back().gathered, send, c10d::AllgatherOptions());
  };

  // Decode rank 0's payload into the chunk, add the others' in rank order.
  auto stage2 = [&](int64_t i) {
    Chunk& ch = st[i];
    wait_wire(ch.ag);
    Span span(profile_.decode_s);
    at::Tensor out = x.narrow(0, ch.begin, ch.m);
    const int64_t slot = ch.nbytes + kTagBytes;
    tags.push_back(tag_words(ch.gathered, world, slot));
    for (int src = 0; src < world; ++src) {
      std::vector<at::Tensor> payload;
      int64_t off = src * slot;
      for (const auto& p : ch.mine) {
        const int64_t len = p.numel() * p.element_size();
        payload.push_back(ch.gathered.narrow(0, off, len).view(p.scalar_type()).view(p.sizes()));
        off += padded_nbytes(len);
      }
      plugin_decompress(method, options, payload, out, /*accumulate=*/src > 0);
    }
    if (average) out.div_(world);
    if (ef) sums.push_back(out.sum());
    ch.gathered = at::Tensor();
    ch.mine.clear();
  };

  for (int64_t i = 0; i < chunks; ++i) {
    stage1(i);
    if (i >= 1) stage2(i - 1);
  }
  stage2(chunks - 1);
  return checked_finite(tags, sums, x);
}

// ------------------------------------------- compressed reduce-scatter ---
// Why a compressed reduce-scatter / all-gather cannot run these tensors
// (empty when it can): `whole` holds world size x `part`'s elements.
std::string CompressedBackend::bad_pair(const char* what, const at::Tensor& whole,
                                        const at::Tensor& part, const char* whole_name,
                                        const char* part_name) const {
  std::ostringstream o;
  for (const auto* t : {&whole, &part}) {
    const auto dt = t->scalar_type();
    if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) {
      o << "compressed " << what << " needs float32, float16 or bfloat16 tensors, got " << dt;
      return o.str();
    }
  }
  if (whole.scalar_type() != part.scalar_type()) {
    o << whole_name << " is " << whole.scalar_type() << " but " << part_name << " is "
      << part.scalar_type();
  } else if (whole.device() != part.device()) {
    o << whole_name << " is on " << whole.device() << " but " << part_name << " is on "
      << part.device();
  } else if (part.numel() == 0) {
    o << "compressed " << what << " of an empty tensor";
  } else if (whole.numel() != part.numel() * getSize()) {
    o << whole_name << " must hold world size (" << getSize() << ") x " << part_name << "'s "
      << part.numel() << " elements, got " << whole.numel();
  }
  return o.str();
}

WorkPtr CompressedBackend::reduce_scatter_keyed(at::Tensor output, at::Tensor input,
                                                std::optional<int64_t> key, bool average) {
  const std::string m = method_for(input.numel());
  if (auto bad = bad_pair("reduce_scatter", input, output, "input", "output"); !bad.empty())
    return refuse(input, key, average, m, 1, bad);
  return submit(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                [this, output, input, key, average, m] {
                  run_reduce_scatter(output, input, key, average, m);
                },
                caller_stream({input}), /*overlaps=*/true);
}

// Rank j receives shard j of every rank's input (spec.reduce_scatter in
// docs/allreduce.md): per chunk of the shard, each rank compresses its W
// segments (segment j = the chunk's part of shard j, with error feedback),
// sends segment j's payload to rank j (one all_to_all of equal payloads),
// and decodes the W payloads it receives in rank order into its output.
// No server stage: the output is the decoded sum, in float32.
void CompressedBackend::run_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                           std::optional<int64_t> key, bool average,
                                           const std::string& m) {
  collective_ = 1;
  struct Restore {
    int& c;
    ~Restore() { c = 0; }
  } restore{collective_};
  ++profile_.calls;
  Span span(profile_.run_s);
  try {
    check_call(input, key, average, m);
    set_tag(input, key, average);
    const int world = getSize();
    const bool direct = input.scalar_type() == at::kFloat && input.is_contiguous() &&
                        output.is_contiguous();
    at::Tensor in = direct ? input.view({-1}) : input.reshape({-1}).to(at::kFloat).contiguous();
    at::Tensor out = direct ? output.view({-1}) : at::empty({output.numel()}, in.options());
    const int64_t S = out.numel();
    if (m == "none" || m == "fp16" || m == "bf16") {
      // Exact, or the 16-bit cast (divided first, as the all-reduce does).
      const auto dt = m == "none" ? at::kFloat : m == "fp16" ? at::kHalf : at::kBFloat16;
      at::Tensor x = (average && m != "none" ? in / world : in).to(dt);
      at::Tensor y = at::empty({S}, x.options());
      c10d::ReduceScatterOptions rs;
      rs.reduceOp = c10d::ReduceOp::SUM;
      wait_wire(inner_->_reduce_scatter_base(y, x, rs));
      out.copy_(y);
      if (average && m == "none") out.div_(world);
      if (!direct) output.copy_(out.view(output.sizes()));
      return;
    }
    Group g{inner_.get(), getRank(), world};
    ErrorFeedback* ef = key ? error_feedback_for(*key, in, m + kReduceScatterSuffix, g) : nullptr;
    begin_seeds(key, ef);
    if (ef) prepare_backup(*ef);
    ResidualGuard guard(ef);
    const int64_t C = chunk_length(S, config_.chunk_numel), chunks = ceil_div(S, C);
    PayloadCodec codec{m, config_, BlockCodec{block_bits(m), block_for(m)}, in.options().dtype(at::kByte), {}};
    const auto byte_opts = codec.byte_opts;

    struct Chunk {
      int64_t begin, len, nbytes;
      at::Tensor recv;
      WorkPtr a2a;
      std::vector<at::Tensor> layout;  // a registered compressor's payload, for decoding
    };
    std::vector<Chunk> st;
    st.reserve(chunks);
    std::vector<at::Tensor> sums, tags;
    auto stage1 = [&](int64_t i) {
      Span span(profile_.encode_s);
      const int64_t c0 = i * C, len = std::min(C, S - c0);
      codec.plugin_layout.clear();  // the last chunk may be shorter: learned per chunk
      std::vector<at::Tensor> sends;
      for (int j = 0; j < world; ++j) {
        const int64_t at0 = j * S + c0;
        std::optional<at::Tensor> r;
        if (ef) r = ef->worker.narrow(0, at0, len);
        sends.push_back(codec.encode(in.narrow(0, at0, len), r, seeds_.at(i, j)));
      }
      const int64_t nbytes = sends[0].numel();
      for (const auto& b : sends)
        TORCH_CHECK(b.numel() == nbytes, "compressor '", m, "' made payloads of ", nbytes, " and ",
                    b.numel(), " bytes for segments of ", len, " elements: payload sizes must "
                    "depend on the element count alone");
      // Each segment's payload, then the call's tag.
      std::vector<at::Tensor> parts;
      for (const auto& b : sends) {
        parts.push_back(b);
        parts.push_back(tag_.view(at::kByte));
      }
      at::Tensor send = at::cat(parts);
      const int64_t slot = nbytes + kTagBytes;
      st.push_back(Chunk{c0, len, nbytes, at::empty({world * slot}, byte_opts), {}, codec.plugin_layout});
      std::vector<int64_t> splits(world, slot);
      st.back().a2a = g.pg->alltoall_base(st.back().recv, send, splits, splits, c10d::AllToAllOptions());
    };
    auto stage2 = [&](int64_t i) {
      Chunk& ch = st[i];
      wait_wire(ch.a2a);
      Span span(profile_.decode_s);
      at::Tensor dst = out.narrow(0, ch.begin, ch.len);
      const int64_t slot = ch.nbytes + kTagBytes;
      tags.push_back(tag_words(ch.recv, world, slot));
      for (int src = 0; src < world; ++src)
        codec.decode(ch.recv.narrow(0, src * slot, ch.nbytes), dst, src > 0, ch.layout);
      if (average) dst.div_(world);
      if (ef) sums.push_back(dst.sum());
      ch.recv = at::Tensor();
    };
    for (int64_t i = 0; i < chunks; ++i) {
      stage1(i);
      if (i >= 1) stage2(i - 1);
    }
    stage2(chunks - 1);
    require_tags(tags);
    if (!direct) output.copy_(out.view(output.sizes()));
    if (ef) {
      // Each rank holds another shard: they agree on finiteness (one MIN)
      // before any rolls back, so the residuals stay consistent.
      bool finite = all_finite(sums, out);
      if (finite && !direct) finite = all_finite({output.sum(at::kFloat)}, output);
      at::Tensor flag = at::full({1}, finite ? 1 : 0, in.options().dtype(at::kInt));
      std::vector<at::Tensor> ts{flag};
      c10d::AllreduceOptions mn;
      mn.reduceOp = c10d::ReduceOp::MIN;
      wait_wire(inner_->allreduce(ts, mn));
      if (flag.item<int32_t>() == 1) {
        guard.release();  // else the guard restores them
        ef->undoable = true;
        ++ef->calls;
      }
    }
  } catch (...) {
    rethrow_with_context(failure_context(input, key, average, m));
  }
}

// ------------------------------------------------ compressed all-gather ---
WorkPtr CompressedBackend::all_gather_keyed(at::Tensor output, at::Tensor input,
                                            std::optional<int64_t> key) {
  const std::string m = method_for(output.numel());
  if (auto bad = bad_pair("all_gather", output, input, "output", "input"); !bad.empty())
    return refuse(input, key, false, m, 2, bad);
  return submit(c10d::OpType::_ALLGATHER_BASE, {output},
                [this, output, input, key, m] { run_all_gather(output, input, key, m); },
                caller_stream({input}), /*overlaps=*/true);
}

// Every rank receives every rank's input, compressed (docs/allreduce.md,
// "All-gather"): per chunk, each rank compresses its part (error feedback
// under the key, method name + "/all_gather"), the payloads are
// all-gathered, and every rank decodes rank j's into block j of the output.
// Every rank decodes the same bytes: the outputs are identical everywhere.
void CompressedBackend::run_all_gather(const at::Tensor& output, const at::Tensor& input,
                                       std::optional<int64_t> key, const std::string& m) {
  collective_ = 2;
  struct Restore {
    int& c;
    ~Restore() { c = 0; }
  } restore{collective_};
  ++profile_.calls;
  Span span(profile_.run_s);
  try {
    check_call(input, key, false, m);
    set_tag(input, key, false);
    const int world = getSize();
    const bool direct = input.scalar_type() == at::kFloat && input.is_contiguous() &&
                        output.is_contiguous();
    at::Tensor in = direct ? input.view({-1}) : input.reshape({-1}).to(at::kFloat).contiguous();
    at::Tensor out = direct ? output.view({-1}) : at::empty({output.numel()}, in.options());
    const int64_t S = in.numel();
    if (m == "none" || m == "fp16" || m == "bf16") {
      const auto dt = m == "none" ? at::kFloat : m == "fp16" ? at::kHalf : at::kBFloat16;
      at::Tensor x = in.to(dt), y = at::empty({world * S}, x.options());
      wait_wire(inner_->_allgather_base(y, x, c10d::AllgatherOptions()));
      out.copy_(y);
      if (!direct) output.copy_(out.view(output.sizes()));
      return;
    }
    Group g{inner_.get(), getRank(), world};
    ErrorFeedback* ef = key ? error_feedback_for(*key, in, m + kAllGatherSuffix, g) : nullptr;
    begin_seeds(key, ef);
    if (ef) prepare_backup(*ef);
    ResidualGuard guard(ef);
    PayloadCodec codec{m, config_, BlockCodec{block_bits(m), block_for(m)},
                       in.options().dtype(at::kByte), {}};
    const int64_t C = chunk_length(S, config_.chunk_numel), chunks = ceil_div(S, C);

    struct Chunk {
      int64_t begin, len, nbytes;
      at::Tensor gathered;
      WorkPtr ag;
      std::vector<at::Tensor> layout;
    };
    std::vector<Chunk> st;
    st.reserve(chunks);
    std::vector<at::Tensor> tags;
    auto stage1 = [&](int64_t i) {
      Span span(profile_.encode_s);
      const int64_t c0 = i * C, len = std::min(C, S - c0);
      codec.plugin_layout.clear();
      std::optional<at::Tensor> r;
      if (ef) r = ef->worker.narrow(0, c0, len);
      at::Tensor payload = codec.encode(in.narrow(0, c0, len), r, seeds_.at(i, 0));
      const int64_t nbytes = payload.numel(), slot = nbytes + kTagBytes;
      at::Tensor send = at::cat({payload, tag_.view(at::kByte)});  // then the call's tag
      st.push_back(Chunk{c0, len, nbytes, at::empty({world * slot}, codec.byte_opts), {},
                         codec.plugin_layout});
      st.back().ag = g.pg->_allgather_base(st.back().gathered, send, c10d::AllgatherOptions());
    };
    auto stage2 = [&](int64_t i) {
      Chunk& ch = st[i];
      wait_wire(ch.ag);
      Span span(profile_.decode_s);
      const int64_t slot = ch.nbytes + kTagBytes;
      tags.push_back(tag_words(ch.gathered, world, slot));
      for (int j = 0; j < world; ++j)
        codec.decode(ch.gathered.narrow(0, j * slot, ch.nbytes),
                     out.narrow(0, j * S + ch.begin, ch.len), false, ch.layout);
      ch.gathered = at::Tensor();
    };
    for (int64_t i = 0; i < chunks; ++i) {
      stage1(i);
      if (i >= 1) stage2(i - 1);
    }
    stage2(chunks - 1);
    require_tags(tags);
    if (!direct) output.copy_(out.view(output.sizes()));
    // The output is the same on every rank, so every rank decides alike: a
    // non-finite one leaves the residuals as they were.
    if (ef) {
      bool finite = all_finite({out.sum()}, out);
      if (finite && !direct) finite = all_finite({output.sum(at::kFloat)}, output);
      if (finite) {
        guard.release();  // else the guard restores them
        ef->undoable = true;
        ++ef->calls;
      }
    }
  } catch (...) {
    rethrow_with_context(failure_context(input, key, false, m));
  }
}

// -------------------------------------------------- error-feedback state ---
std::map<int64_t, ErrorFeedback> CompressedBackend::error_feedback_state(
    std::optional<std::vector<int64_t>> keys) {
  std::map<int64_t, ErrorFeedback> copy;
  submit(c10d::OpType::UNKNOWN, {}, [this, &copy, &keys] {
    for (const auto& [key, ef] : error_feedback_) {
      if (keys && std::find(keys->begin(), keys->end(), key) == keys->end()) continue;
      ErrorFeedback c = ef;
      c.worker = ef.worker.clone();
      for (auto& s : c.server) s = s.clone();
      copy.emplace(key, std::move(c));
    }
  })->wait();
  return copy;
}

void CompressedBackend::load_error_feedback_state(std::map<int64_t, ErrorFeedback> state,
                                                  bool replace) {
  // Everything is checked before anything is replaced, and the tensors are
  // copied: the caller's stay theirs (the engine swaps its buffers in place).
  for (auto& [key, ef] : state) {
    // Hierarchical: residuals are per shard, over the inter-node group.
    const int world = inter_ ? inter_->getSize() : getSize();
    const int rank = inter_ ? inter_->getRank() : getRank();
    TORCH_CHECK(ef.world_size == world, "error-feedback state of key ", key,
                " was saved with world size ", ef.world_size, ", this group has ", world,
                ": it cannot be reused (reset it instead)");
    // A reduce-scatter's or all-gather's residuals: method + "/collective".
    const bool scattered = ef.method.find('/') != std::string::npos;
    const std::string base = ef.method.substr(0, ef.method.find('/'));
    const bool method_ok = config_.method == "auto"
                               ? (known_method(base) && base != "fp16" && base != "bf16" && base != "none")
                               : base == config_.method;
    TORCH_CHECK(method_ok && ef.chunk_numel == config_.chunk_numel,
                "error-feedback state of key ", key, " was saved for ", ef.method,
                " with chunk_numel ", ef.chunk_numel, "; this group runs ", config_.method,
                " with chunk_numel ", config_.chunk_numel);
    TORCH_CHECK(ef.numel > 0 && ef.worker.dim() == 1 && ef.worker.numel() == ef.numel &&
                    ef.worker.scalar_type() == at::kFloat,
                "error-feedback state of key ", key, " is inconsistent: worker residual is ",
                ef.worker.sizes(), " ", ef.worker.scalar_type(), ", numel ", ef.numel,
                " (expected a 1-D float32 tensor of numel elements)");
    // The server residuals: this rank's segment of every chunk (block
    // methods' all-reduce), none otherwise.
    std::vector<int64_t> want;
    if (is_block_method(base) && !scattered) {
      const int64_t C = chunk_length(ef.numel, ef.chunk_numel);
      for (int64_t c0 = 0; c0 < ef.numel; c0 += C)
        want.push_back(BlockLayout(std::min(C, ef.numel - c0), world, block_for(base),
                                   block_bits(base)).len[rank]);
    }
    TORCH_CHECK(ef.server.size() == want.size(), "error-feedback state of key ", key, " has ",
                ef.server.size(), " server residuals; ", ef.method, " on ", ef.numel,
                " elements in chunks of ", ef.chunk_numel, " has ", want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const at::Tensor& t = ef.server[i];
      TORCH_CHECK(t.dim() == 1 && t.numel() == want[i] && t.scalar_type() == at::kFloat,
                  "error-feedback state of key ", key, ": server residual ", i, " is ", t.sizes(),
                  " ", t.scalar_type(), ", expected ", want[i], " float32 elements");
      TORCH_CHECK(t.device() == ef.worker.device(), "error-feedback state of key ", key,
                  ": server residual ", i, " is on ", t.device(), ", the worker residual on ",
                  ef.worker.device());
    }
    bool finite = at::isfinite(ef.worker).all().item<bool>();
    for (const auto& t : ef.server) finite = finite && at::isfinite(t).all().item<bool>();
    TORCH_CHECK(finite, "error-feedback state of key ", key, " holds NaN or Inf residuals: every "
                "later step would be non-finite (reset it instead)");
    ef.worker = ef.worker.clone(at::MemoryFormat::Contiguous);
    for (auto& t : ef.server) t = t.clone(at::MemoryFormat::Contiguous);
    ef.worker_backup = at::Tensor();
    ef.server_backup.clear();
  }
  submit(c10d::OpType::UNKNOWN, {}, [this, replace, state = std::move(state)]() mutable {
    if (replace) {
      error_feedback_ = std::move(state);
    } else {
      for (auto& [key, ef] : state) error_feedback_.insert_or_assign(key, std::move(ef));
    }
  })->wait();
}

void CompressedBackend::wait_wire(const WorkPtr& work) {
  ++profile_.collectives;
  Span span(profile_.wire_s);
  wait_inner(work);
}

void CompressedBackend::set_tag(const at::Tensor& tensor, std::optional<int64_t> key,
                                bool average) {
  const uint64_t h = call_tag(collective_, key ? *key : -1, tensor.numel(),
                              static_cast<int>(tensor.scalar_type()), average);
  int32_t words[kTagWords];
  static_assert(sizeof(words) == sizeof(h), "a tag is 64 bits");
  memcpy(words, &h, sizeof(h));
  if (tensor.is_cpu()) {
    tag_ = at::tensor(std::vector<int32_t>(words, words + kTagWords), at::kInt);
    return;
  }
  // On an accelerator the copy would block the worker every call: each tag
  // is copied once. Keyless calls of many sizes could grow the cache
  // without bound: it starts over past a few thousand tags.
  auto where = std::make_pair(h, tensor.device().str());
  auto it = device_tags_.find(where);
  if (it == device_tags_.end()) {
    if (device_tags_.size() >= 4096) device_tags_.clear();
    at::Tensor t =
        at::tensor(std::vector<int32_t>(words, words + kTagWords), at::kInt).to(tensor.device());
    it = device_tags_.emplace(where, t).first;
  }
  tag_ = it->second;
}

at::Tensor CompressedBackend::tag_words(const at::Tensor& buf, int world, int64_t slot) const {
  const int64_t t = buf.scalar_type() == at::kByte ? kTagBytes : kTagWords;
  return buf.view({world, slot}).narrow(1, slot - t, t);
}

at::Tensor CompressedBackend::tags_ok(const std::vector<at::Tensor>& words) const {
  if (words.empty()) return at::ones({}, tag_.options().dtype(at::kBool));
  const at::Tensor all = at::cat(words);
  return all.eq(all.scalar_type() == at::kByte ? tag_.view(at::kByte) : tag_).all();
}

void CompressedBackend::require_tags(bool ok) const {
  TORCH_CHECK(ok,
              "the ranks ran different compressed calls at the same position (another key, "
              "size, dtype or op: the payloads' call tags differ), so their results were "
              "discarded and the residuals kept. The engine runs each rank's calls in the order "
              "they were submitted: calls submitted from several threads must reach it in the "
              "same order on every rank (issue the compressed calls of a group from one thread; "
              "check_calls=\"every\" names the difference)");
}

void CompressedBackend::require_tags(const std::vector<at::Tensor>& words) {
  require_tags(read_checks({tags_ok(words)})[0]);
}

std::vector<bool> CompressedBackend::read_checks(const std::vector<at::Tensor>& checks) {
  Span span(profile_.sync_s);
  return read_flags(checks);
}

bool CompressedBackend::checked_finite(const std::vector<at::Tensor>& words,
                                       const std::vector<at::Tensor>& sums, const at::Tensor& t) {
  std::vector<at::Tensor> checks;
  {
    Span span(profile_.decode_s);
    checks.push_back(tags_ok(words));
    if (!sums.empty()) checks.push_back(at::isfinite(at::stack(sums)).all());
  }
  const std::vector<bool> ok = read_checks(checks);
  require_tags(ok[0]);
  // A sum is finite only if every term is; the exact check only when the
  // sum itself is not (an overflow of finite values, or a non-finite one).
  return sums.empty() || ok[1] || at::isfinite(t).all().item<bool>();
}

Profile CompressedBackend::profile(bool reset) {
  Profile copy;
  submit(c10d::OpType::UNKNOWN, {}, [this, reset, &copy] {
    copy = profile_;
    if (reset) profile_ = Profile();
  })->wait();
  return copy;
}

void CompressedBackend::undo_error_feedback(const std::vector<int64_t>& keys) {
  std::string error;
  submit(c10d::OpType::UNKNOWN, {}, [this, &keys, &error] {
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = error_feedback_.find(keys[i]);
      if (it == error_feedback_.end() || !it->second.undoable) {
        error = "error-feedback key " + std::to_string(keys[i]) +
                (it == error_feedback_.end()
                     ? " holds no residuals"
                     : " cannot be undone: its last call did not keep new residuals, or was "
                       "undone already, or the residuals were loaded since");
        return;
      }
      if (std::find(keys.begin(), keys.begin() + i, keys[i]) != keys.begin() + i) {
        error = "error-feedback key " + std::to_string(keys[i]) + " is given twice";
        return;
      }
    }
    for (int64_t key : keys) {
      ErrorFeedback& ef = error_feedback_.at(key);
      swap_residuals(ef);
      ef.undoable = false;
      --ef.calls;
    }
  })->wait();
  TORCH_CHECK(error.empty(), error);
}

void CompressedBackend::reset_error_feedback(std::optional<int64_t> key) {
  submit(c10d::OpType::UNKNOWN, {}, [this, key] {
    if (key.has_value()) {
      error_feedback_.erase(*key);
    } else {
      error_feedback_.clear();
    }
  })->wait();
}

// ------------------------------------------------------------ forwarding ---
WorkPtr CompressedBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) {
  return forward(c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, tensors, opts]() mutable {
    return inner_->allreduce_coalesced(tensors, opts);
  });
}

WorkPtr CompressedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) {
  return forward(c10d::OpType::BROADCAST, tensors,
                 [this, tensors, opts]() mutable { return inner_->broadcast(tensors, opts); });
}

WorkPtr CompressedBackend::reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) {
  return forward(c10d::OpType::REDUCE, tensors,
                 [this, tensors, opts]() mutable { return inner_->reduce(tensors, opts); });
}

WorkPtr CompressedBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::ALLGATHER, outputs.empty() ? std::vector<at::Tensor>{} : outputs[0],
                 [this, outputs, inputs, opts]() mutable {
                   return inner_->allgather(outputs, inputs, opts);
                 },
                 inputs);
}

WorkPtr CompressedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::_ALLGATHER_BASE, {output}, [this, output, input, opts]() mutable {
    return inner_->_allgather_base(output, input, opts);
  });
}

WorkPtr CompressedBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::ALLGATHER_COALESCED, {}, [this, outputs, inputs, opts]() mutable {
    return inner_->allgather_coalesced(outputs, inputs, opts);
  }, inputs);
}

WorkPtr CompressedBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::COALESCED, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) {
  return forward(c10d::OpType::GATHER, {}, [this, outputs, inputs, opts]() mutable {
    return inner_->gather(outputs, inputs, opts);
  }, inputs);
}

WorkPtr CompressedBackend::scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) {
  return forward(c10d::OpType::SCATTER, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->scatter(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::REDUCE_SCATTER, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->reduce_scatter(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [this, output, input, opts]() mutable {
                   return inner_->_reduce_scatter_base(output, input, opts);
                 });
}

WorkPtr CompressedBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::COALESCED, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_split_sizes,
                                         std::vector<int64_t>& input_split_sizes,
                                         const c10d::AllToAllOptions& opts) {
  return forward(c10d::OpType::ALLTOALL_BASE, {output},
                 [this, output, input, output_split_sizes, input_split_sizes, opts]() mutable {
                   return inner_->alltoall_base(output, input, output_split_sizes,
                                                input_split_sizes, opts);
                 });
}

WorkPtr CompressedBackend::alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) {
  return forward(c10d::OpType::ALLTOALL, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->alltoall(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::barrier(const c10d::BarrierOptions& opts) {
  return forward(c10d::OpType::BARRIER, {}, [this, opts] { return inner_->barrier(opts); });
}

void CompressedBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  submit(c10d::OpType::BARRIER, {}, [this, opts, wait_all_ranks] {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  })->wait();
}

// Point-to-point: matched by tag, not issue order, so no need to queue.
WorkPtr CompressedBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return inner_->send(tensors, dst, tag);
}

WorkPtr CompressedBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return inner_->recv(tensors, src, tag);
}

WorkPtr CompressedBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return inner_->recvAnysource(tensors, tag);
}

}  // namespace dist
}  // namespace pycomm
