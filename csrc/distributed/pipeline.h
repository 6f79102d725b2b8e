// The chunk pipeline of every compressed collective: a call is cut into
// chunks, and each chunk goes through the same stages (compress and issue,
// wait and decode, ...), chunk i+1's compress running while chunk i is on
// the wire.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace pycomm {
namespace dist {

// Runs stage s of chunk t - s at step t, for every chunk (0 <= t - s <
// chunks), the stages of one step in order. With stages A, B, C: A0; A1 B0;
// A2 B1 C0; ...; then B(n-1) C(n-2); C(n-1). The issue order of the
// collectives therefore depends on the number of chunks alone, the same on
// every rank (Gloo and NCCL match collectives by the order they are issued
// in).
template <class... Stage>
void run_pipeline(int64_t chunks, Stage&&... stage) {
  constexpr int64_t depth = sizeof...(Stage);
  for (int64_t t = 0; t + 1 < chunks + depth; ++t) {
    int64_t s = 0;
    auto step = [&](auto& run) {
      if (const int64_t i = t - s++; i >= 0 && i < chunks) run(i);
    };
    (step(stage), ...);
  }
}

// The state of one chunk of a payload exchange: the elements it covers,
// the buffer it receives (`slot` bytes from each rank, its tag last) and
// the inner collective that fills it.
struct PayloadChunk {
  int64_t begin = 0, len = 0, slot = 0;
  at::Tensor recv;
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> layout;  // a registered compressor's payload, for decoding
};

}  // namespace dist
}  // namespace pycomm
