// CompressedBackend: a c10d::Backend that wraps a real one (Gloo or NCCL)
// and compresses float SUM/AVG all-reduces (docs/allreduce.md); every other
// collective is forwarded unchanged.
//
// Ordering: Gloo and NCCL match collectives across ranks by the order in
// which they are issued. The compressed algorithms issue several dependent
// collectives per call, so all collectives of this backend (forwarded ones
// included) are issued from ONE worker thread, in the order the caller
// submitted them; the caller gets a Work at once. Point-to-point ops are
// matched by tag, not order, and go straight to the inner backend.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "spec.h"

namespace pycomm {
namespace dist {

struct Config {
  std::string method = "onebit";  // one of kMethods, or "auto"
  int64_t min_compress_numel = 65536;
  int64_t chunk_numel = kDefaultChunkNumel;
  int64_t block_size = 0;  // 0: each block method's default (default_block_size)
  double density = 0.01;
  bool approx = true;
  // Cross-rank check of compressed calls (docs/reliability.md): 0 never,
  // 1 at the first use of each key / keyless signature, 2 every call.
  int check_calls = 1;
  // method "auto": the method of a tensor of n elements is that of the first
  // entry whose bound exceeds n (set from the calibration, docs/auto.md).
  std::vector<std::pair<int64_t, std::string>> size_methods;
  // The calibration the table came from (JSON, kept for reports).
  std::string calibration;
  // A method that is not one of kMethods names a compressor registered in
  // Python (pycomm.register_compressor): the engine reaches it through the
  // ops pycomm::plugin_compress / plugin_decompress, with these options
  // (JSON, passed to its constructor).
  std::string plugin_options = "{}";
  // int8/int4 rounding: -1 to nearest; else stochastic, with the seeds of
  // rounding_seed (spec.h) drawn from this group seed in [0, 2^32).
  int64_t rounding_seed = -1;
};

// The seeds of one call's compresses (stochastic rounding; spec.h,
// rounding_seed): at(chunk, part) is -1 when the group rounds to nearest.
struct CallSeeds {
  int64_t seed = -1, stream = -1, call = 0;
  int collective = 0;
  int64_t rank = 0;
  int64_t at(int64_t chunk, int64_t part) const {
    return seed < 0 ? -1 : int64_t(rounding_seed(seed, stream, call, collective, rank, chunk, part));
  }
};

// The ranks one compressed step runs over: every rank (flat), or the ranks
// holding the same shard on every node (hierarchical, docs/hierarchy.md).
struct Group {
  c10d::Backend* pg;
  int rank;
  int world;
};

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

class CompressedBackend : public c10d::Backend {
 public:
  // `intra` (the ranks of this node) and `inter` (this rank's peers, one per
  // node, with the same local rank) make the all-reduce hierarchical; both
  // null: flat.
  CompressedBackend(c10::intrusive_ptr<c10d::Backend> inner, Config config,
                    c10::intrusive_ptr<c10d::Backend> intra = {},
                    c10::intrusive_ptr<c10d::Backend> inter = {});
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

  // Error-feedback state, read and replaced between collectives.
  // Copies of the residuals (of `keys` only, when given).
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
  // Queues `body` for the worker thread; the Work completes when it returns.
  // `stream` (an accelerator's, see caller_stream): the body runs with it
  // current, and the Work's completion is recorded on it, so the work is
  // ordered after what the caller queued before the call, and the caller's
  // stream (not its host thread) waits for the result.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> result,
                                        std::function<void()> body,
                                        std::optional<c10::Stream> stream = std::nullopt,
                                        bool overlaps = false);
  // Issues an inner collective from the worker thread and waits for it there,
  // on the caller's stream of the tensors' device (`tensors`, else `result`).
  c10::intrusive_ptr<c10d::Work> forward(c10d::OpType type, std::vector<at::Tensor> result,
                                         std::function<c10::intrusive_ptr<c10d::Work>()> issue,
                                         const std::vector<at::Tensor>& tensors = {});
  void run_worker();
  // Finishes pending calls in order: those the device has passed (`wait`
  // false), or all of them (`wait` true), or all up to the last one on
  // `key` (waiting for the device as needed).
  void settle(bool wait, std::optional<int64_t> key = std::nullopt);
  void finish_pending(PendingCall& call);
  // Called by a running compressed call instead of reading `checks`: the
  // call is finished later by `finish` (see PendingCall).
  void defer(const std::vector<at::Tensor>& checks, std::optional<int64_t> key,
             std::function<void(const std::vector<bool>&)> finish);
  // The running call's tag (spec.h, kTagWords int32s on its device), set
  // before its payloads are built.
  void set_tag(const at::Tensor& tensor, std::optional<int64_t> key, bool average);
  // The tags ending each of the `world` slots of `slot` elements (int32
  // words or bytes) of an exchanged buffer: a view, checked later.
  at::Tensor tag_words(const at::Tensor& buf, int world, int64_t slot) const;
  // Whether all of them are the running call's tag (a 0-dim bool tensor).
  at::Tensor tags_ok(const std::vector<at::Tensor>& words) const;
  // Raises, naming the cause, unless the tags matched.
  void require_tags(bool ok) const;
  void require_tags(const std::vector<at::Tensor>& words);
  // Reads a call's 0-dim bool checks together (Profile::sync_s).
  std::vector<bool> read_checks(const std::vector<at::Tensor>& checks);
  // The tag check and whether `t` is finite (`sums`: float32 sums of its
  // parts, taken on the way), with one host read when both hold.
  bool checked_finite(const std::vector<at::Tensor>& words, const std::vector<at::Tensor>& sums,
                      const at::Tensor& t);
  // Waits for an inner collective of a compressed call (Profile::wire_s).
  void wait_wire(const c10::intrusive_ptr<c10d::Work>& work);
  c10::intrusive_ptr<c10d::Work> forward_allreduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::AllreduceOptions& opts);

  void run_compressed(const at::Tensor& tensor, std::optional<int64_t> key, bool average,
                      const std::string& method);
  // Error feedback with a rollback (docs/allreduce.md, "Non-finite results"):
  // true where the compress writes the new residual to the second buffer
  // (onebit on CPU: no copy), false where the old one is copied there first.
  bool double_buffered(const at::Tensor& x, const std::string& method) const;
  // Both return whether the reduced result is finite (the same on every
  // rank of `g`).
  // `deferred_checks`: filled with the call's checks instead of reading
  // them (the return value is then meaningless).
  bool run_blocks(const at::Tensor& x, ErrorFeedback* ef, bool average, const Group& g,
                  const std::string& method,
                  std::vector<at::Tensor>* deferred_checks = nullptr);
  // The block length `method` runs with: the configured one, or its default.
  int64_t block_for(const std::string& method) const {
    return config_.block_size > 0 ? config_.block_size : default_block_size(method);
  }
  bool run_topk(const at::Tensor& x, ErrorFeedback* ef, bool average, const Group& g);
  // A registered compressor: each rank's payload of a chunk is gathered by
  // every rank, which decodes and adds them in rank order (docs/allreduce.md).
  bool run_plugin(const at::Tensor& x, ErrorFeedback* ef, bool average, const Group& g,
                  const std::string& method);
  // Exchanges a descriptor of this call with every rank and throws, on every
  // rank, when they differ (Config::check_calls decides when).
  // `refused`: this rank will raise instead of running the call; its
  // descriptor then matches no valid call, so every rank raises.
  void check_call(const at::Tensor& tensor, std::optional<int64_t> key, bool average,
                  const std::string& method, bool refused = false);
  std::string describe_call(const at::Tensor& tensor, std::optional<int64_t> key, bool average,
                            const std::string& method) const;
  // "pycomm rank R of W [(peer: rank P)]: <call> failed: " for errors.
  std::string failure_context(const at::Tensor& tensor, std::optional<int64_t> key,
                              bool average, const std::string& method) const;
  void run_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                          std::optional<int64_t> key, bool average, const std::string& method);
  std::string bad_pair(const char* what, const at::Tensor& whole, const at::Tensor& part,
                       const char* whole_name, const char* part_name) const;
  c10::intrusive_ptr<c10d::Work> refuse(const at::Tensor& tensor, std::optional<int64_t> key,
                                        bool average, const std::string& m, int collective,
                                        std::string why);
  void run_all_gather(const at::Tensor& output, const at::Tensor& input,
                      std::optional<int64_t> key, const std::string& method);
  void run_cast(const at::Tensor& x, bool average, const std::string& method);
  // Sets seeds_ for the running call: its key's stream (counted in `ef`),
  // or the keyless one.
  void begin_seeds(std::optional<int64_t> key, ErrorFeedback* ef);
  void run_exact(const at::Tensor& x, bool average);
  ErrorFeedback* error_feedback_for(int64_t key, const at::Tensor& x, const std::string& method,
                                    const Group& g);

  c10::intrusive_ptr<c10d::Backend> inner_;
  Config config_;
  c10::intrusive_ptr<c10d::Backend> intra_, inter_;
  bool inner_has_avg_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  // A submitted collective; `overlaps`: a compressed call, which may start
  // while earlier ones are pending. Anything else starts once every pending
  // call is finished (the state accessors see settled residuals).
  struct Task {
    std::function<void()> run;
    bool overlaps = false;
  };
  std::deque<Task> queue_;
  // Touched by the worker thread only.
  std::deque<PendingCall> pending_;
  std::optional<PendingCall> deferred_;  // set by the running call (defer)
  bool stopping_ = false;
  std::thread worker_;

  // Only the worker thread touches these while collectives run; the state
  // accessors go through the queue too.
  std::map<int64_t, ErrorFeedback> error_feedback_;
  // Keys and keyless (numel, dtype, op) signatures already checked.
  std::set<int64_t> checked_keys_;
  std::set<std::tuple<int64_t, int, bool>> checked_signatures_;
  // The collective the worker is running (index into kCollectives), for the
  // call check and error messages.
  int collective_ = 0;
  // Written by the worker thread only; read through the queue.
  Profile profile_;
  at::Tensor tag_;  // the running call's (set_tag)
  // Tags already on a device, by (hash, device): a call's tag is copied to
  // its device once, not every call (a blocking host-to-device copy).
  std::map<std::pair<uint64_t, std::string>, at::Tensor> device_tags_;
  // Keyless calls run by a compressor with error feedback (onebit, topk,
  // int8, int4, registered): the stream of their rounding seeds.
  int64_t keyless_calls_ = 0;
  // The seeds of the running call's compresses (begin_seeds).
  CallSeeds seeds_;
};

}  // namespace dist
}  // namespace pycomm
