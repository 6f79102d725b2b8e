"""The engine's fixed cost per call on a CPU: back-to-back keyed
``pd.all_reduce`` calls against plain Gloo's ``dist.all_reduce`` of the same
tensor, in the same process and the same rounds.

Each of ``--ranks`` local processes (Gloo over 127.0.0.1) makes, per round
and per contender, ``--calls`` synchronous calls one after another (no
barrier between them: what a loop of small all-reduces costs), and records
the mean time per call; the median over ``--rounds`` rounds (contenders in
rotated order each round, ``pycomm_bench.timing.time_interleaved``) is
reported, rank 0's, with its ratio to plain's
median. Every method runs on a group of its own (``pd.wrap``), one key per
size. ``<method>:queued`` is the same call made with ``async_op=True`` and
waited for at once: the engine's worker thread runs it, where a synchronous
call on a CPU runs on the caller's thread when the worker is idle, so the
two differ by the hand-off to the worker and back.

Example::

    $ python benchmarks/engine_per_call.py --ranks 1 --sizes 1024,65536
    $ python benchmarks/engine_per_call.py --ranks 2 --methods onebit,int8,topk --json out.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pycomm_bench.netem import free_port
from pycomm_bench.timing import time_interleaved
from tabulate import tabulate

METHODS = "onebit,int8,int4,topk,fp16,none"


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import pycomm.distributed as pd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {m: pd.wrap(None, compressor=m, min_compress_numel=1) for m in args.methods}
    out = {}
    for n in args.sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        calls = {"plain": lambda: dist.all_reduce(x)}
        for m, g in groups.items():
            calls[m] = lambda g=g: pd.all_reduce(x, key=n, group=g, op="avg")
            calls[f"{m}:queued"] = lambda g=g: pd.all_reduce(x, key=n, group=g, op="avg", async_op=True).wait()
        # One sample = `calls` calls back to back; ranks start each together.
        batches = {k: (lambda f=f: [f() for _ in range(args.calls)], dist.barrier) for k, f in calls.items()}
        samples = time_interleaved(batches, repeats=args.rounds, warmup=max(1, args.warmup // args.calls))
        per_call = {k: [t / args.calls for t in v] for k, v in samples.items()}
        out[n] = {k: statistics.median(v) for k, v in per_call.items()}
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--sizes", default="1024,65536")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per round and contender")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=200, help="calls per contender before the timed rounds")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--label", default="", help="recorded with the results (e.g. the build measured)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.methods = args.methods.split(",")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    out = queue.get()
    for pr in procs:
        pr.join()
    rows = []
    for n, times in out.items():
        for k, t in times.items():
            rows.append([n, k, t * 1e6, t / times["plain"]])
    print(f"back-to-back calls, {args.ranks} rank(s), median of {args.rounds} rounds of {args.calls} calls"
          + (f" ({args.label})" if args.label else ""))
    print(tabulate(rows, headers=["numel", "method", "us/call", "x plain"], floatfmt=".2f"))
    if args.json:
        doc = {"benchmark": "engine_per_call", "date": _dt.date.today().isoformat(), "host": platform.node(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "label": args.label,
               "command": "python benchmarks/engine_per_call.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "ranks": args.ranks, "calls": args.calls, "rounds": args.rounds,
               "records": [dict(numel=n, method=k, per_call_s=t, vs_plain=t / times["plain"])
                           for n, times in out.items() for k, t in times.items()]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
