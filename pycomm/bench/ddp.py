"""End-to-end DDP benchmark: does compression make training faster on my
network, and does it hurt the model?

W ranks (``--ranks``) train the same model with DDP, once per method
(``--methods``), on emulated links of each ``--bandwidth``
(:mod:`pycomm.bench.netem`: one network namespace per rank, every link shaped
with tbf both ways; the link's bus bandwidth is measured and printed before
use). Without root or iproute2 it runs on plain loopback, labelled so.

Methods, side by side in the same rank processes (same seed, same batches):

* ``allreduce``: DDP's own all-reduce, float32 (the baseline);
* ``fp16``, ``bf16``: PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``;
* ``powersgd-R``: PyTorch's ``powerSGD_hook`` of rank R (error feedback and
  warm start on), run through :func:`pycomm.ddp.serialized_hook` (the
  unwrapped hook fails on Gloo with more than one bucket:
  docs/powersgd_on_gloo.md);
* ``onebit``, ``topk-D`` (density D): pycomm's :func:`compressed_hook` over
  the plain Gloo group; ``-noef`` turns error feedback off; ``-backend``
  runs the same hook over a ``"pycomm"`` process group, so the C++ backend
  compresses (e.g. ``onebit-noef-backend``);
* ``auto`` (``auto-noef``): the hook over a ``compressor="auto"`` pycomm
  group, which calibrates itself when created and then runs, per bucket
  size, the method it predicts fastest (docs/auto.md).

Every compressing method, PyTorch's and pycomm's, starts after the same
``start_iter`` plain warm-up steps. At the training bandwidth
(``--train-bandwidth``, default 1 Gbit/s) every method trains ``--steps``
steps: loss vs steps and vs seconds, step times after warm-up. At the other
bandwidths each method runs ``--time-steps`` timed steps after a 2-step
warm-up: step times only. Per (method, bandwidth) the JSON record has the
median and p10/p90 step time (max over ranks per step), tokens/s, bytes sent
per rank per step (counted on each rank's interface), the compression time
share, the final loss (of the trained model on batches no rank trained on)
and whether every rank ended with identical parameters; the summary adds each method's break-even bandwidth (the link
speed above which it stops beating ``allreduce``, interpolated in log
bandwidth between measured points).

Example::

    $ pycomm-bench ddp --quick
    $ pycomm-bench ddp --ranks 4 --bandwidth 100mbit,1gbit --methods allreduce,fp16,onebit --steps 200
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .launch import Rank, RanksFailed, run_ranks, threads_per_rank
from .methods import DDP_BASES, Method, parse_method as _parse_method
from .report import finish, fmt_number, machine_info, progress_bar, table
from .timing import median, summarize

HELP = "end-to-end DDP training on emulated slow links: pycomm vs all-reduce, fp16 and PowerSGD"

DEFAULT_BANDWIDTHS = ["100mbit", "1gbit", "2.5gbit", "none"]
QUICK_BANDWIDTHS = ["1gbit", "none"]
DEFAULT_METHODS = [
    "allreduce", "fp16", "powersgd-1", "powersgd-4",
    "onebit", "onebit-noef", "topk-0.01", "topk-0.01-noef", "topk-0.001", "topk-0.001-noef",
    "onebit-backend", "onebit-noef-backend", "topk-0.01-backend", "topk-0.01-noef-backend",
    "topk-0.001-backend", "topk-0.001-noef-backend", "auto",
]
QUICK_METHODS = ["allreduce", "fp16", "powersgd-4", "onebit", "onebit-noef", "topk-0.01"]
WORKLOADS = ("lm", "mlp")
DEFAULT_STEPS = 150
QUICK_STEPS = 40
DEFAULT_TIME_STEPS = 10
DEFAULT_START_ITER = 10
#: Plain steps before the timed ones at the timing-only bandwidths (DDP
#: rebuilds its buckets after the first; the compressors start at the second).
TIMING_START_ITER = 2
DEFAULT_TIMEOUT = 600.0
DEFAULT_BUCKET_CAP_MB = 4.0
#: The language model's context in the benchmark (shorter than its 128-byte
#: default: fewer tokens per step keep compute small next to communication,
#: as on GPUs, which are ~1000x faster than these CPU cores).
DEFAULT_SEQ_LEN = 64
DEFAULT_OPTIMIZER = "adamw"
DEFAULT_LR = {"adamw": 1e-3, "sgd": 0.05}
#: onebit block of the benchmark's pycomm methods: with AdamW, 256 trained
#: the language model to a loss within 2% of plain all-reduce where the
#: library default 2048 stayed ~11% above it (4 ranks, 150-200 steps).
DEFAULT_BLOCK_SIZE = 256
#: "train_loss_last": mean over ranks and over the last this many steps.
FINAL_LOSS_WINDOW = 20
#: "final_loss": the loss of the trained model on this many batches that no
#: rank trains on (the same for every method), averaged; far less noisy than
#: the training loss of single small batches.
EVAL_BATCHES = 32
EVAL_RANK = 1_000_000


# --------------------------------------------------------------------------- methods


def parse_method(name: str) -> Method:
    """``Method`` of a name such as ``onebit-noef-backend`` or ``powersgd-4``
    (:mod:`pycomm.bench.methods`, the names this benchmark trains with).

    >>> parse_method("topk-0.01-noef")
    Method(name='topk-0.01-noef', entry='hook', compressor='topk', error_feedback=False, density=0.01, rank=None)
    """
    return _parse_method(name, bases=DDP_BASES)


# --------------------------------------------------------------------------- rank side


def _workload(cfg: Dict[str, Any]):
    from . import models

    if cfg["workload"] == "lm":
        return models.char_lm(cfg["model"], batch_size=cfg["batch_size"], seed=cfg["seed"],
                              seq_len=cfg["seq_len"])
    return models.narrow_mlp(batch_size=cfg["batch_size"], seed=cfg["seed"])


def _optimizer(model, cfg: Dict[str, Any]):
    """AdamW or SGD with momentum 0.9, fused (one pass over the parameters
    instead of several: on these cores the unfused AdamW step of the
    4.9M-parameter model costs as much as a third of the forward + backward)."""
    import torch

    if cfg["optimizer"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)


class _RankTrainer:
    """Everything one rank does: every method in turn, same data and seed."""

    def __init__(self, rank: Rank) -> None:
        import torch
        import torch.distributed as dist

        self.me = rank
        self.cfg = rank.cfg
        self.dist = dist
        self.torch = torch
        self.rank = rank.rank
        self.world = rank.world
        self._pycomm_groups: Dict[Tuple, Any] = {}

    # ---- helpers
    def emit(self, event: str, **fields: Any) -> None:
        if self.rank == 0:  # rank 0 speaks for the group
            self.me.emit(event, **fields)

    def _pycomm_group(self, m: Method):
        """A "pycomm" group for ``m``'s settings (created once, in method order:
        every rank creates the same groups in the same order)."""
        import pycomm.distributed as pd

        key = (m.compressor, m.density)
        if key not in self._pycomm_groups:
            settings: Dict[str, Any] = {"compressor": m.compressor, "block_size": self.cfg["block_size"]}
            if m.density is not None:
                settings["density"] = m.density
            self._pycomm_groups[key] = pd.wrap(None, **settings)
        return self._pycomm_groups[key]

    def _setup(self, m: Method, start_iter: int):
        """(ddp model, optimizer, loss_fn, batch_fn, hook state) for method ``m``."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, batch_fn, loss_fn = _workload(self.cfg)
        group = self._pycomm_group(m) if m.entry == "backend" else None
        ddp = DDP(model, process_group=group, bucket_cap_mb=self.cfg["bucket_cap_mb"])
        state = None
        if m.entry == "torch":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

            from ..ddp import serialized_hook

            if m.compressor == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif m.compressor == "bf16":
                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            else:
                state = P.PowerSGDState(process_group=None, matrix_approximation_rank=m.rank,
                                        start_powerSGD_iter=start_iter, use_error_feedback=True,
                                        warm_start=True, random_seed=self.cfg["seed"])
                ddp.register_comm_hook(state, serialized_hook(P.powerSGD_hook))
        elif m.pycomm:
            from ..ddp import CompressionState, compressed_hook

            kw: Dict[str, Any] = {"block_size": self.cfg["block_size"]}
            if m.density is not None:
                kw["density"] = m.density
            state = CompressionState(process_group=group, compressor=m.compressor, start_iter=start_iter,
                                     error_feedback=m.error_feedback, **kw)
            ddp.register_comm_hook(state, compressed_hook)
        opt = _optimizer(ddp, self.cfg)
        return ddp, opt, loss_fn, batch_fn, state

    def _params_identical(self, ddp) -> bool:
        """Every rank ends with bit-identical parameters (DDP's promise; a
        compressed all-reduce that gave ranks different results breaks it)."""
        return self.me.identical(self.torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))

    def _compress_time(self, m: Method, numel: int) -> Optional[float]:
        """Seconds this rank's compressor takes for one compress + decompress
        of a gradient of ``numel`` elements, all ranks at once (as in
        training), median of 3. None for methods without a pycomm/cast kernel."""
        torch = self.torch
        if m.compressor not in ("onebit", "topk", "fp16", "bf16"):
            return None
        g = torch.randn(numel, generator=torch.Generator().manual_seed(self.rank))
        if m.compressor in ("fp16", "bf16"):
            dt = torch.float16 if m.compressor == "fp16" else torch.bfloat16

            def once() -> None:
                g.to(dt).to(torch.float32)
        else:
            import pycomm

            kw = {"density": m.density} if m.density is not None else {"block_size": self.cfg["block_size"]}
            c = pycomm.get_compressor(m.compressor, **kw)
            r = torch.zeros(numel) if m.error_feedback else None

            def once() -> None:
                c.decompress(c.compress(g, r))

        once()
        times = []
        for _ in range(3):
            self.dist.barrier()
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        return self.me.max_over_ranks([median(times)])[0]

    def compute_time(self) -> float:
        """Median seconds of one forward + backward + optimizer step without any
        communication, all ranks at once (the part no compression removes)."""
        model, batch_fn, loss_fn = _workload(self.cfg)
        opt = _optimizer(model, self.cfg)
        times = []
        for step in range(6):
            self.dist.barrier()
            t0 = time.perf_counter()
            loss_fn(model, batch_fn(self.rank, step)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= 2:
                times.append(time.perf_counter() - t0)
        return self.me.max_over_ranks([median(times)])[0]

    def nocomm_step_time(self, steps: int = 12, warmup: int = 2) -> float:
        """Median step time of the same DDP training with a hook that sends
        nothing (each rank keeps its own gradient), timed like :meth:`train`
        (per step the slowest rank): a step's everything but communication,
        DDP's bucket copies, hook machinery and rank skew included. A
        method's step time minus this is its communication cost per step."""
        torch = self.torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, batch_fn, loss_fn = _workload(self.cfg)
        ddp = DDP(model, bucket_cap_mb=self.cfg["bucket_cap_mb"])

        def no_comm(_, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, no_comm)
        opt = _optimizer(ddp, self.cfg)
        times = []
        self.dist.barrier()
        for step in range(steps):
            t0 = time.perf_counter()
            loss_fn(ddp, batch_fn(self.rank, step)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return median(self.me.max_over_ranks(times)[warmup:])

    # ---- one method
    def train(self, m: Method, steps: int, start_iter: int, timed_from: int, report_every: int) -> Dict[str, Any]:
        torch = self.torch
        ddp, opt, loss_fn, batch_fn, _ = self._setup(m, start_iter)
        numel = sum(p.numel() for p in ddp.parameters())
        times: List[float] = []
        losses: List[float] = []
        tx0 = tx1 = None
        self.dist.barrier()
        for step in range(steps):
            if step == timed_from:
                tx0 = self.me.tx_bytes()
            t0 = time.perf_counter()
            loss = loss_fn(ddp, batch_fn(self.rank, step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if (step + 1) % report_every == 0 or step + 1 == steps:
                self.emit("step", method=m.name, step=step + 1, steps=steps)
        tx1 = self.me.tx_bytes()
        times = self.me.max_over_ranks(times)
        losses = self.me.mean_over_ranks(losses)
        sent = None
        if tx0 is not None and tx1 is not None:
            sent = self.me.mean_over_ranks([float(tx1 - tx0)])[0] / max(1, steps - timed_from)
        timed = times[timed_from:]
        stats = summarize(timed)
        window = losses[-min(FINAL_LOSS_WINDOW, len(losses)):]
        with torch.no_grad():
            evals = [float(loss_fn(ddp.module, batch_fn(EVAL_RANK + i, 0))) for i in range(EVAL_BATCHES)]
        rec = {
            "method": m.name,
            "entry": m.entry,
            "compressor": m.compressor,
            "error_feedback": m.error_feedback,
            "gradient_numel": numel,
            "steps": steps,
            "start_iter": start_iter,
            "timed_steps": len(timed),
            "step_time_median_s": stats["median_s"],
            "step_time_p10_s": stats["p10_s"],
            "step_time_p90_s": stats["p90_s"],
            "bytes_sent_per_rank_per_step": sent,
            "final_loss": sum(evals) / len(evals),
            "train_loss_last": sum(window) / len(window),
            "loss_per_step": losses,
            "step_times_s": times,
            "params_identical": self._params_identical(ddp),
        }
        rec["compress_time_s"] = self._compress_time(m, numel)
        if m.compressor == "auto":
            import pycomm.distributed as pd

            # What the calibration chose for each bucket (and the whole table).
            cal = pd.calibration(self._pycomm_group(m))
            rec["auto_bucket_methods"] = {str(b.buffer().numel()): cal.choose(b.buffer().numel())
                                          for b in ddp.reducer._get_zeros_like_grad_buckets()}
            rec["auto_calibration"] = cal.to_dict()
        del ddp, opt
        return rec


def _rank_main(rank: Rank) -> None:
    """One rank (:func:`pycomm.bench.launch.run_ranks`): the baselines, then every method of the plan."""
    trainer = _RankTrainer(rank)
    trainer.emit("compute", compute_time_s=trainer.compute_time(), nocomm_step_time_s=trainer.nocomm_step_time())
    for run in rank.cfg["plan"]:
        rec = trainer.train(parse_method(run["method"]), run["steps"], run["start_iter"], run["timed_from"],
                            max(1, run["steps"] // 20))
        trainer.emit("result", record=rec)
    trainer.dist.barrier()


# --------------------------------------------------------------------------- parent side


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults (``--quick`` shrinks them) and checks; ValueError names the option."""
    from .cli import split_list
    from .netem import parse_rate
    from .report import default_json_path

    if args.device.type != "cpu":
        raise ValueError("--device: the ddp benchmark trains on CPU ranks over Gloo (emulated links)")
    if args.repeats is not None:
        raise ValueError("--repeats: not used by ddp; use --steps (training) and --time-steps (timing)")
    if args.warmup is not None:
        raise ValueError("--warmup: not used by ddp; use --start-iter")
    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2, got {args.ranks}")
    bws = split_list(args.bandwidth) or (QUICK_BANDWIDTHS if args.quick else DEFAULT_BANDWIDTHS)
    rates: List[Optional[float]] = []
    for b in bws:
        try:
            rates.append(parse_rate(b))
        except ValueError as exc:
            raise ValueError(f"--bandwidth: {exc}") from None
    if len(set(rates)) != len(rates):
        raise ValueError(f"--bandwidth: repeated value in {bws}")
    if not getattr(args, "netns", True) and any(r is not None for r in rates):
        raise ValueError(f"--bandwidth {','.join(bws)}: with --no-netns links cannot be shaped, use --bandwidth none")
    args.bandwidth = bws
    args.rates = rates
    methods = split_list(args.methods) or (QUICK_METHODS if args.quick else DEFAULT_METHODS)
    for name in methods:
        try:
            parse_method(name)
        except ValueError as exc:
            raise ValueError(f"--methods: {exc}") from None
    if "allreduce" not in methods:
        methods = ["allreduce", *methods]  # every ratio is against it
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods: repeated method in {methods}")
    args.methods = methods
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if args.start_iter is None:
        args.start_iter = min(DEFAULT_START_ITER, max(2, args.steps // 4))
    if args.start_iter < 2:
        raise ValueError(f"--start-iter must be >= 2 (DDP rebuilds its buckets after step 1), got {args.start_iter}")
    if args.steps < args.start_iter + 3:
        raise ValueError(f"--steps ({args.steps}) must exceed --start-iter ({args.start_iter}) by at least 3")
    if args.train_bandwidth is None:
        args.train_rate = 1e9 if 1e9 in rates else rates[0]
    else:
        try:
            args.train_rate = parse_rate(args.train_bandwidth)
        except ValueError as exc:
            raise ValueError(f"--train-bandwidth: {exc}") from None
        if args.train_rate not in rates:
            raise ValueError(f"--train-bandwidth {args.train_bandwidth} is not one of --bandwidth {bws}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.block_size % 32:
        raise ValueError(f"--block-size must be a multiple of 32, got {args.block_size}")
    if args.batch_size is None:
        args.batch_size = 1 if args.workload == "lm" else 32
    if args.json is None:
        suffix = "" if args.workload == "lm" else f"-{args.workload}"
        args.json = default_json_path(f"ddp{suffix}", "cpu", quick=args.quick)
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ddp`` options (the common ones are already there)."""
    from .cli import positive_int

    g = parser.add_argument_group("ddp options")
    g.add_argument("--ranks", type=positive_int, default=4, help="processes, one per emulated host (default: 4)")
    g.add_argument("--bandwidth", nargs="+", metavar="RATE", default=None,
                   help="link rates, comma or space separated, e.g. 100mbit,1gbit,2.5gbit,none "
                        f"(none: unshaped; default: {','.join(DEFAULT_BANDWIDTHS)}; "
                        f"{','.join(QUICK_BANDWIDTHS)} with --quick)")
    g.add_argument("--train-bandwidth", default=None, metavar="RATE",
                   help="the rate at which every method trains --steps steps (default: 1gbit if "
                        "swept, else the first); elsewhere only --time-steps are timed")
    g.add_argument("--methods", nargs="+", metavar="METHOD", default=None,
                   help="allreduce, fp16, bf16, powersgd-<rank>, onebit, topk-<density>, auto; onebit and "
                        "topk with -noef and/or -backend, auto with -noef (default: all of "
                        f"{','.join(DEFAULT_METHODS)}; with --quick {','.join(QUICK_METHODS)})")
    g.add_argument("--workload", choices=WORKLOADS, default="lm",
                   help="lm: the byte-level GPT on standard-library text (default); mlp: many small tensors")
    g.add_argument("--steps", type=positive_int, default=None,
                   help=f"training steps at the training bandwidth (default: {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    g.add_argument("--time-steps", type=positive_int, default=DEFAULT_TIME_STEPS,
                   help=f"timed steps at every other bandwidth (default: {DEFAULT_TIME_STEPS})")
    g.add_argument("--start-iter", type=int, default=None,
                   help=f"plain all-reduce warm-up steps before any method compresses (default: {DEFAULT_START_ITER})")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences (lm) or rows (mlp) per rank per step (default: 1 / 32)")
    g.add_argument("--model", choices=("default", "tiny"), default="default",
                   help="lm size: default (4.9M parameters) or tiny (43K, for smoke tests)")
    g.add_argument("--seq-len", type=positive_int, default=DEFAULT_SEQ_LEN,
                   help=f"lm: bytes per sequence (default: {DEFAULT_SEQ_LEN})")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default=DEFAULT_OPTIMIZER,
                   help=f"adamw, or sgd with momentum 0.9 (default: {DEFAULT_OPTIMIZER})")
    g.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: {DEFAULT_LR['adamw']:g} for adamw, {DEFAULT_LR['sgd']:g} for sgd)")
    g.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"onebit block size of the pycomm methods (default: {DEFAULT_BLOCK_SIZE})")
    g.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB,
                   help=f"DDP bucket size (default: {DEFAULT_BUCKET_CAP_MB:g})")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds without progress before a run is stopped (default: {DEFAULT_TIMEOUT:g})")
    g.add_argument("--no-netns", dest="netns", action="store_false",
                   help="run every rank on plain loopback, no namespaces (unshaped only: --bandwidth none)")
    g.add_argument("--netns-prefix", default="pycomm-ddp",
                   help="name prefix of the network namespaces built (leftovers with it are deleted first)")
    g.add_argument("--train-all", action="store_true",
                   help="train every method --steps steps at the training bandwidth, -backend ones too "
                        "(by default those are only timed there: their training is their hook twin's, bit for bit)")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="do not write PNG plots")


def run_ddp(args: argparse.Namespace, out=sys.stdout) -> List[Dict[str, Any]]:
    """Run the sweep; the list of records (one per method and bandwidth)."""
    from .netem import LoopbackCluster, fmt_rate, link_report, make_cluster

    order = [args.train_rate] + [r for r in args.rates if r != args.train_rate]
    plans = {r: run_plan(args, r == args.train_rate) for r in order}
    total = sum(run["steps"] for plan in plans.values() for run in plan)
    bar = progress_bar(total, "step", args.progress)
    date = _dt.date.today().isoformat()
    machine = machine_info("cpu")
    records: List[Dict[str, Any]] = []
    try:
        for rate in order:
            plan = plans[rate]
            cfg = {
                "workload": args.workload, "batch_size": args.batch_size, "seed": args.seed,
                "seq_len": args.seq_len, "model": args.model, "optimizer": args.optimizer,
                "block_size": args.block_size,
                "lr": args.lr, "bucket_cap_mb": args.bucket_cap_mb, "plan": plan,
            }
            cluster = (make_cluster(args.ranks, rate, prefix=args.netns_prefix) if args.netns
                       else LoopbackCluster(args.ranks, reason="--no-netns"))
            with cluster:
                if not cluster.emulated:
                    cfg["count_ifname"] = "lo"
                busbw, line = link_report(cluster)
                bar.write(line, file=out)
                done: Dict[str, int] = {}

                def on_step(ev: Dict[str, Any]) -> None:
                    if ev["event"] == "step":
                        bar.set_postfix_str(f"{fmt_rate(rate)} {ev['method']}", refresh=False)
                        bar.update(ev["step"] - done.get(ev["method"], 0))
                        done[ev["method"]] = ev["step"]

                # The timeout bounds each collective and the wait for any progress alike.
                events = run_ranks(_rank_main, cluster, cfg, timeout=args.timeout, stall=args.timeout,
                                   threads=threads_per_rank(args.ranks, args.threads), on_event=on_step)
            baselines = next(({k: v for k, v in e.items() if k not in ("event", "rank")}
                              for e in events if e["event"] == "compute"), {})
            recs = [e["record"] for e in events if e["event"] == "result"]
            for rec, run in zip(recs, plan):
                tokens = args.ranks * args.batch_size * _seq_len(args)
                sent = rec["bytes_sent_per_rank_per_step"]
                if sent is not None and not cluster.emulated:
                    sent = sent / args.ranks  # loopback counts every rank's traffic once
                rec.update({
                    "bandwidth": rate,
                    "link_busbw_measured": busbw,
                    "emulated": cluster.emulated,
                    "link": cluster.describe(),
                    "ranks": args.ranks,
                    "workload": args.workload,
                    "training_run": run["training"],
                    "loss_from": run.get("loss_from"),
                    "bytes_sent_per_rank_per_step": sent,
                    "tokens_per_s": tokens / rec["step_time_median_s"] if args.workload == "lm" else None,
                    "samples_per_s": args.ranks * args.batch_size / rec["step_time_median_s"],
                    "compute_time_s": baselines.get("compute_time_s"),
                    "nocomm_step_time_s": baselines.get("nocomm_step_time_s"),
                    "compress_time_share": (rec["compress_time_s"] / rec["step_time_median_s"]
                                            if rec["compress_time_s"] is not None else None),
                    "date": date,
                    "machine": {k: machine.get(k) for k in ("node", "cpu_model", "cpu_count", "torch", "pycomm")},
                })
                if not run["training"]:
                    rec.pop("loss_per_step", None)
                records.append(rec)
    finally:
        bar.close()
    add_speedups(records)
    return records


def run_plan(args: argparse.Namespace, training: bool) -> List[Dict[str, Any]]:
    """What each method runs at one bandwidth: ``--steps`` at the training
    bandwidth, ``--time-steps`` timed steps after a 2-step warm-up elsewhere.
    A ``-backend`` method whose hook twin also runs is only timed at the
    training bandwidth too: the backend and the hook compute the same thing
    bit for bit (tests/test_bench_ddp.py checks it on the same run), so its
    loss is the twin's (``loss_from``) and training it again would only
    double the run time.

    >>> a = argparse.Namespace(methods=["allreduce", "onebit", "onebit-backend"], steps=100,
    ...                        start_iter=10, time_steps=5)
    >>> [(r["method"], r["steps"], r["training"]) for r in run_plan(a, True)]
    [('allreduce', 100, True), ('onebit', 100, True), ('onebit-backend', 7, False)]
    """
    timing = {"steps": TIMING_START_ITER + args.time_steps, "start_iter": TIMING_START_ITER,
              "timed_from": TIMING_START_ITER + 1, "training": False}
    full = {"steps": args.steps, "start_iter": args.start_iter, "timed_from": args.start_iter + 1,
            "training": True}
    plan = []
    for name in args.methods:
        twin = name[: -len("-backend")] if name.endswith("-backend") else None
        if not training:
            plan.append({"method": name, **timing})
        elif twin is not None and twin in args.methods and not getattr(args, "train_all", False):
            plan.append({"method": name, **timing, "loss_from": twin})
        else:
            plan.append({"method": name, **full})
    return plan


def _seq_len(args: argparse.Namespace) -> int:
    return args.seq_len if args.workload == "lm" else 1


# --------------------------------------------------------------------------- analysis


def _effective_bw(rec: Dict[str, Any]) -> float:
    """The x of a record in bandwidth plots and break-even: the set rate, or
    the measured bus bandwidth for an unshaped link."""
    return rec["bandwidth"] if rec["bandwidth"] is not None else rec["link_busbw_measured"]


def add_speedups(records: List[Dict[str, Any]]) -> None:
    """Add ``speedup_vs_allreduce`` (plain median / method median, same bandwidth)."""
    base = {r["bandwidth"]: r["step_time_median_s"] for r in records if r["method"] == "allreduce"}
    for r in records:
        b = base.get(r["bandwidth"])
        r["speedup_vs_allreduce"] = b / r["step_time_median_s"] if b else None


def break_even(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per method: the link speed (bit/s) above which it stops beating plain
    all-reduce. Interpolated linearly in log(bandwidth) between the two
    measured bandwidths where its speedup crosses 1; ``None`` with a reason
    when it wins (or loses) at every measured bandwidth.

    >>> recs = [dict(method=m, bandwidth=b, link_busbw_measured=b, speedup_vs_allreduce=s)
    ...         for m, b, s in [("x", 1e8, 4.0), ("x", 1e9, 2.0), ("x", 1e10, 0.5)]]
    >>> round(break_even(recs)["x"]["bits_per_s"] / 1e9, 2)
    3.16
    """
    out: Dict[str, Dict[str, Any]] = {}
    by_method: Dict[str, List[Tuple[float, float]]] = {}
    for r in records:
        if r["method"] == "allreduce" or r.get("speedup_vs_allreduce") is None:
            continue
        by_method.setdefault(r["method"], []).append((_effective_bw(r), r["speedup_vs_allreduce"]))
    for m, pts in by_method.items():
        pts.sort()
        res: Dict[str, Any] = {"bits_per_s": None}
        if all(s >= 1 for _, s in pts):
            res["note"] = f"faster at every measured bandwidth (up to {pts[-1][0] / 1e9:.2f} Gbit/s)"
        elif all(s < 1 for _, s in pts):
            res["note"] = f"slower at every measured bandwidth (from {pts[0][0] / 1e9:.2f} Gbit/s)"
        else:
            for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
                if s0 >= 1 > s1:
                    f = (math.log(s0)) / (math.log(s0) - math.log(s1))
                    res["bits_per_s"] = math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
                    res["note"] = "interpolated"
                    break
            else:
                res["note"] = "no single crossing (slower at low, faster at high bandwidth)"
        out[m] = res
    return out


def format_table(records: List[Dict[str, Any]]) -> str:
    """Median step time per method (rows) and bandwidth (columns), with the
    speedup over plain all-reduce, the bytes and loss at the training bandwidth."""
    from .netem import fmt_rate

    bws: List[Optional[float]] = []
    for r in records:
        if r["bandwidth"] not in bws:
            bws.append(r["bandwidth"])
    bws.sort(key=lambda b: math.inf if b is None else b)
    methods: List[str] = []
    for r in records:
        if r["method"] not in methods:
            methods.append(r["method"])
    cell = {(r["method"], r["bandwidth"]): r for r in records}
    train = {r["method"]: r for r in records if r.get("training_run")}
    plain_loss = train.get("allreduce", {}).get("final_loss")
    be = break_even(records)
    headers = ["method"] + [f"{fmt_rate(b) if b else 'unshaped'}\nms (x plain)" for b in bws]
    headers += ["MB sent/rank/step\n(train link)", "compress\nshare", "held-out loss\n(vs plain)", "ranks\nidentical",
                "break-even"]
    rows = []
    for m in methods:
        row = [m]
        for b in bws:
            r = cell.get((m, b))
            if r is None:
                row.append("-")
                continue
            sp = r.get("speedup_vs_allreduce")
            row.append(f"{r['step_time_median_s'] * 1e3:.0f} ({sp:.2f}x)" if sp else f"{r['step_time_median_s'] * 1e3:.0f}")
        t = train.get(m) or next((r for r in records if r["method"] == m and r.get("loss_from")), {})
        sent = t.get("bytes_sent_per_rank_per_step")
        row.append(fmt_number(sent / 1e6) if sent is not None else "-")
        share = t.get("compress_time_share")
        row.append(f"{share * 100:.0f}%" if share is not None else "-")
        loss = t.get("final_loss")
        if t.get("loss_from"):
            loss = train.get(t["loss_from"], {}).get("final_loss")
            row.append(f"as {t['loss_from']}" if loss is not None else "-")
        else:
            row.append(f"{loss:.3f} ({loss / plain_loss:.3f})" if loss is not None and plain_loss else "-")
        row.append("yes" if all(r.get("params_identical") for r in records if r["method"] == m) else "NO")
        e = be.get(m)
        row.append("-" if e is None else (fmt_rate(e["bits_per_s"]) if e["bits_per_s"] else e["note"].split(" (")[0]))
        rows.append(row)
    return table(rows, headers, tablefmt="github")


def plot(records: List[Dict[str, Any]], prefix: str) -> List[str]:
    """PNG plots next to the JSON: step time vs bandwidth, loss vs steps and
    loss vs seconds at the training bandwidth. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .netem import fmt_rate

    paths = []
    methods: List[str] = []
    for r in records:
        if r["method"] not in methods:
            methods.append(r["method"])
    style = {m: ("-" if not m.endswith("-backend") else "--") for m in methods}
    ranks = records[0]["ranks"]

    fig, ax = plt.subplots(figsize=(8, 5))
    for m in methods:
        pts = sorted((_effective_bw(r), r["step_time_median_s"]) for r in records if r["method"] == m)
        ax.plot([p[0] / 1e9 for p in pts], [p[1] * 1e3 for p in pts], style[m], marker="o", label=m,
                linewidth=2.5 if m == "allreduce" else 1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth, Gbit/s (unshaped: measured)")
    ax.set_ylabel("median step time, ms")
    ax.set_title(f"DDP step time vs bandwidth, {ranks} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(prefix + "-step-time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    train = [r for r in records if r.get("training_run") and r.get("loss_per_step")]
    if train:
        rate = train[0]["bandwidth"]
        for kind in ("steps", "seconds"):
            fig, ax = plt.subplots(figsize=(8, 5))
            for r in train:
                loss = _smooth(r["loss_per_step"])
                if kind == "steps":
                    x = list(range(1, len(loss) + 1))
                else:
                    x, acc = [], 0.0
                    for t in r["step_times_s"]:
                        acc += t
                        x.append(acc)
                ax.plot(x, loss, style[r["method"]], label=r["method"], linewidth=2.5 if r["method"] == "allreduce" else 1.2)
            ax.set_xlabel("step" if kind == "steps" else "wall-clock seconds (sum of measured step times)")
            ax.set_ylabel("training loss (mean over ranks, smoothed)")
            ax.set_title(f"loss vs {kind} at {fmt_rate(rate) if rate else 'unshaped'}, {ranks} ranks")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            paths.append(f"{prefix}-loss-vs-{kind}.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    return paths


def _smooth(xs: Sequence[float], window: int = 10) -> List[float]:
    """Trailing moving average (the per-step loss of small batches is noisy)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def run(args: argparse.Namespace) -> int:
    """``pycomm-bench ddp``: run, print the table, write JSON (and plots)."""
    t0 = time.monotonic()
    try:
        records = run_ddp(args)
    except RanksFailed as exc:
        print(f"pycomm-bench ddp: {exc}", file=sys.stderr)
        return 1
    print()
    bad = sorted({r["method"] for r in records if not r["params_identical"]})
    status = finish(records, args.json, format_table(records),
                    [f"{m}: ranks ended with different parameters" for m in bad], t0)
    if args.plots:
        try:
            for p in plot(records, os.path.splitext(args.json)[0]):
                print(f"wrote {p}")
        except ImportError:
            print("matplotlib is not installed: no plots", file=sys.stderr)
    return status


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["ddp", *sys.argv[1:]]))
