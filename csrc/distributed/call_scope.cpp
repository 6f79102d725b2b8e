// The one scope every compressed call runs in (run_call), whichever the
// collective, and the exact and 16-bit paths they share.
#include "call_scope.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <ATen/ScalarOps.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "algorithms.h"
#include "backend.hpp"
#include "call_check.h"

namespace pycomm {
namespace dist {
namespace {

// A cast's wire dtype, by the name its row gives (spec.h: "float16",
// "bfloat16").
at::ScalarType wire_dtype(const std::string& name) {
  for (at::ScalarType t : {at::kHalf, at::kBFloat16})
    if (name == (t == at::kHalf ? "float16" : "bfloat16")) return t;
  TORCH_CHECK(false, "no wire dtype named '", name, "'");
}

// Elements of the exact and 16-bit path's division on a CPU at a time (4
// MB of float32), and the size above which a call sends from a kept
// buffer: a smaller one's allocations come from the heap at once.
constexpr int64_t kCastChunk = int64_t{1} << 20;

// `numel` elements of `options`' dtype at the start of `slot`, a CPU byte
// buffer kept between calls, grown when too small. A new buffer of a
// bucket's size per call has its pages faulted in afresh whenever the
// allocator has given the last one back to the system, which glibc does
// for the caller's thread (docs/performance.md, "A large synchronous cast
// on a CPU").
at::Tensor kept_cpu(at::Tensor& slot, int64_t numel, const at::TensorOptions& options) {
  const int64_t nbytes = numel * static_cast<int64_t>(options.dtype().itemsize());
  if (!slot.defined() || slot.numel() < nbytes) slot = at::empty({nbytes}, at::kByte);
  return slot.narrow(0, 0, nbytes).view(options.dtype().toScalarType());
}

}  // namespace

Float32Views::Float32Views(const at::Tensor& input, const at::Tensor& output)
    : direct(input.scalar_type() == at::kFloat && input.is_contiguous() && output.is_contiguous()) {
  in = direct ? input.view({-1}) : input.reshape({-1}).to(at::kFloat).contiguous();
  if (output.is_same(input)) {
    out = in;
  } else {
    out = direct ? output.view({-1}) : at::empty({output.numel()}, in.options());
  }
}

bool Float32Views::write_back(const at::Tensor& output, bool check) const {
  if (direct) return true;
  output.copy_(out.view(output.sizes()));
  return !check || all_finite({output.sum(at::kFloat)}, output);
}

std::optional<PendingCall> CompressedBackend::run_call(Call& call, const at::Tensor& tensor,
                                                       const std::function<void()>& body) {
  // The engine's own tensor operations skip autograd's dispatch (views,
  // version counters), as c10d's collectives do: several microseconds per
  // call, most of a small call's host time on a CPU.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  ++profile_.calls;
  Span span(profile_.run_s);
  try {
    check_call(call, tensor);
    call.tag = checker_.tag(call, tensor);
    body();
    return std::move(call.deferred);
  } catch (...) {
    if (const auto key = call.key) {
      // A refused or failed call is this key's last call: undo_error_feedback
      // must not roll back the one before it, which was kept. Its previous
      // call is decided first, so that deciding it later cannot make it
      // undoable again.
      settle(/*wait=*/true, *key);
      if (ErrorFeedback* ef = residuals_.find(*key)) ef->undoable = false;
    }
    rethrow_with_context(failure_context(call, tensor));
  }
}

bool CompressedBackend::run_uncompressed(
    Call& call, const Float32Views& views, const at::Tensor& input, const at::Tensor& output,
    const std::function<at::Tensor(const at::Tensor&)>& exchange) {
  const std::string& m = call.method;
  const bool average = call.average;
  const bool exact = method_is(m, "exact");
  if (!exact && !method_is(m, "cast")) return false;
  // These payloads carry no tag, so one element more per row (a
  // reduce-scatter's input has a row per rank, an all-gather's output one
  // from each rank) stands for it: 0 from every call, NaN from a stand-in
  // (a rank that refused its call), so that what arrives tells every rank
  // (NaN + anything is NaN).
  const int world = getSize();
  const int64_t rows_in = call.collective == 1 ? world : 1;
  const int64_t rows_out = call.collective == 2 ? world : 1;
  const int64_t len_in = views.in.numel() / rows_in, len_out = views.out.numel() / rows_out;
  at::Tensor send;
  {
    Span span(profile_.encode_s);
    const auto options = views.in.options().dtype(exact ? at::kFloat : wire_dtype(method_row(m)->dtype));
    const at::Tensor values = views.in.view({rows_in, len_in});
    // A 16-bit sum is divided first (as PyTorch's fp16 hook does), so that
    // it cannot overflow; an exact one after.
    const bool divide = average && !exact;
    if (views.in.is_cpu() && views.in.numel() > kCastChunk) {
      // A large call on a CPU sends from a kept buffer. torch divides into
      // a 16-bit output, or by a Scalar into any output, through a
      // temporary of the output's size: the division goes into a kept
      // float32 scratch, kCastChunk elements at a time, by the wrapped
      // number `x / world` divides by.
      send = kept_cpu(cast_send_, rows_in * (len_in + 1), options).view({rows_in, len_in + 1});
      const at::Tensor divisor = at::native::wrapped_scalar_tensor(world);
      for (int64_t r = 0; r < rows_in; ++r)
        for (int64_t lo = 0; lo < len_in; lo += kCastChunk) {
          const at::Tensor part = values[r].narrow(0, lo, std::min(kCastChunk, len_in - lo));
          if (!divide) {
            send[r].narrow(0, lo, part.numel()).copy_(part);
            continue;
          }
          at::Tensor scaled = kept_cpu(cast_scratch_, part.numel(), part.options());
          send[r].narrow(0, lo, part.numel()).copy_(at::div_out(scaled, part, divisor));
        }
    } else {
      send = at::empty({rows_in, len_in + 1}, options);
      send.narrow(1, 0, len_in).copy_(divide ? values / world : values);
    }
    send.narrow(1, len_in, 1).fill_(call.standing_in ? NAN : 0.0);
  }
  const at::Tensor wire = exchange(send.view({-1})).view({rows_out, len_out + 1});
  {
    Span span(profile_.decode_s);
    views.out.view({rows_out, len_out}).copy_(wire.narrow(1, 0, len_out));
    if (average && exact) views.out.div_(world);
  }
  views.write_back(output, false);
  // Checked where the call finishes; a stand-in's own call fails anyway.
  if (!call.standing_in)
    defer(call, input, {wire.narrow(1, len_out, 1).eq(0).all()},
          [this](const std::vector<bool>& ok) { require_tags(ok[0]); });
  return true;
}

void CompressedBackend::defer(Call& c, const at::Tensor& tensor,
                              const std::vector<at::Tensor>& checks,
                              std::function<void(const std::vector<bool>&)> finish) {
  finish = [this, finish = std::move(finish), tensor, collective = c.collective, key = c.key,
            average = c.average, method = c.method](const std::vector<bool>& ok) {
    try {
      finish(ok);
    } catch (...) {
      rethrow_with_context(failure_context(Call{collective, key, average, method}, tensor));
    }
  };
  const c10::Device device = checks.at(0).device();
  at::Tensor dev;
  if (device.is_cpu()) {  // the values, without a stack
    dev = at::empty({static_cast<int64_t>(checks.size())}, at::kBool);
    bool* v = dev.data_ptr<bool>();
    for (size_t i = 0; i < checks.size(); ++i) v[i] = *checks[i].const_data_ptr<bool>();
  } else {
    dev = at::stack(checks);
  }
  PendingCall call{std::nullopt, dev, std::move(finish), {}, std::nullopt, c.key};
  if (!dev.is_cpu()) {
    call.checks = at::empty({dev.numel()}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
    call.checks.copy_(dev, /*non_blocking=*/true);
    call.done.emplace(device.type());
    call.done->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  c.deferred.emplace(std::move(call));
}


void CompressedBackend::wait_wire(const c10::intrusive_ptr<c10d::Work>& work) { env().wait(work); }

CallResiduals CompressedBackend::residuals_for(Call& call, const at::Tensor& x, const Group& g) {
  const std::optional<int64_t> key = call.key;
  const std::string& method = call.method;
  // A reduce-scatter's or all-gather's residuals are never mixed with an
  // all-reduce's under the same key; only the all-reduce double-buffers.
  static const char* const suffix[kNumCollectives] = {"", kReduceScatterSuffix,
                                                      kAllGatherSuffix};
  ErrorFeedback* ef = nullptr;
  if (key && x.numel() > 0) {
    settle(/*wait=*/true, *key);  // its last call's residuals decided first
    ef = &residuals_.for_call(*key, x, method + suffix[call.collective], g.world, g.rank);
  }
  if (ef && call.standing_in) {  // a copy: a stand-in never changes the residuals
    ErrorFeedback& copy = call.stand_in_residuals;
    copy = *ef;
    copy.worker = ef->worker.clone();
    for (auto& s : copy.server) s = s.clone();
    copy.worker_backup = at::Tensor();
    copy.server_backup.clear();
    ef = &copy;
  }
  begin_seeds(call, ef);
  return CallResiduals(ef, call.collective == 0 && double_buffered(x, method));
}

void CompressedBackend::begin_seeds(Call& call, ErrorFeedback* ef) {
  // Every rank runs the same calls in the same order, so the keyless count
  // is the same on all; a key's count travels with its residuals.
  const std::optional<int64_t> key = call.key;
  call.seeds = CallSeeds{config_.rounding_seed, key ? *key : -1, 0, call.collective, getRank()};
  if (ef) {
    call.seeds.call = ef->calls;  // counted when the call keeps its residuals
  } else if (!key) {
    call.seeds.call = keyless_calls_++;
  }
}

// ------------------------------------------------------------ call check ---
void CompressedBackend::check_call(const Call& call, const at::Tensor& tensor, bool refused) {
  queue_.require_usable();  // every compressed call and refusal starts here
  std::optional<CallRecord> first;
  const CallChecker::Need need = checker_.need(call, tensor, refused, &first);
  if (need == CallChecker::Need::kNothing) return;
  Span span(profile_.check_s);
  if (need == CallChecker::Need::kStandIn) {
    stand_in(*call.key, *first);
    CallChecker::changed(*call.key, *first, CallChecker::record(call, tensor), refused);
  }
  ++profile_.collectives;  // its wait counts as the check's, not the wire's
  // The check's own group exchanges on the CPU (Gloo); the inner group on
  // the tensor's device.
  const c10::Device where = check_ ? c10::Device(c10::kCPU) : tensor.device();
  checker_.exchange(check_ ? check_.get() : inner_.get(), call, tensor, refused, where,
                    [](const c10::intrusive_ptr<c10d::Work>& w) {
                      try {
                        wait_inner(w);
                      } catch (...) {
                        rethrow_with_context(
                            "its call check (the first use of a key, or of a keyless signature) "
                            "got no answer from every rank: a rank is lost, or runs a call whose "
                            "check it skipped at this position (a key it has used before, where "
                            "this rank makes a key's first call); check_calls=\"every\" names "
                            "the calls. ");
                      }
                    });
}

void CompressedBackend::stand_in(int64_t key, const CallRecord& first) {
  const int world = getSize();
  const at::Tensor zeros = at::zeros({first.numel}, at::TensorOptions(first.dtype).device(first.device));
  Call call{first.collective, key, first.average, first.method, /*standing_in=*/true};
  try {
    switch (first.collective) {
      case 0:
        run_compressed(std::move(call), zeros);
        break;
      case 1:
        run_reduce_scatter(std::move(call), at::empty({first.numel / world}, zeros.options()),
                           zeros);
        break;
      default:
        run_all_gather(std::move(call), at::empty({first.numel * world}, zeros.options()), zeros);
    }
  } catch (...) {
    // Expected: its tags match no rank's. The caller raises the reason.
  }
}

std::string CompressedBackend::failure_context(const Call& call, const at::Tensor& tensor) const {
  std::ostringstream o;
  o << "pycomm rank " << getRank() << " of " << getSize();
  // With two ranks the peer is known; with more, Gloo's own message below
  // names the peer's address when the failure is a connection.
  if (getSize() == 2) o << " (peer: rank " << 1 - getRank() << ")";
  o << ": " << CallChecker::describe(call, tensor) << " failed: ";
  return o.str();
}

void CompressedBackend::require_call_tags(const Call& call, const std::vector<at::Tensor>& words) {
  if (call.tag.is_cpu()) return require_tags(cpu_tags_ok(call.tag, words));
  require_tags(env().read({tags_ok(call.tag, words)})[0]);
}

bool checked_finite(const CallEnv& env, const Call& call, const std::vector<at::Tensor>& words,
                    const std::vector<at::Tensor>& sums, const at::Tensor& t) {
  if (sums.empty() && call.tag.is_cpu()) {
    // Nothing to read back from a device: the tags compared in place.
    Span span(env.profile.decode_s);
    require_tags(cpu_tags_ok(call.tag, words));
    return true;
  }
  std::vector<at::Tensor> checks;
  {
    Span span(env.profile.decode_s);
    checks.push_back(tags_ok(call.tag, words));
    if (!sums.empty()) checks.push_back(at::isfinite(at::stack(sums)).all());
  }
  const std::vector<bool> ok = env.read(checks);
  require_tags(ok[0]);
  // A sum is finite only if every term is; the exact check only when the
  // sum itself is not (an overflow of finite values, or a non-finite one).
  return sums.empty() || ok[1] || at::isfinite(t).all().item<bool>();
}

}  // namespace dist
}  // namespace pycomm
