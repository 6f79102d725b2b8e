// Cross-rank checks of compressed calls: the call check (a descriptor of
// each call compared across ranks), the call tags that end every payload,
// and the reading of a call's checks.
#include "call_check.h"

#include <string.h>

#include <sstream>

#include "codecs.h"
#include "spec.h"

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

}  // namespace

std::vector<bool> read_flags(const std::vector<at::Tensor>& flags) {
  if (flags.empty()) return {};
  bool on_cpu = true;
  for (const at::Tensor& f : flags) on_cpu = on_cpu && f.is_cpu();
  if (on_cpu) {  // read where they are: a stack would cost more than the reads
    std::vector<bool> out;
    for (const at::Tensor& f : flags) out.push_back(*f.const_data_ptr<bool>());
    return out;
  }
  // On an accelerator, one copy to the host for all of them.
  const at::Tensor host = at::stack(flags).to(at::kCPU);
  const bool* p = host.const_data_ptr<bool>();
  return std::vector<bool>(p, p + host.numel());
}

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

// ------------------------------------------------------------ CallChecker ---
CallRecord CallChecker::record(const Call& call, const at::Tensor& tensor) {
  return CallRecord{call.collective, tensor.numel(), tensor.scalar_type(), call.average,
                    call.method, tensor.device()};
}

std::string CallChecker::describe(const Call& call, const at::Tensor& tensor) {
  std::ostringstream o;
  o << kCollectives[call.collective] << " key="
    << (call.key ? std::to_string(*call.key) : "None") << " " << tensor.numel() << " "
    << dtype_name(tensor.scalar_type()) << " " << call.method << " "
    << (call.average ? "avg" : "sum");
  return o.str();
}

std::string CallChecker::describe(const CallRecord& r) {
  std::ostringstream o;
  const char* name = kCollectives[r.collective];
  o << (name[0] == 'a' ? "an " : "a ") << name << " of " << r.numel << " " << dtype_name(r.dtype)
    << " elements on " << r.device.type() << " (" << r.method << ", "
    << (r.average ? "avg" : "sum") << ")";
  return o.str();
}

namespace {

// A keyless call's signature: calls alike in it are compared once.
std::tuple<int64_t, int, bool> signature(const Call& call, const at::Tensor& tensor) {
  return std::make_tuple(tensor.numel(),
                         static_cast<int>(tensor.scalar_type()) + 256 * call.collective,
                         call.average);
}

}  // namespace

CallChecker::Need CallChecker::need(const Call& call, const at::Tensor& tensor, bool refused,
                                    std::optional<CallRecord>* first) const {
  if (config_.check_calls == 0 || call.standing_in) return Need::kNothing;
  if (config_.check_calls == 1) {
    if (!call.key) {
      if (signatures_.count(signature(call, tensor)) > 0) return Need::kNothing;
    } else if (auto it = keys_.find(*call.key); it != keys_.end()) {
      if (!refused && it->second == record(call, tensor)) return Need::kNothing;
      *first = it->second;
      return Need::kStandIn;
    }
  }
  return Need::kExchange;
}

void CallChecker::changed(int64_t key, const CallRecord& first, const CallRecord& now,
                          bool refused) {
  TORCH_CHECK(refused, "error-feedback key ", key, " was first used for ", describe(first),
              " on every rank, and this call is ", describe(now),
              ": a key's calls must keep its collective, size, dtype, op and compressor. "
              "Use another key, or reset_error_feedback(", key,
              ") on every rank first. Every rank raises.");
  TORCH_CHECK(false, "every rank raises (the call of key ", key, " was stopped on each)");
}

void CallChecker::exchange(c10d::Backend* pg, const Call& call, const at::Tensor& tensor,
                           bool refused, c10::Device device,
                           const std::function<void(const c10::intrusive_ptr<c10d::Work>&)>& wait) {
  const std::string& method = call.method;
  int64_t density_bits;
  memcpy(&density_bits, &config_.density, sizeof(density_bits));
  std::vector<int64_t> mine(kFields);
  mine[kNumel] = refused ? kRefusedNumel : tensor.numel();  // never equal to a peer's valid call
  mine[kDtype] = static_cast<int>(tensor.scalar_type());
  mine[kOp] = call.average;
  mine[kKey] = call.key ? *call.key : -1;
  mine[kMethod] = is_plugin(method) ? plugin_code(method, config_.plugin_options) : method_code(method);
  mine[kChunk] = config_.chunk_numel;
  mine[kBlock] = block_for(config_, method);
  mine[kDensity] = density_bits;
  mine[kApprox] = config_.approx;
  mine[kDevice] = static_cast<int64_t>(tensor.device().type());
  mine[kCollective] = call.collective;
  mine[kRounding] = method_rounds(method) ? config_.rounding_seed : -1;
  const int world = world_;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor in = at::tensor(mine, at::kLong).to(device);
  at::Tensor out = at::empty({world * kFields}, opts);
  wait(pg->_allgather_base(out, in, c10d::AllgatherOptions()));
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
  if (call.key) {
    keys_.insert_or_assign(*call.key, record(call, tensor));
  } else {
    signatures_.insert(signature(call, tensor));
  }
}

void CallChecker::forget(std::optional<int64_t> key) {
  if (key.has_value()) {
    keys_.erase(*key);
  } else {
    keys_.clear();
  }
}

at::Tensor CallChecker::tag(const Call& call, const at::Tensor& tensor) {
  // A stand-in's tag: each rank's differs from every call's, its own too.
  const int64_t numel = call.standing_in ? kRefusedNumel - rank_ : tensor.numel();
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
  return it->second;
}

// ------------------------------------------------------------------ tags ---
at::Tensor tag_words(const at::Tensor& buf, int world, int64_t slot) {
  const int64_t t = buf.scalar_type() == at::kByte ? kTagBytes : kTagWords;
  // One view (a call's ops cost more than its small tensors' bytes).
  TORCH_INTERNAL_ASSERT(buf.is_contiguous() && buf.numel() == world * slot);
  return buf.as_strided({world, t}, {slot, 1}, buf.storage_offset() + slot - t);
}

bool cpu_tags_ok(const at::Tensor& tag, const std::vector<at::Tensor>& words) {
  // Each view is [ranks, tag] rows of a received buffer, a tag's bytes apart
  // from the next.
  const auto* want = static_cast<const char*>(tag.const_data_ptr());
  for (const at::Tensor& w : words) {
    const auto* row = static_cast<const char*>(w.const_data_ptr());
    const int64_t step = w.stride(0) * w.element_size();
    for (int64_t r = 0; r < w.size(0); ++r)
      if (memcmp(row + r * step, want, kTagBytes) != 0) return false;
  }
  return true;
}

at::Tensor tags_ok(const at::Tensor& tag, const std::vector<at::Tensor>& words) {
  if (words.empty()) return at::ones({}, tag.options().dtype(at::kBool));
  if (tag.is_cpu()) return at::scalar_tensor(cpu_tags_ok(tag, words), at::kBool);
  const at::Tensor all = at::cat(words);
  return all.eq(all.scalar_type() == at::kByte ? tag.view(at::kByte) : tag).all();
}

void require_tags(bool ok) {
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

}  // namespace dist
}  // namespace pycomm
