"""The bus bandwidth of a cluster's links, measured with rank processes: a
plain Gloo all-reduce across the ranks of a :mod:`pycomm_bench.netem`
cluster, started by :mod:`pycomm_bench.launch` (which is why it lives in
neither: netem builds the namespaces, launch starts ranks in them).

Example::

    $ python -m pycomm_bench.links check --ranks 2 --rate 100M   # build, measure, print, tear down
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional, Sequence, Tuple

from .launch import run_ranks
from .netem import fmt_rate, make_cluster, parse_rate


def measure_busbw(cluster, nbytes: int = 4 << 20, repeats: int = 5, warmup: int = 1,
                  timeout: float = 60.0) -> float:
    """Bus bandwidth (bit/s) of a plain Gloo float32 all-reduce of ``nbytes``
    across the cluster's ranks, each a process started in its namespace
    (:func:`pycomm_bench.launch.run_ranks`): 2(W-1)/W x bits / time, time the
    median over ``repeats`` of the slowest rank's time (a barrier before each
    call). Raises :class:`pycomm_bench.launch.RanksFailed` if a rank fails
    or ``timeout`` seconds pass.

    >>> with make_cluster(2, 100e6) as c:          # doctest: +SKIP
    ...     measure_busbw(c) / 1e6
    95.1
    """
    cfg = {"nbytes": nbytes, "repeats": repeats, "warmup": warmup}
    events = run_ranks(_busbw_rank, cluster, cfg, timeout=timeout, stall=timeout, threads=1)
    return next(e["busbw_bits_per_s"] for e in events if e["event"] == "busbw")


def link_report(cluster, **measure_kw) -> Tuple[float, str]:
    """Measure the cluster's bus bandwidth (:func:`measure_busbw`) and a line
    to print before using it: what it is, the set rate and the measured one."""
    bw = measure_busbw(cluster, **measure_kw)
    rate = cluster.rate_bits_per_s
    ratio = f" ({bw / rate:.2f} x)" if rate else ""
    return bw, f"{cluster.describe()}: set {fmt_rate(rate)}, measured bus bandwidth {fmt_rate(bw)}{ratio}"


def _busbw_rank(rank) -> None:
    """One rank of :func:`measure_busbw`."""
    import torch
    import torch.distributed as dist

    from .timing import median

    cfg, w = rank.cfg, rank.world
    x = torch.ones(max(1, cfg["nbytes"] // 4), dtype=torch.float32)
    times = []
    for i in range(cfg["warmup"] + cfg["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        t = rank.max_over_ranks([time.perf_counter() - t0])[0]
        if i >= cfg["warmup"]:
            times.append(t)
        x.fill_(1.0)
    busbw = 2 * (w - 1) / w * x.numel() * 4 * 8 / median(times)
    if rank.rank == 0:
        rank.emit("busbw", world_size=w, nbytes=x.numel() * 4, times_s=times, median_s=median(times),
                  busbw_bits_per_s=busbw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m pycomm_bench.links check``: build a cluster, measure its
    bus bandwidth, print it, tear the cluster down.

    >>> main(["check", "--ranks", "2", "--rate", "none"])   # doctest: +SKIP
    2 ranks on 127.0.0.1 ...: set unshaped, measured bus bandwidth 3.58 Gbit/s
    0
    """
    ap = argparse.ArgumentParser(prog="python -m pycomm_bench.links", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="build a cluster, measure its bus bandwidth, tear it down")
    c.add_argument("--ranks", type=int, default=2)
    c.add_argument("--rate", default="100M", help="e.g. 100M, 1G, none")
    c.add_argument("--nbytes", type=int, default=4 << 20)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--prefix", default="pycomm")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rate = parse_rate(args.rate)
    with make_cluster(args.ranks, rate, prefix=args.prefix) as cluster:
        _, line = link_report(cluster, nbytes=args.nbytes, repeats=args.repeats)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
