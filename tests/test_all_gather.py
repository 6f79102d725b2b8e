"""The engine's compressed all-gather (pd.all_gather) over real Gloo ranks
against the simulation (simulate_all_gather), bit for bit, at 2 and 4
ranks: every method and a registered compressor, chunked, 16-bit inputs,
error feedback over steps, a non-finite step, and a refused mismatch."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks

import plugin_int8  # noqa: F401  (registers "int8-absmax")
from pycomm.distributed.simulate import ErrorFeedback, simulate_all_gather

STEPS = 3
# (name, compressor, settings, input size, chunk_numel, dtype)
CASES = [
    ("int8", "int8", {"block_size": 64}, 5003, 2000, torch.float32),
    ("int4-bf16", "int4", {"block_size": 32}, 333, 100, torch.bfloat16),
    ("onebit", "onebit", {"block_size": 64}, 5003, 2000, torch.float32),
    ("onebit-1", "onebit", {"block_size": 32}, 1, 1 << 20, torch.float16),
    ("topk", "topk", {"density": 0.05, "approx": False}, 333, 100, torch.float32),
    ("int8-absmax", "int8-absmax", {}, 5003, 2000, torch.float32),
    ("fp16", "fp16", {}, 333, 100, torch.float32),
    ("none", "none", {}, 333, 100, torch.float32),
]
KEYED = ("int8", "int4", "onebit", "topk", "int8-absmax")
COMPILED = ("int8", "int4", "onebit", "topk")


def _input(case, step, rank, poison=False):
    name, _, _, n, _, dtype = case
    g = torch.Generator().manual_seed(1000 * CASES.index(case) + 10 * step + rank)
    x = torch.randn(n, generator=g) * (1 + rank)
    if poison and rank == 1:
        x[n // 2] = math.inf
    return x.to(dtype)


def _rank(rank, world):
    import plugin_int8  # noqa: F401  (a spawned rank imports the user's file too)

    import pycomm.distributed as pd

    out = {}
    for case in CASES:
        name, method, settings, n, chunk, dtype = case
        pg = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=chunk,
                     **({"compressor_options": settings} if method == "int8-absmax" else settings))
        key = 5 if method in KEYED else None
        res = []
        for step in range(STEPS):
            y = torch.empty(world * n, dtype=dtype)
            pd.all_gather(y, _input(case, step, rank), key=key, group=pg)
            ef = pd.error_feedback_state(pg).get(5) if key is not None else None
            res.append((y, ef["worker"].clone() if ef else None, ef["method"] if ef else None))
        out[name] = res
        if key is not None:  # a non-finite step: the residuals stay as they were
            before = pd.error_feedback_state(pg)[5]["worker"].clone()
            y = torch.empty(world * n, dtype=dtype)
            pd.all_gather(y, _input(case, STEPS, rank, poison=True), key=key, group=pg)
            out[name + "/nonfinite"] = (before, pd.error_feedback_state(pg)[5]["worker"].clone(), y)
    # Ranks calling with different sizes: refused on every rank, naming it.
    pg = pd.wrap(compressor="int8", min_compress_numel=1)
    n = 64 * (rank + 1)
    try:
        pd.all_gather(torch.empty(world * n), torch.randn(n), key=9, group=pg)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    y = torch.empty(world * 100)
    pd.all_gather(y, torch.full((100,), float(rank)), group=pg)  # the group still works
    out["after"] = y
    for bad, call in [("size", lambda: pd.all_gather(torch.empty(7), torch.ones(3), group=pg)),
                      ("dtype", lambda: pd.all_gather(torch.empty(2 * world, dtype=torch.int32),
                                                      torch.ones(2, dtype=torch.int32), group=pg))]:
        try:
            call()
            out[bad] = None
        except (RuntimeError, ValueError) as exc:
            out[bad] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return {w: run_ranks(_rank, w, timeout=240) for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_equals_simulation(results, world, case):
    name, method, settings, n, chunk, dtype = case
    keyed = method in KEYED
    efs = [ErrorFeedback() for _ in range(world)] if keyed else None
    kw = dict(settings)
    if method in COMPILED:
        kw["impl"] = "cpu"  # the engine's kernels: bit for bit
    for step in range(STEPS):
        want = simulate_all_gather([_input(case, step, r) for r in range(world)], method, chunk, efs, **kw)
        for r in range(world):
            got, residual, ef_method = results[world][r][name][step]
            assert got.dtype == dtype and got.numel() == world * n
            assert torch.equal(got, want[r]), (name, world, step, r)
            if keyed:
                assert ef_method == method + "/all_gather"
                assert torch.equal(residual, efs[r].worker), (name, world, step, r)
    if keyed and n > 1:
        assert efs[0].worker.abs().sum() > 0  # error feedback holds something


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [c[0] for c in CASES if c[1] in KEYED])
def test_nonfinite_step_leaves_residuals(results, world, name):
    for r in range(world):
        before, after, y = results[world][r][name + "/nonfinite"]
        assert not torch.isfinite(y).all()
        assert torch.equal(before, after), (name, world, r)


@pytest.mark.parametrize("world", [2, 4])
def test_misuse_is_refused_on_every_rank(results, world):
    for r in range(world):
        res = results[world][r]
        assert res["mismatch"] is not None and "numel" in res["mismatch"], res["mismatch"]
        assert res["after"].view(world, 100)[:, 0].tolist() == [float(j) for j in range(world)]
        assert "world size" in res["size"]
        assert "float32, float16 or bfloat16" in res["dtype"]
