"""Every row of the method table through every entry point, by its row alone.

Nothing here names a method: the cases are the rows of
``spec.METHOD_TABLE``, so a new row (a new quant width, say) is run through
the engine's three collectives against the simulation, the DDP hook, DiLoCo,
``pycomm.fsdp``'s collectives, ``pycomm plan`` and the benchmark harness's
method names without an edit to this file. Two Gloo ranks, CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import run_ranks

import pycomm.distributed as pd
from pycomm.distributed import simulate, spec

#: Every method a compressed call runs (the exact one forwards to Gloo).
COMPRESSED = [m for m in spec.METHODS if spec.method_spec(m).kind != "exact"]
N = 4099  # odd: partial blocks, bytes and words
WORLD = 2
SETTINGS = dict(chunk_numel=1536, block_size=64)  # several chunks and blocks


def _settings(method):
    """The group settings of ``method``: a block size where it has blocks."""
    row = spec.method_spec(method)
    return {"chunk_numel": SETTINGS["chunk_numel"],
            **({"block_size": SETTINGS["block_size"]} if row.kind == "block" else {})}


def _kwargs(method):
    """The simulation's compressor settings for ``method`` (the engine's kernels)."""
    row = spec.method_spec(method)
    kw = {"block_size": SETTINGS["block_size"]} if row.kind == "block" else {}
    return {**kw, "impl": "cpu"} if row.family is not None else kw


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N * WORLD, generator=g) * (1 + rank)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model, opt, rank, steps):
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _collectives(rank, world):
    out = {}
    x = _inputs(rank)
    for m in COMPRESSED:
        group = pd.wrap(compressor=m, min_compress_numel=1, **_settings(m))
        ar = x.clone()
        pd.all_reduce(ar, group=group, op="avg")
        rs = torch.empty(N)
        pd.reduce_scatter(rs, x, group=group, op="avg")
        ag = torch.empty(N * world)
        pd.all_gather(ag, x[:N].clone(), group=group)
        # Keyed: the residual kept for the key exists where the row keeps residuals.
        keyed = x.clone()
        pd.all_reduce(keyed, key=7, group=group, op="avg")
        kept = sorted(pd.error_feedback_state(group))
        out[m] = dict(all_reduce=ar, reduce_scatter=rs, all_gather=ag, keys=kept)
    return out


@pytest.mark.parametrize("method", COMPRESSED)
def test_collectives_match_the_simulation(collectives, method):
    xs = [_inputs(r) for r in range(WORLD)]
    chunk, kw = SETTINGS["chunk_numel"], _kwargs(method)
    want = {
        "all_reduce": simulate.simulate_allreduce(xs, method, op="avg", chunk_numel=chunk, **kw),
        "reduce_scatter": simulate.simulate_reduce_scatter(xs, method, op="avg", chunk_numel=chunk, **kw),
        "all_gather": simulate.simulate_all_gather([x[:N] for x in xs], method, chunk_numel=chunk, **kw),
    }
    # onebit's block scale is a mean (a float sum in another order): float
    # rounding; every other method is bit for bit.
    exact = spec.method_spec(method).family != "onebit"
    for rank in range(WORLD):
        got = collectives[rank][method]
        for name, results in want.items():
            tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[name], results[rank], **tol, msg=lambda s: f"{method} {name}: {s}")
        assert got["keys"] == ([7] if spec.method_spec(method).residuals else [])


def _entry_points(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook
    from pycomm.optim import DiLoCo

    out = {}
    for m in COMPRESSED:
        # The DDP hook, with the method's default error feedback.
        model = DDP(_model())
        state = CompressionState(compressor=m, start_iter=2, **_settings(m))
        model.register_comm_hook(state, compressed_hook)
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, 6)
        hook = (_flat(model.module), state.iteration, state.error_feedback, sorted(state.state_dict()["engine"]["residuals"]))
        # DiLoCo, every fragment synced once more at the end.
        model = _model()
        opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=2, compressor=m,
                     **({"block_size": 64} if spec.method_spec(m).kind == "block" else {}))
        _train(model, opt, rank, 4)
        out[m] = dict(hook=hook, diloco=(_flat(model), opt.error_feedback))
    return out


def _every_entry(rank, world):
    return {"collectives": _collectives(rank, world), "entry_points": _entry_points(rank, world)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_every_entry, WORLD, timeout=480)


@pytest.fixture(scope="module")
def collectives(runs):
    return [r["collectives"] for r in runs]


@pytest.fixture(scope="module")
def entry_points(runs):
    return [r["entry_points"] for r in runs]


@pytest.mark.parametrize("method", COMPRESSED)
def test_hook_and_diloco_run_every_method(entry_points, method):
    row = spec.method_spec(method)
    hooks = [entry_points[r][method]["hook"] for r in range(WORLD)]
    assert torch.equal(hooks[0][0], hooks[1][0]), "DDP replicas differ"
    assert bool(torch.isfinite(hooks[0][0]).all())
    assert hooks[0][1] == 6
    # The one error-feedback rule: the row's default.
    assert hooks[0][2] == spec.error_feedback_for(method, None) == row.error_feedback
    assert bool(hooks[0][3]) == row.error_feedback  # residuals kept, per bucket, only then
    dilocos = [entry_points[r][method]["diloco"] for r in range(WORLD)]
    assert torch.equal(dilocos[0][0], dilocos[1][0]), "DiLoCo replicas differ after a sync"
    assert dilocos[0][1] == row.error_feedback


def test_plan_and_bench_know_every_method():
    from pycomm import plan
    from pycomm_bench import methods as bench_methods

    assert set(plan.COMPRESSORS) == set(spec.METHODS)
    for m in COMPRESSED:
        row = spec.method_spec(m)
        r = plan.predict_allreduce_time(m, 1 << 20, 4, 1e9, 1e-5)
        assert r["bytes_per_rank"] == spec.wire_bytes(m, 1 << 20, 4, chunk_numel=spec.DEFAULT_CHUNK_NUMEL)
        if row.kind == "block":
            # Fewer bits, fewer bytes: the payload scales with the row's width.
            assert r["bytes_per_rank"] < spec.wire_bytes("none", 1 << 20, 4) * max(row.bits, 2) / 16
        if row.kind in ("block", "cast"):
            assert bench_methods.parse_method(m).compressor == m
