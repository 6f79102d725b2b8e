"""Test data and helpers shared by the compressor tests."""

from __future__ import annotations

import torch

import pycomm

SIZES = [1, 31, 32, 33, 2047, 2049, 4097, 1 << 20]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["random", "zeros", "negative", "nonfinite"]


def make_grad(kind: str, n: int, dtype=torch.float32, seed: int = 0, device="cpu") -> torch.Tensor:
    """Gradients of one kind: random (normal), zeros, negative, nonfinite
    (normal with NaN, +Inf and -Inf sprinkled in), heavy (Student-t, df=3)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(n, generator=gen)
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "negative":
        x = -torch.rand(n, generator=gen) - 1e-3
    elif kind == "nonfinite":
        x = torch.randn(n, generator=gen)
        for pos, val in ((0, float("nan")), (n // 3, float("inf")), (n // 2, float("-inf")), (n - 1, float("nan"))):
            x[pos] = val
    elif kind == "heavy":
        x = torch.distributions.StudentT(3.0).sample((n,))
    else:
        raise ValueError(kind)
    return x.to(dtype=dtype, device=device)


# Compiled implementations under test, with the device each runs on. Listed
# explicitly (not discovered) so that an extension that failed to build fails
# the tests instead of silently shrinking them. Triton has its own tests.
IMPL_DEVICES = [("cpu", "cpu")] + ([("cuda", "cuda")] if torch.cuda.is_available() else [])
