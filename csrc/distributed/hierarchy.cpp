// The hierarchical all-reduce's node steps (docs/hierarchy.md): an exact
// reduce-scatter inside the node leaves this rank one shard of the node's
// sum; the compressed step all-reduces that shard with the same shard of
// every other node; an exact all-gather inside the node puts the shards
// back together.
// Over Gloo the node's exact steps are all-reduces of the whole tensor
// instead: Gloo's reduce-scatter and all-gather are slower than its
// all-reduce (2 ranks, 64 MB on loopback: 108 and 94 ms against 63).
#include "backend.hpp"

namespace pycomm {
namespace dist {

CompressedBackend::NodeShard CompressedBackend::reduce_in_node(const at::Tensor& x) {
  NodeShard s{x, {}, {}, 0, flat_group()};
  if (!intra_) return s;
  const int64_t n = x.numel();
  const int L = intra_->getSize(), l = intra_->getRank();
  const int64_t S = ceil_div(n, L), len = std::clamp<int64_t>(n - l * S, 0, S);
  s.lo = std::min(n, l * S);
  if (node_allreduces()) {
    std::vector<at::Tensor> ts{x};
    wait_wire(intra_->allreduce(ts, c10d::AllreduceOptions()));  // SUM
    s.y = x.narrow(0, s.lo, len);
  } else {
    s.padded = n == L * S ? x : at::cat({x, at::zeros({L * S - n}, x.options())});
    s.shard = at::empty({S}, x.options());
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = c10d::ReduceOp::SUM;
    wait_wire(intra_->_reduce_scatter_base(s.shard, s.padded, rs));
    s.y = s.shard.narrow(0, 0, len);
  }
  s.g = Group{inter_.get(), inter_->getRank(), inter_->getSize()};
  return s;
}

void CompressedBackend::agree_in_node(const at::Tensor& x, std::exception_ptr failed) {
  at::Tensor flag = at::full({1}, failed ? 1 : 0, x.options().dtype(at::kInt));
  std::vector<at::Tensor> ts{flag};
  c10d::AllreduceOptions mx;
  mx.reduceOp = c10d::ReduceOp::MAX;
  wait_wire(intra_->allreduce(ts, mx));
  if (failed) std::rethrow_exception(failed);
  TORCH_CHECK(flag.item<int32_t>() == 0,
              "another rank of this node failed its shard group's compressed step (the ranks ran "
              "different compressed calls at the same position, or a rank refused its call, "
              "and its error says why): the output holds no valid result and the residuals are "
              "as before the call");
}

void CompressedBackend::gather_in_node(const at::Tensor& x, NodeShard& s, bool average) {
  const int64_t n = x.numel();
  if (average) s.y.div_(intra_->getSize());  // the inter step averaged over nodes
  if (node_allreduces()) {
    // Every other rank of the node adds zeros to this rank's shard: exact.
    x.narrow(0, 0, s.lo).zero_();
    x.narrow(0, s.lo + s.y.numel(), n - s.lo - s.y.numel()).zero_();
    std::vector<at::Tensor> ts{x};
    wait_wire(intra_->allreduce(ts, c10d::AllreduceOptions()));
  } else {
    wait_wire(intra_->_allgather_base(s.padded, s.shard, c10d::AllgatherOptions()));
    if (s.padded.data_ptr() != x.data_ptr()) x.copy_(s.padded.narrow(0, 0, n));
  }
}

}  // namespace dist
}  // namespace pycomm
