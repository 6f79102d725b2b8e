// The work queue: the worker thread that issues every collective of a
// group in submission order (or the caller, for a call it waits for), and
// the deferred finishing of compressed calls whose checks are still on an
// accelerator (PendingCall).
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "work_queue.h"

namespace pycomm {
namespace dist {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

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

namespace {
// The queue whose task this thread runs (the worker, or a caller in
// run_on_caller): where a failed inner collective is recorded.
thread_local WorkQueue* running_queue = nullptr;
}  // namespace

void wait_inner(const WorkPtr& work) {
  if (!work) return;
  try {
    work->wait();
  } catch (const std::exception& e) {
    if (running_queue) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      running_queue->mark_broken(c10_error ? c10_error->what_without_backtrace() : e.what());
    }
    throw;
  }
}

std::optional<c10::Stream> caller_stream(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && !t.is_cpu() && !t.is_meta())
      return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
  }
  return std::nullopt;
}

// ---------------------------------------------------------- the worker ---
namespace {
thread_local bool caller_waits = false;
}  // namespace

CallerWaits::CallerWaits(bool waits) : outer_(caller_waits) { caller_waits = waits; }
CallerWaits::~CallerWaits() { caller_waits = outer_; }
bool CallerWaits::active() { return caller_waits; }

WorkQueue::WorkQueue(int rank, Profile& profile)
    : rank_(rank), profile_(profile), worker_([this] { run_worker(); }) {}

WorkQueue::~WorkQueue() { stop(); }

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void WorkQueue::run_worker() {
  // Collectives never record autograd history (as on the caller's side of
  // dist.all_reduce): the tensors may be Parameters that require grad.
  const c10::AutoGradMode no_grad(false);
  for (;;) {
    {
      const std::lock_guard<std::mutex> issuing(issue_mutex_);
      settle(/*wait=*/false);  // what the device has passed (on a CPU: all)
    }
    std::optional<Task> task;
    bool stopping;
    std::unique_lock<std::mutex> lock(queue_mutex_);
    auto ready = [this] { return stopping_ || !queue_.empty(); };
    // With calls pending, look at the device now and then: their Works
    // complete when it has passed them.
    if (pending_.empty()) {
      queue_cv_.wait(lock, ready);
    } else {
      queue_cv_.wait_for(lock, std::chrono::microseconds(50), ready);
    }
    // Taken before the queue is released: a call that a caller runs on
    // its own thread (run_on_caller) cannot start between this pop and
    // this task.
    const std::lock_guard<std::mutex> issuing(issue_mutex_);
    stopping = stopping_;
    if (!queue_.empty()) {
      task = std::move(queue_.front());
      queue_.pop_front();
    } else if (stopping && pending_.empty()) {
      return;  // stopping, and everything submitted has run
    }
    lock.unlock();
    settle(/*wait=*/task ? !task->overlaps : stopping);
    if (task) task->run();
  }
}

bool WorkQueue::run_on_caller(Task& task) {
  // Only where nothing of the caller's thread state can reach the engine's
  // own tensor operations (inference mode, dispatch keys, a Python
  // dispatch mode): those run as on the worker thread.
  const auto keys = c10::impl::tls_local_dispatch_key_set();
  if (keys.included_ != c10::default_included_set || keys.excluded_ != c10::default_excluded_set ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0)
    return false;
  std::unique_lock<std::mutex> lock(queue_mutex_);
  TORCH_CHECK(!stopping_, "pycomm backend is shutting down");
  std::unique_lock<std::mutex> issuing(issue_mutex_, std::try_to_lock);
  if (!issuing.owns_lock() || !queue_.empty()) return false;
  lock.unlock();
  const c10::AutoGradMode no_grad(false);
  settle(/*wait=*/!task.overlaps);
  task.run();
  settle(/*wait=*/false);  // a deferred CPU call is finished at once
  return true;
}

void WorkQueue::settle(bool wait, std::optional<int64_t> key) {
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

void WorkQueue::finish_pending(PendingCall& call) {
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

void WorkQueue::mark_broken(const std::string& why) {
  if (broken_.empty()) broken_ = why.empty() ? "unknown error" : why;
}

void WorkQueue::require_usable() const {
  if (broken_.empty()) return;
  C10_THROW_ERROR(DistBackendError,
                  "this pycomm group cannot run collectives any more: one of its inner "
                  "collectives failed earlier (" + broken_ + "). After a timeout or a lost peer "
                  "the inner group's ranks are no longer in step; create a new group (and resume "
                  "from a checkpoint)");
}

WorkPtr WorkQueue::submit(c10d::OpType type, std::vector<at::Tensor> result,
                          std::function<void()> body, std::optional<c10::Stream> stream,
                          bool overlaps) {
  return submit_call(type, std::move(result), [body = std::move(body)] {
    body();
    return std::optional<PendingCall>();
  }, stream, overlaps);
}

WorkPtr WorkQueue::submit_call(c10d::OpType type, std::vector<at::Tensor> result,
                               std::function<std::optional<PendingCall>()> body,
                               std::optional<c10::Stream> stream, bool overlaps) {
  auto work = c10::make_intrusive<PycommWork>(rank_, type, std::move(result));
  Task task{[this, work, body = std::move(body), stream,
             queued = std::chrono::steady_clock::now()] {
    profile_.queued_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count();
    // The completion too is recorded on the caller's stream: the Work's
    // future makes the waiter's stream wait on an event recorded on the
    // current stream when it completes.
    std::optional<c10::StreamGuard> guard;
    if (stream) guard.emplace(*stream);
    WorkQueue* const outer = running_queue;
    running_queue = this;
    try {
      if (std::optional<PendingCall> deferred = body()) {
        deferred->work = work;
        deferred->stream = stream;
        if (!deferred->done && pending_.empty()) {
          finish_pending(*deferred);  // on a CPU its checks are read: finished now
        } else {
          pending_.push_back(std::move(*deferred));  // finished later, by settle
        }
      } else {
        work->complete();
      }
    } catch (...) {
      work->complete(std::current_exception());
    }
    running_queue = outer;
  }, overlaps};
  // On an accelerator the caller's thread is not blocked by the call in
  // any case (it waits on its stream), so the worker runs it.
  if (!stream && CallerWaits::active() && run_on_caller(task)) return work;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    TORCH_CHECK(!stopping_, "pycomm backend is shutting down");
    queue_.push_back(std::move(task));
  }
  queue_cv_.notify_one();
  return work;
}

}  // namespace dist
}  // namespace pycomm
