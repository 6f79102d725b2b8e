"""The quality study: does a method keep the model, in a regime users train in?

Every method trains the same small GPT (:data:`pycomm_bench.models.GPT_SMALL`,
509K parameters, byte-level) on standard-library text with its last 10% held
out, in the regime of :data:`REGIME`: 512 tokens per rank per step (4
sequences of 128 bytes), 1000 steps, AdamW, a linear lr warm-up over 6% of
the steps and a cosine floored at 10% of the peak, the same 60 exact steps
before any method compresses, the held-out loss on 32 fixed batches every
100 steps and at the end. Each run is one ``pycomm-bench ddp`` training run
(:func:`pycomm_bench.ddp.run_ddp`) on plain loopback: loss does not depend
on the link.

The same tuning budget for every method (:data:`ARMS`): three settings on
seed 0, then the best of them (lowest final held-out loss) on the other
seeds. The per-step methods sweep the inner lr (:data:`LR_GRID`); DiLoCo
takes its inner lr from plain all-reduce's best at the same ranks by a
rule (:func:`diloco_inner_lr`) and sweeps its outer Nesterov step
(:data:`OUTER_GRID`: lr and momentum). Every finished
run is written at once to ``<out>/<run id>.json``; a run whose file exists
is not run again, so the study resumes where it stopped (``--max-runs``
and ``--arms`` bound a sitting). The report (``--report-only`` makes just
it) combines the files: per method the grid and its winner, the final
held-out loss's mean and spread over seeds, its ratio to plain all-reduce
of the same seed and ranks (``final_loss_vs_allreduce_mean``), the bytes
sent per rank per step and the held-out curve (mean over seeds), written to
``<out>-<date>.json`` with a plot of the curves.

Example::

    $ pycomm-bench quality                          # the whole study, resumable
    $ pycomm-bench quality --arms allreduce diloco-H16 --max-runs 4
    $ pycomm-bench quality --report-only
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .ddp import add_flattening
from .methods import ALLREDUCE, TORCHFT, parse_method
from .report import clean, fail, fmt_number, machine_info, table, write_json
from .sweep import mean, stdev

HELP = "the quality study: held-out loss of every method against plain all-reduce, tuned alike, over seeds"

#: The regime every run trains in (``pycomm-bench ddp`` options).
REGIME: Dict[str, Any] = {
    "model": "small", "seq_len": 128, "batch_size": 4, "steps": 1000, "lr_schedule": "warmup-cosine",
    "lr_warmup": 60, "start_iter": 60, "heldout": 0.1, "eval_every": 100, "eval_batches": 32,
    "text_files": 1000, "text_bytes": 8_000_000,
}


def regime_of(steps: int) -> Dict[str, Any]:
    """:data:`REGIME` over ``steps`` steps: the warm-up, the exact steps and
    the evaluation interval keep their share of the run.

    >>> r = regime_of(5000); r["steps"], r["lr_warmup"], r["start_iter"], r["eval_every"]
    (5000, 300, 300, 500)
    """
    scale = steps / REGIME["steps"]
    return dict(REGIME, steps=steps, lr_warmup=max(1, round(REGIME["lr_warmup"] * scale)),
                start_iter=max(1, round(REGIME["start_iter"] * scale)),
                eval_every=max(1, round(REGIME["eval_every"] * scale)))


#: ``--quick``: the same study in miniature (a smoke test of the driver).
QUICK_REGIME: Dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "batch_size": 2, "steps": 24, "lr_schedule": "warmup-cosine",
    "lr_warmup": 2, "start_iter": 4, "heldout": 0.1, "eval_every": 8, "eval_batches": 2,
    "text_files": 8, "text_bytes": 200_000,
}
#: The learning rates every per-step method is tried with, per optimizer
#: (SGD: momentum 0.9, as ``pycomm-bench ddp --optimizer sgd``).
LR_GRID: Dict[str, Tuple[float, ...]] = {"adamw": (2e-3, 4e-3, 8e-3), "sgd": (0.05, 0.1, 0.2)}
#: DiLoCo's outer Nesterov SGD settings (lr, momentum), tried at plain's
#: best inner lr: as many as the lr grid, so every method gets three runs.
OUTER_GRID = ((0.5, 0.9), (1.0, 0.7), (1.0, 0.5))
DEFAULT_SEEDS = 3
#: Timed steps per method and link (--links): two syncs of DiLoCo-H16.
DEFAULT_TIME_STEPS = 32
DEFAULT_OUT = os.path.join("benchmarks", "results", "quality", "runs")


@dataclass(frozen=True)
class Arm:
    """One method of the study at one number of ranks (replicas for DiLoCo)."""

    method: str
    ranks: int = 4
    optimizer: str = "adamw"
    #: Sequences per rank per step (None: the regime's). With it, ranks of
    #: ``16 // ranks`` sequences keep the 4-rank arms' global batch: the
    #: anchors compare replicas at the same global batch.
    batch_size: Optional[int] = None

    @property
    def diloco(self) -> bool:
        """DiLoCo, pycomm's or torchft's: tuned over the outer grid.

        >>> Arm("diloco-H16-int4").diloco, Arm("torchft-diloco-H16").diloco, Arm("int4").diloco
        (True, True, False)
        """
        return parse_method(self.method).sync_every is not None

    @property
    def name(self) -> str:
        """``<ranks>r-<method>``, ``-<optimizer>`` after it unless AdamW.

        >>> Arm("int8").name, Arm("onebit", 4, "sgd").name, Arm("diloco-H16", 1, batch_size=16).name
        ('4r-int8', '4r-onebit-sgd', '1r-b16-diloco-H16')
        """
        batch = "" if self.batch_size is None else f"b{self.batch_size}-"
        return f"{self.ranks}r-{batch}{self.method}" + ("" if self.optimizer == "adamw" else f"-{self.optimizer}")

    @property
    def baseline(self) -> "Arm":
        """Plain all-reduce at the same ranks, batch and optimizer."""
        return Arm(ALLREDUCE, self.ranks, self.optimizer, self.batch_size)

    def regime(self, regime: Dict[str, Any]) -> Dict[str, Any]:
        """``regime`` with this arm's batch."""
        return regime if self.batch_size is None else dict(regime, batch_size=self.batch_size)


#: The study, in the order it runs (what a user's choice needs first): the
#: baseline; DiLoCo exact and with int4; OneBitAdam with its variance
#: frozen (DeepSpeed's 1-bit Adam, ``-v0``); the int8/int4 hooks;
#: PyTorch's fp16 and PowerSGD hooks; DiLoCo at 2 and 1 replicas against
#: plain at the same ranks; OneBitAdam with its variance refreshed by an
#: exact step every 20 (0/1 Adam's remedy for a frozen variance, now its
#: default); DiLoCo
#: with onebit pseudo-gradients every 16 and every 8 steps (and exact at 8,
#: its reference); DiLoCo's int4 without error feedback (its own default)
#: and with top-k; the onebit and top-k hooks; momentum SGD: plain,
#: OneBitSGD and the onebit and int8 hooks; then 1 and 2 replicas at the
#: 4-rank arms' global batch (16 and 8 sequences per rank), as the anchors
#: compare them; the onebit hook without error feedback (is the residual
#: what hurts it under AdamW?); the int8 and int4 hooks without error
#: feedback (the table's default for them: does the hook need it?); the
#: 2-bit (ternary) levels in the hook and as DiLoCo's pseudo-gradient codec;
#: torchft's own DiLoCo (exact) at 4 and 2 replicas, beside pycomm's
#: ``diloco-H16`` arms at the same ranks and batch; and pycomm's onebit
#: pseudo-gradients at 2 replicas, to compare with torchft's there too;
#: then onebit rotated, sending the outer update (``-rot-upd``), at 4 and 2.
ARMS: Tuple[Arm, ...] = (
    Arm(ALLREDUCE), Arm("diloco-H16"), Arm("diloco-H16-int4"), Arm("optim-onebit-v0"), Arm("int8"), Arm("int4"),
    Arm("fp16"), Arm("powersgd-4"), Arm(ALLREDUCE, 2), Arm("diloco-H16-int4", 2), Arm(ALLREDUCE, 1),
    Arm("diloco-H16", 1), Arm("optim-onebit-v20"), Arm("diloco-H16-onebit"), Arm("diloco-H8"), Arm("diloco-H8-onebit"),
    Arm("diloco-H16-int4-noef"), Arm("diloco-H16-topk-0.02"), Arm("onebit"), Arm("topk-0.01"), Arm("diloco-H16", 2),
    Arm(ALLREDUCE, 4, "sgd"), Arm("optim-onebit", 4, "sgd"), Arm("onebit", 4, "sgd"), Arm("int8", 4, "sgd"),
    Arm(ALLREDUCE, 1, batch_size=16), Arm("diloco-H16", 1, batch_size=16),
    Arm(ALLREDUCE, 2, batch_size=8), Arm("diloco-H16", 2, batch_size=8), Arm("diloco-H16-int4", 2, batch_size=8),
    Arm("onebit-noef"), Arm("int8-noef"), Arm("int4-noef"), Arm("int2"), Arm("diloco-H16-int2"),
    Arm("int2-noef"), Arm("torchft-diloco-H16"), Arm("torchft-diloco-H16", 2), Arm("diloco-H16-onebit", 2),
    Arm("diloco-H16-onebit-rot-upd"), Arm("diloco-H16-onebit-rot-upd", 2),
)


def setting_tag(setting: Dict[str, float]) -> str:
    """A run's tuned setting as text (in its file name).

    >>> setting_tag({"lr": 0.002}), setting_tag({"lr": 0.002, "outer_lr": 0.8, "outer_momentum": 0.9})
    ('lr0.002', 'lr0.002-outer0.8m0.9')
    """
    tag = f"lr{setting['lr']:g}"
    if "outer_lr" in setting:
        tag += f"-outer{setting['outer_lr']:g}m{setting['outer_momentum']:g}"
    return tag


def run_id(arm: Arm, setting: Dict[str, float], seed: int) -> str:
    """``<ranks>r-<method>-<setting>-s<seed>``, the file name of one run.

    >>> run_id(Arm("int8"), {"lr": 0.001}, 2)
    '4r-int8-lr0.001-s2'
    """
    return f"{arm.name}-{setting_tag(setting)}-s{seed}"


def load_runs(out: str) -> Dict[str, Dict[str, Any]]:
    """Every finished run under ``out``, by run id."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path, encoding="utf-8") as fh:
            runs[os.path.splitext(os.path.basename(path))[0]] = json.load(fh)
    return runs


def winner(arm: Arm, runs: Dict[str, Dict[str, Any]], grid: Sequence[Dict[str, float]],
           seed: int) -> Optional[Dict[str, float]]:
    """The setting of ``grid`` with the lowest final held-out loss on
    ``seed``; None while any of them has not run.

    >>> runs = {"4r-int8-lr0.001-s0": {"final_loss": 2.0}, "4r-int8-lr0.002-s0": {"final_loss": 1.9}}
    >>> winner(Arm("int8"), runs, [{"lr": 0.001}, {"lr": 0.002}], 0)
    {'lr': 0.002}
    """
    losses = []
    for s in grid:
        rec = runs.get(run_id(arm, s, seed))
        if rec is None:
            return None
        losses.append((_loss(rec), s))
    return min(losses, key=lambda p: p[0])[1]


def _loss(rec: Dict[str, Any]) -> float:
    """A run's final held-out loss; +inf where it diverged (stored as null)."""
    return math.inf if rec["final_loss"] is None else rec["final_loss"]


def grid_of(arm: Arm, runs: Dict[str, Dict[str, Any]], lrs: Dict[str, Sequence[float]],
            outer: Sequence[Tuple[float, float]], seed: int) -> Optional[List[Dict[str, float]]]:
    """The settings ``arm`` is tuned over: the lr grid, or for DiLoCo the
    outer grid at :func:`diloco_inner_lr` of plain all-reduce's best lr at
    the same ranks (None until that is known)."""
    if not arm.diloco:
        return [{"lr": lr} for lr in lrs[arm.optimizer]]
    best = winner(arm.baseline, runs, [{"lr": lr} for lr in lrs[arm.optimizer]], seed)
    if best is None:
        return None
    lr = diloco_inner_lr(best["lr"], arm.ranks)
    return [{"lr": lr, "outer_lr": a, "outer_momentum": m} for a, m in outer]


def diloco_inner_lr(plain_lr: float, replicas: int) -> float:
    """DiLoCo's inner lr: plain all-reduce's best at the same ranks, scaled
    by the square root of the batch ratio (Adam's square-root rule): a
    replica steps on 1/M of plain's batch. At plain's best lr (4e-3, 4
    ranks) the replicas' 512-token steps stalled on one seed of three
    (held-out 2.30 against 1.98 and 1.99), as plain itself does at 8e-3.

    >>> diloco_inner_lr(0.004, 4), diloco_inner_lr(0.004, 1)
    (0.002, 0.004)
    """
    return float(f"{plain_lr / math.sqrt(replicas):.3g}")


def pending(arms: Sequence[Arm], runs: Dict[str, Dict[str, Any]], seeds: Sequence[int],
            lrs: Dict[str, Sequence[float]],
            outer: Sequence[Tuple[float, float]]) -> List[Tuple[Arm, Dict[str, float], int]]:
    """The runs still to make, in order: per arm its grid on the first seed,
    then its winner on the other seeds. An arm whose grid waits on another
    arm's winner (DiLoCo on plain's lr) is skipped until that is known.

    >>> [(a.name, s, seed) for a, s, seed in pending([Arm("int8")], {}, [0, 1], {"adamw": [0.001, 0.002]}, [])]
    [('4r-int8', {'lr': 0.001}, 0), ('4r-int8', {'lr': 0.002}, 0)]
    """
    todo = []
    for arm in arms:
        grid = grid_of(arm, runs, lrs, outer, seeds[0])
        if grid is None:
            continue
        missing = [(arm, s, seeds[0]) for s in grid if run_id(arm, s, seeds[0]) not in runs]
        if missing:
            todo += missing
            continue
        best = winner(arm, runs, grid, seeds[0])
        todo += [(arm, best, seed) for seed in seeds[1:] if run_id(arm, best, seed) not in runs]
    return todo


def ddp_argv(arm: Arm, setting: Dict[str, float], seed: int, regime: Dict[str, Any]) -> List[str]:
    """The ``pycomm-bench ddp`` command line of one run.

    >>> " ".join(ddp_argv(Arm("int8"), {"lr": 0.002}, 1, {"steps": 10, "model": "tiny"}))
    'ddp --no-netns --bandwidth none --no-baseline --no-plots --no-progress --ranks 4 --methods int8 --seed 1 --seeds 1 --lr 0.002 --steps 10 --model tiny'
    """
    argv = ["ddp", "--no-netns", "--bandwidth", "none", "--no-baseline", "--no-plots", "--no-progress",
            "--ranks", str(arm.ranks), "--methods", arm.method, "--seed", str(seed), "--seeds", "1",
            "--lr", f"{setting['lr']:g}"]
    if arm.optimizer != "adamw":
        argv += ["--optimizer", arm.optimizer]
    if "outer_lr" in setting:
        argv += ["--outer-lr", f"{setting['outer_lr']:g}", "--outer-momentum", f"{setting['outer_momentum']:g}"]
    for k, v in arm.regime(regime).items():
        if k not in ("text_files", "text_bytes"):  # no options of their own (the study's text)
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def run_one(arm: Arm, setting: Dict[str, float], seed: int, regime: Dict[str, Any], out: str) -> Dict[str, Any]:
    """Train one run and write its record to ``<out>/<run id>.json``."""
    from . import ddp
    from .cli import build_parser

    args = build_parser().parse_args(ddp_argv(arm, setting, seed, regime))
    args.text_files, args.text_bytes = regime["text_files"], regime["text_bytes"]
    args = ddp.resolve_args(args)
    t0 = time.monotonic()
    (rec,) = ddp.run_ddp(args, out=sys.stderr)
    rec = clean(dict(rec, diverged=not math.isfinite(rec["final_loss"])))
    rec.update(seed=seed, setting={k: float(v) for k, v in setting.items()}, arm=arm.name,
               run_wall_s=time.monotonic() - t0,
               text_files=regime["text_files"], text_bytes=regime["text_bytes"],
               tokens_per_rank_per_step=arm.regime(regime)["batch_size"] * regime["seq_len"])
    write_json(os.path.join(out, run_id(arm, setting, seed) + ".json"), rec)
    return rec


# --------------------------------------------------------------------------- report


def summarize(arms: Sequence[Arm], runs: Dict[str, Dict[str, Any]], seeds: Sequence[int],
              lrs: Dict[str, Sequence[float]],
              outer: Sequence[Tuple[float, float]]) -> List[Dict[str, Any]]:
    """One record per arm whose grid has run: its grid (seed 0's final
    loss per setting), the winner, and over the seeds run at the winner the
    final held-out loss (mean, sample std, per seed), its per-seed ratio to
    plain all-reduce's winner at the same ranks and optimizer (mean, min, max), bytes
    sent per rank per step, held-out curve (mean over seeds) and step time
    (loopback; informative only)."""
    out = []
    plain_best: Dict[Arm, Dict[int, float]] = {}
    for arm in arms:
        grid = grid_of(arm, runs, lrs, outer, seeds[0])
        best = None if grid is None else winner(arm, runs, grid, seeds[0])
        if best is None:
            continue
        recs = [runs[run_id(arm, best, s)] for s in seeds if run_id(arm, best, s) in runs]
        # A seed that diverged makes the arm's mean infinite: the report
        # names those seeds and gives no mean (the finite ones stay listed).
        diverged = [r["seed"] for r in recs if r["final_loss"] is None]
        losses = [r["final_loss"] for r in recs]
        finite = [x for x in losses if x is not None]
        if arm.method == ALLREDUCE:
            plain_best[arm] = {r["seed"]: _loss(r) for r in recs}
        base = plain_best.get(arm.baseline, {})
        ratios = [_loss(r) / base[r["seed"]] for r in recs if r["seed"] in base]
        ratios = None if not ratios or diverged or not all(map(math.isfinite, ratios)) else ratios
        curves = [dict(map(tuple, r["eval_loss_curve"])) for r in recs
                  if r.get("eval_loss_curve") and r["final_loss"] is not None]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        first = recs[0]
        out.append({
            "arm": arm.name, "method": arm.method, "ranks": arm.ranks, "optimizer": arm.optimizer,
            "batch_size": first["batch_size"], "arm_batch_size": arm.batch_size,
            "global_batch": first["batch_size"] * arm.ranks,
            "steps": first["steps"], "tokens_per_step": first["tokens_per_step"],
            "tokens_per_rank_per_step": first["tokens_per_rank_per_step"], "model": first["model"],
            "gradient_numel": first["gradient_numel"],
            "grid": [{"setting": s, "final_loss_seed0": runs[run_id(arm, s, seeds[0])]["final_loss"]} for s in grid],
            "winner": best, "winner_at_grid_edge": _at_edge(arm, best, lrs[arm.optimizer], outer),
            "seeds": [r["seed"] for r in recs], "final_loss_per_seed": losses, "diverged_seeds": diverged,
            "final_loss_mean": None if diverged else mean(finite),
            "final_loss_std": None if diverged else stdev(finite),
            "final_loss_vs_allreduce_per_seed": ratios or None,
            "final_loss_vs_allreduce_mean": mean(ratios) if ratios else None,
            "final_loss_vs_allreduce_min": min(ratios) if ratios else None,
            "final_loss_vs_allreduce_max": max(ratios) if ratios else None,
            # After the exact warm-up (the method's own traffic), and over every step.
            # One rank sends nothing: what its interface counted is other processes' traffic.
            "bytes_sent_per_rank_per_step": _mean_of(recs, "bytes_sent_per_rank_per_step") if arm.ranks > 1 else None,
            "bytes_sent_per_rank_per_step_all_steps":
                _mean_of(recs, "bytes_sent_per_rank_per_step_all_steps") if arm.ranks > 1 else None,
            "diloco_bytes_per_step": first.get("diloco_bytes_per_step"),
            "final_loss_min": None if diverged else min(finite), "final_loss_max": None if diverged else max(finite),
            "torchft_version": first.get("torchft_version"),
            "eval_loss_curve": [[s, mean([c[s] for c in curves])] for s in steps],
            "step_time_mean_s_loopback": mean([r["step_time_mean_s"] for r in recs]),
            # Steps of plain all-reduce before the method starts (its warm-up; OneBitAdam's is longer).
            "exact_steps": first["start_iter"],
        })
    plain = {(r["ranks"], r["optimizer"], r["batch_size"]): r for r in out if r["method"] == ALLREDUCE}
    for r in out:
        p = plain.get((r["ranks"], r["optimizer"], r["batch_size"]))
        for k, f in (("bytes_vs_allreduce", "bytes_sent_per_rank_per_step"),
                     ("bytes_vs_allreduce_all_steps", "bytes_sent_per_rank_per_step_all_steps")):
            sent, psent = r[f], p and p[f]
            r[k] = psent / sent if sent and psent else None
    add_flattening(out)  # does the loss still fall over the last quarter? (a saturated task proves nothing)
    return out


def _mean_of(recs: Sequence[Dict[str, Any]], key: str) -> Optional[float]:
    """The mean of ``key`` over the records that have it; None if none does."""
    xs = [r[key] for r in recs if r.get(key) is not None]
    return mean(xs) if xs else None


def crossing(curve: Sequence[Sequence[float]], target: float) -> Optional[float]:
    """The first step at which a held-out ``curve`` ([step, loss] points)
    reaches ``target``, interpolated linearly between evaluations; None if
    it never does.

    >>> crossing([[0, 5.0], [100, 3.0], [200, 2.0]], 2.5), crossing([[0, 5.0], [100, 3.0]], 2.0)
    (150.0, None)
    """
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            return s1 if v0 <= target else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
    return None


def _on_links(r: Dict[str, Any]) -> bool:
    """Whether ``--links`` times arm record ``r``: the AdamW arms at the
    regime's batch (at each of their rank counts)."""
    return r["optimizer"] == "adamw" and r.get("arm_batch_size") is None


#: The rank count whose link timings are named after the link alone.
LINK_RANKS = 4


def links_path(links_dir: str, link: str, ranks: int) -> str:
    """Where :func:`time_links` writes ``ranks``-rank timings at ``link``:
    ``<link>.json`` at :data:`LINK_RANKS`, ``<link>-<ranks>ranks.json``
    otherwise."""
    return os.path.join(links_dir, f"{link}.json" if ranks == LINK_RANKS else f"{link}-{ranks}ranks.json")


def link_times(links_dir: str, link: str, ranks: int = LINK_RANKS) -> Dict[str, float]:
    """``{method: mean step time}`` of the ``ranks``-rank methods timed at
    ``link`` (:func:`links_path`, written by :func:`time_links`); {} if not yet."""
    path = links_path(links_dir, link, ranks)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return {r["method"]: r["step_time_mean_s"] for r in json.load(fh)}


def timed_links(links_dir: str) -> Dict[str, Dict[int, Dict[str, float]]]:
    """``{link: {ranks: {method: mean step time}}}`` of every timing in ``links_dir``."""
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    for path in sorted(glob.glob(os.path.join(links_dir, "*.json"))):
        name = os.path.splitext(os.path.basename(path))[0]
        found = re.fullmatch(r"(.+)-(\d+)ranks", name)
        link, ranks = (found.group(1), int(found.group(2))) if found else (name, LINK_RANKS)
        out.setdefault(link, {})[ranks] = link_times(links_dir, link, ranks)
    return out


def time_links(summary: List[Dict[str, Any]], links: Sequence[str], links_dir: str, regime: Dict[str, Any],
               time_steps: int) -> int:
    """Time the methods of ``summary`` on each emulated link, at each of
    their rank counts, where not yet timed for all of them: one run per link
    and rank count (``pycomm-bench ddp --time-only``, written to
    :func:`links_path`)."""
    for ranks in sorted({r["ranks"] for r in summary if _on_links(r)}):
        methods = [r["method"] for r in summary if _on_links(r) and r["ranks"] == ranks]
        for link in links:
            path = links_path(links_dir, link, ranks)
            if os.path.exists(path) and set(methods) <= set(link_times(links_dir, link, ranks)):
                continue
            rc = _time_link(link, ranks, methods, path, regime, time_steps)
            if rc:
                return rc
    return 0


def _time_link(link: str, ranks: int, methods: List[str], path: str, regime: Dict[str, Any], time_steps: int) -> int:
    """One ``pycomm-bench ddp --time-only`` run: ``methods`` at ``ranks`` ranks on ``link``."""
    from .cli import main

    argv = ["ddp", "--time-only", "--bandwidth", link, "--no-plots", "--no-progress", "--ranks", str(ranks),
            "--methods", *methods, "--time-steps", str(time_steps), "--json", path, "--netns-prefix", "pycomm-quality"]
    for k in ("model", "seq_len", "batch_size"):
        argv += [f"--{k.replace('_', '-')}", str(regime[k])]
    print(f"[quality] timing {len(methods)} methods at {link}, {ranks} ranks: pycomm-bench {' '.join(argv)}",
          file=sys.stderr)
    return main(argv)


def add_time_to_loss(summary: List[Dict[str, Any]], times: Dict[str, Dict[int, Dict[str, float]]]) -> None:
    """Per arm and timed link (``times``: :func:`timed_links`): the
    wall-clock to reach plain all-reduce's final held-out loss at the same
    rank count (its exact warm-up steps at plain's step time, the rest at
    its own), against plain's whole run; where a method never reaches it,
    the reverse: the time plain needs to reach the method's final loss,
    against the method's whole run."""
    plains = {r["ranks"]: r for r in summary if r["method"] == ALLREDUCE and _on_links(r)}
    for r in summary:
        plain = plains.get(r["ranks"])
        target = None if plain is None else plain["final_loss_mean"]
        if not _on_links(r) or target is None or r["final_loss_mean"] is None:  # a diverged seed: no curve to put on a clock
            continue
        r["links"] = {}
        for link, by_ranks in times.items():
            t = by_ranks.get(r["ranks"], {})
            if r["method"] not in t or ALLREDUCE not in t:
                continue
            tp, tm = t[ALLREDUCE], t[r["method"]]

            def clock(step: float) -> float:
                return min(step, r["exact_steps"]) * tp + max(0.0, step - r["exact_steps"]) * tm

            steps = crossing(r["eval_loss_curve"], target)
            total = clock(r["steps"])
            rec = {"step_time_mean_s": tm, "run_s": total, "allreduce_run_s": plain["steps"] * tp}
            if steps is not None:
                rec["time_to_allreduce_final_s"] = clock(steps)
                rec["allreduce_time_over_method_time"] = rec["allreduce_run_s"] / clock(steps)
            else:  # the reverse: how long plain takes to get where the method ends
                back = crossing(plain["eval_loss_curve"], r["final_loss_mean"])
                rec["allreduce_time_to_method_final_s"] = back * tp if back is not None else None
                rec["allreduce_time_over_method_time"] = back * tp / total if back is not None else None
            r["links"][link] = rec


def _at_edge(arm: Arm, best: Dict[str, float], lrs: Sequence[float], outer: Sequence[Tuple[float, float]]) -> bool:
    """Whether the winner is the grid's first or last setting (the optimum may lie outside it)."""
    if arm.diloco:
        pts = [tuple(p) for p in outer]
        return len(pts) > 1 and (best["outer_lr"], best["outer_momentum"]) in (pts[0], pts[-1])
    return len(lrs) > 1 and best["lr"] in (min(lrs), max(lrs))


def format_summary(summary: List[Dict[str, Any]], n_seeds: int) -> str:
    """The study's table: one row per arm."""
    rows = []
    for r in summary:
        ratio = r["final_loss_vs_allreduce_mean"]
        rows.append([
            r["arm"], setting_tag(r["winner"]) + (" (edge)" if r["winner_at_grid_edge"] else ""),
            f"{len(r['seeds'])}/{n_seeds}",
            f"diverged (seed {', '.join(map(str, r['diverged_seeds']))})" if r["diverged_seeds"]
            else f"{r['final_loss_mean']:.4f} ±{r['final_loss_std']:.4f}",
            "-" if ratio is None else f"{(ratio - 1) * 100:+.2f}% ({(r['final_loss_vs_allreduce_min'] - 1) * 100:+.2f}"
                                      f"..{(r['final_loss_vs_allreduce_max'] - 1) * 100:+.2f})",
            "-" if r["bytes_sent_per_rank_per_step"] is None else fmt_number(r["bytes_sent_per_rank_per_step"] / 1e3),
            " / ".join("-" if r[k] is None else f"{r[k]:.0f}x" for k in ("bytes_vs_allreduce",
                                                                          "bytes_vs_allreduce_all_steps")),
        ])
    head = ["ranks-method", "best setting", "seeds", "held-out loss\nmean ±std",
            "vs allreduce, same seed\nmean (min..max)", "kB sent/rank/step\nafter warm-up",
            "fewer bytes than allreduce:\nafter warm-up / all steps"]
    return table(rows, head, tablefmt="github")


def format_links(summary: List[Dict[str, Any]]) -> str:
    """Per arm and link: mean step time and the wall-clock to plain's final
    loss at the same rank count (or, where it never gets there, plain's
    time to the method's final loss), as a ratio to plain."""
    rows = []
    for r in summary:
        for link, x in (r.get("links") or {}).items():
            ratio = x.get("allreduce_time_over_method_time")
            if r["method"] == ALLREDUCE:
                verdict = f"its final loss at {x['time_to_allreduce_final_s']:.0f} s (the reference)"
            elif "time_to_allreduce_final_s" in x:
                verdict = f"reaches it in {x['time_to_allreduce_final_s']:.0f} s: {ratio:.2f}x faster than allreduce"
            elif ratio is not None:
                verdict = (f"never reaches it; allreduce reaches this method's final loss in "
                           f"{x['allreduce_time_to_method_final_s']:.0f} s = {ratio:.2f}x its run")
            else:
                verdict = "never reaches it; allreduce never gets as high"
            rows.append([r["arm"], link, f"{x['step_time_mean_s'] * 1e3:.0f}", f"{x['run_s']:.0f}", verdict])
    return table(rows, ["arm", "link", "mean step ms", "run s", "to allreduce's final held-out loss (same ranks)"],
                 tablefmt="github")


def plot_seconds(summary: List[Dict[str, Any]], times: Dict[str, Dict[int, Dict[str, float]]], path: str) -> str:
    """Held-out loss (mean over seeds) against wall-clock seconds on each
    timed link and rank count: where each method's curve crosses plain's
    final loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(link, ranks, t) for link, by_ranks in times.items() for ranks, t in sorted(by_ranks.items())]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (link, ranks, t) in zip(axes[0], panels):
        for r in summary:
            if not _on_links(r) or r["ranks"] != ranks or r["method"] not in t or len(r["eval_loss_curve"]) < 2:
                continue
            tp, tm, e = t[ALLREDUCE], t[r["method"]], r["exact_steps"]
            xs = [min(s, e) * tp + max(0, s - e) * tm for s, _ in r["eval_loss_curve"][1:]]
            ax.plot(xs, [v for _, v in r["eval_loss_curve"][1:]], label=r["method"],
                    linewidth=2.5 if r["method"] == ALLREDUCE else 1.2)
        ax.set_xscale("log")
        ax.set_xlabel(f"seconds at {link} (measured step times, {ranks} ranks)")
        ax.set_ylabel("held-out loss (mean over seeds)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(summary: List[Dict[str, Any]], path: str) -> str:
    """Held-out loss (mean over seeds) against steps, one panel per number of ranks and optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["ranks"], r["optimizer"]) for r in summary}, key=lambda p: (-p[0], p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (w, optimizer) in zip(axes[0], panels):
        for r in summary:
            if (r["ranks"], r["optimizer"]) != (w, optimizer) or len(r["eval_loss_curve"]) < 2:
                continue
            xs, ys = zip(*r["eval_loss_curve"][1:])  # from the first evaluation after step 0's
            ax.plot(xs, ys, label=f"{r['method']} ({setting_tag(r['winner'])})",
                    linewidth=2.5 if r["method"] == ALLREDUCE else 1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (mean over seeds)")
        ax.set_title(f"{w} rank(s), {optimizer}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- against torchft

#: How many times fewer bytes than torchft's exact sync pycomm's DiLoCo
#: with a block codec of this many bits (error feedback on) must send.
BYTES_TARGET_BY_BITS = {4: 7.0, 1: 25.0}
#: The most pycomm's compressed DiLoCo's held-out loss may exceed torchft's exact one (0.5%).
LOSS_TARGET = 0.005
#: The link where pycomm's DiLoCo must not step slower than torchft's.
TARGET_LINK = "100mbit"


def against_torchft(summary: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per ``torchft-diloco-H<H>`` arm of ``summary``, each pycomm DiLoCo
    arm at the same ranks, batch and H (one fragment, no delay) against it:
    held-out loss (the per-seed ratio to torchft's, mean, min, max), bytes
    per rank per step (the formula, and as measured) and step time per
    timed link, with the targets and whether each is met (None: not
    measured). The exact arm must lie within torchft's seed spread (its
    mean between torchft's lowest and highest seed); a codec of
    :data:`BYTES_TARGET_BY_BITS` with error feedback must send that many
    times fewer bytes at most :data:`LOSS_TARGET` above torchft's loss;
    every arm must step no slower at :data:`TARGET_LINK`.

    >>> arm = lambda method, loss, sent: dict(arm=f"4r-{method}", method=method, ranks=4, batch_size=4,
    ...     seeds=[0], final_loss_per_seed=[loss], final_loss_mean=loss, final_loss_min=loss, final_loss_max=loss,
    ...     diloco_bytes_per_step=sent, bytes_sent_per_rank_per_step=sent)
    >>> [(c["arm"], [t["met"] for t in c["targets"]]) for c in against_torchft(
    ...     [arm("torchft-diloco-H16", 2.0, 800.0), arm("diloco-H16", 2.0, 800.0), arm("diloco-H16-int4", 2.02, 100.0)])]
    [('4r-diloco-H16', [True, None]), ('4r-diloco-H16-int4', [False, None])]
    """
    from pycomm.distributed import spec

    out = []
    for ft in summary:
        if not ft["method"].startswith(f"{TORCHFT}-") or ft["final_loss_mean"] is None:
            continue
        h = parse_method(ft["method"]).sync_every
        for r in summary:
            m = parse_method(r["method"])
            if (m.entry == TORCHFT or m.sync_every != h or (m.fragments, m.delay) != (1, 0)
                    or (r["ranks"], r["batch_size"]) != (ft["ranks"], ft["batch_size"])):
                continue
            theirs = dict(zip(ft["seeds"], ft["final_loss_per_seed"]))
            ratios = [x / theirs[s] for s, x in zip(r["seeds"], r["final_loss_per_seed"])
                      if s in theirs and x is not None]
            c = {"arm": r["arm"], "torchft_arm": ft["arm"], "ranks": r["ranks"],
                 "final_loss_mean": r["final_loss_mean"], "final_loss_min": r["final_loss_min"],
                 "final_loss_max": r["final_loss_max"], "torchft_final_loss_mean": ft["final_loss_mean"],
                 "torchft_final_loss_min": ft["final_loss_min"], "torchft_final_loss_max": ft["final_loss_max"],
                 "seeds_compared": [s for s in r["seeds"] if s in theirs],
                 "loss_vs_torchft_mean": mean(ratios) if ratios else None,
                 "loss_vs_torchft_min": min(ratios) if ratios else None,
                 "loss_vs_torchft_max": max(ratios) if ratios else None,
                 "bytes_per_step_formula": r["diloco_bytes_per_step"],
                 "torchft_bytes_per_step_formula": ft["diloco_bytes_per_step"],
                 "fewer_bytes_than_torchft": ft["diloco_bytes_per_step"] / r["diloco_bytes_per_step"],
                 "bytes_sent_per_rank_per_step": r["bytes_sent_per_rank_per_step"],
                 "torchft_bytes_sent_per_rank_per_step": ft["bytes_sent_per_rank_per_step"],
                 "step_time_mean_s": {k: v["step_time_mean_s"] for k, v in (r.get("links") or {}).items()},
                 "torchft_step_time_mean_s": {k: v["step_time_mean_s"] for k, v in (ft.get("links") or {}).items()},
                 "targets": []}
            if m.compressor == spec.EXACT_METHOD:
                mine = r["final_loss_mean"]
                met = None if mine is None else ft["final_loss_min"] <= mine <= ft["final_loss_max"]
                c["targets"].append({"target": "held-out loss mean within torchft's seed spread (min..max)",
                                     "met": met})
            else:
                bits = spec.method_spec(m.compressor).bits if m.kind == "block" else None
                if bits not in BYTES_TARGET_BY_BITS or not m.error_feedback:
                    continue
                want = BYTES_TARGET_BY_BITS[bits]
                loss = c["loss_vs_torchft_mean"]
                c["targets"].append({"target": f">= {want:g}x fewer bytes than torchft's exact sync, at <= "
                                               f"{LOSS_TARGET * 100:g}% held-out loss above it",
                                     "met": None if loss is None else
                                     c["fewer_bytes_than_torchft"] >= want and loss - 1 <= LOSS_TARGET})
            mine, theirs_t = c["step_time_mean_s"].get(TARGET_LINK), c["torchft_step_time_mean_s"].get(TARGET_LINK)
            c["targets"].append({"target": f"mean step no slower than torchft's at {TARGET_LINK}",
                                 "met": None if mine is None or theirs_t is None else mine <= theirs_t})
            out.append(c)
    return out


def format_against_torchft(rows: List[Dict[str, Any]]) -> str:
    """The comparison with torchft's DiLoCo, one row per pycomm arm."""
    def verdict(met: Optional[bool]) -> str:
        return "not measured" if met is None else "met" if met else "NOT met"

    out = []
    for c in rows:
        ratio = c["loss_vs_torchft_mean"]
        out.append([c["arm"], c["torchft_arm"],
                    "-" if c["final_loss_mean"] is None else f"{c['final_loss_mean']:.4f}",
                    f"{c['torchft_final_loss_mean']:.4f}",
                    "-" if ratio is None else f"{(ratio - 1) * 100:+.2f}%",
                    f"{c['fewer_bytes_than_torchft']:.1f}x",
                    ", ".join(f"{link} {t * 1e3:.0f} ({c['torchft_step_time_mean_s'][link] * 1e3:.0f})"
                              for link, t in sorted(c["step_time_mean_s"].items())
                              if link in c["torchft_step_time_mean_s"]) or "not timed",
                    "; ".join(f"{t['target']}: {verdict(t['met'])}" for t in c["targets"])])
    return table(out, ["pycomm arm", "against", "held-out loss", "torchft's", "vs torchft, same seed",
                       "fewer bytes (formula)", "mean step ms (torchft's)", "targets"], tablefmt="github")


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import positive_int

    g = parser.add_argument_group("quality options")
    g.add_argument("--arms", nargs="+", metavar="ARM", default=None,
                   help="the arms to run, as <method>[-sgd] (4 ranks) or <ranks>r-<method>[-sgd] (default: all of "
                        f"{', '.join(a.name for a in ARMS)})")
    g.add_argument("--seeds", type=positive_int, default=DEFAULT_SEEDS,
                   help=f"seeds per method: the grid runs on the first, its winner on all (default: {DEFAULT_SEEDS})")
    g.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                   help="the lr grid of every optimizer (default: " +
                        "; ".join(f"{o}: {' '.join(f'{x:g}' for x in g)}" for o, g in LR_GRID.items()) + ")")
    g.add_argument("--outer", nargs="+", default=None, metavar="LR:MOMENTUM",
                   help="DiLoCo's outer grid (default: " + " ".join(f"{a:g}:{m:g}" for a, m in OUTER_GRID) + ")")
    g.add_argument("--steps", type=positive_int, default=None,
                   help=f"train this many steps instead of {REGIME['steps']} (a longer study: the warm-up and the "
                        f"evaluations scale with it; runs go to {DEFAULT_OUT}-<steps>steps)")
    g.add_argument("--out", default=None, help=f"folder of the per-run files (default: {DEFAULT_OUT})")
    g.add_argument("--max-runs", type=positive_int, default=None, help="stop after this many runs")
    g.add_argument("--report-only", action="store_true", help="run nothing: report the runs made so far")
    g.add_argument("--links", nargs="+", metavar="RATE", default=None,
                   help="after the runs, time each 4-rank method on these emulated links (e.g. 100mbit 1gbit; "
                        "network namespaces, root) and report its wall-clock to plain all-reduce's final loss")
    g.add_argument("--links-dir", default=None, metavar="DIR",
                   help="where --links writes and the report reads the step times (default: <out>/links); "
                        "another folder times a set of arms side by side without replacing the study's")
    g.add_argument("--time-steps", type=positive_int, default=DEFAULT_TIME_STEPS,
                   help=f"timed steps per method and link with --links (default: {DEFAULT_TIME_STEPS})")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.device.type != "cpu":
        raise ValueError("--device: the quality study trains on CPU ranks over Gloo")
    for opt in ("repeats", "warmup"):
        if getattr(args, opt) is not None:
            raise ValueError(f"--{opt}: not used by quality (the regime is fixed: see --help)")
    names = {a.name: a for a in ARMS}
    if args.arms is None:
        args.arm_list = list(ARMS)
    else:
        from .cli import split_list

        args.arm_list = []
        for text in split_list(args.arms):
            name = text if text.split("-")[0].endswith("r") and text[0].isdigit() else f"4r-{text}"
            if name not in names:
                raise ValueError(f"--arms: unknown arm {text!r}; the study's arms are {', '.join(names)}")
            args.arm_list.append(names[name])
    if args.lrs is not None and any(not lr > 0 for lr in args.lrs):
        raise ValueError(f"--lrs: every lr must be > 0, got {args.lrs}")
    args.lr_grid = {o: tuple(args.lrs) for o in LR_GRID} if args.lrs else LR_GRID
    try:
        args.outer_grid = tuple(tuple(float(x) for x in p.split(":")) for p in args.outer) if args.outer else OUTER_GRID
        if any(len(p) != 2 or not p[0] > 0 or not 0 <= p[1] < 1 for p in args.outer_grid):
            raise ValueError
    except ValueError:
        raise ValueError(f"--outer: expected LR:MOMENTUM pairs with LR > 0 and 0 <= MOMENTUM < 1, got {args.outer}") \
            from None
    if args.links is not None:
        from .cli import split_list
        from .netem import parse_rate

        args.links = split_list(args.links)
        for link in args.links:
            try:
                if parse_rate(link) is None:
                    raise ValueError("an emulated link needs a rate")
            except ValueError as exc:
                raise ValueError(f"--links {link}: {exc}") from None
    if args.quick and args.steps is not None:
        raise ValueError("--steps: not with --quick (the miniature study has its own length)")
    args.regime = QUICK_REGIME if args.quick else regime_of(args.steps or REGIME["steps"])
    if args.out is None:
        args.out = DEFAULT_OUT + ("-quick" if args.quick else "" if args.steps is None else f"-{args.steps}steps")
    if args.links_dir is None:
        args.links_dir = os.path.join(args.out, "links")
    if args.json is None:  # quality/runs[-X] -> quality/summary[-X].json
        folder, runs = os.path.split(args.out)
        args.json = os.path.join(folder, runs.replace("runs", "summary", 1) + ".json")
    return args


def run(args: argparse.Namespace) -> int:
    """Run the pending runs (each written at once), then report."""
    seeds = list(range(args.seeds))
    done = 0
    while not args.report_only and (args.max_runs is None or done < args.max_runs):
        runs = load_runs(args.out)
        todo = pending(args.arm_list, runs, seeds, args.lr_grid, args.outer_grid)
        if not todo:
            break
        arm, setting, seed = todo[0]
        print(f"[quality] {run_id(arm, setting, seed)} ({len(todo)} known to run, {done} done this sitting)",
              file=sys.stderr, flush=True)
        try:
            rec = run_one(arm, setting, seed, args.regime, args.out)
        except Exception as exc:  # noqa: BLE001 - a run that fails is reported, the study stops
            return fail("quality", f"{run_id(arm, setting, seed)} failed: {exc}", 1)
        print(f"[quality] {run_id(arm, setting, seed)}: held-out loss "
              f"{'diverged' if rec['diverged'] else format(rec['final_loss'], '.4f')} "
              f"in {rec['run_wall_s']:.0f} s", file=sys.stderr, flush=True)
        done += 1
    runs = load_runs(args.out)
    summary = summarize(args.arm_list, runs, seeds, args.lr_grid, args.outer_grid)
    if not summary:
        print("pycomm-bench quality: no arm has finished its grid yet", file=sys.stderr)
        return 0
    if args.links and not args.report_only:
        rc = time_links(summary, args.links, args.links_dir, args.regime, args.time_steps)
        if rc:
            return rc
    times = timed_links(args.links_dir)
    add_time_to_loss(summary, times)
    left = pending(args.arm_list, runs, seeds, args.lr_grid, args.outer_grid)
    doc = {"regime": args.regime, "lr_grid": {o: list(g) for o, g in args.lr_grid.items()}, "outer_grid": [list(p) for p in args.outer_grid],
           "seeds": seeds, "runs_done": len(runs), "runs_known_left": len(left), "arms": summary,
           "links_dir": args.links_dir, "date": _dt.date.today().isoformat(), "machine": machine_info("cpu")}
    versus = against_torchft(summary)
    if versus:
        doc["against_torchft"] = versus
    from .records import stamp_command, update_index_of

    write_json(args.json, stamp_command(doc))
    print(format_summary(summary, len(seeds)))
    if times:
        print(format_links(summary))
    if versus:
        print(format_against_torchft(versus))
    plain = [r for r in summary if r["method"] == ALLREDUCE and r.get("eval_loss_change_last_quarter") is not None]
    for r in plain:
        print(f"{r['arm']}: held-out loss change over the last quarter {r['eval_loss_change_last_quarter'] * 100:+.2f}%")
    print(f"wrote {args.json} ({len(runs)} runs; {len(left)} known to be left)")
    if not getattr(args, "plots", True):
        update_index_of(args.json)
        return 0
    try:
        print(f"wrote {plot_curves(summary, os.path.splitext(args.json)[0] + '-curves.png')}")
        if times:
            print(f"wrote {plot_seconds(summary, times, os.path.splitext(args.json)[0] + '-seconds.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    update_index_of(args.json)
    return 0


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["quality", *sys.argv[1:]]))
