// Error-feedback residuals (docs/allreduce.md) and how a call keeps or
// drops the new ones ("Non-finite results").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "config.h"

namespace pycomm {
namespace dist {

// Error-feedback residuals of one key (see docs/allreduce.md).
struct ErrorFeedback {
  int64_t numel = 0;
  int world_size = 0;
  int64_t chunk_numel = 0;
  std::string method;
  at::Tensor worker;                // numel floats
  std::vector<at::Tensor> server;   // onebit: this rank's segment of each chunk
  // Second buffers: the old residuals while a call runs, or its new ones
  // (see CompressedBackend::double_buffered); not part of the saved state.
  at::Tensor worker_backup;
  std::vector<at::Tensor> server_backup;
  // Calls that kept new residuals on this key (the stream of its
  // stochastic rounding seeds; saved with the residuals, so a resumed run
  // draws the same numbers). A non-finite call, or an undone one, does not
  // count: a skipped step leaves everything as it was.
  int64_t calls = 0;
  // The last call on this key kept its new residuals and the second buffers
  // still hold the ones before it: undo_error_feedback can put them back.
  bool undoable = false;
};

// The fields of a key's saved residuals (error_feedback_state() and its
// load), listed once for the Python binding; "calls" apart: states saved
// before keys counted their calls lack it.
#define PYCOMM_EF_SAVED_FIELDS(X) X(numel) X(world_size) X(chunk_numel) X(method) X(worker) X(server)

// The layout of one key's saved residuals, the one check of every load
// (the engine's, ResidualStore::check, and a client's before its group
// exists, through the Python binding): a 1-D float32 worker of ef.numel
// elements; a block method's all-reduce keeps one server residual per
// chunk, rank `rank`'s segment of it over ef.world_size ranks at `block`
// elements a block (rank < 0: the rank is not known, at most the chunk's
// length), other methods and collectives none; one device; every value
// finite. Throws a ValueError naming `label` (the residuals' name in the
// caller's state, e.g. state['engine']['residuals'][1]) and the field.
void check_residual_layout(const std::string& label, const ErrorFeedback& ef, int rank, int64_t block);

// Exchanges the residuals and their second buffers (a swap, no copy).
void swap_residuals(ErrorFeedback& ef);

// Keeps a call's new residuals when its result is `finite`, else the old
// ones, and counts the call when it kept them. `double_buffered`: the new
// residuals are in the second buffers (commit them if finite); else the
// old ones are (restore them if not). The result is identical on every
// rank, so every rank decides alike.
void keep_residuals(ErrorFeedback* ef, bool finite, bool double_buffered);

// Whether a method's compress on x writes the new residuals to the second
// buffers rather than in place: a block method's (compress_into) on every
// CPU, and on a GPU when the build has its CUDA kernels; top-k's on a CPU.
bool double_buffered(const at::Tensor& x, const std::string& method);

// A group's residuals by key, and the layout rules they follow: made at a
// key's first call, checked at every call and at a load, copied out, undone,
// reset. Not thread-safe: the group's work queue is its one user at a time.
class ResidualStore {
 public:
  explicit ResidualStore(const Config& config) : config_(config) {}

  // The residuals of `key` for a call of x by `method` over `world` ranks
  // (this one `rank`): made, zero, at the key's first call; refused when
  // they belong to another tensor, method, world size or device.
  ErrorFeedback& for_call(int64_t key, const at::Tensor& x, const std::string& method, int world,
                          int rank);
  // The residuals a key holds (null: none).
  ErrorFeedback* find(int64_t key);
  // Copies of the residuals of `keys` (all when none given).
  std::map<int64_t, ErrorFeedback> copy(const std::optional<std::vector<int64_t>>& keys) const;
  // Checks every key of `state` against this group's layout (`world` ranks,
  // this one `rank`: the server residuals are its segments) and makes its
  // tensors copies of its own; throws, naming the key and the field, before
  // anything is changed.
  void check(std::map<int64_t, ErrorFeedback>& state, int world, int rank) const;
  // Puts checked residuals in: in place of all (`replace`), or of their keys.
  void put(std::map<int64_t, ErrorFeedback> state, bool replace);
  // Puts back the residuals before the last call of each key; "" or why not
  // (nothing is changed then).
  std::string undo(const std::vector<int64_t>& keys);
  // Forgets the residuals of `key` (all when none given).
  void erase(std::optional<int64_t> key);

 private:
  const Config& config_;
  std::map<int64_t, ErrorFeedback> keys_;
};

// One call's hold on its key's residuals (none: `ef` null). The second
// buffers are allocated at the first call. Compressors that update the
// residuals in place (not double-buffered) have the old ones copied to the
// second buffers first, and put back if the call fails part-way, so that a
// failed call leaves them as they were, as a non-finite one does.
class CallResiduals {
 public:
  CallResiduals(ErrorFeedback* ef, bool double_buffered);
  ~CallResiduals();
  CallResiduals(const CallResiduals&) = delete;
  CallResiduals& operator=(const CallResiduals&) = delete;

  ErrorFeedback* get() const { return ef_; }
  bool double_buffered() const { return double_buffered_; }
  // The call's decision (keep_residuals).
  void commit(bool finite);

 private:
  ErrorFeedback* ef_;
  bool double_buffered_;
  bool decided_ = false;
};

}  // namespace dist
}  // namespace pycomm
