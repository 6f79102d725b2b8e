"""End-to-end DDP benchmark: does compression make training faster on my
network, and does it hurt the model?

W ranks (``--ranks``) train the same model with DDP, once per method
(``--methods``), on emulated links of each ``--bandwidth``
(:mod:`pycomm_bench.netem`: one network namespace per rank, every link shaped
with tbf both ways; the link's bus bandwidth is measured and printed before
use). Without root or iproute2 it runs on plain loopback, labelled so.

Methods, side by side in the same rank processes (same seed, same batches):

* ``allreduce``: DDP's own all-reduce, float32 (the baseline);
* ``fp16``, ``bf16``: PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``;
* ``powersgd-R``: PyTorch's ``powerSGD_hook`` of rank R (error feedback and
  warm start on), run through :func:`pycomm.ddp.serialized_hook` (the
  unwrapped hook fails on Gloo with more than one bucket:
  docs/powersgd_on_gloo.md);
* each method of the table that keeps residuals (``spec.EF_METHODS``;
  ``topk-D``: density D; a quant row such as ``int8``: block quantization,
  an absmax scale per block): pycomm's :func:`compressed_hook` over the
  plain Gloo group; ``-noef`` turns error feedback off; ``-backend`` runs
  the same hook over a ``"pycomm"`` process group, so the C++ backend
  compresses (e.g. ``onebit-noef-backend``); ``-sr`` (a method that rounds,
  and ``optim-`` of one, before the other suffixes) rounds stochastically
  (e.g. ``int4-sr-noef``, ``optim-int4-sr``);
* ``auto`` (``auto-noef``): the hook over a ``compressor="auto"`` pycomm
  group, which calibrates itself when created and then runs, per bucket
  size, the method it predicts fastest (docs/auto.md);
* ``optim-C`` (C a block codec; ``optim-C-overlap``: the
  momenta sent per DDP bucket during backward): no gradient compression but
  pycomm's compressed-momentum optimizer matching ``--optimizer``
  (:class:`pycomm.optim.OneBitAdam` for adamw, :class:`pycomm.optim.OneBitSGD`
  for sgd), attached to the DDP model: exact averaged gradients for
  ``--optim-warmup`` steps (default: 20% of ``--steps``, at least
  ``--start-iter``), then DDP sends nothing and the optimizer all-reduces
  its momentum with compressor C (``optim-C-vK``, AdamW: every K-th step
  averages exactly instead and updates OneBitAdam's variance,
  ``variance_update_every=K``);
* ``diloco-H<H>[-F<F>][-d<tau>][-<codec>]`` (e.g. ``diloco-H16``,
  ``diloco-H16-int4``, ``diloco-H32-F4-d1-int4``): the model is not wrapped
  in DDP and no gradient is sent; after the plain warm-up (gradients
  averaged exactly, so every rank starts DiLoCo from the same parameters)
  :class:`pycomm.optim.DiLoCo` wraps the inner AdamW (``--optimizer adamw``
  only: its outer Nesterov step is tuned for an AdamW inner loop) and
  averages the pseudo-gradients every H steps, F fragments staggered, each
  applied tau steps after its send, with the codec (none: exact; the
  outer Nesterov SGD: ``--outer-lr``, ``--outer-momentum``). The
  ranks' parameters differ between syncs, so the held-out loss is that of
  the replicas' mean (an exact all-reduce outside the timed steps, its
  bytes not counted); the record adds ``diloco_bytes_per_step``
  (``DiLoCo.bytes_per_step``), ``diloco_syncs`` and ``diloco_memory_bytes``,
  and checks that every rank holds the same anchor. Its step time varies
  (a sync every H/F steps): its table cell and speedup use the mean
  (``step_time_mean_s``, against plain's mean), not the median;
* ``torchft-diloco-H<H>``: the same warm-up, then every rank becomes one
  torchft replica (a ``torchft.Manager`` of group world size 1 with its
  own TCPStore, ``use_async_quorum=False``, a lighthouse in rank 0 with
  ``min_replicas`` = the ranks) and trains inside
  ``torchft.local_sgd.DiLoCo`` with the same inner AdamW and an outer
  Nesterov ``torch.optim.SGD`` (``--outer-lr``, ``--outer-momentum``),
  exact (torchft's ``should_quantize`` needs an accelerator). Evaluated,
  counted and timed as ``diloco-*``: ``diloco_bytes_per_step`` is the same
  formula (an exact float32 all-reduce of the model every H steps,
  ``spec.wire_bytes("none", n, W) / H``); the record adds
  ``torchft_version``.

Every compressing method, PyTorch's and pycomm's, starts after the same
``start_iter`` plain warm-up steps (``optim-*``: after ``--optim-warmup``;
``fp16``/``bf16``: PyTorch's cast hooks, which have no warm-up of their own,
are wrapped to all-reduce plainly until then, as ``powersgd-R`` does).
``--quick`` runs are smoke tests: their held-out losses are one evaluation
after 40 steps and the ratios to plain flip between neighbouring steps
(PowerSGD 1.43x at step 40, 1.02x at 44), so the output says the loss
column is no verdict.
``--seeds N`` trains every method N times, with seeds ``--seed`` ...
``--seed + N - 1`` (the seed fixes the model's initial weights and every
rank's batches: the same for every method of one seed): each record then
holds every seed's results (``per_seed``), the final loss's mean and
spread over seeds, and per seed its ratio to ``allreduce``'s final loss of
the same seed (mean, min and max of those ratios). ``--eval-every K``
records the held-out loss every K steps (whether the baseline has
flattened); ``--merge`` combines the JSON files of runs made with
different seeds into one, as if they had been one run. At the training bandwidth
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
    $ pycomm-bench ddp --bandwidth none --no-netns --methods int8,int4,optim-onebit --seeds 3 --steps 600
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pycomm.distributed import spec

from .launch import Rank, RanksFailed
from .methods import ALLREDUCE, AUTO, DDP_BASES, DILOCO, TORCHFT, Method, parse_method as _parse_method, vocabulary
from .report import fail, finish, fmt_number, machine_info, progress_bar, table
from .sweep import (DEFAULT_LR, EVAL_BATCHES, EVAL_RANK, FINAL_LOSS_WINDOW,
                    add_sweep_options, effective_bw, error_feedback_suffix, eval_batch_fn, json_key, mean,
                    parse_bandwidths, per_rank_bytes, plot, set_lr, train_at, with_baseline, workload, write_plots)
from .sweep import combine_seeds as combine_seed_records
from .timing import median, summarize

HELP = "end-to-end DDP training on emulated slow links: pycomm vs all-reduce, fp16 and PowerSGD"

DEFAULT_BANDWIDTHS = ["100mbit", "1gbit", "2.5gbit", "none"]
QUICK_BANDWIDTHS = ["1gbit", "none"]
DEFAULT_METHODS = [
    "allreduce", "fp16", "powersgd-1", "powersgd-4",
    "onebit", "onebit-noef", "topk-0.01", "topk-0.01-noef", "topk-0.001", "topk-0.001-noef",
    "int8", "int4", "optim-onebit",
    "onebit-backend", "onebit-noef-backend", "topk-0.01-backend", "topk-0.01-noef-backend",
    "topk-0.001-backend", "topk-0.001-noef-backend", "auto",
]
QUICK_METHODS = ["allreduce", "fp16", "powersgd-4", "onebit", "onebit-noef", "topk-0.01", "int4"]
WORKLOADS = ("lm", "mlp")
DEFAULT_STEPS = 150
QUICK_STEPS = 40
DEFAULT_TIME_STEPS = 10
DEFAULT_START_ITER = 10
#: Plain steps before the timed ones at the timing-only bandwidths (DDP
#: rebuilds its buckets after the first; the compressors start at the second).
TIMING_START_ITER = 2
DEFAULT_BUCKET_CAP_MB = 4.0
DEFAULT_OPTIMIZER = "adamw"
#: DiLoCo's outer Nesterov SGD, as :class:`pycomm.optim.DiLoCo` defaults it
#: (Douillard et al. 2023); ``--outer-lr`` / ``--outer-momentum``.
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9
#: Printed under the table of a ``--quick`` run (a single held-out
#: evaluation after 40 steps, on one seed).
QUICK_LOSS_NOTE = ("--quick: the held-out losses are one evaluation after a few steps on one seed, and their "
                   "ratios to allreduce flip between neighbouring steps (PowerSGD 1.43x at step 40, 1.02x at "
                   "44): no verdict on quality; compare losses with --steps 400 --seeds 3 --eval-every 100")
#: onebit block of the benchmark's pycomm methods: with AdamW, 256 trained
#: the language model to a loss within 2% of plain all-reduce where the
#: library default 2048 stayed ~11% above it (4 ranks, 150-200 steps).
DEFAULT_BLOCK_SIZE = 256
#: Default warm-up of the ``optim-*`` methods, as a fraction of ``--steps``
#: (at least ``--start-iter``): 1-bit Adam freezes its variance after the
#: warm-up, and its authors (and DeepSpeed's docs) put that at 15-25% of
#: training; with AdamW a 10-step warm-up left OneBitAdam 5.7% above plain
#: after 400 steps where 80 steps (20%) left it 1.2% above (seed 0).
OPTIM_WARMUP_FRACTION = 0.2


# --------------------------------------------------------------------------- methods


def parse_method(name: str) -> Method:
    """``Method`` of a name such as ``onebit-noef-backend`` or ``powersgd-4``
    (:mod:`pycomm_bench.methods`, the names this benchmark trains with).

    >>> m = parse_method("topk-0.01-noef")
    >>> (m.entry, m.compressor, m.density, m.error_feedback)
    ('hook', 'topk', 0.01, False)
    """
    return _parse_method(name, bases=DDP_BASES)


# --------------------------------------------------------------------------- rank side


def _optim_classes():
    """(OneBitAdam, OneBitSGD) of :mod:`pycomm.optim`."""
    try:
        from pycomm.optim import OneBitAdam, OneBitSGD
    except ImportError:  # a package without re-exports: the module itself
        from pycomm.optim.onebit import OneBitAdam, OneBitSGD
    return OneBitAdam, OneBitSGD


def _optimizer(model, cfg: Dict[str, Any], m: Optional[Method] = None, warmup: int = 0):
    """AdamW or SGD with momentum 0.9, fused (one pass over the parameters
    instead of several: on these cores the unfused AdamW step of the
    4.9M-parameter model costs as much as a third of the forward + backward).
    For an ``optim-*`` method, the compressed-momentum optimizer with the
    same hyperparameters (AdamW's weight decay 0, SGD's momentum 0.9), its
    exact warm-up ``warmup`` steps long, attached to the DDP ``model``."""
    import torch

    if m is not None and m.entry == "optim":
        OneBitAdam, OneBitSGD = _optim_classes()
        kw = {"warmup_steps": warmup, "compressor": m.compressor, "block_size": cfg["block_size"],
              "rounding": m.rounding}
        if cfg["optimizer"] == "sgd":
            opt = OneBitSGD(model.parameters(), lr=cfg["lr"], momentum=0.9, **kw)
        else:
            if m.variance_every is not None:
                kw["variance_update_every"] = m.variance_every
            opt = OneBitAdam(model.parameters(), lr=cfg["lr"], weight_decay=0.0, **kw)
        opt.attach(model, overlap=m.overlap)
        return opt
    if cfg["optimizer"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)


class _AfterWarmup:
    """A PyTorch DDP hook (``hook(None, bucket)``, e.g. ``fp16_compress_hook``)
    that runs only after ``start_iter`` steps of DDP's plain all-reduce, the
    warm-up every other method gets (PowerSGD's ``start_powerSGD_iter``,
    pycomm's ``start_iter``). Steps are counted at each step's last bucket.

    >>> w = _AfterWarmup(2, hook=None)
    >>> w.iter, w.start_iter
    (0, 2)
    """

    def __init__(self, start_iter: int, hook) -> None:
        self.start_iter, self.inner, self.iter = start_iter, hook, 0

    @staticmethod
    def hook(state: "_AfterWarmup", bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        fut = (default_hooks.allreduce_hook(None, bucket) if state.iter < state.start_iter
               else state.inner(None, bucket))
        if bucket.is_last():
            state.iter += 1
        return fut


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

        key = (m.compressor, m.density, m.rounding)
        if key not in self._pycomm_groups:
            settings: Dict[str, Any] = {"compressor": m.compressor, "block_size": self.cfg["block_size"],
                                        "rounding": m.rounding}
            if m.density is not None:
                settings["density"] = m.density
            self._pycomm_groups[key] = pd.wrap(None, **settings)
        return self._pycomm_groups[key]

    def _setup(self, m: Method, start_iter: int, seed: int):
        """(ddp model, optimizer, loss_fn, batch_fn, hook state) for method
        ``m`` and ``seed`` (``optim-*``: ``start_iter`` is the optimizer's
        warm-up)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, batch_fn, loss_fn = workload(self.cfg, seed)
        if m.entry in (DILOCO, TORCHFT):
            # No DDP: DiLoCo's replicas drift between syncs by design. The
            # warm-up's inner AdamW; DiLoCo wraps it after start_iter (train()).
            return model, _optimizer(model, self.cfg), loss_fn, batch_fn, None
        group = self._pycomm_group(m) if m.entry == "backend" else None
        ddp = DDP(model, process_group=group, bucket_cap_mb=self.cfg["bucket_cap_mb"])
        state = None
        if m.entry == "torch":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

            from pycomm.ddp import serialized_hook

            if m.kind == "cast":  # torch's fp16_compress_hook, bf16_compress_hook
                state = _AfterWarmup(start_iter, getattr(default_hooks, f"{m.compressor}_compress_hook"))
                ddp.register_comm_hook(state, _AfterWarmup.hook)
            else:
                state = P.PowerSGDState(process_group=None, matrix_approximation_rank=m.rank,
                                        start_powerSGD_iter=start_iter, use_error_feedback=True,
                                        warm_start=True, random_seed=seed)
                ddp.register_comm_hook(state, serialized_hook(P.powerSGD_hook))
        elif m.pycomm:
            from pycomm.ddp import CompressionState, compressed_hook

            kw: Dict[str, Any] = {"block_size": self.cfg["block_size"], "rounding": m.rounding}
            if m.density is not None:
                kw["density"] = m.density
            state = CompressionState(process_group=group, compressor=m.compressor, start_iter=start_iter,
                                     error_feedback=m.error_feedback, **kw)
            ddp.register_comm_hook(state, compressed_hook)
        opt = _optimizer(ddp, self.cfg, m, start_iter)
        return ddp, opt, loss_fn, batch_fn, state

    @staticmethod
    def _release(state, opt) -> None:
        """Free the residuals a finished method left in its engine group (a
        run with many methods and seeds would otherwise hold them all)."""
        import pycomm.distributed as pd

        for owner in (state, opt):
            engine = getattr(owner, "_engine", None)
            if engine is not None:
                try:
                    pd.reset_error_feedback(group=engine)
                except Exception:  # noqa: BLE001 - memory only: never fail a finished run
                    pass

    def _params_identical(self, ddp) -> bool:
        """Every rank ends with bit-identical parameters (DDP's promise; a
        compressed all-reduce that gave ranks different results breaks it)."""
        return self.me.identical(self.torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))

    def _compress_time(self, m: Method, numel: int) -> Optional[float]:
        """Seconds this rank's compressor takes for one compress + decompress
        of a gradient of ``numel`` elements, all ranks at once (as in
        training), median of 3. None for methods without a pycomm/cast kernel."""
        torch = self.torch
        if m.kind in (None, "exact"):
            return None
        g = torch.randn(numel, generator=torch.Generator().manual_seed(self.rank))
        if m.kind == "cast":
            dt = spec.method_spec(m.compressor).dtype

            def once() -> None:
                g.to(dt).to(torch.float32)
        else:
            import pycomm

            kw = {"density": m.density} if m.density is not None else {"block_size": self.cfg["block_size"]}
            if m.compressor in spec.ROUNDING_METHODS:
                kw["rounding"] = m.rounding
            c = pycomm.get_compressor(m.compressor, **kw)
            r = torch.zeros(numel) if m.error_feedback else None
            if m.entry == "optim":  # the momentum, every element of the model
                r = torch.zeros(numel)

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
        model, batch_fn, loss_fn = workload(self.cfg)
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

        model, batch_fn, loss_fn = workload(self.cfg)
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

    # ---- DiLoCo
    def _average(self, tensors) -> None:
        """Replace ``tensors`` by their mean over the ranks, exactly: one
        flat float32 all-reduce (DDP's own average, without DDP)."""
        with self.torch.no_grad():
            flat = self.torch.cat([t.reshape(-1) for t in tensors])
            self.dist.all_reduce(flat)
            flat.div_(self.world)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _average_gradients(self, model) -> None:
        """DDP's exact gradient average, for a model without DDP (DiLoCo's warm-up)."""
        self._average([p.grad for p in model.parameters() if p.grad is not None])

    def _consensus(self, model):
        """A copy of ``model`` holding the mean of every rank's parameters
        (DiLoCo's replicas differ between syncs; evaluated is their average,
        what an exact sync with outer lr 1 would give). A collective."""
        import copy

        avg = copy.deepcopy(model)
        self._average(list(avg.parameters()))
        return avg

    def _diloco(self, m: Method, model, inner):
        """DiLoCo of method ``m`` around the warm-up's ``inner`` optimizer
        (its AdamW state kept), from the parameters every rank now shares."""
        from pycomm.optim import DiLoCo

        kw: Dict[str, Any] = {}
        if m.kind == "block":
            kw = {"block_size": self.cfg["block_size"], "rounding": m.rounding}
        elif m.kind == "sparse":
            kw = {"density": m.density}
        return DiLoCo(model, inner, sync_every=m.sync_every, fragments=m.fragments, delay=m.delay,
                      compressor=m.compressor, error_feedback=m.error_feedback, rotate=m.rotate,
                      compress_update=m.compress_update,
                      outer_lr=self.cfg.get("outer_lr", DILOCO_OUTER_LR),
                      outer_momentum=self.cfg.get("outer_momentum", DILOCO_OUTER_MOMENTUM), **kw)

    # ---- one method
    def _eval(self, module, batch_fn, loss_fn) -> float:
        """The held-out loss: the mean over ``--eval-batches`` batches no
        rank trains on (the same for every method of a seed)."""
        n = self.cfg.get("eval_batches", EVAL_BATCHES)
        with self.torch.no_grad():
            evals = [float(loss_fn(module, batch_fn(EVAL_RANK + i, 0))) for i in range(n)]
        return sum(evals) / len(evals)

    def _engine_of(self, m: Method, state, opt):
        """The pycomm group that runs ``m``'s compressed collectives (None:
        the method does not use the engine, or has not yet: an optimizer
        in its warm-up)."""
        if m.entry == "backend":
            return self._pycomm_group(m)
        for owner in (state, opt):
            engine = getattr(owner, "_engine", None)
            if engine is not None:
                return engine
        return None

    @staticmethod
    def _engine_profile(engine, steps: int) -> Dict[str, float]:
        """This rank's engine profile over the timed steps (pd.profile), in
        milliseconds (counts: per step)."""
        import pycomm.distributed as pd

        p = pd.profile(engine)
        keys = ("calls", "collectives", "run_s") + pd.PROFILE_PHASES
        return {k.replace("_s", "_ms") if k.endswith("_s") else k:
                p[k] / max(1, steps) * (1000.0 if k.endswith("_s") else 1.0) for k in keys}

    def train(self, m: Method, steps: int, start_iter: int, timed_from: int, report_every: int,
              seed: int, eval_every: int = 0) -> Dict[str, Any]:
        import pycomm.distributed as pd

        ddp, opt, loss_fn, batch_fn, state = self._setup(m, start_iter, seed)
        heldout = eval_batch_fn(self.cfg, seed, batch_fn)
        diloco = m.entry in (DILOCO, TORCHFT)
        torchft = None  # the replica of a torchft-diloco-* method, from start_iter on
        module = ddp if diloco else ddp.module
        eval_tx = 0  # bytes of DiLoCo's evaluation averages, not training's
        numel = sum(p.numel() for p in ddp.parameters())
        times: List[float] = []
        losses: List[float] = []
        curve: List[List[float]] = []
        tx0 = tx1 = None
        engine = None
        self.dist.barrier()
        tx_start = self.me.tx_bytes()
        try:
            for step in range(steps):
                if eval_every and step and step % eval_every == 0:
                    # Untimed, on rank 0 only (the ranks hold the same parameters);
                    # the others wait at the barrier, not in a timed step.
                    tx_eval = self.me.tx_bytes()
                    held_out = self._eval(self._consensus(module) if diloco else module, heldout, loss_fn)
                    if self.rank == 0:
                        curve.append([step, held_out])
                    self.dist.barrier()
                    if tx_eval is not None:
                        eval_tx += self.me.tx_bytes() - tx_eval
                if m.entry == DILOCO and step == start_iter:
                    opt = self._diloco(m, ddp, opt)
                if m.entry == TORCHFT and step == start_iter:
                    torchft = _TorchftReplica(self, m, ddp, opt)  # torchft's hooks on the inner AdamW
                if step == timed_from:
                    tx0 = self.me.tx_bytes()
                    engine = self._engine_of(m, state, opt)
                    if engine is not None:
                        pd.profile(engine, reset=True)
                set_lr(opt, self.cfg, step, steps)
                t0 = time.perf_counter()
                loss = loss_fn(ddp, batch_fn(self.rank, step))
                loss.backward()
                if diloco and step < start_iter:
                    self._average_gradients(ddp)  # the plain warm-up, without DDP
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
                losses.append(float(loss.detach()))
                if (step + 1) % report_every == 0 or step + 1 == steps:
                    self.emit("step", method=m.name, seed=seed, step=step + 1, steps=steps)
        finally:
            if torchft is not None:
                torchft.close()
        if m.entry == DILOCO:
            # A sync still in flight (delay > 0) is applied; the replicas'
            # average is what the recorded studies evaluate (finish()'s final
            # sync of every fragment would add one outer step to them).
            opt.finish(sync_all=False)
        tx1 = self.me.tx_bytes()
        if tx1 is not None:
            tx1 -= eval_tx
        times = self.me.max_over_ranks(times)
        losses = self.me.mean_over_ranks(losses)
        sent = sent_all = None
        if tx0 is not None and tx1 is not None:
            sent, sent_all = self.me.mean_over_ranks([float(tx1 - tx0), float(tx1 - tx_start)])
            sent, sent_all = sent / max(1, steps - timed_from), sent_all / steps
        timed = times[timed_from:]
        stats = summarize(timed)
        window = losses[-min(FINAL_LOSS_WINDOW, len(losses)):]
        # Rank 0 speaks for the group (its record is the one sent), and every
        # rank holds the same parameters (checked below): one evaluation.
        if diloco:
            final = self._eval(self._consensus(module), heldout, loss_fn)
            final = final if self.rank == 0 else math.nan
        else:
            final = self._eval(module, heldout, loss_fn) if self.rank == 0 else math.nan
        if eval_every:
            curve.append([steps, final])
        anchor = (torchft.anchor() if torchft is not None else opt.anchor) if diloco else None
        rec = {
            "method": m.name,
            "entry": m.entry,
            "compressor": m.compressor,
            "error_feedback": m.error_feedback,
            "rounding": m.rounding,
            "variance_update_every": getattr(opt, "variance_update_every", None),
            "optimizer": type(opt).__name__,
            "seed": seed,
            "gradient_numel": numel,
            "steps": steps,
            "start_iter": start_iter,
            "timed_from": timed_from,
            "timed_steps": len(timed),
            "step_time_median_s": stats["median_s"],
            "step_time_p10_s": stats["p10_s"],
            "step_time_p90_s": stats["p90_s"],
            "bytes_sent_per_rank_per_step": sent,
            "bytes_sent_per_rank_per_step_all_steps": sent_all,
            "final_loss": final,
            "train_loss_last": sum(window) / len(window),
            "loss_per_step": losses,
            "eval_loss_curve": curve if eval_every else None,
            "step_times_s": times,
            # DiLoCo's replicas differ by design; its promise is the same anchor.
            "params_identical": self.me.identical(self.torch.cat([a.reshape(-1) for a in anchor]))
                                if diloco else self._params_identical(ddp),
        }
        if engine is not None:
            rec["engine_profile_ms_per_step"] = self._engine_profile(engine, len(timed))
        rec["compress_time_s"] = self._compress_time(m, numel)
        if m.compressor == AUTO:
            import pycomm.distributed as pd

            # What the calibration chose for each bucket (and the whole table).
            cal = pd.calibration(self._pycomm_group(m))
            rec["auto_bucket_methods"] = {str(b.buffer().numel()): cal.choose(b.buffer().numel())
                                          for b in ddp.reducer._get_zeros_like_grad_buckets()}
            rec["auto_calibration"] = cal.to_dict()
        if torchft is not None:
            rec.update(torchft.record(numel))
        if m.entry == DILOCO:
            rec["diloco_bytes_per_step"] = opt.bytes_per_step(world_size=self.world)
            rec["diloco_bytes_per_sync"] = opt.bytes_per_sync(world_size=self.world)
            rec["diloco_syncs"] = opt.syncs
            rec["diloco_outer_lr"], rec["diloco_outer_momentum"] = opt.outer_lr, opt.outer_momentum
            rec["diloco_memory_bytes"] = opt.memory_bytes()
            rec["optimizer"] = f"DiLoCo({type(opt.inner).__name__})"
            opt = opt._session  # its engine group's residuals are released below
        if m.entry == "optim":
            # The optimizer's own count (from the spec) of what a compressed step sends.
            rec["optim_bytes_per_step"] = {"exact": opt.bytes_per_step(compressed=False),
                                           "compressed": opt.bytes_per_step(compressed=True)}
        self._release(state, opt)
        del ddp, opt, state
        return rec


#: Seconds any torchft wait may take in a rank (a quorum, a collective, a
#: connection) before it raises: a hung replica ends the run, never stalls it.
TORCHFT_TIMEOUT_S = 60.0


def _own_addr(peer: str) -> str:
    """The address this process reaches ``peer`` from (its own side of the
    route: 127.0.0.1 on loopback, the namespace's address on an emulated
    link), which its peers can reach it at. No packet is sent.

    >>> _own_addr("127.0.0.1")
    '127.0.0.1'
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


class _TorchftReplica:
    """One rank as one torchft replica, from the parameters the warm-up
    left (the same on every rank): rank 0 runs the lighthouse
    (``min_replicas`` = the ranks, so every quorum holds all of them)
    inside its own process, so that it cannot outlive the run; each rank its own TCPStore and ``torchft.Manager`` (group world
    size 1, synchronous quorum as torchft's DiLoCo requires, no sync at
    step 0: the replicas start equal), and torchft's DiLoCo is entered
    around the inner optimizer ``inner``, whose step hooks then do the
    syncs. :meth:`close` ends all of it (a ``finally`` of the training
    loop); every wait of torchft is bounded by :data:`TORCHFT_TIMEOUT_S`.
    """

    def __init__(self, trainer: "_RankTrainer", m: Method, model, inner) -> None:
        import os
        from datetime import timedelta

        import torch
        from torchft import Manager, ProcessGroupGloo
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo

        self.lighthouse = self.manager = self.diloco = self.store = None
        self.committed: Optional[int] = None
        self.sync_every, self.world = m.sync_every, trainer.world
        try:
            addr = _own_addr(os.environ["MASTER_ADDR"])
            lighthouse = [None]
            if trainer.rank == 0:
                self.lighthouse = LighthouseServer(bind=f"{addr}:0", min_replicas=trainer.world,
                                                   join_timeout_ms=int(TORCHFT_TIMEOUT_S * 1000))
                # Its own address names this host; the peers reach it at addr.
                lighthouse = [f"http://{addr}:{self.lighthouse.address().rsplit(':', 1)[1]}"]
            trainer.dist.broadcast_object_list(lighthouse, src=0)
            timeout = timedelta(seconds=TORCHFT_TIMEOUT_S)
            self.store = torch.distributed.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                                    timeout=timeout)
            self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                                   min_replica_size=trainer.world, use_async_quorum=False,
                                   replica_id=f"replica_{trainer.rank}", lighthouse_addr=lighthouse[0],
                                   store_addr=addr, store_port=self.store.port, rank=0, world_size=1,
                                   hostname=addr, timeout=timeout, quorum_timeout=timeout,
                                   connect_timeout=timeout, init_sync=False)
            outer = torch.optim.SGD(model.parameters(), lr=trainer.cfg.get("outer_lr", DILOCO_OUTER_LR),
                                    momentum=trainer.cfg.get("outer_momentum", DILOCO_OUTER_MOMENTUM),
                                    nesterov=True)
            self.outer_lr, self.outer_momentum = outer.defaults["lr"], outer.defaults["momentum"]
            self.diloco = TorchftDiLoCo(self.manager, [model], inner, outer_optimizer=outer,
                                        sync_every=m.sync_every)
            self.diloco.__enter__()
        except BaseException:
            self.close()
            raise

    def anchor(self) -> List[Any]:
        """The parameters of the last sync, torchft's backup copy (the same
        on every replica after each committed sync)."""
        return [t for f in self.diloco._fragments for t in f.original_parameters.values()]

    def close(self) -> None:
        """Leave DiLoCo (its hooks off the inner optimizer), shut the
        Manager and the lighthouse down; safe to call twice."""
        try:
            if self.diloco is not None:
                self.diloco.__exit__(None, None, None)
            if self.manager is not None:
                self.committed = self.manager.current_step()  # one per committed outer sync
                self.manager.shutdown(wait=False)
        finally:
            if self.lighthouse is not None:
                self.lighthouse.shutdown()
            self.manager = self.lighthouse = self.store = None  # self.diloco stays: its anchor is read after

    def record(self, numel: int) -> Dict[str, Any]:
        """The record's torchft fields. Bytes by the same formula as
        ``diloco-*`` (``DiLoCo.bytes_per_step``): one exact float32
        all-reduce of the whole model per sync, over every rank."""
        import importlib.metadata

        per_sync = spec.wire_bytes(spec.EXACT_METHOD, numel, self.world)
        return {
            "torchft_version": importlib.metadata.version("torchft"),
            "diloco_bytes_per_sync": per_sync,
            "diloco_bytes_per_step": per_sync / self.sync_every,
            "diloco_bytes_formula": "spec.wire_bytes('none', n, W) / H: an exact float32 all-reduce of the "
                                    "whole model every H steps (as DiLoCo.bytes_per_step counts it)",
            "diloco_syncs": self.committed,
            "diloco_outer_lr": self.outer_lr, "diloco_outer_momentum": self.outer_momentum,
            "diloco_memory_bytes": None,
            "optimizer": "torchft.local_sgd.DiLoCo(AdamW)",
            "torchft_quantize": False,
            "torchft_note": "exact sync: torchft's should_quantize path needs an accelerator and does not run on "
                            "CPU; one torchft replica per rank (group world size 1), a lighthouse with "
                            "min_replicas = ranks, Manager(use_async_quorum=False, init_sync=False)",
        }


def _rank_main(rank: Rank) -> None:
    """One rank (:func:`pycomm_bench.launch.run_ranks`): the baselines, then every method of the plan."""
    trainer = _RankTrainer(rank)
    trainer.emit("compute", compute_time_s=trainer.compute_time(), nocomm_step_time_s=trainer.nocomm_step_time())
    for seed in rank.cfg["seeds"]:
        for run in rank.cfg["plan"]:
            rec = trainer.train(parse_method(run["method"]), run["steps"], run["start_iter"], run["timed_from"],
                                max(1, run["steps"] // 20), seed,
                                rank.cfg.get("eval_every", 0) if run["training"] else 0)
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
    if args.ranks < 1:  # 1: one process, e.g. DiLoCo with one replica against plain AdamW
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    bws, rates = parse_bandwidths(args.bandwidth, QUICK_BANDWIDTHS if args.quick else DEFAULT_BANDWIDTHS,
                                  getattr(args, "netns", True))
    args.bandwidth = bws
    args.rates = rates
    methods = split_list(args.methods) or (QUICK_METHODS if args.quick else DEFAULT_METHODS)
    for name in methods:
        try:
            error_feedback_suffix(name, default_on=True, where="pycomm-bench ddp")
            parse_method(name)
        except ValueError as exc:
            raise ValueError(f"--methods: {exc}") from None
    if any(parse_method(name).entry == TORCHFT for name in methods):
        import importlib.util

        if importlib.util.find_spec("torchft") is None:
            raise ValueError("--methods: torchft-diloco-* trains with torchft's DiLoCo: pip install torchft")
    if getattr(args, "optimizer", DEFAULT_OPTIMIZER) != "adamw":
        for name in methods:
            if parse_method(name).entry in (DILOCO, TORCHFT):
                raise ValueError(f"--methods: {name}: DiLoCo's outer step (Nesterov, lr 0.7) is tuned for an "
                                 f"AdamW inner optimizer: use --optimizer adamw")
            if parse_method(name).variance_every is not None:
                raise ValueError(f"--methods: {name}: -v<K> sets OneBitAdam's variance updates "
                                 f"(--optimizer adamw), not {args.optimizer}'s")
    args.methods = with_baseline(methods, ALLREDUCE, add=getattr(args, "baseline", True))
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if args.start_iter is None:
        args.start_iter = min(DEFAULT_START_ITER, max(2, args.steps // 4))
    if args.start_iter < 2:
        raise ValueError(f"--start-iter must be >= 2 (DDP rebuilds its buckets after step 1), got {args.start_iter}")
    if args.steps < args.start_iter + 3:
        raise ValueError(f"--steps ({args.steps}) must exceed --start-iter ({args.start_iter}) by at least 3")
    if getattr(args, "optim_warmup", None) is None:
        args.optim_warmup = max(args.start_iter, round(OPTIM_WARMUP_FRACTION * args.steps))
    if args.optim_warmup < 2:
        raise ValueError(f"--optim-warmup must be >= 2 (DDP rebuilds its buckets after step 1), got {args.optim_warmup}")
    if any(m.startswith("optim-") for m in methods) and args.steps < args.optim_warmup + 3:
        raise ValueError(f"--steps ({args.steps}) must exceed --optim-warmup ({args.optim_warmup}) by at least 3")
    if getattr(args, "eval_every", 0) and args.eval_every >= args.steps:
        raise ValueError(f"--eval-every ({args.eval_every}) must be below --steps ({args.steps})")
    if args.train_bandwidth is None:
        args.train_rate = 1e9 if 1e9 in rates else rates[0]
    else:
        try:
            args.train_rate = parse_rate(args.train_bandwidth)
        except ValueError as exc:
            raise ValueError(f"--train-bandwidth: {exc}") from None
        if args.train_rate not in rates:
            raise ValueError(f"--train-bandwidth {args.train_bandwidth} is not one of --bandwidth {bws}")
    # DiLoCo's own checks, here instead of inside every rank.
    if not getattr(args, "outer_lr", DILOCO_OUTER_LR) > 0:
        raise ValueError(f"--outer-lr must be > 0, got {args.outer_lr}")
    if not 0 <= getattr(args, "outer_momentum", DILOCO_OUTER_MOMENTUM) < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if not 0.0 <= args.heldout < 1.0:
        raise ValueError(f"--heldout must be in [0, 1), got {args.heldout}")
    if args.heldout and args.workload != "lm":
        raise ValueError("--heldout: only the language model (--workload lm) has text to hold out")
    if args.lr_warmup >= args.steps:
        raise ValueError(f"--lr-warmup ({args.lr_warmup}) must be below --steps ({args.steps})")
    if args.block_size % 32:
        raise ValueError(f"--block-size must be a multiple of 32, got {args.block_size}")
    if args.batch_size is None:
        args.batch_size = 1 if args.workload == "lm" else 32
    if args.json is None:
        suffix = "" if args.workload == "lm" else f"-{args.workload}"
        args.json = default_json_path("ddp", "cpu", quick=args.quick, settings=f"{args.ranks}ranks{suffix}")
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ddp`` options (the common ones are already there)."""
    from .cli import nonnegative_int, positive_int

    g = parser.add_argument_group("ddp options")
    add_sweep_options(g, bandwidth_help="link rates, comma or space separated, e.g. 100mbit,1gbit,2.5gbit,none "
                                        f"(none: unshaped; default: {','.join(DEFAULT_BANDWIDTHS)}; "
                                        f"{','.join(QUICK_BANDWIDTHS)} with --quick)",
                      netns_prefix="pycomm-ddp", baseline=ALLREDUCE)
    g.add_argument("--train-bandwidth", default=None, metavar="RATE",
                   help="the rate at which every method trains --steps steps (default: 1gbit if "
                        "swept, else the first); elsewhere only --time-steps are timed")
    g.add_argument("--methods", nargs="+", metavar="METHOD", default=None,
                   help=f"{vocabulary(DDP_BASES, suffixes=True)} (optim-*: the compressed-momentum optimizer "
                        "matching --optimizer; default: all of "
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
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default=DEFAULT_OPTIMIZER,
                   help=f"adamw, or sgd with momentum 0.9 (default: {DEFAULT_OPTIMIZER})")
    g.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: {DEFAULT_LR['adamw']:g} for adamw, {DEFAULT_LR['sgd']:g} for sgd)")
    g.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"onebit block size of the pycomm methods (default: {DEFAULT_BLOCK_SIZE})")
    g.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB,
                   help=f"DDP bucket size (default: {DEFAULT_BUCKET_CAP_MB:g})")
    g.add_argument("--optim-warmup", type=positive_int, default=None, metavar="STEPS",
                   help="optim-* methods: steps of exact averaging before the momentum is compressed "
                        f"(default: {OPTIM_WARMUP_FRACTION * 100:.0f}%% of --steps, at least --start-iter)")
    g.add_argument("--outer-lr", type=float, default=DILOCO_OUTER_LR,
                   help=f"diloco-* methods: the outer SGD's learning rate (default: {DILOCO_OUTER_LR})")
    g.add_argument("--outer-momentum", type=float, default=DILOCO_OUTER_MOMENTUM,
                   help=f"diloco-* methods: the outer SGD's Nesterov momentum, 0 for none "
                        f"(default: {DILOCO_OUTER_MOMENTUM})")
    g.add_argument("--eval-every", type=nonnegative_int, default=0, metavar="STEPS",
                   help="also record the held-out loss every STEPS training steps (untimed; 0: only at the end)")
    g.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="run nothing: combine these result files (the same settings, different seeds) into "
                        "--json, as if they had been one run with every seed")
    g.add_argument("--train-all", action="store_true",
                   help="train every method --steps steps at the training bandwidth, -backend ones too "
                        "(by default those are only timed there: their training is their hook twin's, bit for bit)")
    g.add_argument("--time-only", action="store_true",
                   help="train nothing: every method is only timed (--time-steps) at every --bandwidth, e.g. "
                        "to put a quality study's loss curves on a link's clock (pycomm-bench quality --links)")
    g.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="do not train allreduce unless --methods names it (for a run to be --merge'd with "
                        "files of the same settings and seeds that hold it: training is deterministic, and "
                        "the merge checks that shared seeds agree); ratios to it come from the merge")


def run_ddp(args: argparse.Namespace, out=sys.stdout) -> List[Dict[str, Any]]:
    """Run the sweep; the list of records (one per method and bandwidth,
    each holding every seed's results)."""
    order = [args.train_rate] + [r for r in args.rates if r != args.train_rate]
    plans = {r: run_plan(args, r == args.train_rate and not getattr(args, "time_only", False)) for r in order}
    seeds = list(range(args.seed, args.seed + args.seeds))
    total = len(seeds) * sum(run["steps"] for plan in plans.values() for run in plan)
    bar = progress_bar(total, "step", args.progress)
    date = _dt.date.today().isoformat()
    machine = machine_info("cpu")
    records: List[Dict[str, Any]] = []
    try:
        for rate in order:
            plan = plans[rate]
            cfg = {
                "workload": args.workload, "batch_size": args.batch_size, "seed": seeds[0], "seeds": seeds,
                "seq_len": args.seq_len, "model": args.model, "optimizer": args.optimizer,
                "block_size": args.block_size, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
                "lr": args.lr, "lr_schedule": args.lr_schedule, "lr_warmup": args.lr_warmup,
                "heldout": args.heldout, "text_files": getattr(args, "text_files", 64),
                "text_bytes": getattr(args, "text_bytes", 2_000_000), "bucket_cap_mb": args.bucket_cap_mb, "plan": plan,
                "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
            }
            events, cluster, busbw = train_at(_rank_main, args, rate, cfg, bar, out)
            baselines = next(({k: v for k, v in e.items() if k not in ("event", "rank")}
                              for e in events if e["event"] == "compute"), {})
            runs = {run["method"]: run for run in plan}
            per_method: Dict[str, List[Dict[str, Any]]] = {}
            for rec in (e["record"] for e in events if e["event"] == "result"):
                run = runs[rec["method"]]
                sent = per_rank_bytes(rec["bytes_sent_per_rank_per_step"], cluster, args.ranks)
                sent_all = per_rank_bytes(rec["bytes_sent_per_rank_per_step_all_steps"], cluster, args.ranks)
                rec.update({
                    "bandwidth": rate,
                    "link_busbw_measured": busbw,
                    "emulated": cluster.emulated,
                    "link": cluster.describe(),
                    "ranks": args.ranks,
                    "workload": args.workload,
                    "model": args.model,
                    "optimizer": args.optimizer,
                    "optimizer_class": rec.pop("optimizer"),
                    "lr": args.lr,
                    "lr_schedule": args.lr_schedule,
                    "lr_warmup": args.lr_warmup,
                    "heldout": args.heldout,
                    "eval_batches": args.eval_batches,
                    "batch_size": args.batch_size,
                    "seq_len": _seq_len(args),
                    "block_size": args.block_size,
                    "training_run": run["training"],
                    "loss_from": run.get("loss_from"),
                    "bytes_sent_per_rank_per_step": sent,
                    "bytes_sent_per_rank_per_step_all_steps": sent_all,
                    "tokens_per_step": args.ranks * args.batch_size * _seq_len(args) if args.workload == "lm" else None,
                    "samples_per_step": args.ranks * args.batch_size,
                    "compute_time_s": baselines.get("compute_time_s"),
                    "nocomm_step_time_s": baselines.get("nocomm_step_time_s"),
                    "date": date,
                    "machine": {k: machine.get(k) for k in ("node", "cpu_model", "cpu_count", "torch", "pycomm")},
                })
                per_method.setdefault(rec["method"], []).append(rec)
            for run in plan:
                records.append(combine_seeds(per_method[run["method"]]))
    finally:
        bar.close()
    finish_records(records)
    return records


#: Per-seed fields of a record, kept in its ``per_seed`` list; everything
#: else of a record is the same for every seed (settings, link, baselines)
#: or an aggregate :func:`combine_seeds` computes.
PER_SEED_FIELDS = ("seed", "final_loss", "train_loss_last", "bytes_sent_per_rank_per_step",
                   "bytes_sent_per_rank_per_step_all_steps", "step_time_median_s",
                   "params_identical", "compress_time_s", "timed_from", "loss_per_step", "step_times_s",
                   "eval_loss_curve", "optim_bytes_per_step", "engine_profile_ms_per_step", "diloco_syncs")
#: Settings that must agree between runs whose seeds are combined (--merge).
SAME_FOR_EVERY_SEED = ("method", "bandwidth", "ranks", "workload", "model", "optimizer", "lr", "lr_schedule",
                       "lr_warmup", "heldout",
                       "batch_size", "eval_batches",
                       "seq_len", "block_size", "steps", "start_iter", "training_run", "emulated",
                       "diloco_outer_lr", "diloco_outer_momentum")


def combine_seeds(recs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One record of a method at one bandwidth from its per-seed records
    (:func:`pycomm_bench.sweep.combine_seeds`, the settings of
    :data:`SAME_FOR_EVERY_SEED` checked), plus ``params_identical`` (every
    seed), the compression time (median), the engine profile and
    ``eval_loss_curve`` (means over seeds). With one seed every field is
    that seed's.

    >>> r = lambda seed, loss: dict(method="m", seed=seed, final_loss=loss, train_loss_last=loss,
    ...     bytes_sent_per_rank_per_step=1.0, params_identical=True, timed_from=1, compress_time_s=None,
    ...     loss_per_step=[3.0, loss], step_times_s=[9.0, 0.1 * seed + 0.1], eval_loss_curve=None)
    >>> c = combine_seeds([r(1, 2.2), r(0, 2.0)])
    >>> c["seeds"], round(c["final_loss"], 3), round(c["final_loss_std"], 3), c["loss_per_step"]
    ([0, 1], 2.1, 0.141, [3.0, 2.1])
    """
    out = combine_seed_records(recs, PER_SEED_FIELDS, SAME_FOR_EVERY_SEED)
    recs = sorted(recs, key=lambda r: r["seed"])
    out["params_identical"] = all(r["params_identical"] for r in recs)
    ct = [r["compress_time_s"] for r in recs if r.get("compress_time_s") is not None]
    out["compress_time_s"] = median(ct) if ct else None
    out["timed_from"] = recs[0]["timed_from"]
    profiles = [r["engine_profile_ms_per_step"] for r in recs if r.get("engine_profile_ms_per_step")]
    if profiles:
        out["engine_profile_ms_per_step"] = {k: mean([p[k] for p in profiles]) for k in profiles[0]}
    if recs[0].get("optim_bytes_per_step") is not None:
        out["optim_bytes_per_step"] = recs[0]["optim_bytes_per_step"]
    for k in ("diloco_bytes_per_step", "diloco_bytes_per_sync", "diloco_memory_bytes"):
        if recs[0].get(k) is not None:  # the same count for every seed
            out[k] = recs[0][k]
    curves = [r.get("eval_loss_curve") for r in recs]
    out["eval_loss_curve"] = None
    if all(curves):
        steps = sorted(set.intersection(*({p[0] for p in c} for c in curves)))
        at = [{p[0]: p[1] for p in c} for c in curves]
        out["eval_loss_curve"] = [[s, mean([a[s] for a in at])] for s in steps]
    return out


def finish_records(records: List[Dict[str, Any]]) -> None:
    """The fields derived from the combined step times and losses: tokens/s,
    samples/s, compression share, speedups, loss ratios, flattening."""
    for r in records:
        t = r["step_time_median_s"]
        timed = r["step_times_s"][r["timed_from"]:]
        # The median hides a rare slow step (DiLoCo's sync every H/F steps): the mean does not.
        r["step_time_mean_s"] = mean(timed) if timed else None
        r["tokens_per_s"] = r["tokens_per_step"] / t if r.get("tokens_per_step") else None
        r["samples_per_s"] = r["samples_per_step"] / t if r.get("samples_per_step") else None
        r["compress_time_share"] = r["compress_time_s"] / t if r.get("compress_time_s") is not None else None
        if not r.get("training_run"):
            r.pop("loss_per_step", None)
    add_speedups(records)
    add_loss_ratios(records)
    add_flattening(records)


def add_loss_ratios(records: List[Dict[str, Any]]) -> None:
    """Per training record: its final loss over ``allreduce``'s of the SAME
    seed at the same bandwidth, per seed (``final_loss_vs_allreduce_per_seed``)
    and their mean, min and max (None without a baseline of that seed).

    >>> recs = [dict(method=m, bandwidth=None, training_run=True, per_seed=[dict(seed=s, final_loss=l)
    ...         for s, l in zip((0, 1), ls)]) for m, ls in (("allreduce", (2.0, 4.0)), ("x", (2.2, 4.0)))]
    >>> add_loss_ratios(recs)
    >>> recs[1]["final_loss_vs_allreduce_per_seed"], recs[1]["final_loss_vs_allreduce_max"]
    ([1.1, 1.0], 1.1)
    """
    base = {r["bandwidth"]: {p["seed"]: p["final_loss"] for p in r.get("per_seed", [])}
            for r in records if r["method"] == ALLREDUCE and r.get("training_run")}
    for r in records:
        ratios = None
        plain = base.get(r["bandwidth"], {})
        if r.get("training_run") and r.get("per_seed") and all(p["seed"] in plain for p in r["per_seed"]):
            ratios = [round(p["final_loss"] / plain[p["seed"]], 12) for p in r["per_seed"]]
        r["final_loss_vs_allreduce_per_seed"] = ratios
        r["final_loss_vs_allreduce_mean"] = mean(ratios) if ratios else None
        r["final_loss_vs_allreduce_min"] = min(ratios) if ratios else None
        r["final_loss_vs_allreduce_max"] = max(ratios) if ratios else None


def add_flattening(records: List[Dict[str, Any]]) -> None:
    """On records with a held-out loss curve (``--eval-every``):
    ``eval_loss_change_last_quarter``, the relative change of the held-out
    loss (mean over seeds) from the evaluation nearest 75% of the steps to
    the end (e.g. -0.01: it still fell 1% over the last quarter)."""
    for r in records:
        curve = r.get("eval_loss_curve")
        r["eval_loss_change_last_quarter"] = None
        if curve and len(curve) >= 2:
            last_step, last = curve[-1]
            step, loss = min(curve[:-1], key=lambda p: abs(p[0] - 0.75 * last_step))
            r["eval_loss_change_last_quarter"] = last / loss - 1
            r["eval_loss_change_from_step"] = step


def merge_files(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The records of several ``pycomm-bench ddp`` JSON files made with
    different seeds (same settings otherwise), combined as if they had been
    one run: every (method, bandwidth) pools its seeds, then speedups and
    loss ratios are recomputed. A seed of a method found in two files is
    kept once (the first) if both trained to the same final loss (training
    is deterministic: e.g. the ``allreduce`` baseline that every run
    includes); ValueError if they differ, or if the files' settings do."""
    import json

    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    order: List[Tuple[str, str]] = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            recs = json.load(fh)
        for rec in recs:
            if "per_seed" not in rec:
                raise ValueError(f"{path}: record of {rec.get('method')!r} has no per_seed results "
                                 f"(written before --seeds existed?)")
            key = (rec["method"], json_key(rec["bandwidth"]))
            if key not in groups:
                groups[key] = []
                order.append(key)
            meta = {k: v for k, v in rec.items() if k not in PER_SEED_FIELDS and k != "per_seed"}
            for p in rec["per_seed"]:
                same = [q for q in groups[key] if q["seed"] == p["seed"]]
                if same and same[0]["final_loss"] == p["final_loss"]:
                    continue  # the same training again
                if same:
                    raise ValueError(f"{rec['method']}: seed repeated in {path} with another final loss "
                                     f"({p['final_loss']} vs {same[0]['final_loss']})")
                groups[key].append(dict(meta, **p))
    records = [combine_seeds(groups[k]) for k in order]
    finish_records(records)
    return records


def run_plan(args: argparse.Namespace, training: bool) -> List[Dict[str, Any]]:
    """What each method runs at one bandwidth: ``--steps`` at the training
    bandwidth, ``--time-steps`` timed steps after a 2-step warm-up elsewhere.
    A ``-backend`` method whose hook twin also runs is only timed at the
    training bandwidth too: the backend and the hook compute the same thing
    bit for bit (tests/test_bench_ddp.py checks it on the same run), so its
    loss is the twin's (``loss_from``) and training it again would only
    double the run time. An ``optim-*`` method's warm-up (its
    ``start_iter``) is ``--optim-warmup`` when it trains; its timed steps
    (and bytes) start after it. A ``diloco-*`` method syncs every H/F
    steps: where it is only timed, its timed steps are rounded up to whole
    periods of H (its t-th DiLoCo step is the (t+1)-th timed one, so
    ``--time-steps`` rounded up to k*H timed steps hold exactly k syncs of
    each fragment).

    >>> a = argparse.Namespace(methods=["allreduce", "onebit", "onebit-backend", "optim-onebit"], steps=100,
    ...                        start_iter=10, time_steps=5, optim_warmup=20)
    >>> [(r["method"], r["steps"], r["training"], r["timed_from"]) for r in run_plan(a, True)]
    [('allreduce', 100, True, 11), ('onebit', 100, True, 11), ('onebit-backend', 7, False, 3), ('optim-onebit', 100, True, 21)]
    >>> a.methods = ["diloco-H16-int4"]
    >>> [(r["steps"] - r["timed_from"], r["timed_from"]) for r in run_plan(a, False)]
    [(16, 3)]
    """
    timing = {"steps": TIMING_START_ITER + args.time_steps, "start_iter": TIMING_START_ITER,
              "timed_from": TIMING_START_ITER + 1, "training": False}
    full = {"steps": args.steps, "start_iter": args.start_iter, "timed_from": args.start_iter + 1,
            "training": True}
    warmup = getattr(args, "optim_warmup", None) or args.start_iter
    plan = []
    for name in args.methods:
        twin = name[: -len("-backend")] if name.endswith("-backend") else None
        if not training and parse_method(name).sync_every is not None:  # diloco-*, torchft-diloco-*
            h = parse_method(name).sync_every
            timed = -(-args.time_steps // h) * h
            plan.append({"method": name, **timing, "steps": timing["timed_from"] + timed})
        elif not training:
            plan.append({"method": name, **timing})
        elif twin is not None and twin in args.methods and not getattr(args, "train_all", False):
            plan.append({"method": name, **timing, "loss_from": twin})
        elif name.startswith("optim-"):
            plan.append({"method": name, **full, "start_iter": warmup, "timed_from": warmup + 1})
        else:
            plan.append({"method": name, **full})
    return plan


def _seq_len(args: argparse.Namespace) -> int:
    return args.seq_len if args.workload == "lm" else 1


# --------------------------------------------------------------------------- analysis


def step_time_stat(r: Dict[str, Any]) -> str:
    """The statistic a record's step time is reported and compared by: the
    median, robust on a shared machine, but the mean for DiLoCo, whose
    median is a step without a sync and hides the sync every H/F steps.

    >>> step_time_stat(dict(entry="diloco")), step_time_stat(dict(entry="torchft")), step_time_stat(dict(entry="hook"))
    ('mean', 'mean', 'median')
    """
    return "mean" if r.get("entry") in (DILOCO, TORCHFT) else "median"


def add_speedups(records: List[Dict[str, Any]]) -> None:
    """Add ``speedup_vs_allreduce``: plain's step time over the method's, at
    the same bandwidth, both by the method's statistic (:func:`step_time_stat`)."""
    base = {r["bandwidth"]: r for r in records if r["method"] == ALLREDUCE}
    for r in records:
        key = f"step_time_{step_time_stat(r)}_s"
        b = base.get(r["bandwidth"], {}).get(key)
        r["speedup_vs_allreduce"] = b / r[key] if b and r.get(key) else None


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
        if r["method"] == ALLREDUCE or r.get("speedup_vs_allreduce") is None:
            continue
        by_method.setdefault(r["method"], []).append((effective_bw(r), r["speedup_vs_allreduce"]))
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
    plain_loss = train.get(ALLREDUCE, {}).get("final_loss")
    be = break_even(records)
    headers = ["method"] + [f"{fmt_rate(b) if b else 'unshaped'}\nms (x plain)" for b in bws]
    headers += ["MB sent/rank/step\n(train link)", "compress\nshare",
                "held-out loss\n(vs plain" + (": mean, min-max over seeds)" if any(
                    len(r.get("seeds", ())) > 1 for r in records) else ")"), "ranks\nidentical",
                "break-even"]
    rows = []
    for m in methods:
        row = [m]
        for b in bws:
            r = cell.get((m, b))
            if r is None:
                row.append("-")
                continue
            sp, stat = r.get("speedup_vs_allreduce"), step_time_stat(r)
            t = f"{r[f'step_time_{stat}_s'] * 1e3:.0f}" + ("" if stat == "median" else f" {stat}")
            row.append(f"{t} ({sp:.2f}x)" if sp else t)
        t = train.get(m) or next((r for r in records if r["method"] == m and r.get("loss_from")), {})
        sent = t.get("bytes_sent_per_rank_per_step")
        row.append(fmt_number(sent / 1e6) if sent is not None else "-")
        share = t.get("compress_time_share")
        row.append(f"{share * 100:.0f}%" if share is not None else "-")
        row.append(_loss_cell(t, train, plain_loss))
        row.append("yes" if all(r.get("params_identical") for r in records if r["method"] == m) else "NO")
        e = be.get(m)
        row.append("-" if e is None else (fmt_rate(e["bits_per_s"]) if e["bits_per_s"] else e["note"].split(" (")[0]))
        rows.append(row)
    return table(rows, headers, tablefmt="github")


def _loss_cell(t: Dict[str, Any], train: Dict[str, Dict[str, Any]], plain_loss: Optional[float]) -> str:
    """``loss (x plain)``; over several seeds ``mean ±std (x plain: mean of
    the per-seed ratios, min-max)``."""
    loss = t.get("final_loss")
    if t.get("loss_from"):
        loss = train.get(t["loss_from"], {}).get("final_loss")
        return f"as {t['loss_from']}" if loss is not None else "-"
    if loss is None:
        return "-"
    ratios = t.get("final_loss_vs_allreduce_per_seed")
    if ratios and len(ratios) > 1:
        return (f"{loss:.3f} ±{t['final_loss_std']:.3f} ({t['final_loss_vs_allreduce_mean']:.3f}, "
                f"{t['final_loss_vs_allreduce_min']:.3f}-{t['final_loss_vs_allreduce_max']:.3f})")
    if ratios:
        return f"{loss:.3f} ({ratios[0]:.3f})"
    return f"{loss:.3f} ({loss / plain_loss:.3f})" if plain_loss else "-"


def format_flattening(records: List[Dict[str, Any]]) -> str:
    """One line per training ``allreduce`` record with a held-out loss curve:
    how much its loss still fell over the last quarter of the steps."""
    lines = []
    for r in records:
        if r["method"] == ALLREDUCE and r.get("eval_loss_change_last_quarter") is not None:
            pts = ", ".join(f"{s}: {v:.3f}" for s, v in r["eval_loss_curve"])
            lines.append(f"allreduce held-out loss (mean over {len(r['seeds'])} seed(s)) by step: {pts}\n"
                         f"change from step {r['eval_loss_change_from_step']} to {r['steps']}: "
                         f"{r['eval_loss_change_last_quarter'] * 100:+.2f}%")
    return "\n".join(lines)


def format_profile(records: List[Dict[str, Any]]) -> str:
    """Where the engine's thread spent each timed step (rank 0, ms per step,
    ``pycomm.distributed.profile``), one row per method and link that ran
    the engine; "" when none did.

    >>> p = dict(calls=3.0, collectives=7.0, run_ms=20.0, queued_ms=1.0, check_ms=0.0,
    ...          encode_ms=6.0, wire_ms=11.0, decode_ms=2.5, other_ms=0.5)
    >>> print(format_profile([dict(method="onebit", bandwidth=1e9, step_time_median_s=0.1,
    ...                            engine_profile_ms_per_step=p)]))
    engine thread per step (rank 0, ms):
    method    link        step    calls    collectives    run    queued    check    encode    wire    decode    other
    onebit    1 Gbit/s     100        3              7     20         1        0         6      11       2.5      0.5
    """
    from tabulate import tabulate

    rows = []
    for r in records:
        p = r.get("engine_profile_ms_per_step")
        if not p:
            continue
        link = "unshaped" if not r.get("bandwidth") else f"{r['bandwidth'] / 1e9:g} Gbit/s"
        rows.append([r["method"], link, round(r["step_time_median_s"] * 1e3, 1), round(p["calls"], 1),
                     round(p["collectives"], 1)] +
                    [round(p[k], 2) for k in ("run_ms", "queued_ms", "check_ms", "encode_ms", "wire_ms",
                                              "decode_ms", "other_ms")])
    if not rows:
        return ""
    head = ["method", "link", "step", "calls", "collectives", "run", "queued", "check", "encode", "wire",
            "decode", "other"]
    return "engine thread per step (rank 0, ms):\n" + tabulate(rows, head, tablefmt="plain")


def format_diloco(records: List[Dict[str, Any]]) -> str:
    """One line per ``diloco-*`` record: its bytes per step as measured
    (the table's column) with ``DiLoCo.bytes_per_step``'s formula beside it,
    against plain all-reduce's measured bytes, and its state; the table's
    step time for these rows is the mean (:func:`step_time_stat`). "" without one.

    >>> print(format_diloco([dict(method="allreduce", bandwidth=None, bytes_sent_per_rank_per_step=3e7),
    ...                      dict(method="diloco-H16", bandwidth=None, bytes_sent_per_rank_per_step=2.1e6,
    ...                           diloco_bytes_per_step=2e6, diloco_memory_bytes=4e7, error_feedback=False)]))
    DiLoCo rows: step time is the mean over the timed steps (the median is a step without a sync).
    diloco-H16 (unshaped, error feedback off): 2.10 MB/step measured (2.00 MB by DiLoCo.bytes_per_step; 14x fewer than allreduce's measured 30.0 MB), 40.0 MB of DiLoCo state per rank
    """
    plain = {r["bandwidth"]: r for r in records if r["method"] == ALLREDUCE}
    lines = []
    for r in records:
        if r.get("diloco_bytes_per_step") is None:
            continue
        p = plain.get(r["bandwidth"], {})
        link = "unshaped" if not r["bandwidth"] else f"{r['bandwidth'] / 1e9:g} Gbit/s"
        sent, formula = r.get("bytes_sent_per_rank_per_step"), r["diloco_bytes_per_step"]
        mine = sent if sent is not None else formula
        head = f"{fmt_number(sent / 1e6)} MB/step measured (" if sent is not None else "not measured ("
        plain_sent = p.get("bytes_sent_per_rank_per_step")
        vs = f"; {plain_sent / mine:.0f}x fewer than allreduce's measured {fmt_number(plain_sent / 1e6)} MB" \
            if plain_sent and mine else ""
        # The harness's names keep residuals unless -noef, where DiLoCo() defaults to the method's own rule.
        ef = "" if r.get("error_feedback") is None else f", error feedback {'on' if r['error_feedback'] else 'off'}"
        memory = r.get("diloco_memory_bytes")  # not counted for torchft's DiLoCo
        lines.append(f"{r['method']} ({link}{ef}): {head}{fmt_number(formula / 1e6)} MB by DiLoCo.bytes_per_step{vs})"
                     + ("" if memory is None else f", {fmt_number(memory / 1e6)} MB of DiLoCo state per rank"))
    if lines:
        lines.insert(0, "DiLoCo rows: step time is the mean over the timed steps (the median is a step without a sync).")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``pycomm-bench ddp``: run (or ``--merge``), print the table, write JSON (and plots)."""
    t0 = time.monotonic()
    try:
        records = merge_files(args.merge) if args.merge else run_ddp(args)
    except RanksFailed as exc:
        return fail("ddp", exc, 1)
    except (OSError, ValueError) as exc:  # unreadable or incompatible --merge files; bad settings
        return fail("ddp", f"{'--merge: ' if args.merge else ''}{exc}", 2)
    print()
    bad = sorted({r["method"] for r in records if not r["params_identical"]})
    text = format_table(records)
    extra = [t for t in (format_flattening(records), format_profile(records), format_diloco(records)) if t]
    if getattr(args, "quick", False):
        extra.append(QUICK_LOSS_NOTE)
    status = finish(records, args.json, "\n\n".join([text] + extra),
                    [f"{m}: ranks ended with different parameters" for m in bad], t0)
    if args.plots:
        write_plots(records, args.json)
    return status


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["ddp", *sys.argv[1:]]))
