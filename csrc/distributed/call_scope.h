// What every compressed call shares on the worker thread, whichever the
// collective: the collective it runs (for its check and its messages) and
// the flat float32 views it computes on.
#pragma once

#include <ATen/ATen.h>

namespace pycomm {
namespace dist {

// Sets the running collective (index into kCollectives) for a scope, and
// sets it back to the all-reduce's after.
class RunningCollective {
 public:
  RunningCollective(int& running, int collective) : running_(running), outer_(running) {
    running_ = collective;
  }
  ~RunningCollective() { running_ = outer_; }  // a stand-in runs inside a call
  RunningCollective(const RunningCollective&) = delete;
  RunningCollective& operator=(const RunningCollective&) = delete;

 private:
  int& running_;
  const int outer_;
};

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
