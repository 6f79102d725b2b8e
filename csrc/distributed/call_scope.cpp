// The one scope every compressed call runs in (run_call), whichever the
// collective, and the exact and 16-bit paths they share.
#include "call_scope.h"

#include <cmath>

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
    set_tag(call, tensor);
    body();
    return std::move(call.deferred);
  } catch (...) {
    if (const auto key = call.key) {
      // A refused or failed call is this key's last call: undo_error_feedback
      // must not roll back the one before it, which was kept. Its previous
      // call is decided first, so that deciding it later cannot make it
      // undoable again.
      settle(/*wait=*/true, *key);
      if (auto it = error_feedback_.find(*key); it != error_feedback_.end()) it->second.undoable = false;
    }
    rethrow_with_context(failure_context(call, tensor));
  }
}

bool CompressedBackend::run_uncompressed(
    const Call& call, const Float32Views& views, const at::Tensor& output,
    const std::function<at::Tensor(const at::Tensor&)>& exchange, at::Tensor* slot_ok) {
  const std::string& m = call.method;
  const bool average = call.average;
  const bool check_slot = slot_ok != nullptr;
  const bool exact = method_is(m, "exact");
  if (!exact && !method_is(m, "cast")) return false;
  const int64_t n = views.in.numel();
  at::Tensor send;
  {
    // A 16-bit sum is divided first (as PyTorch's fp16 hook does), so that
    // it cannot overflow; an exact one after.
    Span span(profile_.encode_s);
    const at::Tensor values = average && !exact ? views.in / getSize() : views.in;
    const auto dtype = exact ? at::kFloat : wire_dtype(method_row(m)->dtype);
    if (check_slot) {
      // These payloads carry no tag, so one more element stands for it: 0
      // from every call, NaN from a stand-in (a rank that refused its call),
      // so that the sum tells every rank (NaN + anything is NaN).
      send = at::empty({n + 1}, values.options().dtype(dtype));
      send.narrow(0, 0, n).copy_(values);
      send.narrow(0, n, 1).fill_(call.standing_in ? NAN : 0.0);
    } else {
      send = values.to(dtype);
    }
  }
  const at::Tensor wire = exchange(send);
  const at::Tensor result = check_slot ? wire.narrow(0, 0, n) : wire;
  {
    Span span(profile_.decode_s);
    if (!result.is_same(views.out)) views.out.copy_(result);
    if (average && exact) views.out.div_(getSize());
  }
  views.write_back(output, false);
  // Read when the call is finished, as the block codecs' tags are: no
  // wait for an accelerator inside the call. A stand-in's own call fails
  // anyway.
  if (slot_ok && !call.standing_in) *slot_ok = wire.narrow(0, n, 1).eq(0).squeeze(0);
  return true;
}

void CompressedBackend::wait_wire(const c10::intrusive_ptr<c10d::Work>& work) {
  ++profile_.collectives;
  Span span(profile_.wire_s);
  wait_inner(work);
}

}  // namespace dist
}  // namespace pycomm
