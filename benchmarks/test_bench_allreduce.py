"""pytest-benchmark versions of the all-reduce cases: plain Gloo against the
"pycomm" backend's fp16, onebit and topk all-reduces of 4M float32, 2 ranks.

Rank 0 is the pytest process; rank 1 is a process started by the fixture
(:class:`pycomm_bench.launch.RankProcesses`) that runs the same collective
each time rank 0 tells it which (a 2-element
broadcast before every call, identical for every contender). Before timing,
each contender's result must be bit-identical on both ranks, and plain Gloo's
must be the exact sum.

Run with the kernel suite and compare with the saved baseline (fails on a
median regression over 20%)::

    bash scripts/microbench.sh            # or --save to record a new baseline
"""

import os
from datetime import timedelta

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pycomm_bench.allreduce import parse_method  # noqa: E402
from pycomm_bench.launch import Rank, RankProcesses  # noqa: E402

N = 1 << 22
WORLD = 2
ROUNDS = 10
WARMUP_ROUNDS = 2
#: (name, pycomm compressor or None for plain Gloo), in the order every rank builds its groups.
CASES = [(m.name, m.compressor if m.compressed else None)
         for m in map(parse_method, "plain,fp16,onebit,topk-0.01".split(","))]
EXIT = -1


def _groups():
    """Same groups, same order, on every rank."""
    import pycomm.distributed as pd

    return {name: (None if comp is None else pd.wrap(None, compressor=comp)) for name, comp in CASES}


def _data(rank):
    # On a 2^-10 grid with small magnitudes: every float32 partial sum is exact.
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-1024, 1024, (N,), generator=g).float() / 1024


def _command(case=EXIT):
    cmd = torch.tensor([case], dtype=torch.int64)
    dist.broadcast(cmd, src=0)
    return int(cmd.item())


def _call(groups, name, x, base):
    x.copy_(base)
    dist.all_reduce(x, group=groups[name])


def _worker(rank):
    """Rank 1: the collective rank 0 names, until it says EXIT."""
    groups = _groups()
    base, x = _data(1), torch.empty(N)
    names = [n for n, _ in CASES]
    while (case := _command()) != EXIT:
        if case >= len(names):  # verification: check the result's bits with rank 0
            _verify(rank, groups, names[case - len(names)], x, base)
        else:
            _call(groups, names[case], x, base)


def _verify(rank, groups, name, x, base):
    """True on both ranks iff they end with the same bits."""
    _call(groups, name, x, base)
    return rank.identical(x)


@pytest.fixture(scope="module")
def world():
    with RankProcesses(_worker, WORLD, ranks=[1], timeout=120, threads=1) as procs:
        os.environ.update(procs.cluster.env(0))
        dist.init_process_group("gloo", rank=0, world_size=WORLD, timeout=timedelta(seconds=120))
        try:
            yield _groups()
        finally:
            _command(EXIT)
            dist.destroy_process_group()
            procs.wait()


@pytest.mark.benchmark(group="all-reduce 4M float32, 2 ranks")
@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_allreduce(benchmark, world, name):
    names = [n for n, _ in CASES]
    case = names.index(name)
    base, x = _data(0), torch.empty(N)

    _command(len(names) + case)
    assert _verify(Rank({}), world, name, x, base), f"{name}: the ranks' results differ"
    if name == "plain":
        assert torch.equal(x, base + _data(1)), "plain all-reduce is not the exact sum"

    def call():
        _command(case)
        _call(world, name, x, base)

    benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    benchmark.extra_info.update(numel=N, world=WORLD)
    if benchmark.stats is not None:
        benchmark.extra_info["algbw_gbps"] = 4 * N / benchmark.stats.stats.median / 1e9
