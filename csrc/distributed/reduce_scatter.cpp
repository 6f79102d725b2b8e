// The compressed reduce-scatter (docs/allreduce.md, spec.reduce_scatter):
// rank j receives shard j of the sum (or average) of every rank's input.
#include "backend.hpp"
#include "call_check.h"
#include "call_scope.h"

namespace pycomm {
namespace dist {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

WorkPtr CompressedBackend::reduce_scatter_keyed(at::Tensor output, at::Tensor input,
                                                std::optional<int64_t> key, bool average) {
  const std::string m = method_for(input.numel());
  if (auto bad = bad_pair("reduce_scatter", input, output, "input", "output"); !bad.empty())
    return refuse(input, key, average, m, 1, bad);
  return submit_call(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                     [this, output, input, key, average, m] {
                       return run_reduce_scatter(Call{1, key, average, m}, output, input);
                     },
                     caller_stream({input}));
}

// Per chunk of the shard, each rank compresses its W segments (segment j =
// the chunk's part of shard j, with error feedback), sends segment j's
// payload to rank j (one all_to_all of equal payloads), and decodes the W
// payloads it receives in rank order into its output. No server stage: the
// output is the decoded sum, in float32.
std::optional<PendingCall> CompressedBackend::run_reduce_scatter(Call call,
                                                                 const at::Tensor& output,
                                                                 const at::Tensor& input) {
  return run_call(call, input, [&] {
    const bool average = call.average;
    const int world = getSize();
    const Float32Views views(input, output);
    const int64_t S = views.out.numel();
    if (run_uncompressed(call, views, input, output, [&](const at::Tensor& send) {
          at::Tensor mine = send, recv = at::empty({send.numel() / world}, send.options());
          c10d::ReduceScatterOptions rs;
          rs.reduceOp = c10d::ReduceOp::SUM;
          wait_wire(inner_->_reduce_scatter_base(recv, mine, rs));
          return recv;
        }))
      return;
    const Group g = flat_group();
    CallResiduals residuals = residuals_for(call, views.in, g);
    ErrorFeedback* ef = residuals.get();
    std::vector<at::Tensor> sums;
    require_call_tags(call, exchange_payloads(env(), call, views.in, S, /*all_to_all=*/true, ef, /*into_backup=*/false, g,
                                   [&](const PayloadCodec& codec, const PayloadChunk& ch) {
                                     const at::Tensor dst = views.out.narrow(0, ch.begin, ch.len);
                                     codec.decode(ch.recv, ch.slot, ch.layout, {dst});
                                     if (average) dst.div_(world);
                                     if (ef) sums.push_back(dst.sum());
                                   }));
    const bool out_finite = !ef || all_finite(sums, views.out);
    const bool finite = views.write_back(output, ef && out_finite) && out_finite;
    if (!ef) return;
    // Each rank holds another shard: they agree on finiteness (one MIN)
    // before any rolls back, so the residuals stay consistent.
    at::Tensor flag = at::full({1}, finite ? 1 : 0, views.in.options().dtype(at::kInt));
    std::vector<at::Tensor> ts{flag};
    c10d::AllreduceOptions mn;
    mn.reduceOp = c10d::ReduceOp::MIN;
    wait_wire(inner_->allreduce(ts, mn));
    residuals.commit(flag.item<int32_t>() == 1);
  });
}

}  // namespace dist
}  // namespace pycomm
