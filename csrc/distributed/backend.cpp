// CompressedBackend: its set-up and shutdown, its settings, and what the
// entry points of every compressed collective share before a call is
// queued (the checks of the caller's tensors).
#include "backend.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>

#include <sstream>


namespace pycomm {
namespace dist {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

CompressedBackend::CompressedBackend(c10::intrusive_ptr<c10d::Backend> inner, Config config,
                                     c10::intrusive_ptr<c10d::Backend> intra,
                                     c10::intrusive_ptr<c10d::Backend> inter,
                                     c10::intrusive_ptr<c10d::Backend> check)
    : c10d::Backend(inner->getRank(), inner->getSize()),
      inner_(std::move(inner)),
      config_(std::move(config)),
      intra_(std::move(intra)),
      inter_(std::move(inter)),
      check_(std::move(check)),
      queue_(getRank(), profile_) {
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
  TORCH_CHECK(!check_ || (check_->getSize() == getSize() && check_->getRank() == getRank()),
              "the call check's group must hold the same ranks as the inner group");
  // Gloo has no AVG: forwarded AVGs become SUM and a division here.
  inner_has_avg_ = inner_->getBackendName() != "gloo";
}

CompressedBackend::~CompressedBackend() {
  // Python may drop the last reference with the GIL held. Joining the
  // worker (which may be running a compressor registered in Python) and the
  // inner backends' threads (which may release Python objects) then needs
  // the GIL elsewhere: release it while shutting down.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
  queue_.stop();
  check_.reset();
  intra_.reset();
  inter_.reset();
  inner_.reset();
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
    const Call call{collective, key, average, m};
    const std::string context = failure_context(call, tensor);
    try {
      check_call(call, tensor, /*refused=*/true);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, context, why, "; ", e.what_without_backtrace());
    }
    TORCH_CHECK(false, context, why);
  });
}

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

Profile CompressedBackend::profile(bool reset) {
  Profile copy;
  submit(c10d::OpType::UNKNOWN, {}, [this, reset, &copy] {
    copy = profile_;
    if (reset) profile_ = Profile();
  })->wait();
  return copy;
}

int64_t CompressedBackend::kept_nbytes() {
  int64_t n = 0;
  submit(c10d::OpType::UNKNOWN, {}, [this, &n] {
    for (const at::Tensor* t : {&cast_send_, &cast_scratch_})
      if (t->defined()) n += t->nbytes();
  })->wait();
  return n;
}

// -------------------------------------------------- error-feedback state ---
// Between collectives, through the queue: the worker is the store's one user.
std::map<int64_t, ErrorFeedback> CompressedBackend::error_feedback_state(
    std::optional<std::vector<int64_t>> keys) {
  std::map<int64_t, ErrorFeedback> copy;
  submit(c10d::OpType::UNKNOWN, {}, [this, &copy, &keys] { copy = residuals_.copy(keys); })->wait();
  return copy;
}

void CompressedBackend::load_error_feedback_state(std::map<int64_t, ErrorFeedback> state,
                                                  bool replace) {
  // Hierarchical: residuals are per shard, over the inter-node group.
  residuals_.check(state, inter_ ? inter_->getSize() : getSize(),
                   inter_ ? inter_->getRank() : getRank());
  submit(c10d::OpType::UNKNOWN, {}, [this, replace, state = std::move(state)]() mutable {
    // The loaded keys' next calls are compared across ranks again (every
    // rank loads).
    if (replace) {
      checker_.forget(std::nullopt);
    } else {
      for (const auto& kv : state) checker_.forget(kv.first);
    }
    residuals_.put(std::move(state), replace);
  })->wait();
}

void CompressedBackend::undo_error_feedback(const std::vector<int64_t>& keys) {
  std::string error;
  submit(c10d::OpType::UNKNOWN, {}, [this, &keys, &error] { error = residuals_.undo(keys); })->wait();
  TORCH_CHECK(error.empty(), error);
}

void CompressedBackend::reset_error_feedback(std::optional<int64_t> key) {
  submit(c10d::OpType::UNKNOWN, {}, [this, key] {
    // The key's next call is compared across ranks again (every rank resets).
    residuals_.erase(key);
    checker_.forget(key);
  })->wait();
}

}  // namespace dist
}  // namespace pycomm
