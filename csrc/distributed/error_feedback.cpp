// Error-feedback residuals: a call's hold on its key's residuals (kept
// when the result is finite, else put back), and the store of a group's
// residuals with the layout rules they follow.
#include "error_feedback.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>

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

// This rank's server residual lengths of a block method's all-reduce on
// `numel` elements: its segment of every chunk (none for other methods).
std::vector<int64_t> server_lengths(const Config& config, const std::string& method,
                                    int64_t numel, int64_t chunk_numel, int world, int rank) {
  std::vector<int64_t> out;
  if (!is_block_method(method)) return out;
  const int64_t C = chunk_length(numel, chunk_numel);
  for (int64_t c0 = 0; c0 < numel; c0 += C)
    out.push_back(BlockLayout(std::min(C, numel - c0), world, block_for(config, method),
                              block_bits(method)).len[rank]);
  return out;
}

}  // namespace

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
    for (int64_t len : server_lengths(config_, method, x.numel(), config_.chunk_numel, world, rank))
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
    const bool scattered = ef.method.find('/') != std::string::npos;
    const std::string base = ef.method.substr(0, ef.method.find('/'));
    const bool method_ok = config_.method == "auto" ? method_residuals(base) : base == config_.method;
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
    const std::vector<int64_t> want =
        scattered ? std::vector<int64_t>{}
                  : server_lengths(config_, base, ef.numel, ef.chunk_numel, world, rank);
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
