"""Test setup shared by the test suite and the docstring examples of the
library (pycomm/), the benchmark harness (bench/pycomm_bench/) and the
repository tools (tools/), all collected by the README's test command."""

import os

import torch

# Triton decides at import time whether to interpret: without a GPU, run its
# kernels on CPU tensors (small sizes only; it is slow).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
