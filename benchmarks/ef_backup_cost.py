"""What the non-finite rollback adds to a compressed all-reduce with error
feedback: one copy of the residuals per call (docs/allreduce.md,
"Non-finite results"), timed next to the fused compress it precedes.

    python benchmarks/ef_backup_cost.py            # prints a table, one line per size

Interleaved rounds, medians; CPU, torch's default thread count. The
end-to-end effect is measured with ``python -m pycomm_bench allreduce``
(before and after the change); this script shows where it comes from.
"""

from __future__ import annotations

import sys

import torch

import pycomm  # noqa: F401 - registers torch.ops.pycomm
from pycomm_bench import fmt_number, median, table, time_interleaved

SIZES = (1 << 20, 1 << 22, 1 << 24)
ROUNDS = 31


def main() -> int:
    rows = []
    for n in SIZES:
        g = torch.randn(n)
        r = torch.randn(n) * 0.1
        backup = torch.empty_like(r)
        ops = {
            "onebit": (lambda: torch.ops.pycomm.onebit_compress(g, r, 2048), None),
            "topk": (lambda: torch.ops.pycomm.topk_compress(g, r, max(1, n // 100), True), None),
            "copy": (lambda: backup.copy_(r), None),
        }
        med = {k: median(v) for k, v in time_interleaved(ops, repeats=ROUNDS, warmup=1).items()}
        rows.append([n, fmt_number(med["onebit"] * 1e3), fmt_number(med["topk"] * 1e3), fmt_number(med["copy"] * 1e3),
                     f"{med['copy'] / med['onebit']:.0%}", f"{med['copy'] / med['topk']:.0%}"])
    print(table(rows, ["numel", "onebit compress ms", "topk compress ms", "backup copy ms", "copy/onebit",
                       "copy/topk"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
