"""CompressionState.load_state_dict is all or nothing, and copies.

Every field of a state is checked before anything changes: a refused state
leaves the object (configuration, iteration, bucket layouts, residuals, and
the residuals in its engine group) exactly as it was, and the error names the
offending field. The loaded residuals are copies: the engine trains its own
tensors, never the caller's, so loading the same checkpoint object twice
restores the same residuals.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.ddp import CompressionState, compressed_hook


def _residual(numel=100, method="onebit", chunk_numel=64, server=(50, 0), world_size=2):
    g = torch.Generator().manual_seed(numel)
    return {"numel": numel, "world_size": world_size, "chunk_numel": chunk_numel, "method": method,
            "worker": torch.randn(numel, generator=g),
            "server": [torch.randn(n, generator=g) for n in server]}


def _good_state(iteration=7, start_iter=3, block_size=64):
    """A valid saved state (onebit, two buckets, residuals for both)."""
    return {
        "version": 3,
        "config": {"compressor": "onebit", "density": 0.01, "approx": True, "block_size": block_size,
                   "chunk_numel": 64, "start_iter": start_iter, "error_feedback": True},
        "iteration": iteration,
        "bucket_layouts": {0: (100, [2, 3]), 1: (30, [0, 1])},
        "engine": {"version": 1, "world_size": None, "rank": None, "method": "onebit",
                   "residuals": {0: _residual(100), 1: _residual(30, server=(30,))}},
    }


def _snapshot(state):
    return copy.deepcopy(state.state_dict())


def _same(a, b):
    """Equal state dicts, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _set(path, value):
    """A mutation of a state: ``path`` into the dict, replaced by ``value``
    (``_DELETE``: removed)."""

    def mutate(state):
        d = state
        for key in path[:-1]:
            d = d[key]
        if value is _DELETE:
            del d[path[-1]]
        else:
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value

    return mutate


_DELETE = object()

# (id, mutation, exception type, text the error must hold)
BAD = [
    ("version", _set(["version"], 1), ValueError, "state['version']"),
    ("missing-field", _set(["iteration"], _DELETE), ValueError, "missing ['iteration']"),
    ("unknown-field", _set(["extra"], 1), ValueError, "unknown ['extra']"),
    ("config-type", _set(["config"], [1, 2]), TypeError, "state['config'] must be a dict"),
    ("config-missing", _set(["config", "density"], _DELETE), ValueError, "missing ['density']"),
    ("config-unknown", _set(["config", "speed"], 3), ValueError, "unknown ['speed']"),
    ("compressor", _set(["config", "compressor"], "powersgd"), ValueError, "state['config']['compressor']"),
    ("start_iter", _set(["config", "start_iter"], 1), ValueError, "state['config']['start_iter'] must be >= 2"),
    ("start_iter-type", _set(["config", "start_iter"], 2.0), TypeError, "state['config']['start_iter']"),
    ("block_size", _set(["config", "block_size"], 100), ValueError, "state['config']['block_size']"),
    ("chunk_numel", _set(["config", "chunk_numel"], 0), ValueError, "state['config']['chunk_numel']"),
    ("density", _set(["config", "density"], 2.0), ValueError, "state['config']['density']"),
    ("approx", _set(["config", "approx"], "yes"), TypeError, "state['config']['approx']"),
    ("error_feedback-flag", _set(["config", "error_feedback"], 1), TypeError, "state['config']['error_feedback']"),
    ("iteration-negative", _set(["iteration"], -1), ValueError, "state['iteration'] must be a non-negative int"),
    ("iteration-float", _set(["iteration"], 7.0), ValueError, "state['iteration']"),
    ("iteration-bool", _set(["iteration"], True), ValueError, "state['iteration']"),
    ("iteration-str", _set(["iteration"], "7"), ValueError, "state['iteration']"),
    ("world-without-rank", _set(["engine", "world_size"], 2), ValueError,
     "state['engine']['world_size'] and state['engine']['rank']"),
    ("rank-out-of-range", lambda s: s["engine"].update(world_size=2, rank=2), ValueError, "state['engine']['rank']"),
    ("world-zero", lambda s: s["engine"].update(world_size=0, rank=0), ValueError, "state['engine']['world_size']"),
    ("engine-version", _set(["engine", "version"], 0), ValueError, "state['engine']['version']"),
    ("engine-method", _set(["engine", "method"], "topk"), ValueError, "its residuals are 'topk''s"),
    ("layouts-type", _set(["bucket_layouts"], [1]), TypeError, "state['bucket_layouts'] must be a dict"),
    ("layout-key", _set(["bucket_layouts", -1], (3, [9])), ValueError, "state['bucket_layouts'][-1]"),
    ("layout-shape", _set(["bucket_layouts", 1], (30,)), ValueError, "state['bucket_layouts'][1]"),
    ("layout-numel", _set(["bucket_layouts", 1], (0, [0, 1])), ValueError, "state['bucket_layouts'][1]: numel"),
    ("layout-empty", _set(["bucket_layouts", 1], (30, [])), ValueError, "state['bucket_layouts'][1]"),
    ("layout-position", _set(["bucket_layouts", 1], (30, [0, "a"])), ValueError, "parameter position"),
    ("layout-overlap", _set(["bucket_layouts", 1], (30, [0, 3])), ValueError, "parameter 3 is also in bucket"),
    ("ef-type", _set(["engine", "residuals"], []), TypeError, "state['engine']['residuals']"),
    ("ef-key", _set(["engine", "residuals", "a"], _residual(10)), ValueError, "state['engine']['residuals']['a']"),
    ("ef-entry", _set(["engine", "residuals", 1], 5), TypeError, "state['engine']['residuals'][1] must be a dict"),
    ("ef-missing", _set(["engine", "residuals", 1, "server"], _DELETE), ValueError, "missing ['server']"),
    ("ef-numel", _set(["engine", "residuals", 1, "numel"], 0), ValueError, "state['engine']['residuals'][1]['numel']"),
    ("ef-world", _set(["engine", "residuals", 1, "world_size"], None), ValueError,
     "state['engine']['residuals'][1]['world_size']"),
    ("ef-method", _set(["engine", "residuals", 1, "method"], "topk"), ValueError,
     "state['engine']['residuals'][1]['method']"),
    ("worker-numel", _set(["engine", "residuals", 1, "worker"], torch.zeros(29)), ValueError,
     "state['engine']['residuals'][1]['worker'] must be a 1-D float32 tensor of numel=30"),
    ("worker-dtype", _set(["engine", "residuals", 1, "worker"], torch.zeros(30, dtype=torch.float64)), ValueError,
     "torch.float64"),
    ("worker-shape", _set(["engine", "residuals", 1, "worker"], torch.zeros(5, 6)), ValueError, "shape (5, 6)"),
    ("worker-type", _set(["engine", "residuals", 1, "worker"], [0.0] * 30), ValueError, "got list"),
    ("server-type", _set(["engine", "residuals", 1, "server"], torch.zeros(30)), TypeError,
     "state['engine']['residuals'][1]['server'] must be a list"),
    ("server-count", _set(["engine", "residuals", 0, "server"], [torch.zeros(50)]), ValueError,
     "one tensor per chunk (2 chunks"),
    ("server-length", _set(["engine", "residuals", 0, "server"], [torch.zeros(51), torch.zeros(0)]), ValueError,
     "state['engine']['residuals'][0]['server'][0]"),
    ("server-dtype", _set(["engine", "residuals", 0, "server"], [torch.zeros(50).half(), torch.zeros(0)]), ValueError,
     "torch.float16"),
]


@pytest.mark.parametrize("name,mutate,exc,text", BAD, ids=[b[0] for b in BAD])
def test_refused_state_changes_nothing_and_names_the_field(name, mutate, exc, text):
    state = CompressionState(compressor="topk", density=0.05, start_iter=5)
    state.load_state_dict(_good_state(iteration=3, start_iter=4))
    before = _snapshot(state)
    before_repr = repr(state)
    # Every other field differs from what is loaded, so a partial load shows.
    bad = _good_state(iteration=11, start_iter=9, block_size=128)
    bad["bucket_layouts"] = {0: (100, [2, 3]), 1: (30, [0, 1])}
    mutate(bad)
    with pytest.raises(exc) as info:
        state.load_state_dict(bad)
    assert text in str(info.value), str(info.value)
    assert _same(state.state_dict(), before)
    assert repr(state) == before_repr


def test_topk_residuals_have_no_server_part():
    state = CompressionState(compressor="topk", start_iter=3)
    good = _good_state()
    good["config"]["compressor"] = good["engine"]["method"] = "topk"
    good["engine"]["residuals"] = {1: _residual(30, method="topk", server=())}
    state.load_state_dict(good)
    good["engine"]["residuals"][1]["server"] = [torch.zeros(3)]
    before = _snapshot(state)
    with pytest.raises(ValueError, match=r"\['server'\] must be empty for 'topk'"):
        state.load_state_dict(good)
    assert _same(state.state_dict(), before)


def test_reset_flag_must_be_a_bool():
    state = CompressionState(compressor="onebit", start_iter=3)
    with pytest.raises(TypeError, match="reset_error_feedback must be a bool"):
        state.load_state_dict(_good_state(), reset_error_feedback="yes")


def test_a_valid_state_loads_whole():
    state = CompressionState(compressor="topk", start_iter=5)
    good = _good_state()
    state.load_state_dict(good)
    assert state.iteration == 7 and state.compressor == "onebit" and state.block_size == 64
    assert state.bucket_layouts == {0: (100, (2, 3)), 1: (30, (0, 1))}
    assert _same(state.state_dict()["engine"]["residuals"], good["engine"]["residuals"])
    # reset: the iteration and configuration, no residuals, no layout
    state.load_state_dict(good, reset_error_feedback=True)
    assert state.iteration == 7 and state.state_dict()["engine"]["residuals"] == {} and state.bucket_layouts == {}


def test_loaded_residuals_are_copies():
    good = _good_state()
    kept = copy.deepcopy(good)
    a, b = CompressionState(compressor="onebit", start_iter=3), CompressionState(compressor="onebit", start_iter=3)
    a.load_state_dict(good)
    b.load_state_dict(good)
    held = a.state_dict()["engine"]["residuals"]
    assert held[0]["worker"].data_ptr() != good["engine"]["residuals"][0]["worker"].data_ptr()
    # The caller changes its tensors: the states keep what was loaded.
    for ef in good["engine"]["residuals"].values():
        ef["worker"].add_(1.0)
        for s in ef["server"]:
            s.mul_(-1.0)
    assert _same(a.state_dict()["engine"]["residuals"], kept["engine"]["residuals"])
    assert _same(b.state_dict()["engine"]["residuals"], kept["engine"]["residuals"])
    # ... and the state's own dict does not change the state either.
    held[0]["worker"].zero_()
    assert _same(a.state_dict()["engine"]["residuals"], kept["engine"]["residuals"])


# ------------------------------------------------ with an engine attached ---
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def _train(model, opt, rank, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(16, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.cos(x[:, :4]))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _setup():
    model = DDP(_model(), bucket_cap_mb=0.05)
    state = CompressionState(compressor="onebit", block_size=64, start_iter=2, chunk_numel=4096)
    model.register_comm_hook(state, compressed_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), state


def _rank_engine(rank, world):
    out = {}
    model, opt, state = _setup()
    _train(model, opt, rank, 0, 5)
    saved = state.state_dict()
    pristine = copy.deepcopy(saved)
    out["keys"] = sorted(saved["engine"]["residuals"])
    before = copy.deepcopy(state.state_dict())

    refusals = {
        # the engine refuses: residuals of another world size
        "engine": lambda s: [ef.update(world_size=3) for ef in s["engine"]["residuals"].values()],
        # the hook refuses: another engine setting once buckets have run
        "block_size": lambda s: s["config"].update(block_size=128),
        # saved by the other rank
        "rank": lambda s: s["engine"].update(rank=1 - rank),
        # a malformed residual
        "worker": lambda s: s["engine"]["residuals"][0].update(worker=torch.zeros(3)),
    }
    for name, mutate in refusals.items():
        bad = copy.deepcopy(saved)
        bad["iteration"] = 99
        bad["config"]["start_iter"] = 50
        mutate(bad)
        try:
            state.load_state_dict(bad)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the type is checked by the test
            out[name] = f"{type(exc).__name__}: {exc}"
        out[name + " unchanged"] = _same(state.state_dict(), before) and state.iteration == 5

    # Loading the same object twice restores the same residuals, however
    # much the engine trained in between (onebit swaps its buffers in place).
    state.load_state_dict(saved)
    _train(model, opt, rank, 5, 9)
    out["trained differs"] = not _same(state.state_dict()["engine"]["residuals"], pristine["engine"]["residuals"])
    state.load_state_dict(saved)
    out["reloaded"] = _same(state.state_dict()["engine"]["residuals"], pristine["engine"]["residuals"])
    out["caller's dict untouched"] = _same(saved, pristine)

    # Two runs from the same loaded object in fresh states are identical.
    params = []
    for _ in range(2):
        model, opt, state = _setup()
        state.load_state_dict(saved)
        _train(model, opt, rank, 5, 9)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["same twice"] = torch.equal(params[0], params[1])
    out["caller's dict untouched after runs"] = _same(saved, pristine)
    return out


@pytest.fixture(scope="module")
def engine_runs():
    return run_ranks(_rank_engine, 2, timeout=120)


def test_refusals_with_an_engine_change_nothing(engine_runs):
    for r in engine_runs:
        assert len(r["keys"]) >= 2, r["keys"]
        assert r["engine"].startswith("RuntimeError: ") and "world size 3" in r["engine"], r["engine"]
        assert r["block_size"].startswith("ValueError: ") and "state['config']['block_size']" in r["block_size"]
        assert r["rank"].startswith("ValueError: ") and "residuals, this is rank" in r["rank"]
        assert r["worker"].startswith("ValueError: ") and "state['engine']['residuals'][0]['worker']" in r["worker"]
        for name in ("engine", "block_size", "rank", "worker"):
            assert r[name + " unchanged"], name


def test_loading_twice_restores_the_same_residuals(engine_runs):
    for r in engine_runs:
        assert r["trained differs"]
        assert r["reloaded"]
        assert r["caller's dict untouched"]
        assert r["same twice"]
        assert r["caller's dict untouched after runs"]


def test_a_state_of_the_previous_version_loads_as_the_same_state():
    """Version 2 kept the engine state's fields (world_size, rank,
    error_feedback) at the top level: it loads as the same state."""
    good = _good_state()
    engine = good.pop("engine")
    old = dict(good, version=2, world_size=engine["world_size"], rank=engine["rank"],
               error_feedback=engine["residuals"])
    a, b = CompressionState(compressor="onebit", start_iter=3), CompressionState(compressor="onebit", start_iter=3)
    a.load_state_dict(old)
    b.load_state_dict(dict(good, engine=engine))
    assert _same(a.state_dict(), b.state_dict())
    assert sorted(a.state_dict()["engine"]["residuals"]) == [0, 1]
    with pytest.raises(ValueError, match=r"state\['engine'\]\['residuals'\]\[1\]\['numel'\]"):
        a.load_state_dict(dict(old, error_feedback={1: _residual(0)}))
