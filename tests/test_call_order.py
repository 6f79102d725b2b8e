"""Compressed calls submitted from two threads of each rank, in a different
order on each rank. The first use of each key was checked already, so the
call check (default "first") does not look again: the payloads' call tags
must catch it. Every rank raises for both calls, the residuals stay as they
were, and the group keeps working. The same two threads in the same order
on every rank run normally."""

from __future__ import annotations

import threading

import pytest
import torch
from _dist import run_ranks

import plugin_int8  # noqa: F401  (registers "int8-absmax")

N = 3000
METHODS = ["onebit", "int4", "topk", "int8-absmax"]
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather"]


def _call(pd, pg, collective, key, x, world):
    """Submits one keyed call (async) and returns its Work."""
    if collective == "all_reduce":
        return pd.all_reduce(x, key=key, group=pg, async_op=True)
    if collective == "reduce_scatter":
        return pd.reduce_scatter(torch.empty(N), x.repeat(world), key=key, group=pg, async_op=True)
    return pd.all_gather(torch.empty(world * N), x, key=key, group=pg, async_op=True)


def _two_threads(pd, pg, collective, world, first_key, seed):
    """Threads for keys 1 and 2; the one for `first_key` submits first.
    Returns {key: None or the error text}."""
    submitted = threading.Event()
    out = {}

    def run(key):
        if key != first_key:
            submitted.wait()
        x = torch.randn(N, generator=torch.Generator().manual_seed(seed + key))
        work = _call(pd, pg, collective, key, x, world)
        if key == first_key:
            submitted.set()
        try:
            work.wait()
            out[key] = None
        except RuntimeError as exc:
            out[key] = str(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def _rank(rank, world):
    import plugin_int8  # noqa: F401

    import pycomm.distributed as pd

    out = {}
    for method in METHODS:
        for collective in COLLECTIVES:
            pg = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=1000)
            # Same order on every rank: runs (and checks each key's first use).
            same = _two_threads(pd, pg, collective, world, first_key=1, seed=0)
            before = pd.error_feedback_state(pg)  # copies
            # Rank 0 submits key 1 first, the others key 2 first.
            swapped = _two_threads(pd, pg, collective, world, first_key=1 if rank == 0 else 2, seed=10)
            after = pd.error_feedback_state(pg)
            kept = sorted(before) == sorted(after) and all(
                torch.equal(before[k]["worker"], after[k]["worker"])
                and all(torch.equal(a, b) for a, b in zip(before[k]["server"], after[k]["server"]))
                for k in before)
            # The group still works: an aligned call, the same everywhere.
            y = torch.full((N,), float(rank + 1))
            pd.all_reduce(y, key=7, group=pg)
            out[(method, collective)] = (same, swapped, kept, y)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, timeout=300)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("method", METHODS)
def test_same_order_from_two_threads_runs(results, method, collective):
    for r in results:
        same = r[(method, collective)][0]
        assert same == {1: None, 2: None}


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("method", METHODS)
def test_swapped_order_raises_on_every_rank_and_keeps_residuals(results, method, collective):
    for r in results:
        _, swapped, kept, _ = r[(method, collective)]
        assert set(swapped) == {1, 2}
        for key, err in swapped.items():
            assert err is not None, f"key {key} ran with another key's payloads"
            assert "call tags differ" in err and "one thread" in err
        assert kept


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("method", METHODS)
def test_group_works_afterwards(results, method, collective):
    ys = [r[(method, collective)][3] for r in results]
    assert all(torch.equal(ys[0], y) for y in ys)
    assert torch.isfinite(ys[0]).all()
