"""Hierarchical all-reduce (docs/hierarchy.md) over Gloo, 4 and 6 processes.

Ranks are grouped into nodes (``hierarchy=ranks_per_node``); every rank
gets the same result, equal bit for bit to the single-process simulation,
and so are the residuals of error feedback, step after step.
"""

import os
from datetime import timedelta

import pytest
import torch

from _dist import run_ranks

from pycomm.distributed import ranks_per_node
from pycomm.distributed.simulate import ErrorFeedback
from pycomm.distributed.simulate import simulate_allreduce, simulate_hierarchical_allreduce

TIMEOUT = 90.0


def _inputs(step, world, n):
    return [torch.randn(n, generator=torch.Generator().manual_seed(31 * step + r)) * (1 + r) for r in range(world)]


def _run(rank, world, method, n, local, settings, op, steps, poison_step=None):
    import pycomm.distributed as pd

    pd.init_process_group(compressor=method, backend="gloo", init_method="env://", min_compress_numel=1,
                          hierarchy=local, timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])),
                          **settings)
    out = []
    for step in range(steps):
        x = _inputs(step, world, n)[rank].clone()
        if step == poison_step and rank == world - 1:
            x[-1] = float("inf")
        pd.all_reduce(x, key=0, op=op)
        out.append(x)
    state = pd.error_feedback_state()
    return out, {k: v["worker"] for k, v in state.items()}, pd.options_of()["ranks_per_node"]


CASES = [
    # method, world, ranks per node, n, settings, op
    ("onebit", 4, 2, 5000, dict(chunk_numel=1024, block_size=64), "avg"),
    ("onebit", 6, 2, 70001, dict(block_size=256), "sum"),  # three nodes
    ("topk", 6, 3, 20000, dict(chunk_numel=5000, density=0.02, approx=True), "sum"),  # three ranks per node
    ("topk", 4, 2, 4099, dict(chunk_numel=1000, density=0.05, approx=False), "avg"),
    ("onebit", 4, 2, 1, dict(block_size=32), "sum"),  # one element: the second shard is empty
]


@pytest.mark.parametrize("method,world,local,n,settings,op", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[3]}" for c in CASES])
def test_hierarchical_equals_simulation(method, world, local, n, settings, op):
    steps = 3
    res = run_ranks(_run, world, method, n, local, settings, op, steps, timeout=TIMEOUT, init_process_group=False)
    assert all(r[2] == local for r in res)
    chunk = settings.get("chunk_numel", 1 << 20)
    kw = {k: v for k, v in settings.items() if k != "chunk_numel"}
    S = -(-n // local)
    efs = [ErrorFeedback() if min(n, (r % local) * S) < min(n, (r % local + 1) * S) else None for r in range(world)]
    for step in range(steps):
        want = simulate_hierarchical_allreduce(_inputs(step, world, n), method, local, op=op, chunk_numel=chunk,
                                               efs=efs, impl="cpu", **kw)
        for r in range(world):
            assert torch.equal(res[r][0][step], res[0][0][step]), "ranks disagree"
            if local > 2:
                # Gloo sums three or more node-local values in its own order
                # (docs/hierarchy.md): equal to rounding, and the selections
                # of top-k almost always agree.
                close = torch.isclose(res[r][0][step], want[r], rtol=1e-5, atol=1e-5)
                assert close.float().mean() > 0.999, f"step {step} rank {r}"
            else:
                assert torch.equal(res[r][0][step], want[r]), f"step {step} rank {r}"
    if local > 2:
        return
    flat = simulate_allreduce(_inputs(steps - 1, world, n), method, op=op, chunk_numel=chunk, impl="cpu", **kw)[0]
    if n > 1:
        assert not torch.equal(res[0][0][-1], flat), "hierarchical gave the flat result: not hierarchical?"
    for r in range(world):
        if efs[r] is None:
            assert res[r][1] == {}, "a rank with an empty shard keeps no residual"
        else:
            assert torch.equal(res[r][1][0], efs[r].worker), f"rank {r} residual"


def test_non_finite_step_rolls_back_every_shard_group():
    # An Inf in one element: only one shard group sees it, but the result is
    # non-finite everywhere and every residual stays as it was.
    world, local, n = 4, 2, 3000
    res = run_ranks(_run, world, "onebit", n, local, dict(block_size=64), "avg", 3, 1,
                    timeout=TIMEOUT, init_process_group=False)
    efs = [ErrorFeedback() for _ in range(world)]
    for step in range(3):
        xs = _inputs(step, world, n)
        if step == 1:
            xs[-1][-1] = float("inf")
        want = simulate_hierarchical_allreduce(xs, "onebit", local, op="avg", efs=efs, impl="cpu", block_size=64)
        for r in range(world):
            assert torch.equal(res[r][0][step], want[r])
            assert bool(torch.isfinite(res[r][0][step]).all()) == (step != 1)
    for r in range(world):
        assert torch.equal(res[r][1][0], efs[r].worker)


def test_ranks_per_node_resolution():
    assert ranks_per_node("flat", 8) == 1
    assert ranks_per_node(4, 8) == 4
    assert ranks_per_node(8, 8) == 1  # one node: nothing to save
    assert ranks_per_node("auto", 8, {}) == 1
    assert ranks_per_node("auto", 8, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert ranks_per_node("auto", 8, {"LOCAL_WORLD_SIZE": "3"}) == 1  # unequal nodes: flat
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        ranks_per_node(3, 8)
    import pycomm.distributed as pd

    with pytest.raises(ValueError, match="hierarchy must be"):
        pd.PycommOptions(hierarchy="nodes")
    with pytest.raises(ValueError, match="hierarchy must be"):
        pd.PycommOptions(hierarchy=0)


def _auto_env(rank, world, contiguous):
    import pycomm.distributed as pd

    # torchrun's layout: 2 ranks per node, numbered contiguously (or not).
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2 if contiguous else rank // 2)
    pd.init_process_group(compressor="onebit", backend="gloo", init_method="env://", min_compress_numel=1,
                          timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])))
    x = _inputs(0, world, 999)[rank].clone()
    pd.all_reduce(x, op="sum")
    return pd.options_of()["ranks_per_node"], x


@pytest.mark.parametrize("contiguous", [True, False])
def test_auto_reads_local_world_size(contiguous):
    res = run_ranks(_auto_env, 4, contiguous, timeout=TIMEOUT, init_process_group=False)
    if contiguous:
        want = simulate_hierarchical_allreduce(_inputs(0, 4, 999), "onebit", 2, impl="cpu", block_size=2048)
    else:  # a layout it cannot shard by node: flat, with a warning
        want = simulate_allreduce(_inputs(0, 4, 999), "onebit", impl="cpu", block_size=2048)
    for local, x in res:
        assert local == (2 if contiguous else 1) and torch.equal(x, want[0])


def _changed_key(rank, world, method, local):
    import pycomm.distributed as pd

    pd.init_process_group(compressor=method, backend="gloo", init_method="env://", min_compress_numel=1,
                          hierarchy=local, timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])))
    n = 4000
    pd.all_reduce(torch.randn(n), key=0)
    try:  # rank 1 changes the key's size: its shard group fails, and its node tells the others
        pd.all_reduce(torch.randn(n - 8 if rank == 1 else n), key=0)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    x = torch.full((n,), float(rank + 1))
    pd.all_reduce(x, key=0)  # the group is still in step
    return error, x


@pytest.mark.parametrize("method", ["onebit", "topk"])
def test_a_changed_key_raises_on_every_rank_of_every_node(method):
    world, local = 4, 2
    res = run_ranks(_changed_key, world, method, local, timeout=TIMEOUT, init_process_group=False)
    for rank, (error, x) in enumerate(res):
        assert error is not None, rank
        if rank == 1:
            assert "error-feedback key 0 was first used for an all_reduce of 4000 float32" in error, error
        else:  # its shard group's tags, or its node, say so
            assert "a rank refused its call" in error, error
        assert torch.equal(x, res[0][1]), rank
