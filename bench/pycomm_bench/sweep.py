"""What the training sweeps (``pycomm-bench ddp`` and ``pycomm-bench fsdp``)
share: the workload, the link rates swept and the clusters built for them,
the options both take, the learning-rate schedule, combining the runs of
several seeds into one record, and the plots.

Example::

    >>> parse_bandwidths(["1gbit,none"], ["100mbit"], netns=True)
    (['1gbit', 'none'], [1000000000.0, None])
    >>> lr_at(1.0, 2, 4, "cosine")
    0.5
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .methods import ALLREDUCE
from .timing import summarize

#: The language model's context in the benchmark (shorter than its 128-byte
#: default: fewer tokens per step keep compute small next to communication,
#: as on GPUs, which are ~1000x faster than these CPU cores).
DEFAULT_SEQ_LEN = 64
DEFAULT_LR = {"adamw": 1e-3, "sgd": 0.05}
#: "warmup-cosine": linear warm-up over ``--lr-warmup`` steps, then cosine
#: decay to :data:`LR_FLOOR` of the peak at the last step (how LLMs are
#: trained, and what DiLoCo's studies use: a floor of 5-10%).
LR_SCHEDULES = ("constant", "cosine", "warmup-cosine")
LR_FLOOR = 0.1
#: "train_loss_last": mean over ranks and over the last this many steps.
FINAL_LOSS_WINDOW = 20
#: "final_loss": the loss of the trained model on this many batches that no
#: rank trains on (the same for every method), averaged; far less noisy than
#: the training loss of single small batches.
EVAL_BATCHES = 32
EVAL_RANK = 1_000_000
#: Seconds without progress before a run is stopped (and any one collective may take).
DEFAULT_TIMEOUT = 600.0


# --------------------------------------------------------------------------- workload


def workload(cfg: Dict[str, Any], seed: Optional[int] = None):
    """(model, batch_fn, loss_fn) of ``seed`` (default: the first seed): the
    benchmark's GPT (``cfg["workload"] == "lm"``) or the many-small-tensors MLP.

    >>> model, batch_fn, loss_fn = workload({"workload": "mlp", "batch_size": 4, "seed": 0})
    >>> float(loss_fn(model, batch_fn(0, 0)).detach()) > 0
    True
    """
    from . import models

    seed = cfg["seed"] if seed is None else seed
    if cfg["workload"] == "lm":
        return models.char_lm(cfg["model"], batch_size=cfg["batch_size"], seed=seed,
                              seq_len=cfg["seq_len"], text=text_options(cfg))
    return models.narrow_mlp(batch_size=cfg["batch_size"], seed=seed)


def text_options(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's text (:func:`pycomm_bench.models.text_batch_fn`):
    ``cfg["text_files"]`` / ``cfg["text_bytes"]`` of the standard library and
    the ``cfg["heldout"]`` fraction kept out of training (defaults: 64 files,
    2 MB, none held out).

    >>> text_options({"heldout": 0.1})
    {'n_files': 64, 'max_bytes': 2000000, 'heldout': 0.1}
    """
    return {"n_files": cfg.get("text_files", 64), "max_bytes": cfg.get("text_bytes", 2_000_000),
            "heldout": cfg.get("heldout", 0.0)}


def eval_batch_fn(cfg: Dict[str, Any], seed: int, batch_fn: Callable) -> Callable:
    """Where the held-out loss's batches come from: the held-out text
    (``cfg["heldout"] > 0``, the language model), else ``batch_fn`` at
    ranks no process trains as (:data:`EVAL_RANK` on), as before."""
    from . import models

    if cfg["workload"] == "lm" and cfg.get("heldout", 0.0) > 0:
        return models.text_batch_fn(cfg["batch_size"], cfg["seq_len"], seed, split="heldout", **text_options(cfg))
    return batch_fn


def lr_at(lr: float, step: int, steps: int, schedule: str, warmup: int = 0) -> float:
    """The learning rate of ``step`` (0-based) of ``steps``: ``lr`` throughout
    ("constant"), cosine-decayed from ``lr`` at step 0 to 0 after the last
    ("cosine": ``lr * (1 + cos(pi * step / steps)) / 2``), or
    "warmup-cosine": ``lr * (step + 1) / warmup`` for the first ``warmup``
    steps, then cosine from ``lr`` to ``LR_FLOOR * lr`` at the last step.

    >>> [round(lr_at(1.0, s, 4, "cosine"), 3) for s in range(4)], lr_at(0.1, 3, 4, "constant")
    ([1.0, 0.854, 0.5, 0.146], 0.1)
    >>> [round(lr_at(1.0, s, 6, "warmup-cosine", warmup=2), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]
    """
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
    if schedule == "warmup-cosine":
        if step < warmup:
            return lr * (step + 1) / warmup
        done = (step - warmup) / max(1, steps - 1 - warmup)
        return lr * (LR_FLOOR + (1.0 - LR_FLOOR) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done))))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def set_lr(opt: Any, cfg: Dict[str, Any], step: int, steps: int) -> None:
    """Set every parameter group of ``opt`` to the learning rate of ``step``
    under ``cfg``'s ``lr``, ``lr_schedule`` and ``lr_warmup``; nothing for a
    constant schedule (the optimizer keeps the lr it was built with)."""
    if cfg.get("lr_schedule", "constant") == "constant":
        return
    lr = lr_at(cfg["lr"], step, steps, cfg["lr_schedule"], cfg.get("lr_warmup", 0))
    for group in opt.param_groups:
        group["lr"] = lr


def mean(xs: Sequence[float]) -> float:
    """The arithmetic mean.

    >>> mean([1.0, 2.0, 4.5])
    2.5
    """
    return sum(xs) / len(xs)


def stdev(xs: Sequence[float]) -> float:
    """Sample standard deviation (0 for one value).

    >>> stdev([2.0, 4.0]), stdev([3.0])
    (1.4142135623730951, 0.0)
    """
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# --------------------------------------------------------------------------- links


def parse_bandwidths(values: Any, default: Sequence[str], netns: bool) -> Tuple[List[str], List[Optional[float]]]:
    """``(names, bits per second)`` of the ``--bandwidth`` option (``default``
    when it was not given; None: unshaped); ValueError naming the option for
    a bad or repeated rate, or a shaped one with ``--no-netns``.

    >>> parse_bandwidths(None, ["100mbit"], netns=True)
    (['100mbit'], [100000000.0])
    >>> parse_bandwidths("1gbit", [], netns=False)
    Traceback (most recent call last):
    ...
    ValueError: --bandwidth 1gbit: with --no-netns links cannot be shaped, use --bandwidth none
    """
    from .cli import split_list
    from .netem import parse_rate

    bws = split_list(values) or list(default)
    rates: List[Optional[float]] = []
    for b in bws:
        try:
            rates.append(parse_rate(b))
        except ValueError as exc:
            raise ValueError(f"--bandwidth: {exc}") from None
    if len(set(rates)) != len(rates):
        raise ValueError(f"--bandwidth: repeated value in {bws}")
    if not netns and any(r is not None for r in rates):
        raise ValueError(f"--bandwidth {','.join(bws)}: with --no-netns links cannot be shaped, use --bandwidth none")
    return bws, rates


def cluster_for(args: argparse.Namespace, rate: Optional[float], cfg: Dict[str, Any]):
    """The cluster of ``args.ranks`` ranks at ``rate`` (namespaces, or plain
    loopback with ``--no-netns``); on loopback the ranks count the bytes of
    ``lo`` (``cfg["count_ifname"]``), which every rank shares.

    >>> args = argparse.Namespace(ranks=2, netns=False, netns_prefix="x")
    >>> cfg = {}; cluster_for(args, None, cfg).emulated, cfg
    (False, {'count_ifname': 'lo'})
    """
    from .netem import LoopbackCluster, make_cluster

    cluster = (make_cluster(args.ranks, rate, prefix=args.netns_prefix) if args.netns
               else LoopbackCluster(args.ranks, reason="--no-netns"))
    if not cluster.emulated:
        cfg["count_ifname"] = "lo"
    return cluster


def train_at(rank_main: Callable, args: argparse.Namespace, rate: Optional[float], cfg: Dict[str, Any], bar: Any,
             out: Any) -> Tuple[List[Dict[str, Any]], Any, float]:
    """One run of a sweep's ranks (``rank_main`` with ``cfg``) on the
    cluster of ``rate`` (:func:`cluster_for`): its link measured first and
    reported through the progress bar ``bar`` on ``out``, each step moving
    the bar. Returns the ranks' events, the cluster and its measured bus
    bandwidth."""
    from .launch import run_ranks, threads_per_rank
    from .links import link_report

    with cluster_for(args, rate, cfg) as cluster:
        busbw, line = link_report(cluster)
        bar.write(line, file=out)
        # The timeout bounds each collective and the wait for any progress alike.
        events = run_ranks(rank_main, cluster, cfg, timeout=args.timeout, stall=args.timeout,
                           threads=threads_per_rank(args.ranks, args.threads),
                           on_event=step_progress(bar, rate))
    return events, cluster, busbw


def per_rank_bytes(sent: Optional[float], cluster: Any, ranks: int) -> Optional[float]:
    """Bytes one rank sent: on loopback the shared ``lo`` counts every
    rank's traffic once (and anything else on it), so divide by the ranks.

    >>> per_rank_bytes(800.0, type("C", (), {"emulated": False})(), 4), per_rank_bytes(None, None, 4)
    (200.0, None)
    """
    if sent is None or cluster.emulated:
        return sent
    return sent / ranks


def step_progress(bar: Any, rate: Optional[float]) -> Callable[[Dict[str, Any]], None]:
    """The ``on_event`` of a sweep's ranks: each ``step`` event moves the
    progress bar by the steps done since that (method, seed)'s last one.

    >>> class Bar:
    ...     n = 0
    ...     def update(self, k): self.n += k
    ...     def set_postfix_str(self, text, refresh): pass
    >>> bar = Bar(); on_step = step_progress(bar, 1e9)
    >>> for step in (3, 5): on_step({"event": "step", "method": "int8", "seed": 0, "step": step})
    >>> bar.n
    5
    """
    from .netem import fmt_rate

    done: Dict[Tuple[str, int], int] = {}

    def on_step(ev: Dict[str, Any]) -> None:
        if ev["event"] == "step":
            key = (ev["method"], ev.get("seed", 0))
            bar.set_postfix_str(f"{fmt_rate(rate)} {ev['method']} seed {key[1]}", refresh=False)
            bar.update(ev["step"] - done.get(key, 0))
            done[key] = ev["step"]

    return on_step


# --------------------------------------------------------------------------- options


def with_baseline(methods: List[str], baseline: str, add: bool = True) -> List[str]:
    """``--methods`` as a sweep runs them: ``baseline`` first unless it is
    there already or ``add`` is false (every ratio is against it); a
    ValueError if a method repeats.

    >>> with_baseline(["int8", "bf16"], "plain")
    ['plain', 'int8', 'bf16']
    """
    if add and baseline not in methods:
        methods = [baseline, *methods]
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods: repeated method in {methods}")
    return methods


def add_sweep_options(g: Any, *, bandwidth_help: str, netns_prefix: str, baseline: str) -> None:
    """The options both training sweeps take, into argument group ``g``:
    ``--ranks``, ``--bandwidth``, ``--model``, ``--seq-len``,
    ``--lr-schedule``, ``--seed``, ``--seeds``, ``--eval-batches``,
    ``--timeout``, ``--no-plots``, ``--no-netns``, ``--netns-prefix``
    (``baseline``: the method the per-seed losses are compared with).

    >>> p = argparse.ArgumentParser()
    >>> add_sweep_options(p, bandwidth_help="rates", netns_prefix="x", baseline="plain")
    >>> a = p.parse_args(["--no-netns", "--seeds", "2"]); (a.netns, a.seeds, a.netns_prefix, a.ranks)
    (False, 2, 'x', 4)
    """
    from .cli import nonnegative_int, positive_int

    g.add_argument("--ranks", type=positive_int, default=4, help="processes, one per emulated host (default: 4)")
    g.add_argument("--bandwidth", nargs="+", metavar="RATE", default=None, help=bandwidth_help)
    g.add_argument("--model", choices=("default", "small", "tiny"), default="default",
                   help="the GPT's size: default (4.9M parameters), small (509K, the quality study's) or tiny "
                        "(43K, for smoke tests)")
    g.add_argument("--seq-len", type=positive_int, default=DEFAULT_SEQ_LEN,
                   help=f"bytes per sequence of the GPT (default: {DEFAULT_SEQ_LEN})")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="constant; cosine: decayed from --lr to 0 over the --steps of the run; warmup-cosine: "
                        f"linear warm-up over --lr-warmup steps, then cosine to {LR_FLOOR:g} of --lr at the "
                        "last step, as LLMs are trained (default: constant)")
    g.add_argument("--lr-warmup", type=nonnegative_int, default=0, metavar="STEPS",
                   help="warm-up steps of --lr-schedule warmup-cosine (default: 0)")
    g.add_argument("--heldout", type=float, default=0.0, metavar="FRACTION",
                   help="keep this last fraction of the language model's text out of training and measure "
                        "the held-out loss on it (default: 0, the held-out batches are other windows of the "
                        "same text)")
    g.add_argument("--seed", type=int, default=0, help="the first seed (default: 0)")
    g.add_argument("--seeds", type=positive_int, default=1,
                   help="train every method once per seed, seeds --seed ... --seed+N-1 (model init and data "
                        "order; the same for every method of a seed); the final loss is then reported as mean "
                        f"and spread over seeds and per seed relative to {baseline} (default: 1)")
    g.add_argument("--eval-batches", type=positive_int, default=EVAL_BATCHES, metavar="N",
                   help=f"held-out batches the final loss is the mean of (default: {EVAL_BATCHES})")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds without progress before a run is stopped (default: {DEFAULT_TIMEOUT:g})")
    g.add_argument("--no-plots", dest="plots", action="store_false",
                   help="do not write PNG plots (step time vs bandwidth, loss vs steps and seconds)")
    g.add_argument("--no-netns", dest="netns", action="store_false",
                   help="run every rank on plain loopback, no namespaces (unshaped only: --bandwidth none)")
    g.add_argument("--netns-prefix", default=netns_prefix,
                   help="name prefix of the network namespaces built (leftovers with it are deleted first)")


def error_feedback_suffix(name: str, default_on: bool, where: str) -> None:
    """Refuse the error-feedback suffix that restates the default. One
    grammar for both sweeps: a method's bare name runs with its entry
    point's default (the DDP hook: error feedback on; pycomm.fsdp: off for
    the block codecs that do not need it, e.g. int8), and a suffix names
    the departure from it: ``-noef`` where it is on, ``-ef`` where it is off.

    >>> error_feedback_suffix("int8-ef", default_on=True, where="pycomm-bench ddp")
    Traceback (most recent call last):
    ...
    ValueError: unknown method 'int8-ef': error feedback is on by default in pycomm-bench ddp: write 'int8' (-noef turns it off)
    >>> error_feedback_suffix("int8-noef", default_on=True, where="pycomm-bench ddp")
    """
    wrong, right = ("ef", "noef") if default_on else ("noef", "ef")
    parts = name.split("-")
    if wrong not in parts:
        return
    bare = "-".join(p for p in parts if p != wrong)
    state, flip = ("on", "off") if default_on else ("off", "on")
    raise ValueError(f"unknown method {name!r}: error feedback is {state} by default in {where}: "
                     f"write {bare!r} (-{right} turns it {flip})")


# --------------------------------------------------------------------------- seeds


def json_key(value: Any) -> str:
    """A value as a sortable, hashable key (JSON text).

    >>> json_key({"b": 1, "a": [2]})
    '{"a": [2], "b": 1}'
    """
    import json

    return json.dumps(value, sort_keys=True)


def combine_seeds(recs: Sequence[Dict[str, Any]], per_seed_fields: Sequence[str],
                  same_for_every_seed: Sequence[str] = ()) -> Dict[str, Any]:
    """One record of a method at one bandwidth from its per-seed records:
    everything but ``per_seed_fields`` from the first, ``per_seed`` (each
    seed's ``per_seed_fields``, by seed), step-time median/p10/p90 over every
    seed's timed steps (from ``timed_from``), ``final_loss`` (mean over
    seeds) with ``final_loss_std`` (sample standard deviation),
    ``_min``/``_max`` and ``final_loss_per_seed``, ``train_loss_last`` and
    the bytes sent (means), and ``loss_per_step`` / ``step_times_s`` as
    means over seeds, step by step (without a loss curve: the first seed's
    step times). ValueError for a repeated seed, or seeds whose
    ``same_for_every_seed`` settings differ. Each sweep adds its own fields.

    >>> r = lambda seed, loss: dict(method="m", seed=seed, final_loss=loss, train_loss_last=loss,
    ...     timed_from=1, loss_per_step=[3.0, loss], step_times_s=[9.0, 0.1 * seed + 0.1])
    >>> c = combine_seeds([r(1, 2.2), r(0, 2.0)], ("seed", "final_loss"))
    >>> c["seeds"], round(c["final_loss"], 3), round(c["final_loss_std"], 3), c["loss_per_step"]
    ([0, 1], 2.1, 0.141, [3.0, 2.1])
    """
    recs = sorted(recs, key=lambda r: r["seed"])
    seeds = [r["seed"] for r in recs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{recs[0]['method']}: seed repeated in {seeds}")
    for k in same_for_every_seed:
        vals = {json_key(r.get(k)) for r in recs}
        if len(vals) > 1:
            raise ValueError(f"{recs[0]['method']}: the seeds' runs differ in {k!r}: {sorted(vals)}")
    out = {k: v for k, v in recs[0].items() if k not in per_seed_fields}
    out["seeds"] = seeds
    out["per_seed"] = [{k: r.get(k) for k in per_seed_fields} for r in recs]
    timed = [t for r in recs for t in r["step_times_s"][r["timed_from"]:]]
    stats = summarize(timed)
    out.update(timed_steps=len(timed), step_time_median_s=stats["median_s"], step_time_p10_s=stats["p10_s"],
               step_time_p90_s=stats["p90_s"])
    losses = [r["final_loss"] for r in recs]
    out.update(final_loss=mean(losses), final_loss_std=stdev(losses), final_loss_min=min(losses),
               final_loss_max=max(losses), final_loss_per_seed=losses,
               train_loss_last=mean([r["train_loss_last"] for r in recs]))
    for k in ("bytes_sent_per_rank_per_step", "bytes_sent_per_rank_per_step_all_steps"):
        sent = [r[k] for r in recs if r.get(k) is not None]
        out[k] = mean(sent) if sent else None
    if all(r.get("loss_per_step") for r in recs):
        out["loss_per_step"] = [mean(xs) for xs in zip(*(r["loss_per_step"] for r in recs))]
        out["step_times_s"] = [mean(xs) for xs in zip(*(r["step_times_s"] for r in recs))]
    else:
        out.pop("loss_per_step", None)
        out["step_times_s"] = recs[0]["step_times_s"]
    return out


# --------------------------------------------------------------------------- plots


def effective_bw(rec: Dict[str, Any]) -> float:
    """The x of a record in bandwidth plots and break-even: the set rate, or
    the measured bus bandwidth for an unshaped link.

    >>> effective_bw({"bandwidth": None, "link_busbw_measured": 3e9}), effective_bw({"bandwidth": 1e9})
    (3000000000.0, 1000000000.0)
    """
    return rec["bandwidth"] if rec["bandwidth"] is not None else rec["link_busbw_measured"]


def plot(records: List[Dict[str, Any]], prefix: str, what: str = "DDP", baseline: str = ALLREDUCE) -> List[str]:
    """PNG plots next to the JSON: step time vs bandwidth, loss vs steps and
    loss vs seconds at the (first) training bandwidth, ``baseline`` drawn
    bold. Returns the paths written.

    >>> plot(records, "benchmarks/results/ddp/cpu-4ranks")   # doctest: +SKIP
    ['benchmarks/results/ddp/cpu-4ranks-step-time.png', ...]
    """
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
        pts = sorted((effective_bw(r), r["step_time_median_s"]) for r in records if r["method"] == m)
        ax.plot([p[0] / 1e9 for p in pts], [p[1] * 1e3 for p in pts], style[m], marker="o", label=m,
                linewidth=2.5 if m == baseline else 1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth, Gbit/s (unshaped: measured)")
    ax.set_ylabel("median step time, ms")
    ax.set_title(f"{what} step time vs bandwidth, {ranks} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(prefix + "-step-time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    train = [r for r in records if r.get("training_run") and r.get("loss_per_step")]
    if train:
        rate = train[0]["bandwidth"]
        train = [r for r in train if r["bandwidth"] == rate]
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
                ax.plot(x, loss, style[r["method"]], label=r["method"], linewidth=2.5 if r["method"] == baseline else 1.2)
            ax.set_xlabel("step" if kind == "steps" else "wall-clock seconds (sum of measured step times)")
            ax.set_ylabel("training loss (mean over ranks, smoothed)")
            ax.set_title(f"{what} loss vs {kind} at {fmt_rate(rate) if rate else 'unshaped'}, {ranks} ranks")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            paths.append(f"{prefix}-loss-vs-{kind}.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    return paths


def write_plots(records: List[Dict[str, Any]], json_path: str, **plot_options: Any) -> None:
    """:func:`plot` next to the JSON file ``json_path``, each path printed
    (and the folder's index rewritten to list them); matplotlib is optional,
    so without it a note on stderr and no plots."""
    from .records import update_index_of

    try:
        for p in plot(records, os.path.splitext(json_path)[0], **plot_options):
            print(f"wrote {p}")
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
    update_index_of(json_path)


def _smooth(xs: Sequence[float], window: int = 10) -> List[float]:
    """Trailing moving average (the per-step loss of small batches is noisy)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out
