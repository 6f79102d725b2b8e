"""End-to-end FSDP2 benchmark: the benchmark's GPT sharded with
``fully_shard`` (each transformer block and the root) on W CPU ranks over
Gloo, plain FSDP2 against FSDP2's own bf16 reduce and pycomm.fsdp's
compressed reduce-scatter (and weight all-gather).

Methods (``--methods``), side by side in the same rank processes (same seed,
same batches, AdamW):

* ``plain``: FSDP2 as is (float32 reduce-scatter and all-gather);
* ``bf16``: FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
  (gradients reduce-scattered in bf16, compute in float32);
* ``C``, each of :data:`COMPRESSORS` (e.g. ``int8``):
  :func:`pycomm.fsdp.compress` with that compressor and its default
  settings (no error feedback, buffers below ``min_compress_numel`` exact);
* ``C-weights``: the same with ``weights=`` that compressor (the parameter
  all-gather compressed too);
* ``C-ef``: C's gradients with error feedback (a float32 residual of each
  module's unsharded gradient and its rollback buffer: ``residual_bytes``
  in the record, and in the peak memory).

Links are emulated as in ``pycomm-bench ddp`` (:mod:`pycomm_bench.netem`:
one namespace per rank, tbf-shaped; loopback without root, labelled so).
Every method trains ``--steps`` steps per seed (``--seeds``); the first
``--warmup`` steps are untimed. Per (method, bandwidth) the JSON record
holds the median and p10/p90 step time (max over ranks per step), the bytes
sent per rank per step (counted on each rank's interface; on loopback the
shared ``lo`` count divided by the ranks), the peak resident memory per
rank during the training steps (below), the held-out loss of the trained
model (the full parameters gathered into an unsharded copy, evaluated on
the same batches as ``pycomm-bench ddp``'s ``final_loss``) and the ratios
to ``plain`` and ``bf16``; PNG plots next to the JSON (as ``pycomm-bench
ddp``'s: step time vs bandwidth, loss vs steps and vs seconds).

Peak memory: the process's resident-set high-water mark (``VmHWM``), reset
through ``/proc/self/clear_refs`` (Linux) after the method's model and
optimizer are built and read after its last step; ``peak_rss_bytes`` is
that peak (the largest over ranks) and ``peak_rss_increase_bytes`` the
peak minus the resident size at the reset. It counts everything the
process touches (the interpreter, torch, freed memory glibc has not
returned, the Gloo buffers), not tensors alone; where ``clear_refs`` cannot
be written it falls back to ``getrusage`` ``ru_maxrss``, the peak of the
whole process lifetime (``memory_measure`` says which).

Example::

    $ pycomm-bench fsdp --quick
    $ pycomm-bench fsdp --ranks 4 --bandwidth 1gbit --steps 30 --seeds 1
    $ pycomm-bench fsdp --ranks 2 --model tiny --bandwidth none --no-netns --steps 6
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from pycomm.distributed import spec

from .launch import Rank, RanksFailed
from .methods import PLAIN
from .report import fail, finish, fmt_number, machine_info, progress_bar, table
from .sweep import (DEFAULT_LR, EVAL_RANK, FINAL_LOSS_WINDOW, add_sweep_options, error_feedback_suffix,
                    eval_batch_fn, mean, parse_bandwidths, per_rank_bytes, set_lr, train_at, with_baseline, workload,
                    write_plots)
from .sweep import combine_seeds as combine_seed_records
from .timing import summarize

HELP = "end-to-end FSDP2 training on emulated slow links: pycomm.fsdp's block codecs vs plain and bf16 reduce"

#: The block codecs pycomm.fsdp runs without error feedback unless asked
#: (those whose row does not turn it on): each is a method, with
#: ``-weights`` (the parameter all-gather compressed too) and ``-ef`` (error
#: feedback on).
COMPRESSORS = tuple(m for m in spec.BLOCK_METHODS if not spec.method_spec(m).error_feedback)
#: FSDP2's own reduce in a narrower float: MixedPrecisionPolicy(reduce_dtype=bfloat16).
REDUCE_CAST = "bf16"
#: method -> (pycomm compressor or None, weights compressor or None, FSDP2 reduce dtype or None)
METHODS: Dict[str, Tuple[Optional[str], Optional[str], Optional[str]]] = {
    PLAIN: (None, None, None),
    REDUCE_CAST: (None, None, str(spec.method_spec(REDUCE_CAST).dtype).replace("torch.", "")),
    **{c: (c, None, None) for c in COMPRESSORS},
    **{f"{c}-weights": (c, c, None) for c in COMPRESSORS},
    **{f"{c}-ef": (c, None, None) for c in COMPRESSORS},
}
#: Methods that turn error feedback on (the residuals' memory shows in the peak).
EF_METHODS = tuple(f"{c}-ef" for c in COMPRESSORS)
DEFAULT_METHODS = ["plain", "bf16", "int8", "int4", "int8-weights"]
DEFAULT_BANDWIDTHS = ["1gbit"]
DEFAULT_STEPS = 60
QUICK_STEPS = 12
DEFAULT_WARMUP = 3
QUICK_WARMUP = 2
#: Per-seed fields, kept in each record's ``per_seed`` list.
PER_SEED_FIELDS = ("seed", "final_loss", "train_loss_last", "step_time_median_s", "bytes_sent_per_rank_per_step",
                   "bytes_sent_per_rank_per_step_all_steps", "peak_rss_bytes", "peak_rss_increase_bytes",
                   "loss_per_step", "step_times_s")


# --------------------------------------------------------------------------- rank side


def _vm_status(field: str) -> Optional[int]:
    """``VmHWM`` / ``VmRSS`` of this process in bytes (None off Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> Tuple[str, int]:
    """Return what is measured and the resident bytes now, after resetting
    the high-water mark where the kernel allows it (memory freed by earlier
    methods handed back to the OS first, so it does not count here)."""
    import ctypes
    import resource

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        now = _vm_status("VmRSS")
        if now is not None:
            return "VmHWM", now
    except OSError:
        pass
    return "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss(measure: str) -> int:
    import resource

    if measure == "VmHWM":
        return _vm_status("VmHWM") or 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _setup(cfg: Dict[str, Any], method: str, seed: int):
    """(FSDP model, optimizer, loss_fn, batch_fn, FSDPCompression or None)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compressor, weights, reduce_dtype = METHODS[method]
    model, batch_fn, loss_fn = workload(cfg, seed)
    kw = {}
    if reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype))
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    comp = None
    if compressor is not None:
        import pycomm.fsdp

        settings = {"error_feedback": True} if method in EF_METHODS else {}
        if cfg.get("min_compress_numel") is not None:
            settings["min_compress_numel"] = cfg["min_compress_numel"]
        comp = pycomm.fsdp.compress(model, compressor, weights=weights, **settings)
    # Unfused: torch's fused CPU AdamW does not take FSDP2's DTensor parameters everywhere.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, foreach=True)
    return model, opt, loss_fn, batch_fn, comp


def _full_model(cfg: Dict[str, Any], model, seed: int):
    """An unsharded float32 copy of the trained FSDP ``model`` (collective:
    every rank gathers every parameter)."""
    from torch.distributed.tensor import DTensor

    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model.state_dict().items()}
    plain, _, _ = workload(cfg, seed)
    plain.load_state_dict(full)
    return plain


def _warm_up(rank: Rank, steps: int = 2) -> None:
    """A few discarded steps of plain FSDP2 before any method is measured:
    the process's first FSDP run pays one-time costs (lazy initialization,
    the allocator's growth) that would otherwise land on the first method."""
    model, opt, loss_fn, batch_fn, _ = _setup(rank.cfg, PLAIN, rank.cfg["seed"])
    for step in range(steps):
        loss_fn(model, batch_fn(rank.rank, step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del model, opt


def _train(rank: Rank, method: str, seed: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    cfg = rank.cfg
    steps, timed_from = cfg["steps"], cfg["warmup"]
    model, opt, loss_fn, batch_fn, comp = _setup(cfg, method, seed)
    numel = sum(p.numel() for p in model.parameters())
    times: List[float] = []
    losses: List[float] = []
    report_every = max(1, steps // 20)
    measure, rss0 = _reset_peak_rss()
    dist.barrier()
    tx_start = rank.tx_bytes()
    tx0 = tx_start if timed_from == 0 else None
    for step in range(steps):
        if step == timed_from:
            tx0 = rank.tx_bytes()
        t0 = time.perf_counter()
        set_lr(opt, cfg, step, steps)
        loss = loss_fn(model, batch_fn(rank.rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if rank.rank == 0 and ((step + 1) % report_every == 0 or step + 1 == steps):
            rank.emit("step", method=method, seed=seed, step=step + 1, steps=steps)
    tx1 = rank.tx_bytes()
    peak = _peak_rss(measure)
    peak, increase = rank.max_over_ranks([float(peak), float(peak - rss0)])
    times = rank.max_over_ranks(times)
    losses = rank.mean_over_ranks(losses)
    sent = sent_all = None
    if tx0 is not None and tx1 is not None:
        sent, sent_all = rank.mean_over_ranks([float(tx1 - tx0), float(tx1 - tx_start)])
        sent, sent_all = sent / max(1, steps - timed_from), sent_all / steps
    full = _full_model(cfg, model, seed)
    final = math.nan
    if rank.rank == 0:
        with torch.no_grad():
            held_out = eval_batch_fn(cfg, seed, batch_fn)
            evals = [float(loss_fn(full, held_out(EVAL_RANK + i, 0))) for i in range(cfg["eval_batches"])]
        final = sum(evals) / len(evals)
    window = losses[-min(FINAL_LOSS_WINDOW, len(losses)):]
    compressor, weights, reduce_dtype = METHODS[method]
    rec = {
        "method": method,
        "compressor": compressor,
        "weights": weights,
        "reduce_dtype": reduce_dtype,
        "error_feedback": comp.error_feedback if comp is not None else None,
        # pycomm's own tensors: the residuals and their rollback buffers.
        "residual_bytes": 2 * comp.residual_bytes() if comp is not None else 0,
        "seed": seed,
        "parameters": numel,
        "steps": steps,
        "timed_from": timed_from,
        "step_time_median_s": summarize(times[timed_from:])["median_s"],
        "bytes_sent_per_rank_per_step": sent,
        "bytes_sent_per_rank_per_step_all_steps": sent_all,
        "memory_measure": measure,
        "peak_rss_bytes": peak,
        "peak_rss_increase_bytes": increase,
        "final_loss": final,
        "train_loss_last": sum(window) / len(window),
        "loss_per_step": losses,
        "step_times_s": times,
    }
    del model, opt, comp, full
    return rec


def _rank_main(rank: Rank) -> None:
    """One rank (:func:`pycomm_bench.launch.run_ranks`): a discarded warm-up,
    then every method of every seed."""
    import torch.distributed as dist

    _warm_up(rank)
    for seed in rank.cfg["seeds"]:
        for method in rank.cfg["methods"]:
            rec = _train(rank, method, seed)
            if rank.rank == 0:
                rank.emit("result", record=rec)
    dist.barrier()


# --------------------------------------------------------------------------- parent side


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults (``--quick`` shrinks them) and checks; ValueError names the option."""
    from .cli import split_list
    from .report import default_json_path

    if args.device.type != "cpu":
        raise ValueError("--device: the fsdp benchmark trains on CPU ranks over Gloo (emulated links)")
    if args.repeats is not None:
        raise ValueError("--repeats: not used by fsdp; use --steps")
    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2, got {args.ranks}")
    args.bandwidth, args.rates = parse_bandwidths(args.bandwidth, DEFAULT_BANDWIDTHS, args.netns)
    methods = split_list(args.methods) or DEFAULT_METHODS
    for name in methods:
        if name not in METHODS:
            try:
                error_feedback_suffix(name, default_on=False, where="pycomm-bench fsdp")
            except ValueError as exc:
                raise ValueError(f"--methods: {exc}") from None
            raise ValueError(f"--methods: unknown method {name!r} (one of {', '.join(METHODS)})")
    args.methods = with_baseline(methods, PLAIN)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if args.warmup is None:
        args.warmup = min(QUICK_WARMUP if args.quick else DEFAULT_WARMUP, args.steps - 1)
    if args.steps < args.warmup + 2:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 2")
    if args.lr is None:
        args.lr = DEFAULT_LR["adamw"]
    if args.json is None:
        args.json = default_json_path("fsdp", "cpu", quick=args.quick, settings=f"{args.ranks}ranks")
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fsdp`` options (the common ones are already there; ``--warmup``
    is the untimed steps at the start of each method's training)."""
    from .cli import nonnegative_int, positive_int

    g = parser.add_argument_group("fsdp options")
    add_sweep_options(g, bandwidth_help="link rates, comma or space separated, e.g. 100mbit,1gbit,none (none: "
                                        f"unshaped; default: {','.join(DEFAULT_BANDWIDTHS)}); every method trains "
                                        "--steps at each",
                      netns_prefix="pycomm-fsdp", baseline=PLAIN)
    g.add_argument("--methods", nargs="+", metavar="METHOD", default=None,
                   help=f"{', '.join(METHODS)} (plain always runs; default: {','.join(DEFAULT_METHODS)}); "
                        "error feedback is off unless a name ends in -ef, as in pycomm.fsdp")
    g.add_argument("--steps", type=positive_int, default=None,
                   help=f"training steps per method and seed (default: {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    g.add_argument("--batch-size", type=positive_int, default=1, help="sequences per rank per step (default: 1)")
    g.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default: {DEFAULT_LR['adamw']:g})")
    g.add_argument("--min-compress-numel", type=nonnegative_int, default=None,
                   help="pycomm.fsdp's min_compress_numel (buffers below it go exact; default: the library's)")


def combine_seeds(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One record from a method's per-seed records: the settings, ``per_seed``,
    step times pooled over the seeds' timed steps, final loss mean/std/min/max,
    bytes (mean) and peak memory (max over seeds)."""
    out = combine_seed_records(recs, PER_SEED_FIELDS)
    for k in ("peak_rss_bytes", "peak_rss_increase_bytes"):
        out[k] = max(r[k] for r in recs)
    return out


def add_ratios(records: List[Dict[str, Any]]) -> None:
    """``step_time_vs_<b>`` (method median / baseline median, same bandwidth:
    below 1 is faster), ``speedup_vs_plain`` and per-seed
    ``final_loss_vs_plain_per_seed`` (with its mean), for b in plain, bf16.

    >>> recs = [dict(method=m, bandwidth=None, step_time_median_s=t, per_seed=[dict(seed=0, final_loss=l)])
    ...         for m, t, l in (("plain", 2.0, 2.0), ("bf16", 1.0, 2.0), ("int8", 0.5, 2.2))]
    >>> add_ratios(recs)
    >>> recs[2]["step_time_vs_plain"], recs[2]["step_time_vs_bf16"], recs[2]["final_loss_vs_plain_mean"]
    (0.25, 0.5, 1.1)
    """
    for base in (PLAIN, REDUCE_CAST):
        ref = {r["bandwidth"]: r for r in records if r["method"] == base}
        for r in records:
            b = ref.get(r["bandwidth"])
            r[f"step_time_vs_{base}"] = r["step_time_median_s"] / b["step_time_median_s"] if b else None
    plain = {r["bandwidth"]: {p["seed"]: p["final_loss"] for p in r["per_seed"]}
             for r in records if r["method"] == PLAIN}
    for r in records:
        t = r["step_time_vs_plain"]
        r["speedup_vs_plain"] = 1.0 / t if t else None
        base = plain.get(r["bandwidth"], {})
        ratios = ([round(p["final_loss"] / base[p["seed"]], 12) for p in r["per_seed"]]
                  if all(p["seed"] in base for p in r["per_seed"]) else None)
        r["final_loss_vs_plain_per_seed"] = ratios
        r["final_loss_vs_plain_mean"] = mean(ratios) if ratios else None


def format_table(records: List[Dict[str, Any]]) -> str:
    """One row per (method, bandwidth): step time with its ratios to plain and
    bf16, MB sent per rank per step, peak RSS, held-out loss (x plain)."""
    from .netem import fmt_rate

    rows = []
    for r in records:
        vp, vb = r.get("step_time_vs_plain"), r.get("step_time_vs_bf16")
        sent = r.get("bytes_sent_per_rank_per_step")
        loss = f"{r['final_loss']:.3f}"
        if len(r["seeds"]) > 1:
            loss += f" ±{r['final_loss_std']:.3f}"
        if r.get("final_loss_vs_plain_mean") is not None:
            loss += f" ({r['final_loss_vs_plain_mean']:.3f})"
        rows.append([r["method"], fmt_rate(r["bandwidth"]) if r["bandwidth"] else "unshaped",
                     f"{r['step_time_median_s'] * 1e3:.0f}", f"{vp:.2f}" if vp else "-", f"{vb:.2f}" if vb else "-",
                     fmt_number(sent / 1e6) if sent is not None else "-",
                     f"{r['peak_rss_bytes'] / 2**20:.0f} (+{r['peak_rss_increase_bytes'] / 2**20:.0f})",
                     f"{r.get('residual_bytes', 0) / 2**20:.0f}", loss])
    headers = ["method", "link", "step ms\n(median)", "time\nx plain", "time\nx bf16", "MB sent/\nrank/step",
               f"peak RSS MiB/rank\n(+ in training, {records[0]['memory_measure'] if records else ''})",
               "residuals\nMiB/rank", "held-out loss\n(x plain)"]
    return table(rows, headers, tablefmt="github")


def run_fsdp(args: argparse.Namespace, out=sys.stdout) -> List[Dict[str, Any]]:
    """Train every method at every bandwidth; the records (one per method
    and bandwidth, each holding every seed's results)."""
    seeds = list(range(args.seed, args.seed + args.seeds))
    bar = progress_bar(len(args.rates) * len(seeds) * len(args.methods) * args.steps, "step", args.progress)
    date = _dt.date.today().isoformat()
    machine = machine_info("cpu")
    records: List[Dict[str, Any]] = []
    try:
        for rate in args.rates:
            cfg = {"workload": "lm", "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "seed": seeds[0], "seeds": seeds, "methods": args.methods, "steps": args.steps,
                   "warmup": args.warmup, "lr": args.lr, "lr_schedule": args.lr_schedule,
                   "lr_warmup": args.lr_warmup, "heldout": args.heldout, "eval_batches": args.eval_batches,
                   "min_compress_numel": args.min_compress_numel}
            events, cluster, busbw = train_at(_rank_main, args, rate, cfg, bar, out)
            per_method: Dict[str, List[Dict[str, Any]]] = {}
            for rec in (e["record"] for e in events if e["event"] == "result"):
                for k in ("bytes_sent_per_rank_per_step", "bytes_sent_per_rank_per_step_all_steps"):
                    rec[k] = per_rank_bytes(rec[k], cluster, args.ranks)
                rec.update({
                    "bandwidth": rate, "link_busbw_measured": busbw, "emulated": cluster.emulated,
                    "link": cluster.describe(), "ranks": args.ranks, "workload": "lm", "model": args.model,
                    "optimizer": "adamw", "lr": args.lr, "lr_schedule": args.lr_schedule,
                    "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "eval_batches": args.eval_batches, "min_compress_numel": args.min_compress_numel,
                    "tokens_per_step": args.ranks * args.batch_size * args.seq_len, "training_run": True,
                    "date": date,
                    "machine": {k: machine.get(k) for k in ("node", "cpu_model", "cpu_count", "torch", "pycomm")},
                })
                per_method.setdefault(rec["method"], []).append(rec)
            records += [combine_seeds(per_method[m]) for m in args.methods]
    finally:
        bar.close()
    for r in records:
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_time_median_s"]
    add_ratios(records)
    return records


def run(args: argparse.Namespace) -> int:
    """``pycomm-bench fsdp``: run, print the table, write JSON."""
    t0 = time.monotonic()
    try:
        records = run_fsdp(args)
    except RanksFailed as exc:
        return fail("fsdp", exc, 1)
    print()
    bad = [f"{r['method']}: non-finite held-out loss" for r in records if not math.isfinite(r["final_loss"])]
    status = finish(records, args.json, format_table(records), bad, t0)
    if args.plots:
        write_plots(records, args.json, what="FSDP2", baseline=PLAIN)
    return status


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["fsdp", *sys.argv[1:]]))
