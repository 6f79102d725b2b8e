// One compressed call as the engine runs it: what it is (collective, key,
// op, method) and what it carries while it runs (its tag, its rounding
// seeds, a stand-in's copy of the residuals, its deferred finish). It is
// built once, where the call is scoped (CompressedBackend::run_call), and
// passed by reference: nothing of a call lives in the backend's members.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "config.h"
#include "error_feedback.h"
#include "work_queue.h"

namespace pycomm {
namespace dist {

struct Call {
  int collective = 0;  // index into kCollectives
  std::optional<int64_t> key;
  bool average = false;
  std::string method;
  // A stand-in for a key's first call (CompressedBackend::stand_in): no
  // call check, a tag no call has, a copy of the residuals.
  bool standing_in = false;
  at::Tensor tag;                        // ends every payload (CallChecker::tag)
  CallSeeds seeds;                       // its compresses' rounding seeds (begin_seeds)
  ErrorFeedback stand_in_residuals;      // a stand-in's copy of its key's
  std::optional<PendingCall> deferred;   // finished later, by settle (defer)
};

}  // namespace dist
}  // namespace pycomm
