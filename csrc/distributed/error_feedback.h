// Error-feedback residuals (docs/allreduce.md) and how a call keeps or
// drops the new ones ("Non-finite results").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

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

// Exchanges the residuals and their second buffers (a swap, no copy).
void swap_residuals(ErrorFeedback& ef);

// Keeps a call's new residuals when its result is `finite`, else the old
// ones, and counts the call when it kept them. `double_buffered`: the new
// residuals are in the second buffers (commit them if finite); else the
// old ones are (restore them if not). The result is identical on every
// rank, so every rank decides alike.
void keep_residuals(ErrorFeedback* ef, bool finite, bool double_buffered);

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
