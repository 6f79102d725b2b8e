// Cross-rank checks of compressed calls: the call check (a descriptor of
// each call compared across ranks), the call tags that end every payload,
// and the reading of a call's checks.
#include "call_check.h"

#include <string.h>

#include <sstream>

#include "backend.hpp"

namespace pycomm {
namespace dist {
namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(t);
  }
}

std::string field_value(int field, int64_t v) {
  switch (field) {
    case kDtype: return dtype_name(static_cast<at::ScalarType>(v));
    case kOp: return v ? "avg" : "sum";
    case kKey: return v < 0 ? "None" : std::to_string(v);
    case kNumel: return v == kRefusedNumel ? "a call it refused" : std::to_string(v);
    case kMethod:
      if (v >= kPluginCode) return "registered compressor #" + std::to_string(v - kPluginCode);
      return v >= 0 && v < kNumMethods ? kMethods[v] : "?";
    case kDensity: {
      double d;
      memcpy(&d, &v, sizeof(d));
      std::ostringstream o;
      o << d;
      return o.str();
    }
    case kApprox: return v ? "True" : "False";
    case kCollective: return v >= 0 && v < kNumCollectives ? kCollectives[v] : "?";
    case kRounding: return v < 0 ? "nearest" : "stochastic, seed " + std::to_string(v);
    case kDevice: return c10::DeviceTypeName(static_cast<c10::DeviceType>(v), true);
    default: return std::to_string(v);
  }
}

// The values of 0-dim bool tensors of one device, read together: one
// host synchronization on an accelerator, whatever their number.
std::vector<bool> read_flags(const std::vector<at::Tensor>& flags) {
  if (flags.empty()) return {};
  const at::Tensor host = at::stack(flags).to(at::kCPU);
  const bool* p = host.const_data_ptr<bool>();
  return std::vector<bool>(p, p + host.numel());
}

}  // namespace

void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const c10::DistBackendError& e) {
    C10_THROW_ERROR(DistBackendError, context + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, context, e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, context, e.what());
  }
  TORCH_CHECK(false, context, "unknown exception");
}

bool all_finite(const std::vector<at::Tensor>& sums, const at::Tensor& t) {
  if (sums.empty() || at::isfinite(at::stack(sums)).all().item<bool>()) return true;
  return at::isfinite(t).all().item<bool>();
}

std::string CompressedBackend::describe_call(const Call& call, const at::Tensor& tensor) const {
  std::ostringstream o;
  o << kCollectives[call.collective] << " key="
    << (call.key ? std::to_string(*call.key) : "None") << " " << tensor.numel() << " "
    << dtype_name(tensor.scalar_type()) << " " << call.method << " "
    << (call.average ? "avg" : "sum");
  return o.str();
}

void CompressedBackend::check_call(const Call& call, const at::Tensor& tensor, bool refused) {
  if (config_.check_calls == 0 || call.standing_in) return;
  Span span(profile_.check_s);
  const std::optional<int64_t> key = call.key;
  const bool average = call.average;
  const std::string& method = call.method;
  const int64_t numel = tensor.numel();
  const int dtype = static_cast<int>(tensor.scalar_type());
  const auto signature = std::make_tuple(numel, dtype + 256 * call.collective, average);
  auto this_call = [&] {
    return CallRecord{call.collective, numel, tensor.scalar_type(), average, method,
                      tensor.device()};
  };
  if (config_.check_calls == 1) {
    if (!key) {
      if (checked_signatures_.count(signature) > 0) return;
    } else if (auto it = checked_keys_.find(*key); it != checked_keys_.end()) {
      const CallRecord first = it->second, now = this_call();
      if (!refused && first == now) return;
      stand_in(*key, first);
      TORCH_CHECK(refused, "error-feedback key ", *key, " was first used for ",
                  describe_record(first), " on every rank, and this call is ",
                  describe_record(now),
                  ": a key's calls must keep its collective, size, dtype, op and compressor. "
                  "Use another key, or reset_error_feedback(", *key,
                  ") on every rank first. Every rank raises.");
      TORCH_CHECK(false, "every rank raises (the call of key ", *key, " was stopped on each)");
    }
  }
  int64_t density_bits;
  memcpy(&density_bits, &config_.density, sizeof(density_bits));
  std::vector<int64_t> mine(kFields);
  mine[kNumel] = refused ? kRefusedNumel : numel;  // never equal to a peer's valid call
  mine[kDtype] = dtype;
  mine[kOp] = average;
  mine[kKey] = key ? *key : -1;
  mine[kMethod] = is_plugin(method) ? plugin_code(method, config_.plugin_options) : method_code(method);
  mine[kChunk] = config_.chunk_numel;
  mine[kBlock] = block_for(method);
  mine[kDensity] = density_bits;
  mine[kApprox] = config_.approx;
  mine[kDevice] = static_cast<int64_t>(tensor.device().type());
  mine[kCollective] = call.collective;
  mine[kRounding] = method_rounds(method) ? config_.rounding_seed : -1;
  const int world = getSize();
  const auto opts = tensor.options().dtype(at::kLong);
  at::Tensor in = at::tensor(mine, at::kLong).to(tensor.device());
  at::Tensor out = at::empty({world * kFields}, opts);
  ++profile_.collectives;  // its wait counts as the check's, not the wire's
  wait_inner(inner_->_allgather_base(out, in, c10d::AllgatherOptions()));
  const at::Tensor all = out.cpu().view({world, kFields});
  const int64_t* a = all.data_ptr<int64_t>();
  auto same = [&](int f) {
    for (int r = 1; r < world; ++r)
      if (a[r * kFields + f] != a[f]) return false;
    return true;
  };
  // Another compressor has other settings anyway: then name it alone.
  const bool same_method = same(kMethod);
  std::ostringstream diffs;
  for (int f = 0; f < kFields; ++f) {
    if (same(f) || (!same_method && f != kMethod)) continue;
    diffs << (diffs.tellp() > 0 ? "; " : "") << kFieldNames[f] << " (";
    for (int r = 0; r < world; ++r)
      diffs << (r ? ", " : "") << "rank " << r << ": " << field_value(f, a[r * kFields + f]);
    diffs << ")";
  }
  TORCH_CHECK(diffs.tellp() == 0,
              "ranks called the compressed ", kCollectives[call.collective],
              " with different arguments: ", diffs.str(),
              ". Every rank must make the same compressed calls in the same order with the same "
              "settings (checked at the first use of each key and of each keyless "
              "(numel, dtype, op); PYCOMM_DEBUG=detail checks every call)");
  if (refused) return;  // every rank refused alike: nothing to remember
  if (key) {
    checked_keys_.insert_or_assign(*key, this_call());
  } else {
    checked_signatures_.insert(signature);
  }
}

std::string CompressedBackend::describe_record(const CallRecord& r) const {
  std::ostringstream o;
  const char* name = kCollectives[r.collective];
  o << (name[0] == 'a' ? "an " : "a ") << name << " of " << r.numel << " " << dtype_name(r.dtype)
    << " elements on " << r.device.type() << " (" << r.method << ", "
    << (r.average ? "avg" : "sum") << ")";
  return o.str();
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
  o << ": " << describe_call(call, tensor) << " failed: ";
  return o.str();
}

void CompressedBackend::set_tag(Call& call, const at::Tensor& tensor) {
  // A stand-in's tag: each rank's differs from every call's, its own too.
  const int64_t numel = call.standing_in ? kRefusedNumel - getRank() : tensor.numel();
  const uint64_t h = call_tag(call.collective, call.key ? *call.key : -1, numel,
                              static_cast<int>(tensor.scalar_type()), call.average);
  int32_t words[kTagWords];
  static_assert(sizeof(words) == sizeof(h), "a tag is 64 bits");
  memcpy(words, &h, sizeof(h));
  // Each tag is made once per device, not every call (on an accelerator a
  // blocking host-to-device copy; on a CPU a tensor made each call). Keyless
  // calls of many sizes could grow the cache without bound: it starts over
  // past a few thousand tags.
  auto where = std::make_pair(h, tensor.device().str());
  auto it = device_tags_.find(where);
  if (it == device_tags_.end()) {
    if (device_tags_.size() >= 4096) device_tags_.clear();
    at::Tensor t =
        at::tensor(std::vector<int32_t>(words, words + kTagWords), at::kInt).to(tensor.device());
    it = device_tags_.emplace(where, t).first;
  }
  call.tag = it->second;
}

at::Tensor CompressedBackend::tag_words(const at::Tensor& buf, int world, int64_t slot) const {
  const int64_t t = buf.scalar_type() == at::kByte ? kTagBytes : kTagWords;
  return buf.view({world, slot}).narrow(1, slot - t, t);
}

at::Tensor CompressedBackend::tags_ok(const Call& call,
                                      const std::vector<at::Tensor>& words) const {
  const at::Tensor& tag = call.tag;
  if (words.empty()) return at::ones({}, tag.options().dtype(at::kBool));
  if (tag.is_cpu()) {
    // On a CPU a comparison in place: each view is [ranks, tag] rows of a
    // received buffer, a tag's bytes apart from the next.
    const auto* want = static_cast<const char*>(tag.const_data_ptr());
    bool ok = true;
    for (const at::Tensor& w : words) {
      const auto* row = static_cast<const char*>(w.const_data_ptr());
      const int64_t step = w.stride(0) * w.element_size();
      for (int64_t r = 0; r < w.size(0) && ok; ++r)
        ok = memcmp(row + r * step, want, kTagBytes) == 0;
    }
    return at::scalar_tensor(ok, at::kBool);
  }
  const at::Tensor all = at::cat(words);
  return all.eq(all.scalar_type() == at::kByte ? tag.view(at::kByte) : tag).all();
}

void CompressedBackend::require_tags(bool ok) const {
  TORCH_CHECK(ok,
              "the ranks ran different compressed calls at the same position (another key, "
              "size, dtype or op: the payloads' call tags differ; or a rank refused its call, "
              "and its error says why): the output holds no valid result (it may have been "
              "written) and the residuals are as before the call. The engine runs each rank's "
              "calls in the order "
              "they were submitted: calls submitted from several threads must reach it in the "
              "same order on every rank (issue the compressed calls of a group from one thread; "
              "check_calls=\"every\" names the difference)");
}

void CompressedBackend::require_tags(const Call& call, const std::vector<at::Tensor>& words) {
  require_tags(read_checks({tags_ok(call, words)})[0]);
}

std::vector<bool> CompressedBackend::read_checks(const std::vector<at::Tensor>& checks) {
  Span span(profile_.sync_s);
  return read_flags(checks);
}

bool CompressedBackend::checked_finite(const Call& call, const std::vector<at::Tensor>& words,
                                       const std::vector<at::Tensor>& sums, const at::Tensor& t) {
  std::vector<at::Tensor> checks;
  {
    Span span(profile_.decode_s);
    checks.push_back(tags_ok(call, words));
    if (!sums.empty()) checks.push_back(at::isfinite(at::stack(sums)).all());
  }
  const std::vector<bool> ok = read_checks(checks);
  require_tags(ok[0]);
  // A sum is finite only if every term is; the exact check only when the
  // sum itself is not (an overflow of finite values, or a non-finite one).
  return sums.empty() || ok[1] || at::isfinite(t).all().item<bool>();
}

}  // namespace dist
}  // namespace pycomm
