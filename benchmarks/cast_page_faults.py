"""What a large 16-bit all-reduce on a CPU pays in page faults: one Gloo
rank (the wire moves nothing), a 25 MB tensor, fp16 (or bf16) called
synchronously (on the caller's thread) and queued (``async_op=True`` and
waited: the engine's worker thread), between calls of two other pycomm
groups (onebit, int8) on tensors of their own, as in
``pycomm-bench allreduce --per-call``. Prints, per contender, the median
time per call and the minor page faults per call (``getrusage``): a call
whose buffers the allocator handed back to the system faults them in
afresh (docs/performance.md, "Memory the engine keeps").

    python benchmarks/cast_page_faults.py            # fp16
    python benchmarks/cast_page_faults.py bf16 --rounds 21

Interleaved rounds (rotated order), medians; CPU, torch's default thread
count.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist

import pycomm.distributed as pd
from pycomm.distributed import spec
from pycomm_bench import fmt_number, median, table

NUMEL = 25 * 2**20 // 4  # a DDP bucket of 25 MB
OTHERS = spec.BLOCK_METHODS[:2]  # the groups whose calls come in between: onebit, int8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", nargs="?", default="fp16", choices=spec.CAST_METHODS)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--calls", type=int, default=2, help="calls per contender and round (default 2)")
    a = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        groups = {m: pd.wrap(None, compressor=m, min_compress_numel=1) for m in (a.method, *OTHERS)}
        x = {k: torch.randn(NUMEL) for k in ("sync", "queued", *OTHERS)}
        calls = {
            a.method: lambda: pd.all_reduce(x["sync"], key=1, group=groups[a.method], op="avg"),
            f"{a.method}:queued": lambda: pd.all_reduce(x["queued"], key=1, group=groups[a.method], op="avg",
                                                        async_op=True).wait(),
            **{m: (lambda m=m: pd.all_reduce(x[m], key=1, group=groups[m], op="avg")) for m in OTHERS},
        }
        for f in calls.values():  # warm-up: every buffer a call keeps exists
            f(), f()
        names = list(calls)
        ms = {k: [] for k in names}
        faults = {k: [] for k in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                for _ in range(a.calls):
                    calls[name]()
                ms[name].append(1e3 * (time.perf_counter() - t0) / a.calls)
                faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / a.calls)
        print(table([[k, fmt_number(median(ms[k])), fmt_number(median(faults[k]))] for k in names],
                    ["call (25 MB, 1 rank)", "ms per call", "minor faults per call"]))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
