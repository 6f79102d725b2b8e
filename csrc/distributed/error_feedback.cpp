// Error-feedback residuals: a call's hold on its key's residuals (kept
// when the result is finite, else put back), and the store of a group's
// residuals with the layout rules they follow.
#include "error_feedback.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <sstream>

#include "codecs.h"

namespace pycomm {
namespace dist {

void swap_residuals(ErrorFeedback& ef) {
  std::swap(ef.worker, ef.worker_backup);
  // A gathered all-reduce (a block codec's on a small tensor) neither
  // reads nor writes its server residuals: they stay as they are.
  if (all_reduce_gathers(ef.method, ef.numel, ef.world_size)) return;
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

bool double_buffered(const at::Tensor& x, const std::string& method) {
  // Top-k's CPU kernel writes the new residual apart from the old one too.
  if (method_is(method, "sparse")) return direct_cpu(x);
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

// ---------------------------------------------------------- ResidualStore ---
namespace {

// Rank `rank`'s server residual length in each chunk of a block method's
// all-reduce on `numel` elements (its segment at `block`); rank < 0: the
// chunks' lengths. None for other methods.
std::vector<int64_t> server_lengths(const std::string& method, int64_t numel, int64_t chunk_numel,
                                    int world, int rank, int64_t block) {
  std::vector<int64_t> out;
  if (!is_block_method(method)) return out;
  const int64_t C = chunk_length(numel, chunk_numel);
  for (int64_t c0 = 0; c0 < numel; c0 += C) {
    const int64_t len = std::min(C, numel - c0);
    out.push_back(rank < 0 ? len : BlockLayout(len, world, block, block_bits(method)).len[rank]);
  }
  return out;
}

// "a torch.float64 tensor of shape (5, 6)", as Python says it.
std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << "a torch." << c10::getDtypeNames(t.scalar_type()).first << " tensor of shape (";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << (t.dim() == 1 ? ",)" : ")");
  return os.str();
}

}  // namespace

void check_residual_layout(const std::string& label, const ErrorFeedback& ef, int rank, int64_t block) {
  // The sizes' own checks are the callers' (with their messages); these guard the arithmetic.
  TORCH_CHECK_VALUE(ef.numel > 0 && ef.chunk_numel > 0 && ef.world_size > 0 && rank < ef.world_size,
                    label, ": numel, chunk_numel and world_size must be positive and the rank below "
                    "the world size");
  const at::Tensor& w = ef.worker;
  TORCH_CHECK_VALUE(w.dim() == 1 && w.numel() == ef.numel && w.scalar_type() == at::kFloat, label,
                    "['worker'] must be a 1-D float32 tensor of numel=", ef.numel, " elements, got ",
                    describe(w));
  // A reduce-scatter's or all-gather's residuals ("<method>/<collective>")
  // keep only the worker's.
  const size_t slash = ef.method.find('/');
  const std::string base = ef.method.substr(0, slash);
  const std::vector<int64_t> want =
      slash != std::string::npos
          ? std::vector<int64_t>{}
          : server_lengths(base, ef.numel, ef.chunk_numel, ef.world_size, rank, block);
  if (slash == std::string::npos && is_block_method(base)) {
    TORCH_CHECK_VALUE(ef.server.size() == want.size(), label,
                      "['server'] must hold one tensor per chunk (", want.size(), " chunks of numel=",
                      ef.numel, " at chunk_numel=", ef.chunk_numel, "), got ", ef.server.size());
  } else {
    TORCH_CHECK_VALUE(ef.server.empty(), label, "['server'] must be empty for '", ef.method, "', got ",
                      ef.server.size(), " tensors");
  }
  const int64_t C = chunk_length(ef.numel, ef.chunk_numel);
  for (size_t i = 0; i < want.size(); ++i) {
    const at::Tensor& t = ef.server[i];
    const int64_t len = std::min<int64_t>(C, ef.numel - int64_t(i) * C);
    TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() <= len && t.scalar_type() == at::kFloat, label,
                      "['server'][", i, "] must be a 1-D float32 tensor of at most ", len,
                      " elements (its chunk's length), got ", describe(t));
    TORCH_CHECK_VALUE(
        rank < 0 || t.numel() == want[i], label, "['server'][", i, "] holds ", t.numel(), " elements, but rank ",
        rank, "'s segment of its ", len, "-element chunk at block_size=", block, " over ",
        ef.world_size, " ranks has ", want[i],
        ": the residuals were saved with another block_size. Run the saved block_size, or start "
        "the residuals over (reset_error_feedback=True)");
    TORCH_CHECK_VALUE(t.device() == w.device(), label, "['server'][", i, "] is on ", t.device(),
                      ", the worker residual on ", w.device());
  }
  for (size_t i = 0; i <= ef.server.size(); ++i) {
    const at::Tensor& t = i == 0 ? w : ef.server[i - 1];
    const std::string field = i == 0 ? "['worker']" : "['server'][" + std::to_string(i - 1) + "]";
    TORCH_CHECK_VALUE(t.numel() == 0 || at::isfinite(t).all().item<bool>(), label, field,
                      " holds a NaN or Inf: a residual that is not finite makes every rank's next "
                      "result non-finite. Load a finite state, or start the residuals over "
                      "(reset_error_feedback=True)");
  }
}

ErrorFeedback& ResidualStore::for_call(int64_t key, const at::Tensor& x, const std::string& method,
                                       int world, int rank) {
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    ErrorFeedback ef;
    ef.numel = x.numel();
    ef.world_size = world;
    ef.chunk_numel = config_.chunk_numel;
    ef.method = method;
    auto opts = x.options().dtype(at::kFloat);
    ef.worker = at::zeros({x.numel()}, opts);
    for (int64_t len : server_lengths(method, x.numel(), config_.chunk_numel, world, rank,
                                      block_for(config_, method)))
      ef.server.push_back(at::zeros({len}, opts));
    it = keys_.emplace(key, std::move(ef)).first;
  }
  ErrorFeedback& ef = it->second;
  ef.undoable = false;  // this call will change the residuals or fail
  // Hierarchical: x is this rank's shard and the world its inter-node group.
  TORCH_CHECK(ef.numel == x.numel() && ef.world_size == world &&
                  ef.chunk_numel == config_.chunk_numel && ef.method == method,
              "error-feedback key ", key, " holds residuals of a ", ef.numel,
              "-element tensor (world size ", ef.world_size, ", chunk_numel ", ef.chunk_numel,
              ", ", ef.method, "); this call has ", x.numel(), " elements (world size ", world,
              ", chunk_numel ", config_.chunk_numel, ", ", method,
              "). Use a different key or reset_error_feedback(", key, ").");
  TORCH_CHECK(ef.worker.device() == x.device(), "error-feedback key ", key, " lives on ",
              ef.worker.device(), " but the tensor is on ", x.device());
  return ef;
}

ErrorFeedback* ResidualStore::find(int64_t key) {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &it->second;
}

std::map<int64_t, ErrorFeedback> ResidualStore::copy(
    const std::optional<std::vector<int64_t>>& keys) const {
  std::map<int64_t, ErrorFeedback> out;
  for (const auto& [key, ef] : keys_) {
    if (keys && std::find(keys->begin(), keys->end(), key) == keys->end()) continue;
    ErrorFeedback c = ef;
    c.worker = ef.worker.clone();
    for (auto& s : c.server) s = s.clone();
    out.emplace(key, std::move(c));
  }
  return out;
}

void ResidualStore::check(std::map<int64_t, ErrorFeedback>& state, int world, int rank) const {
  // Everything is checked before anything is replaced, and the tensors are
  // copied: the caller's stay theirs (the engine swaps its buffers in place).
  for (auto& [key, ef] : state) {
    TORCH_CHECK(ef.world_size == world, "error-feedback state of key ", key,
                " was saved with world size ", ef.world_size, ", this group has ", world,
                ": it cannot be reused (reset it instead)");
    // A reduce-scatter's or all-gather's residuals: method + "/collective".
    const std::string base = ef.method.substr(0, ef.method.find('/'));
    const bool method_ok = config_.method == "auto" ? method_residuals(base) : base == config_.method;
    TORCH_CHECK(method_ok && ef.chunk_numel == config_.chunk_numel,
                "error-feedback state of key ", key, " was saved for ", ef.method,
                " with chunk_numel ", ef.chunk_numel, "; this group runs ", config_.method,
                " with chunk_numel ", config_.chunk_numel);
    check_residual_layout("state[" + std::to_string(key) + "]", ef, rank, block_for(config_, base));
    ef.worker = ef.worker.clone(at::MemoryFormat::Contiguous);
    for (auto& t : ef.server) t = t.clone(at::MemoryFormat::Contiguous);
    ef.worker_backup = at::Tensor();
    ef.server_backup.clear();
  }
}

void ResidualStore::put(std::map<int64_t, ErrorFeedback> state, bool replace) {
  if (replace) {
    keys_ = std::move(state);
  } else {
    for (auto& [key, ef] : state) keys_.insert_or_assign(key, std::move(ef));
  }
}

std::string ResidualStore::undo(const std::vector<int64_t>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = keys_.find(keys[i]);
    if (it == keys_.end() || !it->second.undoable) {
      return "error-feedback key " + std::to_string(keys[i]) +
             (it == keys_.end()
                  ? " holds no residuals"
                  : " cannot be undone: its last call did not keep new residuals, or was "
                    "undone already, or the residuals were loaded since");
    }
    if (std::find(keys.begin(), keys.begin() + i, keys[i]) != keys.begin() + i)
      return "error-feedback key " + std::to_string(keys[i]) + " is given twice";
  }
  for (int64_t key : keys) {
    ErrorFeedback& ef = keys_.at(key);
    swap_residuals(ef);
    ef.undoable = false;
    --ef.calls;
  }
  return "";
}

void ResidualStore::erase(std::optional<int64_t> key) {
  if (key.has_value()) {
    keys_.erase(*key);
  } else {
    keys_.clear();
  }
}

}  // namespace dist
}  // namespace pycomm
