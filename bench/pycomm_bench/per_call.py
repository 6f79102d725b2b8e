"""``pycomm-bench allreduce --per-call``: the engine's cost per call beside
plain Gloo's, for small tensors and a DDP bucket, on local CPU ranks.

Each rank makes, per round and per contender, ``--calls`` synchronous calls
one after another, without a barrier between them (what a loop of small
all-reduces costs; on a CPU the caller waits for each, so its time per call
is the host time per call), and records the mean time per call; the median
over the rounds (``--repeats``, contenders in rotated order each round,
:func:`pycomm_bench.timing.time_interleaved`) is reported, rank 0's, with its
ratio to plain Gloo's ``dist.all_reduce`` of the same size. Each contender
calls on a tensor of its own (the same random start), so its input is its
own last output, as in a loop of that method alone. Every method runs
keyed (``pd.all_reduce(x, key=..., op="avg")``, error feedback where
the method keeps residuals) on a pycomm group of its own (``pd.wrap``,
``min_compress_numel=1``). ``<method>:queued`` is the same call made with
``async_op=True`` and waited for at once: the engine's worker thread runs it
(the DDP hook's path), where a synchronous call on a CPU runs on the
caller's thread when the worker is idle, so the two differ by the hand-off.
One rank (``--ranks 1``) isolates the engine's own cost: the inner
collectives move nothing there.

Example::

    $ pycomm-bench allreduce --per-call --ranks 1 --sizes 1k,64k,6400k
    $ pycomm-bench allreduce --per-call --ranks 2 --methods plain,onebit,int8,topk-0.01 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import time
from typing import Any, Dict, List

from .launch import Rank, run_each_world
from .methods import PLAIN, parse_method
from .report import finish, fmt_number, gloo_document, machine_info, progress_bar, record_events, size_label, table
from .timing import time_interleaved

#: 1K and 64K elements (small all-reduces) and a 25 MB bucket (DDP's default).
DEFAULT_SIZES = (1 << 10, 1 << 16, 25 * 2 ** 20 // 4)
DEFAULT_METHODS = ("plain", "fp16", "onebit", "int8", "int4", "topk-0.01")
DEFAULT_RANKS = (1,)
DEFAULT_CALLS = 200  # back-to-back calls per round and contender (fewer for big tensors)
QUEUED = ":queued"


def calls_for(numel: int, calls: int) -> int:
    """Back-to-back calls per round at ``numel`` elements: ``calls``, fewer
    for big tensors (about 2^24 elements per round and contender, at least 2).

    >>> calls_for(1024, 200), calls_for(6553600, 200)
    (200, 2)
    """
    return max(2, min(calls, (1 << 24) // max(1, numel)))


def _rank_main(rank: Rank) -> None:
    """One rank: every size, every contender, in interleaved rounds."""
    import torch
    import torch.distributed as dist

    import pycomm.distributed as pd

    cfg = rank.cfg
    methods = [parse_method(m) for m in cfg["methods"]]
    groups = {}
    for m in methods:
        if m.compressed:
            settings = {"density": m.density} if m.density is not None else {}
            groups[m.name] = pd.wrap(None, compressor=m.compressor, min_compress_numel=1, **settings)
    for n in cfg["sizes"]:
        calls = calls_for(n, cfg["calls"])
        contenders = {}
        for m in methods:
            # A tensor per contender: each call's input is what the same
            # contender's last call left there, never another method's output
            # (a quantized or sparse tensor, full of ties, is not a gradient).
            x = torch.randn(n, generator=torch.Generator().manual_seed(rank.rank))
            if m.name in groups:
                g, y = groups[m.name], x.clone()
                contenders[m.name] = lambda g=g, x=x: pd.all_reduce(x, key=n, group=g, op="avg")
                contenders[m.name + QUEUED] = lambda g=g, y=y: pd.all_reduce(y, key=n, group=g, op="avg",
                                                                             async_op=True).wait()
            else:
                contenders[m.name] = lambda x=x: dist.all_reduce(x)
        # One sample = `calls` calls back to back; the ranks start each together.
        batches = {k: (lambda f=f: [f() for _ in range(calls)], dist.barrier) for k, f in contenders.items()}
        samples = time_interleaved(batches, repeats=cfg["repeats"], warmup=max(1, cfg["warmup"]),
                                   on_call=lambda _: rank.emit("tick", n=calls))
        if rank.rank == 0:
            rank.emit("records", records=[
                {"ranks": rank.world, "numel": n, "method": k, "calls": calls,
                 "per_call_s": [t / calls for t in v]} for k, v in samples.items()])
        gc.collect()
    dist.barrier()


def run_per_call(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the section for ``args`` (resolved by ``allreduce.resolve_args``)
    and return its JSON document (``records``: median seconds per call and
    the ratio to plain's of the same ranks and size)."""
    from statistics import median

    started = _dt.datetime.now().isoformat(timespec="seconds")
    t_start = time.monotonic()
    machine = machine_info("cpu")
    names = [m for m in args.methods]
    contenders = sum(2 if parse_method(m).compressed else 1 for m in names)
    rounds = args.warmup + args.repeats
    total = sum(contenders * rounds * calls_for(n, args.calls) for n in args.sizes) * len(args.ranks)
    records: List[Dict[str, Any]] = []
    failures: List[Dict[str, Any]] = []
    bar = progress_bar(total, "call", args.progress)

    on_event = record_events(bar, records)

    cfg = dict(methods=names, sizes=args.sizes, repeats=args.repeats, warmup=args.warmup, calls=args.calls)
    try:
        run_each_world(_rank_main, args, cfg, records, failures, on_event)
    finally:
        bar.close()
    for r in records:
        r["median_s"] = median(r["per_call_s"])
    plain = {(r["ranks"], r["numel"]): r["median_s"] for r in records if r["method"] == PLAIN}
    for r in records:
        base = plain.get((r["ranks"], r["numel"]))
        r["vs_plain"] = r["median_s"] / base if base else None
    return gloo_document("allreduce-per-call", started, machine, args, t_start, records, failures, methods=names,
                         calls=args.calls)


def format_table(doc: Dict[str, Any]) -> str:
    """The section's table: microseconds per call, and x plain."""
    rows = [[r["ranks"], size_label(r["numel"]), r["method"], r["calls"], fmt_number(r["median_s"] * 1e6),
             fmt_number(r["vs_plain"]) if r["vs_plain"] is not None else "-"] for r in doc["records"]]
    head = (f"pycomm allreduce, per call: back-to-back keyed calls (op avg) against plain Gloo, median of "
            f"{doc['repeats']} rounds (rank 0); :queued = async_op=True and waited, through the worker\n")
    out = head + table(rows, ["W", "numel", "method", "calls/round", "us/call", "x plain"])
    for f in doc["failures"]:
        out += f"\nFAILED W={f['ranks']}: {f['error'].strip().splitlines()[-1]}"
    return out


def run(args: argparse.Namespace) -> int:
    """Run, print the table, write the JSON. Exit status 1 if a world size failed."""
    t0 = time.monotonic()
    doc = run_per_call(args)
    return finish(doc, args.json, format_table(doc), [f"{f['ranks']} ranks: {f['error']}" for f in doc["failures"]],
                  t0)
