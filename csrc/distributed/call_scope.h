// What every compressed call shares, whichever the collective: the flat
// float32 views it computes on.
#pragma once

#include <ATen/ATen.h>

namespace pycomm {
namespace dist {

// A call's input and output as flat, contiguous float32 tensors: views of
// the caller's when they are float32 and contiguous (`direct`), else
// copies (the input converted, the output a new buffer) written back by
// write_back. An in-place call (all-reduce) passes its tensor as both.
struct Float32Views {
  bool direct;
  at::Tensor in, out;

  Float32Views(const at::Tensor& input, const at::Tensor& output);
  // Writes `out` to `output` unless direct, and returns whether it is
  // finite there when `check` (a float32 result can still overflow a
  // 16-bit dtype); true otherwise.
  bool write_back(const at::Tensor& output, bool check) const;
};

}  // namespace dist
}  // namespace pycomm
