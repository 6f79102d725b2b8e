// The compressed all-reduce (docs/allreduce.md): the two-phase algorithm
// of the block codecs, and the gathered one of top-k, registered
// compressors and block codecs on small tensors (all_reduce_gathers), over
// every rank or, hierarchical, over this rank's shard group (hierarchy.cpp).
#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>

#include "algorithms.h"
#include "backend.hpp"
#include "call_check.h"
#include "call_scope.h"

namespace pycomm {
namespace dist {
namespace {

// x /= divisor (the division div_ makes, element by element), and, with
// `check`, whether every element is finite (a non-finite float has every
// exponent bit set): one parallel pass over a CPU buffer, no tensor.
bool average_checked(float* x, int64_t n, int divisor, bool check) {
  std::atomic<bool> finite{true};
  const float d = float(divisor);
  at::parallel_for(0, n, int64_t(1) << 16, [&](int64_t b, int64_t e) {
    if (divisor != 1) {
#pragma omp simd
      for (int64_t i = b; i < e; ++i) x[i] /= d;
    }
    if (!check) return;
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = b; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, sizeof u);
      bad |= uint32_t((u & 0x7f800000u) == 0x7f800000u);
    }
    if (bad) finite = false;
  });
  return finite;
}

}  // namespace

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

WorkPtr CompressedBackend::allreduce_keyed(at::Tensor tensor, std::optional<int64_t> key,
                                           bool average, std::optional<std::string> method) {
  TORCH_CHECK(!method || known_method(*method), "unknown method '", *method, "'");
  const std::string m = method ? *method : method_for(tensor.numel());
  const auto dt = tensor.scalar_type();
  std::string bad;
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) {
    bad = std::string("compressed all_reduce needs a float32, float16 or bfloat16 tensor, got ") +
          c10::toString(dt);
  } else if (tensor.numel() == 0) {
    bad = "compressed all_reduce of an empty tensor";
  }
  if (!bad.empty()) return refuse(tensor, key, average, m, 0, bad);
  // On an accelerator the worker runs the kernels on the caller's current
  // stream, so they are ordered after the work that produced the tensor.
  return submit_call(c10d::OpType::ALLREDUCE, {tensor},
                     [this, tensor, key, average, m] {
                       return run_compressed(Call{0, key, average, m}, tensor);
                     },
                     caller_stream({tensor}));
}

WorkPtr CompressedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && compresses(tensors[0], opts.reduceOp)) {
    // Plain DDP and dist.all_reduce over a pycomm group land here, without a
    // key: nothing keeps the compression error, and the model pays for it.
    TORCH_WARN_ONCE(
        "pycomm: compressing an all-reduce without error feedback (dist.all_reduce, or DDP "
        "without a comm hook, over a \"pycomm\" group): each step's compression error is lost, "
        "which can cost final loss. With DDP, register pycomm.ddp.compressed_hook with a "
        "CompressionState (error feedback per bucket); elsewhere call "
        "pycomm.distributed.all_reduce(tensor, key=...).");
    return allreduce_keyed(tensors[0], std::nullopt, opts.reduceOp == c10d::ReduceOp::AVG);
  }
  return forward_allreduce(tensors, opts);
}

std::optional<PendingCall> CompressedBackend::run_compressed(Call call,
                                                             const at::Tensor& tensor) {
  return run_call(call, tensor, [&] {
    const std::optional<int64_t> key = call.key;
    const bool average = call.average;
    const std::string& m = call.method;
    const Float32Views views(tensor, tensor);
    const at::Tensor& x = views.in;
    if (run_uncompressed(call, views, tensor, tensor, [this](const at::Tensor& send) {
          std::vector<at::Tensor> ts{send};
          c10d::AllreduceOptions opts;
          opts.reduceOp = c10d::ReduceOp::SUM;
          wait_wire(inner_->allreduce(ts, opts));
          return send;
        }))
      return;
    NodeShard node = reduce_in_node(x);
    const at::Tensor& y = node.y;
    // A rank whose shard is empty (n < ranks per node) has nothing to send;
    // so do its peers on the other nodes, which hold the same shard.
    CallResiduals residuals = residuals_for(call, y, node.g);
    ErrorFeedback* ef = residuals.get();
    // The flat block path reads nothing back inside the call: on an
    // accelerator its checks follow its kernels to the host, and the call is
    // finished (residuals kept or discarded, Work completed) once the device
    // has passed them (settle). The other paths read them here.
    const bool gathered = all_reduce_gathers(m, y.numel(), node.g.world);
    if (!intra_ && !call.standing_in && views.direct && !gathered && y.numel() > 0 &&
        (!ef || residuals.double_buffered())) {
      std::vector<at::Tensor> checks;
      run_blocks(env(), call, y, ef, node.g, &checks);
      defer(call, tensor, checks, [ef, this](const std::vector<bool>& ok) {
        require_tags(ok[0]);
        // The new residuals are in the second buffers.
        keep_residuals(ef, ok.size() < 2 || ok[1], /*double_buffered=*/true);
      });
      return;
    }
    bool finite = true;
    std::exception_ptr failed;
    try {
      if (y.numel() > 0) {
        finite = gathered ? run_gathered(env(), call, y, ef, residuals.double_buffered(), node.g)
                          : run_blocks(env(), call, y, ef, node.g);
      }
    } catch (...) {
      if (!intra_) throw;
      failed = std::current_exception();
    }
    if (intra_) {
      // A shard group whose step failed (its tags differ: a rank stood in,
      // or calls ran in another order) tells its node before the node's
      // exchange, which the node's other ranks would otherwise wait in: one
      // rank of every node is in that shard group, so every rank raises.
      agree_in_node(x, failed);
      gather_in_node(x, node, average);
      // Each node's shard group saw only its shard; the whole result is the
      // same on every rank, so every rank takes the rollback decision alike.
      if (key.has_value()) finite = all_finite({x.sum()}, x);
    }
    finite = views.write_back(tensor, ef && finite) && finite;
    // The result is identical on every rank, so every rank decides alike:
    // a step that GradScaler will skip leaves the residuals as they were.
    residuals.commit(finite);
  });
}

// The two-phase all-reduce of a block codec (docs/allreduce.md): segment j
// of each chunk is reduced by rank j (an all_to_all of the workers'
// payloads, decoded and summed in float32, then compressed again: the
// compressed reduce-scatter), and the reduced segments are all-gathered.
bool run_blocks(const CallEnv& env, const Call& call, const at::Tensor& x, ErrorFeedback* ef,
                const Group& g, std::vector<at::Tensor>* deferred_checks) {
  const Config& config = env.config;
  Profile& profile = env.profile;
  const std::string& method = call.method;
  const bool average = call.average;
  const int world = g.world, rank = g.rank;
  const BlockCodec codec = BlockCodec::of(method, block_for(config, method));
  const int64_t n = x.numel(), C = chunk_length(n, config.chunk_numel), B = codec.block;
  const int64_t chunks = ceil_div(n, C);
  const auto int_opts = x.options().dtype(at::kInt);
  const bool spare_out = double_buffered(x, method);

  struct Chunk {
    int64_t begin;
    BlockLayout lay;
    at::Tensor recv, gathered;
    WorkPtr a2a, ag;
  };
  std::vector<Chunk> st;
  st.reserve(chunks);
  // Compress with error feedback: the new residual written to `spare`, or
  // in place (the old one copied to `spare` before the call).
  auto compress_ef = [&](const at::Tensor& grad, const at::Tensor& r, const at::Tensor& spare,
                         int64_t seed) {
    if (spare_out) return codec.compress_into(grad, r, spare, seed);
    return codec.compress(grad, r, seed);  // the old residual is in `spare` already
  };
  // The result is the decoded server payloads: it is finite exactly when
  // every gathered server scale is (a read of n / B floats; a non-finite
  // block decodes to NaN or +-Inf in every codec). Only error feedback
  // needs to know. The scales and the received tags are views, checked
  // once at the end of the call (a few launches, one host read).
  std::vector<at::Tensor> scales, tags;

  // Stage 1: worker compress, all_to_all of segment payloads.
  auto stage1 = [&](int64_t i) {
    Span span(profile.encode_s);
    const int64_t begin = i * C, m = std::min(C, n - begin);
    st.push_back(Chunk{begin, BlockLayout(m, world, B, codec.bits), {}, {}, {}, {}});
    Chunk& ch = st.back();
    const BlockLayout& lay = ch.lay;
    const int64_t seed = call.seeds.at(i, 0);
    auto [data, scales] = ef ? compress_ef(x.narrow(0, begin, m), ef->worker.narrow(0, begin, m),
                                           ef->worker_backup.narrow(0, begin, m), seed)
                             : codec.compress(x.narrow(0, begin, m), std::nullopt, seed);
    std::vector<at::Tensor> parts;
    std::vector<int64_t> in_splits, out_splits(world, lay.size[rank]);
    for (int j = 0; j < world; ++j) {
      in_splits.push_back(lay.size[j]);
      if (lay.len[j] == 0) continue;
      for (auto& p : codec.segment(data, scales, j * lay.seg, lay.len[j])) parts.push_back(p);
    }
    at::Tensor send = at::cat(parts);
    ch.recv = at::empty({world * lay.size[rank]}, int_opts);
    ch.a2a = g.pg->alltoall_base(ch.recv, send, out_splits, in_splits, c10d::AllToAllOptions());
  };

  // Stage 2: decode this rank's segment from every rank, average, server
  // compress, all_gather of the server payloads.
  auto stage2 = [&](int64_t i) {
    Chunk& ch = st[i];
    const BlockLayout& lay = ch.lay;
    env.wait(ch.a2a);
    // This rank's server payload, padded to segment 0's, then the tag:
    // assembled by one concatenation.
    std::vector<at::Tensor> parts;
    const int64_t len = lay.len[rank];
    if (len > 0) {
      // The first payload is written, the others added: no zero-filled
      // buffer to fault in per chunk. (Starting from +0 instead would only
      // change the sign of zero sums, which encode alike.)
      at::Tensor acc = at::empty({len}, x.options().dtype(at::kFloat));
      {
        Span span(profile.decode_s);
        for (int src = 0; src < world; ++src)
          codec.decompress(acc, ch.recv, src * lay.size[rank], /*accumulate=*/src > 0);
      }
      Span span(profile.encode_s);
      // On a CPU the division in place, in the kernels' chunks: torch's
      // div_ splits 32K elements over its thread team, whose spinning after
      // the region then takes a core from the inner collective's thread.
      if (average && direct_cpu(acc)) {
        average_checked(acc.data_ptr<float>(), len, world, /*check=*/false);
      } else if (average) {
        acc.div_(world);
      }
      const int64_t seed = call.seeds.at(i, 1);
      auto [sd, ss] = ef ? compress_ef(acc, ef->server[i], ef->server_backup[i], seed)
                         : codec.compress(acc, std::nullopt, seed);
      parts = codec.segment(sd, ss, 0, len);
    }
    Span span(profile.encode_s);
    const int64_t slot = lay.size[0] + kTagWords;
    if (const int64_t pad = lay.size[0] - (len > 0 ? lay.size[rank] : 0); pad > 0)
      parts.push_back(at::zeros({pad}, int_opts));
    parts.push_back(call.tag);
    at::Tensor mine = at::cat(parts);
    ch.gathered = at::empty({world * slot}, int_opts);
    ch.ag = g.pg->_allgather_base(ch.gathered, mine, c10d::AllgatherOptions());
  };

  // Stage 3: every rank decodes every segment: identical results everywhere.
  auto stage3 = [&](int64_t i) {
    Chunk& ch = st[i];
    const BlockLayout& lay = ch.lay;
    env.wait(ch.ag);
    Span span(profile.decode_s);
    const int64_t slot = lay.size[0] + kTagWords;
    tags.push_back(tag_words(ch.gathered, world, slot));
    for (int j = 0; j < world; ++j) {
      if (lay.len[j] == 0) continue;
      codec.decompress(x.narrow(0, ch.begin + j * lay.seg, lay.len[j]), ch.gathered,
                       j * slot, false);
      if (ef) scales.push_back(codec.scales_at(ch.gathered, j * slot, lay.len[j]));
    }
    ch.recv = at::Tensor();
    ch.gathered = at::Tensor();
  };

  // Issue order: a2a 0, a2a 1, ag 0, a2a 2, ag 1, ...
  run_pipeline(chunks, stage1, stage2, stage3);
  std::vector<at::Tensor> checks;
  {
    Span span(profile.decode_s);
    checks.push_back(tags_ok(call.tag, tags));
    if (!scales.empty()) checks.push_back(codec.finite(scales));
  }
  if (deferred_checks) {
    *deferred_checks = std::move(checks);
    return true;
  }
  const std::vector<bool> ok = env.read(checks);
  require_tags(ok[0]);
  return ok.size() < 2 || ok[1];
}

bool run_gathered(const CallEnv& env, const Call& call, const at::Tensor& x, ErrorFeedback* ef,
                  bool into_backup, const Group& g) {
  // Sums of finite values can overflow, so the output itself is checked
  // (only for error feedback): a sum per chunk, small next to the
  // selection, or on a CPU a read of it where it is, with the average.
  const bool direct = direct_cpu(x);
  bool finite = true;
  std::vector<at::Tensor> sums;
  const std::vector<at::Tensor> tags = exchange_payloads(
      env, call, x, x.numel(), /*all_to_all=*/false, ef, into_backup, g,
      [&](const PayloadCodec& codec, const PayloadChunk& ch) {
        const at::Tensor out = elements(x, ch.begin, ch.len);
        codec.decode(ch.recv, ch.slot, ch.layout, {out});
        if (!direct) {
          if (call.average) out.div_(g.world);
          if (ef) sums.push_back(out.sum());
          return;
        }
        finite = average_checked(out.data_ptr<float>(), ch.len, call.average ? g.world : 1,
                                 ef != nullptr) && finite;
      });
  const bool checked = checked_finite(env, call, tags, sums, x);  // the tags, at least
  return direct ? finite : checked;
}

}  // namespace dist
}  // namespace pycomm
