// The compressed collectives' algorithms (docs/allreduce.md) as functions
// of one call (Call), its codec and the ranks it runs over (Group), with
// what they use of the group besides: its settings and the profile its
// stages add to (CallEnv). The backend scopes a call (check, tag, residuals,
// views) and hands it to these; they keep no state between calls.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "call.h"
#include "call_check.h"
#include "codecs.h"
#include "config.h"
#include "error_feedback.h"
#include "pipeline.h"
#include "work_queue.h"

namespace pycomm {
namespace dist {

// A group's settings and profile, as a call's algorithm uses them.
struct CallEnv {
  const Config& config;
  Profile& profile;

  // Waits for an inner collective of the call (Profile::wire_s).
  void wait(const c10::intrusive_ptr<c10d::Work>& work) const {
    ++profile.collectives;
    Span span(profile.wire_s);
    wait_inner(work);
  }
  // Reads a call's 0-dim bool checks together (Profile::sync_s).
  std::vector<bool> read(const std::vector<at::Tensor>& checks) const {
    Span span(profile.sync_s);
    return read_flags(checks);
  }
};

// Elements [begin, begin + len) of a flat tensor: t itself when that is
// all of it (a tensor of one chunk: no view to make).
inline at::Tensor elements(const at::Tensor& t, int64_t begin, int64_t len) {
  return begin == 0 && len == t.numel() ? t : t.narrow(0, begin, len);
}

// The payload exchange of the gathered all-reduce, the reduce-scatter and
// the all-gather, pipelined over chunks of `S` elements: per chunk
// [c0, c0 + len), this rank encodes (PayloadCodec, with the call's tag)
// segment j at j S + c0 of `in` (error feedback at the same place of
// ef->worker, the new residual written to ef->worker_backup with
// `into_backup`), for j < world with `all_to_all` (segment j goes to rank j),
// else segment 0 (gathered by every rank); `received` then decodes the
// chunk's buffer, one slot per rank. A registered compressor's payload
// layout is compared across ranks first (one small all-gather a chunk).
// Returns the received tags, views to check.
std::vector<at::Tensor> exchange_payloads(
    const CallEnv& env, const Call& call, const at::Tensor& in, int64_t S, bool all_to_all,
    ErrorFeedback* ef, bool into_backup, const Group& g,
    const std::function<void(const PayloadCodec&, const PayloadChunk&)>& received);

// The two-phase all-reduce of a block codec, in place on x (docs/allreduce.md,
// "Block codecs"). Returns whether the result is finite (only error feedback
// needs to know); with `deferred_checks`, returns their tensors there (the
// tag check, then finiteness when ef is given) unread instead.
bool run_blocks(const CallEnv& env, const Call& call, const at::Tensor& x, ErrorFeedback* ef,
                const Group& g, std::vector<at::Tensor>* deferred_checks = nullptr);

// The gathered all-reduce (top-k, registered compressors, a block codec's
// on a small tensor: all_reduce_gathers), in place on x: each rank's
// payload of a chunk is gathered by every rank, which decodes and adds them
// in rank order. `into_backup`: a block codec writes the new residuals to
// ef->worker_backup (double-buffered). Returns whether the result is finite
// (the same on every rank of `g`).
bool run_gathered(const CallEnv& env, const Call& call, const at::Tensor& x, ErrorFeedback* ef,
                  bool into_backup, const Group& g);

// The tag check and whether `t` is finite (`sums`: float32 sums of its
// parts, taken on the way), with one host read when both hold.
bool checked_finite(const CallEnv& env, const Call& call, const std::vector<at::Tensor>& words,
                    const std::vector<at::Tensor>& sums, const at::Tensor& t);

}  // namespace dist
}  // namespace pycomm
