"""The engine's compressed reduce-scatter (pd.reduce_scatter) over Gloo at 2
and 4 ranks against the simulation (simulate_reduce_scatter), bit for bit
with the engine's own kernels: every method, a registered compressor, odd
shard sizes and chunkings, 16-bit inputs, error feedback over several steps,
a non-finite step that leaves every residual as it was, and calls that
differ between ranks refused on every rank."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks

import plugin_int8  # noqa: F401  (registers "int8-absmax")
from pycomm.distributed.simulate import ErrorFeedback, simulate_reduce_scatter

STEPS = 3
# (name, compressor, settings, shard size, chunk_numel, op, dtype)
CASES = [
    ("onebit", "onebit", {"block_size": 64}, 5003, 2000, "avg", torch.float32),
    ("onebit-fp16", "onebit", {"block_size": 64}, 333, 100, "sum", torch.float16),
    ("onebit-1", "onebit", {"block_size": 32}, 1, 1 << 20, "sum", torch.float32),
    ("topk-approx", "topk", {"density": 0.01, "approx": True}, 5003, 2000, "avg", torch.float32),
    ("topk-exact", "topk", {"density": 0.05, "approx": False}, 333, 100, "sum", torch.float32),
    ("int8-absmax", "int8-absmax", {}, 5003, 2000, "avg", torch.float32),
    ("int8", "int8", {"block_size": 64}, 5003, 2000, "avg", torch.float32),
    ("int4", "int4", {}, 5003, 2000, "sum", torch.float32),
    ("int4-bf16", "int4", {"block_size": 32}, 333, 100, "avg", torch.bfloat16),
    ("fp16", "fp16", {}, 333, 100, "avg", torch.float32),
    ("bf16", "bf16", {}, 333, 100, "sum", torch.float32),
    ("none", "none", {}, 333, 100, "avg", torch.float32),
    # Inputs above 2^20 elements: the exact and 16-bit path's kept buffers
    # on a CPU, a row per rank.
    ("fp16-large", "fp16", {}, (1 << 19) + 7, 1 << 20, "avg", torch.float32),
    ("none-large", "none", {}, (1 << 19) + 7, 1 << 20, "sum", torch.float32),
]
KEYED = ("onebit", "topk", "int8-absmax", "int8", "int4")


def _input(case, step, rank, world, poison=False):
    name, _, _, shard, _, _, dtype = case
    g = torch.Generator().manual_seed(1000 * CASES.index(case) + 10 * step + rank)
    x = torch.randn(world * shard, generator=g) * (1 + rank)
    if poison and rank == world - 1:
        x[world * shard // 2] = math.inf
    return x.to(dtype)


def _rank(rank, world):
    import plugin_int8  # noqa: F401  (a spawned rank imports the user's file too)

    import pycomm.distributed as pd

    out = {}
    for case in CASES:
        name, method, settings, shard, chunk, op, dtype = case
        pg = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=chunk,
                     **({"compressor_options": settings} if method == "int8-absmax" else settings))
        key = 3 if method in KEYED else None
        res = []
        for step in range(STEPS):
            x = _input(case, step, rank, world)
            y = torch.empty(shard, dtype=dtype)
            pd.reduce_scatter(y, x, key=key, group=pg, op=op)
            ef = pd.error_feedback_state(pg).get(3) if key is not None else None
            res.append((y, ef["worker"].clone() if ef else None))
        out[name] = res
        if key is not None:  # a non-finite step: the residuals stay as they were
            before = pd.error_feedback_state(pg)[3]["worker"].clone()
            y = torch.empty(shard, dtype=dtype)
            pd.reduce_scatter(y, _input(case, STEPS, rank, world, poison=True), key=key, group=pg, op=op)
            out[name + "/nonfinite"] = (before, pd.error_feedback_state(pg)[3]["worker"].clone())
    # Ranks calling with different sizes: refused on every rank, naming it.
    pg = pd.wrap(compressor="onebit", min_compress_numel=1)
    n = 64 * (rank + 1)
    try:
        pd.reduce_scatter(torch.empty(n), torch.randn(world * n), key=9, group=pg)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    x = torch.ones(world * 100)
    y = torch.empty(100)
    pd.reduce_scatter(y, x, group=pg)  # the group still works
    out["after"] = y
    return out


@pytest.fixture(scope="module")
def results():
    return {w: run_ranks(_rank, w, timeout=240) for w in (2, 4)}


def _simulate(case, world, efs):
    name, method, settings, shard, chunk, op, dtype = case
    kw = dict(settings)
    if method in ("onebit", "topk", "int8", "int4"):
        kw["impl"] = "cpu"  # the engine's kernels: bit for bit
    return [simulate_reduce_scatter([_input(case, step, r, world) for r in range(world)], method, op,
                                    chunk, efs, **kw) for step in range(STEPS)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_equals_simulation(results, world, case):
    name, method = case[0], case[1]
    keyed = method in KEYED
    efs = [ErrorFeedback() for _ in range(world)] if keyed else None
    want = []
    for step in range(STEPS):
        kw = dict(case[2])
        if method in ("onebit", "topk", "int8", "int4"):
            kw["impl"] = "cpu"
        want.append(simulate_reduce_scatter([_input(case, step, r, world) for r in range(world)], method,
                                            case[5], case[4], efs, **kw))
        for r in range(world):
            got, residual = results[world][r][name][step]
            assert got.dtype == case[6] and got.numel() == case[3]
            if method in ("fp16", "bf16") and world > 2:
                # Gloo adds 16-bit values in its own order (see simulate.py).
                torch.testing.assert_close(got, want[step][r], rtol=0.02, atol=0.05)
            elif method == "none" and world > 2:
                # ... and float32 ones too: equal to float32 rounding.
                torch.testing.assert_close(got, want[step][r])
            else:
                assert torch.equal(got, want[step][r]), (name, world, step, r)
            if keyed:
                assert torch.equal(residual, efs[r].worker), (name, world, step, r)
    if keyed and case[3] > 1:  # one element per block: onebit sends it exactly
        assert efs[0].worker.abs().sum() > 0  # error feedback holds something


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["onebit", "topk-approx", "int8-absmax", "int8", "int4"])
def test_nonfinite_step_leaves_residuals(results, world, name):
    for r in range(world):
        before, after = results[world][r][name + "/nonfinite"]
        assert torch.equal(before, after), (name, world, r)
        assert before.abs().sum() > 0


@pytest.mark.parametrize("world", [2, 4])
def test_mismatch_is_refused_on_every_rank(results, world):
    for r in range(world):
        msg = results[world][r]["mismatch"]
        assert msg is not None and "reduce_scatter with different arguments" in msg, msg
        assert "numel (rank 0: " in msg and f"pycomm rank {r} of {world}" in msg, msg
        assert torch.equal(results[world][r]["after"], torch.full((100,), float(world)))


def test_arguments_are_checked():
    import pycomm.distributed as pd

    with pytest.raises(ValueError, match=r"op must be 'sum' or 'avg'"):
        pd.reduce_scatter(torch.empty(2), torch.empty(4), op="max")
    with pytest.raises(TypeError, match=r"output must be a torch.Tensor"):
        pd.reduce_scatter([0.0], torch.empty(4))
    with pytest.raises(ValueError, match=r"key must be an int in \[0, 2\*\*63\)"):
        pd.reduce_scatter(torch.empty(2), torch.empty(4), key=-2)
