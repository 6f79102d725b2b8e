// Cross-rank checks of compressed calls (docs/reliability.md): the call
// descriptor ranks compare, the call tags every payload ends with, and
// whether a result is finite. CallChecker holds what the ranks have
// compared; the backend owns one and runs its exchanges.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "call.h"
#include "config.h"

namespace pycomm {
namespace dist {

// What a call the ranks compared was: its key's later calls must repeat it.
struct CallRecord {
  int collective;
  int64_t numel;
  at::ScalarType dtype;
  bool average;
  std::string method;
  c10::Device device;
  bool operator==(const CallRecord& o) const {
    return collective == o.collective && numel == o.numel && dtype == o.dtype &&
           average == o.average && method == o.method && device == o.device;
  }
};

// The calls a group's ranks have compared (the first call of each key and
// each keyless signature, Config::check_calls), the descriptor they compare
// and the call tags. Not thread-safe: the group's work queue is its one user
// at a time.
class CallChecker {
 public:
  CallChecker(const Config& config, int rank, int world)
      : config_(config), rank_(rank), world_(world) {}

  // What a call needs before it runs.
  enum class Need {
    kNothing,   // its key or signature was compared already, and it repeats it
    kExchange,  // a descriptor exchange (exchange())
    kStandIn,   // a call of a checked key that differs from the key's first
                // call (in `first`), or that this rank refuses: the peers run
                // the first call, so this rank stands in for it, then raises
  };
  Need need(const Call& call, const at::Tensor& tensor, bool refused,
            std::optional<CallRecord>* first) const;
  // The descriptor exchange over `pg`, in tensors on `device` (`wait` waits
  // for its collective): throws, on every rank, naming each field that
  // differs and every rank's value; else remembers the call (unless
  // `refused`).
  void exchange(c10d::Backend* pg, const Call& call, const at::Tensor& tensor, bool refused,
                c10::Device device,
                const std::function<void(const c10::intrusive_ptr<c10d::Work>&)>& wait);
  // Throws the error of a key's call that differs from its first (after
  // the stand-in), or that this rank refused.
  [[noreturn]] static void changed(int64_t key, const CallRecord& first, const CallRecord& now,
                                   bool refused);
  // Forgets the checked calls of `key` (all when none given): its next call
  // is compared again (after a reset or a load of its residuals).
  void forget(std::optional<int64_t> key);
  // The call's tag (spec.h, kTagWords int32s on the tensor's device), made
  // once per device.
  at::Tensor tag(const Call& call, const at::Tensor& tensor);

  static CallRecord record(const Call& call, const at::Tensor& tensor);
  // "<collective> key=K <numel> <dtype> <method> <op>", for errors.
  static std::string describe(const Call& call, const at::Tensor& tensor);
  // "a <collective> of <numel> <dtype> elements on <device> (<method>, <op>)".
  static std::string describe(const CallRecord& r);

 private:
  const Config& config_;
  int rank_, world_;
  std::map<int64_t, CallRecord> keys_;
  std::set<std::tuple<int64_t, int, bool>> signatures_;
  // Tags already on a device, by (hash, device): a call's tag is copied to
  // its device once, not every call (a blocking host-to-device copy).
  std::map<std::pair<uint64_t, std::string>, at::Tensor> device_tags_;
};

// The tags ending each of the `world` slots of `slot` elements (int32
// words or bytes) of an exchanged buffer: a view, checked later.
at::Tensor tag_words(const at::Tensor& buf, int world, int64_t slot);
// Whether all of them are `tag` (a 0-dim bool tensor).
at::Tensor tags_ok(const at::Tensor& tag, const std::vector<at::Tensor>& words);
// The same, compared in place, for tags on a CPU.
bool cpu_tags_ok(const at::Tensor& tag, const std::vector<at::Tensor>& words);
// Raises, naming the cause, unless the tags matched.
void require_tags(bool ok);
// The values of 0-dim bool tensors of one device, read together: one
// host synchronization on an accelerator, whatever their number.
std::vector<bool> read_flags(const std::vector<at::Tensor>& flags);

// Rethrows the exception being handled with `context` in front of its
// message, keeping a DistBackendError one (callers tell them apart).
[[noreturn]] void rethrow_with_context(const std::string& context);

// Whether every element is finite: one vectorized read (a sum is finite
// only if every term is); the exact check only when the sum itself
// overflows. `sums`: float32 sums of parts of `t`, taken on the way.
bool all_finite(const std::vector<at::Tensor>& sums, const at::Tensor& t);

}  // namespace dist
}  // namespace pycomm
