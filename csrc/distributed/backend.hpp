// CompressedBackend: a c10d::Backend that wraps a real one (Gloo or NCCL)
// and compresses float SUM/AVG all-reduces, reduce-scatters and
// all-gathers (docs/allreduce.md); every other collective is forwarded
// unchanged.
//
// Ordering: Gloo and NCCL match collectives across ranks by the order in
// which they are issued. The compressed algorithms issue several dependent
// collectives per call, so all collectives of this backend (forwarded ones
// included) are issued by one thread at a time, in the order the callers
// submitted them (WorkQueue); the caller gets a Work at once. Point-to-point
// ops are matched by tag, not order, and go straight to the inner backend.
//
// Where the parts live: work_queue.cpp (WorkQueue: the worker thread,
// deferred finishing), call_scope.cpp (what every compressed call shares),
// call_check.cpp (CallChecker: cross-rank call checks and tags),
// error_feedback.cpp (ResidualStore: the residuals), codecs.cpp (the
// compressors and the payload format), algorithms.h (the algorithms as
// functions of a call, its codec and its ranks: pipeline.cpp's chunked
// payload exchange, all_reduce.cpp's two-phase and gathered all-reduce),
// all_reduce.cpp with hierarchy.cpp, reduce_scatter.cpp, all_gather.cpp,
// forward.cpp (every other collective) and backend.cpp (set-up, settings,
// the residual state). The queue, the checker and the store are members;
// none of their files, nor the codecs' or the pipeline's, includes this one.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "algorithms.h"
#include "call.h"
#include "call_check.h"
#include "codecs.h"
#include "config.h"
#include "error_feedback.h"
#include "pipeline.h"
#include "spec.h"
#include "work_queue.h"

namespace pycomm {
namespace dist {

struct Float32Views;

class CompressedBackend : public c10d::Backend {
 public:
  // `intra` (the ranks of this node) and `inter` (this rank's peers, one per
  // node, with the same local rank) make the all-reduce hierarchical; both
  // null: flat.
  CompressedBackend(c10::intrusive_ptr<c10d::Backend> inner, Config config,
                    c10::intrusive_ptr<c10d::Backend> intra = {},
                    c10::intrusive_ptr<c10d::Backend> inter = {},
                    c10::intrusive_ptr<c10d::Backend> check = {});
  ~CompressedBackend() override;

  const std::string getBackendName() const override { return "pycomm"; }
  const Config& config() const { return config_; }
  c10::intrusive_ptr<c10d::Backend> inner() const { return inner_; }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }

  // The compressed path, with error feedback under `key` when given;
  // `method` overrides the configured one (calibration runs each method).
  c10::intrusive_ptr<c10d::Work> allreduce_keyed(at::Tensor tensor, std::optional<int64_t> key,
                                                 bool average,
                                                 std::optional<std::string> method = std::nullopt);
  // Compressed reduce-scatter: `output` (S elements) receives this rank's
  // shard of the sum (or average) of every rank's `input` (world x S
  // elements, shard j = [j S, (j+1) S)), with error feedback under `key`.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_keyed(at::Tensor output, at::Tensor input,
                                                      std::optional<int64_t> key, bool average);
  // Compressed all-gather: `output` (world x S elements) receives every
  // rank's `input` (S elements), rank j's at [j S, (j+1) S), each decoded
  // from its compressed payload; error feedback under `key`.
  c10::intrusive_ptr<c10d::Work> all_gather_keyed(at::Tensor output, at::Tensor input,
                                                  std::optional<int64_t> key);
  // The exact all-reduce of the inner backend (for warm-up iterations).
  c10::intrusive_ptr<c10d::Work> allreduce_plain(at::Tensor tensor, bool average);
  // Whether allreduce(tensor, op) would compress (else it is forwarded).
  bool compresses(const at::Tensor& tensor, const c10d::ReduceOp& op) const;
  // The method a compressed call of `numel` elements runs.
  std::string method_for(int64_t numel) const;
  // Replaces Config::size_methods (between collectives, through the queue).
  void set_size_methods(std::vector<std::pair<int64_t, std::string>> table,
                        std::string calibration);
  // Ranks per node when hierarchical, else 1.
  int ranks_per_node() const { return intra_ ? intra_->getSize() : 1; }

  // Error-feedback state (the residual store), read and replaced between
  // collectives (backend.cpp). Copies of the residuals (of `keys` only, when given).
  std::map<int64_t, ErrorFeedback> error_feedback_state(
      std::optional<std::vector<int64_t>> keys = std::nullopt);
  // Checks `state` whole, then replaces every key's residuals with it
  // (replace) or only the keys it holds (another owner's keys stay).
  void load_error_feedback_state(std::map<int64_t, ErrorFeedback> state, bool replace = true);
  void reset_error_feedback(std::optional<int64_t> key);
  // Puts back the residuals of `keys` as they were before each key's last
  // call (a swap, no copy): one owner of several keys (a compressed step
  // whose calls run per bucket) undoes the calls that kept their residuals
  // when another call of the step was not finite. All keys are checked
  // before any changes.
  void undo_error_feedback(const std::vector<int64_t>& keys);
  // A copy of the worker's Profile (read between collectives); `reset`
  // starts a new one.
  Profile profile(bool reset = false);
  // Bytes the engine keeps between calls for itself (not residuals): the
  // send buffer and scratch of the large exact and 16-bit calls on a CPU.
  int64_t kept_nbytes();

  // ---- every collective of c10d::Backend ----
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // ---- the work queue (work_queue.cpp) ----
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> result,
                                        std::function<void()> body,
                                        std::optional<c10::Stream> stream = std::nullopt,
                                        bool overlaps = false) {
    return queue_.submit(type, std::move(result), std::move(body), stream, overlaps);
  }
  c10::intrusive_ptr<c10d::Work> submit_call(
      c10d::OpType type, std::vector<at::Tensor> result,
      std::function<std::optional<PendingCall>()> body, std::optional<c10::Stream> stream) {
    return queue_.submit_call(type, std::move(result), std::move(body), stream);
  }
  void settle(bool wait, std::optional<int64_t> key = std::nullopt) { queue_.settle(wait, key); }

  // ---- forward.cpp ----
  // Issues an inner collective from the worker thread and waits for it there,
  // on the caller's stream of the tensors' device (`tensors`, else `result`).
  c10::intrusive_ptr<c10d::Work> forward(c10d::OpType type, std::vector<at::Tensor> result,
                                         std::function<c10::intrusive_ptr<c10d::Work>()> issue,
                                         const std::vector<at::Tensor>& tensors = {});
  c10::intrusive_ptr<c10d::Work> forward_allreduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::AllreduceOptions& opts);

  // ---- backend.cpp ----
  // Why a compressed reduce-scatter / all-gather cannot run these tensors
  // (empty when it can): `whole` holds world size x `part`'s elements.
  std::string bad_pair(const char* what, const at::Tensor& whole, const at::Tensor& part,
                       const char* whole_name, const char* part_name) const;
  // A call this rank cannot run: it still takes part in the call check,
  // then raises `why`.
  c10::intrusive_ptr<c10d::Work> refuse(const at::Tensor& tensor, std::optional<int64_t> key,
                                        bool average, const std::string& m, int collective,
                                        std::string why);
  // ---- call_scope.cpp ----
  // Runs `body`, the compressed call `call` on `tensor`, on the issuing
  // thread: counted and timed (Profile), checked across ranks
  // (check_call), tagged (CallChecker::tag), and any error rethrown naming the call
  // and this rank. Returns its deferred finish, if it has one.
  std::optional<PendingCall> run_call(Call& call, const at::Tensor& tensor,
                                      const std::function<void()>& body);
  // Called by a running compressed call (on `tensor`) instead of reading
  // `checks`: the call is finished later by `finish` (see PendingCall),
  // whose errors are rethrown naming the call (the message made only then).
  void defer(Call& call, const at::Tensor& tensor, const std::vector<at::Tensor>& checks,
             std::function<void(const std::vector<bool>&)> finish);
  // The exact or 16-bit path of every collective ("none", "fp16", "bf16";
  // false for the methods that compress, which it leaves to the caller):
  // `exchange` runs the inner collective on the float32 (exact) or 16-bit
  // values it is given and returns where the result is (they themselves
  // when in place); the result is written to `output`.
  // The values exchanged carry one element more per row, 0 from a call
  // and NaN from a stand-in; where the call finishes (defer, on `input`),
  // every such element received must be 0: every rank raises where a rank
  // refused.
  bool run_uncompressed(Call& call, const Float32Views& views, const at::Tensor& input,
                        const at::Tensor& output,
                        const std::function<at::Tensor(const at::Tensor&)>& exchange);
  // Waits for an inner collective of a compressed call (Profile::wire_s).
  void wait_wire(const c10::intrusive_ptr<c10d::Work>& work);
  // The settings and profile the algorithms use (algorithms.h).
  CallEnv env() { return CallEnv{config_, profile_}; }

  // ---- the call check (CallChecker, call_check.cpp; run from call_scope.cpp) ----
  // Exchanges a descriptor of this call with every rank and throws, on every
  // rank, when they differ (Config::check_calls decides when).
  // `refused`: this rank will raise instead of running the call; its
  // descriptor then matches no valid call, so every rank raises.
  void check_call(const Call& call, const at::Tensor& tensor, bool refused = false);
  // A call of a checked key that this rank refuses, or that differs from
  // the key's first call, when the ranks compare first calls only: the
  // peers run the key's first call and would wait for this rank's part.
  // This rank runs that call instead on zeros and on a copy of the
  // residuals, with a tag no rank's call has, so every rank's tag check
  // fails at the same point, the group stays in step, and nothing changes.
  void stand_in(int64_t key, const CallRecord& first);
  // "pycomm rank R of W [(peer: rank P)]: <call> failed: " for errors.
  std::string failure_context(const Call& call, const at::Tensor& tensor) const;
  // Raises, naming the cause, unless every tag in `words` is the call's.
  void require_call_tags(const Call& call, const std::vector<at::Tensor>& words);

  // The call's hold on the residuals of its key for `x` (none when keyless
  // or `x` is empty), kept under its method (with the collective's suffix
  // when not an all-reduce); sets the call's rounding seeds.
  CallResiduals residuals_for(Call& call, const at::Tensor& x, const Group& g);
  // Every rank, for the steps that are not hierarchical.
  Group flat_group() const { return Group{inner_.get(), getRank(), getSize()}; }
  // Sets the call's seeds: its key's stream (counted in `ef`), or the
  // keyless one.
  void begin_seeds(Call& call, ErrorFeedback* ef);

  // ---- all_reduce.cpp ----
  // Scopes the call, then runs the algorithm (algorithms.h) its method has.
  std::optional<PendingCall> run_compressed(Call call, const at::Tensor& tensor);

  // ---- hierarchy.cpp ----
  // This rank's part of a hierarchical all-reduce (docs/hierarchy.md).
  struct NodeShard {
    at::Tensor y;              // the shard the compressed step all-reduces
    at::Tensor padded, shard;  // the node's reduce-scatter buffers
    int64_t lo = 0;            // where y starts in the tensor
    Group g;                   // the ranks of the compressed step
  };
  // Flat: y is the whole of `x` and g every rank.
  NodeShard reduce_in_node(const at::Tensor& x);
  // Raises on every rank of the node when the compressed step failed on
  // any (`failed`: this rank's failure, rethrown), before the node's
  // exchange: one small all-reduce inside the node.
  void agree_in_node(const at::Tensor& x, std::exception_ptr failed);
  // Puts the node's shards back together into `x`.
  void gather_in_node(const at::Tensor& x, NodeShard& s, bool average);
  // Over Gloo the node's exact steps are all-reduces (see reduce_in_node).
  bool node_allreduces() const { return intra_ && intra_->getBackendName() == "gloo"; }

  // ---- reduce_scatter.cpp, all_gather.cpp ----
  std::optional<PendingCall> run_reduce_scatter(Call call, const at::Tensor& output,
                                                const at::Tensor& input);
  std::optional<PendingCall> run_all_gather(Call call, const at::Tensor& output,
                                            const at::Tensor& input);

  c10::intrusive_ptr<c10d::Backend> inner_;
  Config config_;
  c10::intrusive_ptr<c10d::Backend> intra_, inter_;
  // Where the call check exchanges its descriptors: a Gloo group of the
  // same ranks beside the inner one (none: the inner group). A rank whose
  // call skips the check (a key it has used) while a peer checks its call
  // (a key's first use) then waits in another group than the peer, and
  // both time out, instead of one of them receiving the other's message:
  // Gloo aborts the process that receives a message larger than it posted.
  c10::intrusive_ptr<c10d::Backend> check_;
  bool inner_has_avg_;

  // Only the queue's tasks touch these (one at a time, WorkQueue); the
  // state accessors go through the queue too.
  ResidualStore residuals_{config_};
  // The calls the ranks compared, and the call tags. A key's record goes
  // with its residuals (reset, load): its next call is checked again.
  CallChecker checker_{config_, getRank(), getSize()};
  // Written by the issuing thread only; read through the queue.
  Profile profile_;
  // The exact and 16-bit path's send buffer and its division's scratch on
  // a CPU, kept between calls (run_uncompressed): the largest call's.
  at::Tensor cast_send_, cast_scratch_;
  // Keyless calls run by a compressor with error feedback (onebit, topk,
  // int8, int4, registered): the stream of their rounding seeds.
  int64_t keyless_calls_ = 0;
  // Last: its worker thread starts once everything its tasks use is set up.
  WorkQueue queue_;
};

}  // namespace dist
}  // namespace pycomm
