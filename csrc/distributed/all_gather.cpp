// The compressed all-gather (docs/allreduce.md, "All-gather"): every rank
// receives every rank's input, each decoded from its compressed payload.
#include "backend.hpp"
#include "call_check.h"
#include "call_scope.h"

namespace pycomm {
namespace dist {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

WorkPtr CompressedBackend::all_gather_keyed(at::Tensor output, at::Tensor input,
                                            std::optional<int64_t> key) {
  const std::string m = method_for(output.numel());
  if (auto bad = bad_pair("all_gather", output, input, "output", "input"); !bad.empty())
    return refuse(input, key, false, m, 2, bad);
  return submit_call(c10d::OpType::_ALLGATHER_BASE, {output},
                     [this, output, input, key, m] {
                       return run_all_gather(Call{2, key, false, m}, output, input);
                     },
                     caller_stream({input}));
}

// Per chunk, each rank compresses its part (error feedback under the key,
// method name + "/all_gather"), the payloads are all-gathered, and every
// rank decodes rank j's into block j of the output. Every rank decodes the
// same bytes: the outputs are identical everywhere.
std::optional<PendingCall> CompressedBackend::run_all_gather(Call call, const at::Tensor& output,
                                                             const at::Tensor& input) {
  return run_call(call, input, [&] {
    const int world = getSize();
    const Float32Views views(input, output);
    const int64_t S = views.in.numel();
    if (run_uncompressed(call, views, input, output, [&](const at::Tensor& send) {
          at::Tensor mine = send, recv = at::empty({world * send.numel()}, send.options());
          wait_wire(inner_->_allgather_base(recv, mine, c10d::AllgatherOptions()));
          return recv;
        }))
      return;
    const Group g = flat_group();
    CallResiduals residuals = residuals_for(call, views.in, g);
    ErrorFeedback* ef = residuals.get();
    require_call_tags(call, exchange_payloads(env(), call, views.in, S, /*all_to_all=*/false, ef, /*into_backup=*/false, g,
                                   [&](const PayloadCodec& codec, const PayloadChunk& ch) {
                                     std::vector<at::Tensor> dst;
                                     for (int j = 0; j < world; ++j)
                                       dst.push_back(views.out.narrow(0, j * S + ch.begin, ch.len));
                                     codec.decode(ch.recv, ch.slot, ch.layout, dst);
                                   }));
    // The output is the same on every rank, so every rank decides alike: a
    // non-finite one leaves the residuals as they were.
    const bool out_finite = !ef || all_finite({views.out.sum()}, views.out);
    const bool finite = views.write_back(output, ef && out_finite) && out_finite;
    if (ef) residuals.commit(finite);
  });
}

}  // namespace dist
}  // namespace pycomm
