// Error-feedback residuals: a call's hold on its key's residuals (kept
// when the result is finite, else put back), and the state accessors
// (read, loaded, undone, reset between collectives, through the queue).
#include "error_feedback.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "backend.hpp"

namespace pycomm {
namespace dist {

void swap_residuals(ErrorFeedback& ef) {
  std::swap(ef.worker, ef.worker_backup);
  for (size_t i = 0; i < ef.server.size(); ++i) std::swap(ef.server[i], ef.server_backup[i]);
}

void keep_residuals(ErrorFeedback* ef, bool finite, bool double_buffered) {
  if (!ef) return;
  if (finite == double_buffered) swap_residuals(*ef);
  ef->undoable = finite;
  ef->calls += finite;  // a skipped step leaves the count as it was too
}

CallResiduals::CallResiduals(ErrorFeedback* ef, bool double_buffered)
    : ef_(ef), double_buffered_(double_buffered) {
  if (!ef_) return;
  if (!ef_->worker_backup.defined()) ef_->worker_backup = at::empty_like(ef_->worker);
  ef_->server_backup.resize(ef_->server.size());
  for (size_t i = 0; i < ef_->server.size(); ++i) {
    if (!ef_->server_backup[i].defined()) ef_->server_backup[i] = at::empty_like(ef_->server[i]);
  }
  if (double_buffered_) return;
  ef_->worker_backup.copy_(ef_->worker);
  for (size_t i = 0; i < ef_->server.size(); ++i) ef_->server_backup[i].copy_(ef_->server[i]);
}

CallResiduals::~CallResiduals() {
  // A call that failed part-way: its compressors may have updated the
  // residuals in place; put the old ones back.
  if (ef_ && !decided_ && !double_buffered_) swap_residuals(*ef_);
}

void CallResiduals::commit(bool finite) {
  decided_ = true;
  keep_residuals(ef_, finite, double_buffered_);
}

CallResiduals CompressedBackend::residuals_for(Call& call, const at::Tensor& x, const Group& g) {
  const std::optional<int64_t> key = call.key;
  const std::string& method = call.method;
  // A reduce-scatter's or all-gather's residuals are never mixed with an
  // all-reduce's under the same key; only the all-reduce double-buffers.
  static const char* const suffix[kNumCollectives] = {"", kReduceScatterSuffix,
                                                      kAllGatherSuffix};
  ErrorFeedback* ef = key && x.numel() > 0
                          ? error_feedback_for(*key, x, method + suffix[call.collective], g)
                          : nullptr;
  if (ef && call.standing_in) {  // a copy: a stand-in never changes the residuals
    ErrorFeedback& copy = call.stand_in_residuals;
    copy = *ef;
    copy.worker = ef->worker.clone();
    for (auto& s : copy.server) s = s.clone();
    copy.worker_backup = at::Tensor();
    copy.server_backup.clear();
    ef = &copy;
  }
  begin_seeds(call, ef);
  return CallResiduals(ef, call.collective == 0 && double_buffered(x, method));
}

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

void CompressedBackend::begin_seeds(Call& call, ErrorFeedback* ef) {
  // Every rank runs the same calls in the same order, so the keyless count
  // is the same on all; a key's count travels with its residuals.
  const std::optional<int64_t> key = call.key;
  call.seeds = CallSeeds{config_.rounding_seed, key ? *key : -1, 0, call.collective, getRank()};
  if (ef) {
    call.seeds.call = ef->calls;  // counted when the call keeps its residuals
  } else if (!key) {
    call.seeds.call = keyless_calls_++;
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
                               ? method_residuals(base)
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
    // The loaded keys' next calls are compared across ranks again (every
    // rank loads).
    if (replace) {
      checked_keys_.clear();
      error_feedback_ = std::move(state);
    } else {
      for (const auto& kv : state) checked_keys_.erase(kv.first);
      for (auto& [key, ef] : state) error_feedback_.insert_or_assign(key, std::move(ef));
    }
  })->wait();
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
    // The key's next call is compared across ranks again (every rank resets).
    if (key.has_value()) {
      error_feedback_.erase(*key);
      checked_keys_.erase(*key);
    } else {
      error_feedback_.clear();
      checked_keys_.clear();
    }
  })->wait();
}

}  // namespace dist
}  // namespace pycomm
