"""What the non-finite rollback adds to a compressed all-reduce with error
feedback: one copy of the residuals per call (docs/allreduce.md,
"Non-finite results"), timed next to the fused compress it precedes.

    python benchmarks/ef_backup_cost.py            # prints a table, one line per size

Interleaved rounds, medians; CPU, torch's default thread count. The
end-to-end effect is measured with ``python -m pycomm.bench allreduce``
(before and after the change); this script shows where it comes from.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pycomm  # noqa: F401 - registers torch.ops.pycomm

SIZES = (1 << 20, 1 << 22, 1 << 24)
ROUNDS = 31


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    print(f"{'numel':>10} {'onebit compress':>16} {'topk compress':>14} {'backup copy':>12} "
          f"{'copy/onebit':>12} {'copy/topk':>10}")
    for n in SIZES:
        g = torch.randn(n)
        r = torch.randn(n) * 0.1
        backup = torch.empty_like(r)
        ops = {
            "onebit": lambda: torch.ops.pycomm.onebit_compress(g, r, 2048),
            "topk": lambda: torch.ops.pycomm.topk_compress(g, r, max(1, n // 100), True),
            "copy": lambda: backup.copy_(r),
        }
        times = {k: [] for k in ops}
        for name, fn in ops.items():  # warm-up
            fn()
        for _ in range(ROUNDS):
            for name, fn in ops.items():
                times[name].append(_time(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{n:>10} {med['onebit'] * 1e3:>13.2f} ms {med['topk'] * 1e3:>11.2f} ms "
              f"{med['copy'] * 1e3:>9.2f} ms {med['copy'] / med['onebit']:>11.0%} {med['copy'] / med['topk']:>9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
