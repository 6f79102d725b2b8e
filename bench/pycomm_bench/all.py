"""Every benchmark in turn: kernels, all-reduce, end-to-end DDP on the
language model, then DDP on the many-small-tensors model (where compression
is not expected to pay), then the hierarchical all-reduce on emulated nodes,
then FSDP2 on the language model. Each writes its own JSON (and plots) under
benchmarks/results/; ``--quick`` is passed on to each.

Example::

    $ pycomm-bench all            # about 25 minutes on a 2-core machine
    $ pycomm-bench all --quick    # a smoke run of each
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List

HELP = "run every benchmark: kernels, allreduce, ddp (language model), ddp (small tensors), hierarchy, fsdp"

#: (title, argv of pycomm-bench) in the order they run.
PARTS = [
    ("kernels", ["kernels"]),
    ("all-reduce", ["allreduce"]),
    ("DDP, language model", ["ddp"]),
    ("DDP, many small tensors", ["ddp", "--workload", "mlp", "--bandwidth", "100mbit,1gbit,none",
                                 "--methods", "allreduce,fp16,powersgd-4,onebit,topk-0.01"]),
    ("hierarchical all-reduce, 2 emulated nodes", ["hierarchy"]),
    ("FSDP2, language model", ["fsdp"]),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own: --quick, --threads and --no-progress are passed on."""


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.json is not None:
        raise ValueError("--json: each benchmark of 'all' writes its own file; run them one by one to choose")
    return args


def run(args: argparse.Namespace) -> int:
    from .cli import main

    common: List[str] = []
    if args.quick:
        common.append("--quick")
    if args.threads is not None:
        common += ["--threads", str(args.threads)]
    if not args.progress:
        common.append("--no-progress")
    status = 0
    for title, argv in PARTS:
        print(f"\n===== {title}: pycomm-bench {' '.join(argv + common)}", flush=True)
        t0 = time.monotonic()
        rc = main(argv[:1] + common + argv[1:])
        print(f"===== {title}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":  # pragma: no cover
    from .cli import main as _main

    sys.exit(_main(["all", *sys.argv[1:]]))
