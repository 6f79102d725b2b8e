// The worker thread's side of the engine: the Work a caller gets, the
// calls finished later (once an accelerator has passed their checks), and
// where the worker's time goes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace pycomm {
namespace dist {

// Where the worker thread's time goes (docs/performance.md): wall seconds
// summed over the calls since the group was created or last reset. On an
// accelerator the kernels run asynchronously, so encode/decode then count
// their launches and `wire` also the kernels a collective waits for.
struct Profile {
  int64_t calls = 0;         // compressed collectives run
  int64_t collectives = 0;   // inner collectives they issued
  int64_t forwarded = 0;     // collectives forwarded unchanged
  double queued_s = 0;       // submitted -> started: the hand-off, and waiting behind earlier calls
  double run_s = 0;          // compressed calls, start to end
  double check_s = 0;        // the cross-rank call check
  double encode_s = 0;       // compress (worker and server), payload assembly, issuing
  double wire_s = 0;         // waiting for the inner collectives
  double decode_s = 0;       // decompress, sums, finiteness
  double sync_s = 0;         // reading a call's checks (tags, finiteness): on an
                             // accelerator, the wait for its kernels to finish
  double forwarded_s = 0;    // forwarded collectives, start to end
};

// Adds the wall time of a scope to a Profile field.
class Span {
 public:
  explicit Span(double& into) : into_(into), t0_(std::chrono::steady_clock::now()) {}
  ~Span() { into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  double& into_;
  std::chrono::steady_clock::time_point t0_;
};

// A Work completed by the worker thread; its future holds the result tensors.
class PycommWork : public c10d::Work {
 public:
  PycommWork(int rank, c10d::OpType type, std::vector<at::Tensor> result);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return result_; }
  int sourceRank() const override { return source_rank_; }
  void complete(std::exception_ptr error = nullptr, int source_rank = -1);

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int source_rank_ = -1;
};

// A compressed call on an accelerator whose checks (call tags, finiteness)
// are still on their way to the host: its kernels and collectives are
// queued, and the worker thread finishes it (keeps or discards its new
// residuals, counts it, completes its Work) once the device has passed
// `done`, without waiting for the device in between (docs/allreduce.md,
// "Streams").
// On a CPU the checks are read at once and the call is finished at the
// worker's next turn: one path for every device.
struct PendingCall {
  std::optional<c10::Event> done;  // none on a CPU
  at::Tensor checks;  // host copy (pinned on an accelerator) of the call's 0-dim bool checks
  // Applies the checks; throws (the Work's error) when the tags differ.
  std::function<void(const std::vector<bool>&)> finish;
  c10::intrusive_ptr<PycommWork> work;
  std::optional<c10::Stream> stream;
  std::optional<int64_t> key;
};

// Waits for an inner backend's Work. A backend may return none for a
// collective it has nothing to wait for: ProcessGroupNCCL (torch 2.11) does
// for a forwarded all-reduce of one rank. A failure marks the running
// task's queue broken (WorkQueue::mark_broken) and is rethrown.
void wait_inner(const c10::intrusive_ptr<c10d::Work>& work);

// The caller's current stream on the device of the first accelerator
// tensor, taken on the caller's thread (the worker's current stream is
// another one).
std::optional<c10::Stream> caller_stream(const std::vector<at::Tensor>& tensors);

// Set by an entry point whose caller waits for the Work at once (the
// synchronous pycomm.distributed calls): while the worker thread is idle,
// the call then runs on the caller's own thread, in submission order all
// the same, which saves the two thread hand-offs (caller -> worker ->
// caller) that cost as much as a small call's kernels on a CPU.
class CallerWaits {
 public:
  explicit CallerWaits(bool waits);
  ~CallerWaits();
  CallerWaits(const CallerWaits&) = delete;
  CallerWaits& operator=(const CallerWaits&) = delete;
  // Whether this thread's current entry point is one.
  static bool active();

 private:
  bool outer_;
};

// A submitted collective; `overlaps`: a compressed call, which may start
// while earlier ones are pending. Anything else starts once every pending
// call is finished (the state accessors see settled residuals).
struct Task {
  std::function<void()> run;
  bool overlaps = false;
};

// The one thread at a time that issues a group's collectives, in the order
// they were submitted: the worker thread, or a caller that waits for its
// call (CallerWaits) while the worker is idle. Gloo and NCCL match
// collectives across ranks by issue order, and a compressed call issues
// several dependent ones; point-to-point ops are matched by tag and do not
// come here. Everything its tasks touch is touched under its issue lock.
class WorkQueue {
 public:
  // `rank`: the Works' rank; `profile`: where the hand-off (queued_s) and
  // the wait for a device (sync_s) are counted.
  WorkQueue(int rank, Profile& profile);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `body` and returns a Work, completed when it returns.
  // `stream` (an accelerator's, see caller_stream): the body runs with it
  // current, and the Work's completion is recorded on it, so the work is
  // ordered after what the caller queued before the call, and the caller's
  // stream (not its host thread) waits for the result. `overlaps`: see Task.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> result,
                                        std::function<void()> body,
                                        std::optional<c10::Stream> stream = std::nullopt,
                                        bool overlaps = false);
  // A compressed call: `body` returns its deferred finish, if it has one
  // (the Work then completes when settle finishes it).
  c10::intrusive_ptr<c10d::Work> submit_call(
      c10d::OpType type, std::vector<at::Tensor> result,
      std::function<std::optional<PendingCall>()> body, std::optional<c10::Stream> stream,
      bool overlaps = true);
  // Finishes pending calls in order: those the device has passed (`wait`
  // false), or all of them (`wait` true), or all up to the last one on
  // `key` (waiting for the device as needed). Called by a running task.
  void settle(bool wait, std::optional<int64_t> key = std::nullopt);
  // Records that an inner collective failed (a timeout, a lost peer: the
  // inner group's ranks are out of step from then on), called by
  // wait_inner in a task; the first cause is kept.
  void mark_broken(const std::string& why);
  // Throws, naming the first failure, once one was recorded: a task that
  // would issue a collective calls it first. Called by a running task.
  void require_usable() const;
  // Runs what is queued, then stops the worker; no submit after. The owner
  // calls it before the state its tasks use goes.
  void stop();

 private:
  void run_worker();
  // Runs `task` on the calling thread when the worker is idle and nothing
  // is queued; false (nothing run) otherwise.
  bool run_on_caller(Task& task);
  void finish_pending(PendingCall& call);

  const int rank_;
  Profile& profile_;
  std::mutex queue_mutex_;
  // Held by whichever thread runs a task (the worker, or a caller in
  // run_on_caller). Taken after queue_mutex_ when both are.
  std::mutex issue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;
  std::deque<PendingCall> pending_;  // under issue_mutex_
  std::string broken_;               // under issue_mutex_: mark_broken
  bool stopping_ = false;
  std::thread worker_;  // last: started once the rest is set up
};

}  // namespace dist
}  // namespace pycomm
