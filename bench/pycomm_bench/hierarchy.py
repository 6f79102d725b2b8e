"""Hierarchical vs flat compressed all-reduce vs plain all-reduce, on emulated nodes.

``--ranks`` ranks in nodes of ``--ranks-per-node`` (:mod:`pycomm_bench.netem`:
one network namespace per node; ranks of a node talk over its loopback,
unshaped; links between nodes shaped to ``--bandwidth`` both ways). In the
same rank processes and the same interleaved rounds, for each tensor size:

* ``plain``: Gloo's exact all-reduce over all ranks;
* ``<compressor>-flat``: pycomm's compressed all-reduce over all ranks;
* ``<compressor>-hier``: exact reduce-scatter in the node, the compressed
  all-reduce of each shard between nodes, exact all-gather in the node
  (docs/hierarchy.md).

Each call: a barrier, then the call timed on every rank, the max over ranks
taken (it is done when its last rank is); the median and p10/p90 over
``--repeats``. Bytes out of each node per call are counted on the node's
own link (``eth0`` of its namespace). Every method's first result is checked
to be identical on all ranks and equal to the single-process simulation
(:mod:`pycomm.distributed.simulate`).

Example::

    $ pycomm-bench hierarchy                       # 4 ranks, 2 nodes, 1 Gbit/s
    $ pycomm-bench hierarchy --ranks 6 --ranks-per-node 3 --sizes 4M --bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from pycomm.distributed import spec

from .launch import Rank, RanksFailed, run_ranks, threads_per_rank
from .methods import ONEBIT, PLAIN, SPARSE
from .report import default_json_path, fail, finish, machine_info, table
from .timing import summarize, time_interleaved

HELP = "hierarchical vs flat compressed all-reduce vs plain, on emulated nodes joined by slow links"

DEFAULT_SIZES = [1 << 22, 1 << 24]
QUICK_SIZES = [1 << 20]
#: What runs hierarchically: every method that compresses.
COMPRESSORS = spec.EF_METHODS
DEFAULT_COMPRESSORS = [ONEBIT, SPARSE]
DEFAULT_REPEATS, QUICK_REPEATS = 7, 3


def _method_names(compressors: List[str]) -> List[str]:
    return [PLAIN] + [f"{c}-{h}" for c in compressors for h in ("flat", "hier")]


def settings(comp: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The group settings of ``comp`` from the options: ``--density`` for
    topk, ``--block-size`` for onebit (the other block codecs keep their own default).

    >>> settings("topk", {"density": 0.01, "block_size": 2048}), settings("int8", {"block_size": 2048})
    ({'density': 0.01}, {})
    """
    row = spec.method_spec(comp)
    if row.kind == "sparse":
        return {"density": cfg["density"]}
    return {"block_size": cfg["block_size"]} if row.family == "onebit" else {}


# --------------------------------------------------------------------------- rank side


def _rank_main(rank: Rank) -> None:
    """One rank (:func:`pycomm_bench.launch.run_ranks`): every size, every method."""
    import torch
    import torch.distributed as dist

    import pycomm.distributed as pd

    cfg, r, world, local = rank.cfg, rank.rank, rank.world, rank.cfg["ranks_per_node"]
    groups: Dict[str, Any] = {PLAIN: None}
    for comp in cfg["compressors"]:
        kw = settings(comp, cfg)
        groups[f"{comp}-flat"] = pd.wrap(compressor=comp, hierarchy="flat", **kw)
        groups[f"{comp}-hier"] = pd.wrap(compressor=comp, hierarchy=local, **kw)
    names = list(groups)
    count_bytes = rank.ifname is not None and r % local == 0  # one rank per node reads the node's link

    def call(name: str, x: torch.Tensor, key: int) -> None:
        if name == PLAIN:
            dist.all_reduce(x)
        else:  # with error feedback, as in training (one key per size)
            pd.all_reduce(x, key=key, group=groups[name])

    for key, n in enumerate(cfg["sizes"]):
        base = torch.randn(n, generator=torch.Generator().manual_seed(r))
        x = torch.empty_like(base)
        identical: Dict[str, bool] = {}
        simulated: Dict[str, Optional[bool]] = {}
        # Rank 0 checks against the simulation: it rebuilds every rank's input.
        inputs = ([torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(world)]
                  if r == 0 else [])
        for name in names:  # first call: the same on every rank, and what the simulation says
            x.copy_(base)
            call(name, x, key)
            identical[name] = rank.identical(x)
            simulated[name] = _matches_simulation(name, x, inputs, local, cfg) if r == 0 else None

        # Each call: inputs restored and a barrier (untimed), the call timed,
        # the node's link read before and after (untimed, warm-up calls too).
        sent: Dict[str, List[float]] = {m: [] for m in names}
        tx0: Dict[str, Optional[int]] = {}
        calls = [0]

        def setup(name: str) -> None:
            x.copy_(base)
            dist.barrier()
            tx0[name] = rank.tx_bytes() if count_bytes else None

        def after(name: str) -> None:
            tx1 = rank.tx_bytes() if count_bytes else None
            if tx0[name] is not None and tx1 is not None:
                sent[name].append(tx1 - tx0[name])
            calls[0] += 1
            if calls[0] % len(names) == 0 and r == 0:
                rank.emit("step", step=calls[0] // len(names), size=n)

        contenders = {m: (lambda m=m: call(m, x, key), lambda m=m: setup(m)) for m in names}
        times = time_interleaved(contenders, cfg["repeats"], cfg["warmup"], on_call=after)
        # per repeat: the slowest rank; per node: its link's bytes
        worst = rank.max_over_ranks([t for m in names for t in times[m]])
        node_bytes = rank.max_over_ranks([statistics.median(sent[m][cfg["warmup"]:]) if sent[m] else 0.0
                                          for m in names])
        for j, name in enumerate(names):
            stats = summarize(worst[j * cfg["repeats"]:(j + 1) * cfg["repeats"]])
            if r == 0:
                rank.emit("result", record={
                    "method": name, "numel": n, "MB": n * 4 / 1e6, **stats,
                    "node_bytes_out_per_call": node_bytes[j] if rank.ifname else None,
                    "identical_on_all_ranks": identical[name],
                    "matches_simulation": simulated[name],
                })
    dist.barrier()


def _matches_simulation(name: str, got, inputs, local: int, cfg: Dict[str, Any]) -> bool:
    """Rank 0's first result of ``name`` against the single-process
    simulation (docs/hierarchy.md; bit for bit with 2 ranks per node, to
    float32 rounding with more) or, for plain, the float64 sum."""
    import torch

    from pycomm.distributed.simulate import simulate_allreduce, simulate_hierarchical_allreduce

    if name == PLAIN:
        exact = torch.stack(inputs).double().sum(0)
        return bool(torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5))
    comp, kind = name.split("-")
    kw = settings(comp, cfg)
    if kind == "hier":
        want = simulate_hierarchical_allreduce(inputs, comp, local, impl="cpu", **kw)[0]
    else:
        want = simulate_allreduce(inputs, comp, impl="cpu", **kw)[0]
    if kind == "hier" and local > 2:  # Gloo adds 3+ values in its own order
        return bool(torch.isclose(got, want, rtol=1e-5, atol=1e-5).float().mean() > 0.999)
    return bool(torch.equal(got, want))


# --------------------------------------------------------------------------- parent side


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    from .cli import fill_defaults
    from .netem import parse_rate

    if args.device.type != "cpu":
        raise ValueError("--device: this benchmark runs CPU ranks over Gloo (emulated links)")
    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2, got {args.ranks}")
    if args.ranks_per_node < 2 or args.ranks % args.ranks_per_node or args.ranks == args.ranks_per_node:
        raise ValueError(f"--ranks-per-node must be >= 2 and divide --ranks ({args.ranks}) into two or more "
                         f"nodes, got {args.ranks_per_node}")
    try:
        args.rate = parse_rate(args.bandwidth)
    except ValueError as exc:
        raise ValueError(f"--bandwidth: {exc}") from None
    if not args.netns and args.rate is not None:
        raise ValueError("--no-netns: links cannot be shaped, use --bandwidth none")
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    fill_defaults(args, args.quick, repeats=(DEFAULT_REPEATS, QUICK_REPEATS), warmup=(1, 1))
    for c in args.compressors:
        if c not in COMPRESSORS:
            raise ValueError(f"--compressors: any of {', '.join(COMPRESSORS)}, got {c!r}")
    if args.json is None:
        args.json = default_json_path("hierarchy", "cpu", quick=args.quick, settings=str(args.bandwidth).lower())
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import positive_int

    g = parser.add_argument_group("hierarchy options")
    g.add_argument("--ranks", type=int, default=4, help="ranks in all (default 4)")
    g.add_argument("--ranks-per-node", type=int, default=2, help="ranks per emulated node (default 2)")
    g.add_argument("--bandwidth", default="1gbit", help="link between nodes, e.g. 100mbit, 1gbit, none (default 1gbit)")
    g.add_argument("--sizes", type=positive_int, nargs="+", default=None,
                   help="float32 elements per all-reduce (default 4M 16M; --quick: 1M)")
    g.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS,
                   help=f"any of {', '.join(COMPRESSORS)} (default: {' '.join(DEFAULT_COMPRESSORS)})")
    g.add_argument("--block-size", type=positive_int, default=2048, help="onebit block (default 2048)")
    g.add_argument("--density", type=float, default=0.01, help="topk density (default 0.01)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds without progress before giving up")
    g.add_argument("--no-netns", dest="netns", action="store_false",
                   help="no namespaces: every rank on loopback (nothing is shaped)")
    g.add_argument("--netns-prefix", default="pycomm-hier", help="namespace name prefix")


def format_table(doc: Dict[str, Any]) -> str:
    """The results as a text table: time, speedup over plain, bytes out of each node, checks."""
    rows = []
    for rec in doc["records"]:
        plain = next(r for r in doc["records"] if r["numel"] == rec["numel"] and r["method"] == PLAIN)
        sent = rec["node_bytes_out_per_call"]
        rows.append([f"{rec['numel'] / (1 << 20):g}M", rec["method"],
                     f"{rec['median_s'] * 1e3:.1f} ({rec['p10_s'] * 1e3:.0f}-{rec['p90_s'] * 1e3:.0f})",
                     f"{plain['median_s'] / rec['median_s']:.2f}x",
                     "-" if sent is None else f"{sent / 1e6:.2f}",
                     "yes" if rec["identical_on_all_ranks"] else "NO",
                     "yes" if rec["matches_simulation"] else "NO"])
    return f"{doc['cluster']}\n" + table(
        rows, ["elements", "method", "ms median (p10-p90)", "vs plain", "MB out of each node", "identical",
               "= simulation"])


def run(args: argparse.Namespace) -> int:
    """``pycomm-bench hierarchy``: run, print the table, write the JSON."""
    from .links import link_report
    from .netem import LoopbackCluster, make_cluster

    t0 = time.monotonic()
    threads = threads_per_rank(args.ranks, args.threads)
    cfg = {"sizes": args.sizes, "ranks_per_node": args.ranks_per_node, "compressors": args.compressors,
           "block_size": args.block_size, "density": args.density, "repeats": args.repeats,
           "warmup": args.warmup, "timeout": args.timeout, "threads": threads}
    cluster = (make_cluster(args.ranks, args.rate, prefix=args.netns_prefix, ranks_per_node=args.ranks_per_node)
               if args.netns else LoopbackCluster(args.ranks, reason="--no-netns", ranks_per_node=args.ranks_per_node))
    try:
        with cluster:
            cfg["count_ifname"] = "eth0" if cluster.emulated else None
            busbw, line = link_report(cluster)
            print(line, flush=True)
            events = run_ranks(_rank_main, cluster, cfg, timeout=args.timeout, stall=args.timeout, threads=threads)
            desc = cluster.describe()
    except RanksFailed as exc:
        return fail("hierarchy", exc, 1)
    records = [e["record"] for e in events if e["event"] == "result"]
    doc = {"bench": "hierarchy", "date": time.strftime("%Y-%m-%d"), "machine": machine_info("cpu"),
           "cluster": desc, "emulated": cluster.emulated, "bandwidth_bits_per_s": args.rate,
           "link_busbw_measured": busbw, "ranks": args.ranks, "ranks_per_node": args.ranks_per_node,
           "config": cfg, "records": records}
    print()
    bad = sorted({r["method"] for r in records if not (r["identical_on_all_ranks"] and r["matches_simulation"])})
    return finish(doc, args.json, format_table(doc),
                  [f"{m}: ranks got different results, or not the simulation's" for m in bad], t0)


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["hierarchy", *sys.argv[1:]]))
