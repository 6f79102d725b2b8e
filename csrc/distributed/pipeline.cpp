// The chunked payload exchange of the gathered all-reduce, the
// reduce-scatter and the all-gather: one exchange per chunk, pipelined.
#include "pipeline.h"

#include <sstream>

#include "algorithms.h"

namespace pycomm {
namespace dist {
namespace {

// A registered compressor is Python code: nothing but this exchange keeps
// a payload whose length depends on the data from reaching the inner
// collective with another length on each rank (Gloo aborts the process,
// NCCL reads past the buffer). Its cost, one small all-gather per chunk,
// is small next to the compressor itself.
void check_payload_layout(const CallEnv& env, const std::string& method, const PayloadChunk& ch,
                          const Group& g, const c10::Device& device, std::exception_ptr failed) {
  uint64_t layout = kFnvOffset;  // a hash of the tensors' dtypes and shapes
  for (const auto& p : ch.layout) {
    layout = hash_fields({static_cast<int64_t>(p.scalar_type()), p.dim()}, layout);
    for (int64_t d : p.sizes()) layout = hash_fields({d}, layout);
  }
  // A rank whose compressor raised sends a size no payload has.
  const std::vector<int64_t> mine{failed ? kRefusedNumel : ch.slot - kTagBytes,
                                  static_cast<int64_t>(layout)};
  at::Tensor in = at::tensor(mine, at::kLong).to(device);
  at::Tensor out = at::empty({g.world * 2}, in.options());
  env.wait(g.pg->_allgather_base(out, in, c10d::AllgatherOptions()));
  if (failed) std::rethrow_exception(failed);  // its own error says why
  const at::Tensor all = out.cpu();
  const int64_t* a = all.const_data_ptr<int64_t>();
  std::ostringstream raised;
  for (int r = 0; r < g.world; ++r)
    if (a[2 * r] == kRefusedNumel) raised << (raised.tellp() ? ", " : "") << r;
  TORCH_CHECK(raised.tellp() == 0, "compressor '", method, "' raised on rank(s) ", raised.str(),
              " for ", ch.len, " elements of this call (their errors say why), so every rank "
              "raises: the output holds no valid result (it may have been written) and the "
              "residuals are as before the call");
  bool same = true;
  std::ostringstream sizes;
  for (int r = 0; r < g.world; ++r) {
    same = same && a[2 * r] == a[0] && a[2 * r + 1] == a[1];
    sizes << (r ? ", " : "") << "rank " << r << ": " << a[2 * r] << " bytes";
  }
  TORCH_CHECK(same, "compressor '", method, "' made payloads of other sizes, shapes or dtypes on "
              "the ranks for ", ch.len, " elements (", sizes.str(), "): a registered "
              "compressor's payload tensors must have shapes and dtypes that depend on the "
              "element count alone (pycomm.compressors.plugin), e.g. a top-k that keeps a "
              "fixed number of entries, not the entries above a threshold");
}

}  // namespace

std::vector<at::Tensor> exchange_payloads(
    const CallEnv& env, const Call& call, const at::Tensor& in, int64_t S, bool all_to_all,
    ErrorFeedback* ef, bool into_backup, const Group& g,
    const std::function<void(const PayloadCodec&, const PayloadChunk&)>& received) {
  const std::string& method = call.method;
  const Config& config = env.config;
  Profile& profile = env.profile;
  const PayloadCodec codec(method, config, block_for(config, method));
  const int world = g.world, segments = all_to_all ? world : 1;
  const int64_t C = chunk_length(S, config.chunk_numel), chunks = ceil_div(S, C);
  std::vector<PayloadChunk> st;
  st.reserve(chunks);
  std::vector<at::Tensor> tags;

  auto send = [&](int64_t i) {
    Span span(profile.encode_s);
    PayloadChunk& ch = st.emplace_back();
    ch.begin = i * C;
    ch.len = std::min(C, S - ch.begin);
    std::vector<at::Tensor> payloads;
    // A registered compressor may raise on one rank only (a refusal that
    // depends on the data): that rank still takes part in the layout
    // exchange, so that every rank raises there and none is left waiting
    // for its payload (or pairs it with its next call's).
    std::exception_ptr failed;
    try {
      for (int j = 0; j < segments; ++j) {
        const int64_t at0 = j * S + ch.begin;
        std::optional<at::Tensor> r;
        at::Tensor r_out;
        if (ef) r = elements(ef->worker, at0, ch.len);
        if (ef && into_backup) r_out = elements(ef->worker_backup, at0, ch.len);
        payloads.push_back(codec.encode(elements(in, at0, ch.len), r, r_out.defined() ? &r_out : nullptr,
                                        call.seeds.at(i, j), call.tag, ch.layout));
      }
      ch.slot = payloads[0].numel();
      for (const auto& p : payloads)
        TORCH_CHECK(p.numel() == ch.slot, "compressor '", codec.method, "' made payloads of ",
                    ch.slot - kTagBytes, " and ", p.numel() - kTagBytes, " bytes for segments of ",
                    ch.len, " elements: payload sizes must depend on the element count alone");
    } catch (...) {
      if (!is_plugin(method)) throw;
      failed = std::current_exception();
    }
    if (is_plugin(method)) check_payload_layout(env, codec.method, ch, g, in.device(), failed);
    at::Tensor buf = segments == 1 ? payloads[0] : at::cat(payloads);
    ch.recv = at::empty({world * ch.slot}, buf.options());
    if (all_to_all) {
      std::vector<int64_t> splits(world, ch.slot);
      ch.work = g.pg->alltoall_base(ch.recv, buf, splits, splits, c10d::AllToAllOptions());
    } else {
      ch.work = g.pg->_allgather_base(ch.recv, buf, c10d::AllgatherOptions());
    }
  };

  auto receive = [&](int64_t i) {
    PayloadChunk& ch = st[i];
    env.wait(ch.work);
    Span span(profile.decode_s);
    tags.push_back(tag_words(ch.recv, world, ch.slot));
    received(codec, ch);
    ch.recv = at::Tensor();
    ch.layout.clear();
  };

  run_pipeline(chunks, send, receive);
  return tags;
}

}  // namespace dist
}  // namespace pycomm
