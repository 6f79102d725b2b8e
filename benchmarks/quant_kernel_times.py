"""The int8/int4 CPU ops timed directly: compress with error feedback
(round to nearest, block 256) and accumulate-decompress of 16M float32,
one thread, median of 9 calls after 2 warm-ups.

    python benchmarks/quant_kernel_times.py [label]   # prints one dict of ms

Run it with two builds one after the other, alternating, to compare them.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pycomm  # noqa: F401 - registers torch.ops.pycomm

N = 1 << 24
BLOCK = 256


def median_ms(fn, repeats: int = 9, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(label: str = "") -> None:
    torch.set_num_threads(1)
    g = torch.randn(N, generator=torch.Generator().manual_seed(0))
    r = torch.zeros(N)
    out = torch.empty(N)
    res = {}
    for bits in (8, 4):
        data, scales = torch.ops.pycomm.quant_compress(g, r.clone(), bits, BLOCK, -1)
        res[f"int{bits} compress"] = median_ms(lambda: torch.ops.pycomm.quant_compress(g, r, bits, BLOCK, -1))
        res[f"int{bits} decompress_acc"] = median_ms(
            lambda: torch.ops.pycomm.quant_decompress(out, data, scales, bits, BLOCK, True))
    print(label, {k: round(v, 2) for k, v in res.items()})


if __name__ == "__main__":
    main(*sys.argv[1:2])
