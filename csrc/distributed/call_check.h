// Cross-rank checks of compressed calls (docs/reliability.md): the call
// descriptor ranks compare, the call tags every payload ends with, and
// whether a result is finite.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace pycomm {
namespace dist {

// Rethrows the exception being handled with `context` in front of its
// message, keeping a DistBackendError one (callers tell them apart).
[[noreturn]] void rethrow_with_context(const std::string& context);

// Whether every element is finite: one vectorized read (a sum is finite
// only if every term is); the exact check only when the sum itself
// overflows. `sums`: float32 sums of parts of `t`, taken on the way.
bool all_finite(const std::vector<at::Tensor>& sums, const at::Tensor& t);

}  // namespace dist
}  // namespace pycomm
