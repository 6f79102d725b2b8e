// The one scope every compressed call runs in (run_call), whichever the
// collective, and the exact and 16-bit paths they share.
#include "call_scope.h"

#include <cmath>

#include <c10/core/impl/VirtualGuardImpl.h>

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
    // A 16-bit sum is divided first (as PyTorch's fp16 hook does), so that
    // it cannot overflow; an exact one after.
    Span span(profile_.encode_s);
    const at::Tensor values = average && !exact ? views.in / world : views.in;
    const auto dtype = exact ? at::kFloat : wire_dtype(method_row(m)->dtype);
    send = at::empty({rows_in, len_in + 1}, values.options().dtype(dtype));
    send.narrow(1, 0, len_in).copy_(values.view({rows_in, len_in}));
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
  if (!call.standing_in) *slot_ok = wire.narrow(1, len_out, 1).eq(0).all();
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


void CompressedBackend::wait_wire(const c10::intrusive_ptr<c10d::Work>& work) {
  ++profile_.collectives;
  Span span(profile_.wire_s);
  wait_inner(work);
}

}  // namespace dist
}  // namespace pycomm
