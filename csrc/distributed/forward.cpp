// Every collective the engine does not compress: issued unchanged on the
// inner backend, from the worker thread, in submission order with the
// compressed ones (Gloo and NCCL match collectives by issue order).
#include "backend.hpp"

namespace pycomm {
namespace dist {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

WorkPtr CompressedBackend::forward(c10d::OpType type, std::vector<at::Tensor> result,
                                   std::function<WorkPtr()> issue,
                                   const std::vector<at::Tensor>& tensors) {
  auto stream = caller_stream(tensors.empty() ? result : tensors);
  return submit(type, std::move(result), [this, issue = std::move(issue)] {
    queue_.require_usable();
    ++profile_.forwarded;
    Span span(profile_.forwarded_s);
    wait_inner(issue());
  }, stream);
}

WorkPtr CompressedBackend::allreduce_plain(at::Tensor tensor, bool average) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  return forward_allreduce(tensors, opts);
}

WorkPtr CompressedBackend::forward_allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) {
  if (opts.reduceOp == c10d::ReduceOp::AVG && !inner_has_avg_) {
    auto sum_opts = opts;
    sum_opts.reduceOp = c10d::ReduceOp::SUM;
    const int world = getSize();
    auto stream = caller_stream(tensors);
    return submit(c10d::OpType::ALLREDUCE, tensors, [this, tensors, sum_opts, world]() mutable {
      queue_.require_usable();
      ++profile_.forwarded;
      Span span(profile_.forwarded_s);
      wait_inner(inner_->allreduce(tensors, sum_opts));
      for (auto& t : tensors) {
        if (t.is_floating_point() || t.is_complex()) {
          t.div_(world);
        } else {
          t.div_(world, "floor");
        }
      }
    }, stream);
  }
  return forward(c10d::OpType::ALLREDUCE, tensors,
                 [this, tensors, opts]() mutable { return inner_->allreduce(tensors, opts); });
}

WorkPtr CompressedBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) {
  return forward(c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, tensors, opts]() mutable {
    return inner_->allreduce_coalesced(tensors, opts);
  });
}

WorkPtr CompressedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) {
  return forward(c10d::OpType::BROADCAST, tensors,
                 [this, tensors, opts]() mutable { return inner_->broadcast(tensors, opts); });
}

WorkPtr CompressedBackend::reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) {
  return forward(c10d::OpType::REDUCE, tensors,
                 [this, tensors, opts]() mutable { return inner_->reduce(tensors, opts); });
}

WorkPtr CompressedBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::ALLGATHER, outputs.empty() ? std::vector<at::Tensor>{} : outputs[0],
                 [this, outputs, inputs, opts]() mutable {
                   return inner_->allgather(outputs, inputs, opts);
                 },
                 inputs);
}

WorkPtr CompressedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::_ALLGATHER_BASE, {output}, [this, output, input, opts]() mutable {
    return inner_->_allgather_base(output, input, opts);
  });
}

WorkPtr CompressedBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::ALLGATHER_COALESCED, {}, [this, outputs, inputs, opts]() mutable {
    return inner_->allgather_coalesced(outputs, inputs, opts);
  }, inputs);
}

WorkPtr CompressedBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::COALESCED, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) {
  return forward(c10d::OpType::GATHER, {}, [this, outputs, inputs, opts]() mutable {
    return inner_->gather(outputs, inputs, opts);
  }, inputs);
}

WorkPtr CompressedBackend::scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) {
  return forward(c10d::OpType::SCATTER, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->scatter(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::REDUCE_SCATTER, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->reduce_scatter(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [this, output, input, opts]() mutable {
                   return inner_->_reduce_scatter_base(output, input, opts);
                 });
}

WorkPtr CompressedBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return forward(c10d::OpType::COALESCED, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_split_sizes,
                                         std::vector<int64_t>& input_split_sizes,
                                         const c10d::AllToAllOptions& opts) {
  return forward(c10d::OpType::ALLTOALL_BASE, {output},
                 [this, output, input, output_split_sizes, input_split_sizes, opts]() mutable {
                   return inner_->alltoall_base(output, input, output_split_sizes,
                                                input_split_sizes, opts);
                 });
}

WorkPtr CompressedBackend::alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) {
  return forward(c10d::OpType::ALLTOALL, outputs, [this, outputs, inputs, opts]() mutable {
    return inner_->alltoall(outputs, inputs, opts);
  });
}

WorkPtr CompressedBackend::barrier(const c10d::BarrierOptions& opts) {
  return forward(c10d::OpType::BARRIER, {}, [this, opts] { return inner_->barrier(opts); });
}

void CompressedBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  submit(c10d::OpType::BARRIER, {}, [this, opts, wait_all_ranks] {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  })->wait();
}

// Point-to-point: matched by tag, not issue order, so no need to queue.
WorkPtr CompressedBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return inner_->send(tensors, dst, tag);
}

WorkPtr CompressedBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return inner_->recv(tensors, src, tag);
}

WorkPtr CompressedBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return inner_->recvAnysource(tensors, tag);
}

}  // namespace dist
}  // namespace pycomm
