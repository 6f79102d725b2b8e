"""The DDP comm hook (pycomm.ddp) over plain Gloo ranks (which the hook wraps
into the engine's own group) and over pycomm groups: training converges like
plain all-reduce, ranks stay identical, the state survives a restart exactly,
and misuse is refused clearly.

Each multi-process job runs several configurations one after the other in
the same ranks (spawning costs seconds here); the tests check its results.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.ddp import CompressionState, compressed_hook
from pycomm.distributed import spec

IN, HID, OUT, BATCH = 64, 256, 10, 32
# 0.25 MiB = 65536 floats: the 256x256 weights (65536 elements each) end up
# in three buckets after DDP's rebuild (~68K, ~66K and ~17K elements).
BUCKET_CAP_MB = 0.25
LR, MOMENTUM = 0.05, 0.9
STEPS = 300
START_ITER = 10

CONFIGS = {
    "plain": None,
    "fp16": dict(compressor="fp16", start_iter=START_ITER),
    "onebit": dict(compressor="onebit", block_size=256, start_iter=START_ITER),
    "onebit-noef": dict(compressor="onebit", block_size=256, start_iter=START_ITER, error_feedback=False),
    "topk": dict(compressor="topk", density=0.01, start_iter=START_ITER),
    "topk-noef": dict(compressor="topk", density=0.01, start_iter=START_ITER, error_feedback=False),
}

# Final eval loss over plain all-reduce's, same model seed, this file's own
# training (_train: STEPS = FOUR_STEPS = 300, SGD lr 0.05 momentum 0.9,
# BUCKET_CAP_MB, the configs above), measured on model seeds 0-11 (the tests
# use seed 0; 12 seeds x every config, 2 ranks and 4 ranks, one thread per
# rank, CPU; plain's eval loss 0.047-0.050, 0.45 at the start):
#   onebit(B=256)+EF: 2 ranks 1.076-1.267 (seed 0: 1.179), 4 ranks 1.119-1.250
#                     (seed 0: 1.219); over a pycomm group the same, bit for bit;
#   topk(1%)+EF:      2 ranks 1.204-1.503 (seed 0: 1.289), pycomm group the same;
#   fp16:             0.9991-1.0005.
# Each margin is the worst ratio seen plus a slack for what 12 seeds do not
# show (another CPU or torch rounds differently: another trajectory): +0.05
# for onebit and topk, +0.01 for fp16.
EF_MARGIN = {"onebit": 1.32, "topk": 1.55, "fp16": 1.01}
# Without EF the same runs end worse than with it: noEF / EF loss, seeds 0-11,
# 2 ranks: onebit 1.092-1.328 (seed 0: 1.184), topk 1.277-1.599 (seed 0:
# 1.396). Asserted as the lowest ratio seen (1.09) less the same 0.05 slack.
NO_EF_WORSE = 1.04


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(),
        nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT),
    )


def _teacher():
    """A fixed random function to regress (the same in every process)."""
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(IN, 32, generator=g) / IN**0.5
    w2 = torch.randn(32, OUT, generator=g) / 32**0.5
    return lambda x: torch.tanh(x @ w1) @ w2


def _batch(rank, step, teacher):
    # Depends only on (rank, step): a resumed run sees the same data.
    g = torch.Generator().manual_seed(100003 * rank + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, teacher(x)


def _eval_loss(module, teacher):
    g = torch.Generator().manual_seed(999)
    x = torch.randn(1024, IN, generator=g)
    with torch.no_grad():
        return nn.functional.mse_loss(module(x), teacher(x)).item()


def _setup(cfg, seed=0, **ddp_kwargs):
    model = DDP(_model(seed), bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", BUCKET_CAP_MB), **ddp_kwargs)
    state = None
    if cfg is not None:
        state = CompressionState(**cfg)
        model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return model, opt, state


def _steps(model, opt, rank, start, stop, teacher):
    for step in range(start, stop):
        x, y = _batch(rank, step, teacher)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


def _train(rank, cfg, steps, seed=0, **ddp_kwargs):
    teacher = _teacher()
    model, opt, state = _setup(cfg, seed, **ddp_kwargs)
    _steps(model, opt, rank, 0, steps, teacher)
    return {"loss0": _eval_loss(_model(seed), teacher), "loss": _eval_loss(model.module, teacher),
            "params": _flat_params(model), "iteration": state.iteration if state else None}


# ------------------------------------------------------------ rank bodies ---
def _rank_training(rank, world):
    out = {name: _train(rank, cfg, STEPS) for name, cfg in CONFIGS.items()}

    # The pycomm backend path: over a pycomm group the hook hands each bucket
    # to the backend (its C++ algorithms, its residuals under the bucket key).
    import pycomm.distributed as pd

    for name in ("onebit", "topk"):
        cfg = dict(CONFIGS[name])
        settings = {k: cfg[k] for k in ("block_size", "density") if k in cfg}
        pg = pd.wrap(compressor=name, min_compress_numel=1, **settings)
        res = _train(rank, dict(cfg, process_group=pg), STEPS)
        res["backend_keys"] = sorted(pd.error_feedback_state(pg))
        out[f"pycomm-{name}"] = res
    # A state whose compressor differs from the group's is refused.
    pg = pd.wrap(compressor="onebit", min_compress_numel=1)
    try:
        _train(rank, dict(compressor="topk", start_iter=2, process_group=pg), 3)
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - DDP may wrap it
        out["mismatch"] = f"{type(exc).__name__}: {exc}"

    # DDP's own all-reduce of the used-parameter map is issued by autograd
    # while the hook's thread may still be busy: a private group keeps the
    # two streams of collectives apart.
    out["unused"] = _train(
        rank, dict(compressor="onebit", start_iter=2, private_group=True), 20, find_unused_parameters=True
    )

    # A failure inside the hook reaches backward(), never hangs.
    real = pd.all_reduce

    def broken(*args, **kwargs):
        if kwargs.get("compress", True):
            raise RuntimeError("injected failure in the compressed all-reduce")
        return real(*args, **kwargs)

    pd.all_reduce = broken
    try:
        _train(rank, dict(compressor="topk", start_iter=2), 3)
        out["failure"] = None
    except Exception as exc:  # noqa: BLE001 - whatever type DDP wraps it in
        out["failure"] = f"{type(exc).__name__}: {exc}"
    finally:
        pd.all_reduce = real
    return out


RESUME_N = 30
RESUME_CONFIGS = {
    "onebit": dict(compressor="onebit", block_size=256, start_iter=5, chunk_numel=40000),
    "topk": dict(compressor="topk", density=0.01, start_iter=5),
    # Stochastic rounding: each bucket's call count is saved with its
    # residuals (so error feedback is on: without residuals a keyless call's
    # count starts over in a new process).
    "int4-stochastic": dict(compressor="int4", rounding="stochastic", seed=11, start_iter=5, chunk_numel=40000,
                            error_feedback=True),
}


def _rank_uninterrupted(rank, world, directory):
    """2N steps; the state (model, optimizer, hook) is saved after N."""
    teacher = _teacher()
    out = {}
    for name, cfg in RESUME_CONFIGS.items():
        model, opt, state = _setup(cfg)
        _steps(model, opt, rank, 0, RESUME_N, teacher)
        torch.save(
            {"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
            f"{directory}/{name}_rank{rank}.pt",
        )
        _steps(model, opt, rank, RESUME_N, 2 * RESUME_N, teacher)
        out[name] = _flat_params(model)
    return out


def _restore(rank, name, directory, cfg=None, reset=False, **ddp_kwargs):
    ck = torch.load(f"{directory}/{name}_rank{rank % 2}.pt", weights_only=True)
    model, opt, state = _setup(cfg or RESUME_CONFIGS[name], **ddp_kwargs)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"], reset_error_feedback=reset)
    return model, opt, state


def _rank_resumed(rank, world, directory):
    """Fresh processes: load the state saved after N steps, run to 2N."""
    teacher = _teacher()
    out = {}
    for name in RESUME_CONFIGS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt, state = _restore(rank, name, directory)
            assert state.iteration == RESUME_N
            _steps(model, opt, rank, RESUME_N, 2 * RESUME_N, teacher)
        out[name] = _flat_params(model)
        out[name + "_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    # Another bucket layout (every parameter in one bucket): refused as soon
    # as DDP's buckets are known (the second iteration of this process).
    model, opt, state = _restore(rank, "topk", directory, bucket_cap_mb=4)
    try:
        _steps(model, opt, rank, RESUME_N, RESUME_N + 3, teacher)
        out["layout_error"] = None
    except Exception as exc:  # noqa: BLE001
        out["layout_error"] = str(exc)
    return out


def _rank_four(rank, world, directory):
    out = {
        "plain": _train(rank, None, FOUR_STEPS),
        "onebit": _train(rank, CONFIGS["onebit"], FOUR_STEPS),
    }
    # A state saved by 2 ranks is refused by 4 ...
    try:
        _restore(rank, "onebit", directory)
        out["world_error"] = None
    except ValueError as exc:
        out["world_error"] = str(exc)
    # ... unless its residuals are dropped; the iteration carries on.
    teacher = _teacher()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # first iteration: uncompressed
        model, opt, state = _restore(rank, "onebit", directory, reset=True)
        _steps(model, opt, rank, RESUME_N, RESUME_N + 5, teacher)
    out["reset"] = {"iteration": state.iteration, "params": _flat_params(model),
                    "buckets": sorted(state.state_dict()["engine"]["residuals"])}
    return out


FOUR_STEPS = 300  # see EF_MARGIN


# ----------------------------------------------------------------- fixtures ---
@pytest.fixture(scope="module")
def training():
    return run_ranks(_rank_training, 2, timeout=300.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hook_state")
    return directory, run_ranks(_rank_uninterrupted, 2, str(directory), timeout=120.0)


# -------------------------------------------------------------------- tests ---
def _assert_same_on_all_ranks(results):
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_converges_and_ranks_agree(training, name):
    results = [r[name] for r in training]
    _assert_same_on_all_ranks(results)
    res = results[0]
    assert res["loss"] < 0.25 * res["loss0"], res  # it learned (0.45 -> ~0.05 plain)
    if CONFIGS[name] is not None:
        assert res["iteration"] == STEPS


@pytest.mark.parametrize("name", ["fp16", "onebit", "topk"])
def test_with_error_feedback_close_to_plain(training, name):
    plain, loss = training[0]["plain"]["loss"], training[0][name]["loss"]
    assert loss <= EF_MARGIN[name] * plain, f"{name}: {loss:.4f} vs plain {plain:.4f} ({loss / plain:.2f}x)"


@pytest.mark.parametrize("name", ["onebit", "topk"])
def test_without_error_feedback_worse(training, name):
    ef, no_ef = training[0][name]["loss"], training[0][name + "-noef"]["loss"]
    assert no_ef >= NO_EF_WORSE * ef, f"{name}: no EF {no_ef:.4f} vs EF {ef:.4f}"


@pytest.mark.parametrize("name", ["onebit", "topk"])
def test_hook_over_pycomm_group(training, name):
    results = [r[f"pycomm-{name}"] for r in training]
    _assert_same_on_all_ranks(results)
    res, plain = results[0], training[0]["plain"]["loss"]
    # The same engine as over a plain group: the same margin.
    assert res["loss"] <= EF_MARGIN[name] * plain, f"{res['loss']:.4f} vs plain {plain:.4f}"
    # The residuals live in the backend, one per DDP bucket index.
    assert res["backend_keys"] == [0, 1, 2]
    assert "runs the pycomm backend with compressor='onebit'" in training[0]["mismatch"]
    # The hook's own refusals keep their type in DDP's message.
    assert "ValueError" in training[0]["mismatch"]


def test_find_unused_parameters_with_private_group(training):
    _assert_same_on_all_ranks([r["unused"] for r in training])
    assert training[0]["unused"]["iteration"] == 20


def test_failure_reaches_backward(training):
    for r in training:
        assert r["failure"] is not None and "injected failure" in r["failure"]


def test_resume_is_exact(saved):
    directory, uninterrupted = saved
    resumed = run_ranks(_rank_resumed, 2, str(directory), timeout=120.0)
    for rank in range(2):
        for name in RESUME_CONFIGS:
            # CPU, one thread, same data: bit for bit, compressed from step N on
            # (DDP's first, unrebuilt bucket is split as the saved layout).
            assert torch.equal(resumed[rank][name], uninterrupted[rank][name]), (rank, name)
            assert resumed[rank][name + "_warnings"] == []
        err = resumed[rank]["layout_error"]
        assert err is not None and "reset_error_feedback=True" in err and "bucket 0" in err, err


def test_four_ranks_and_world_size_refusal(saved):
    directory, _ = saved
    res = run_ranks(_rank_four, 4, str(directory), timeout=240.0)
    _assert_same_on_all_ranks([r["onebit"] for r in res])
    _assert_same_on_all_ranks([r["plain"] for r in res])
    plain, onebit = res[0]["plain"]["loss"], res[0]["onebit"]["loss"]
    assert onebit < 0.25 * res[0]["onebit"]["loss0"]
    assert onebit <= EF_MARGIN["onebit"] * plain, (onebit, plain)
    for r in res:
        assert "world size 2" in r["world_error"] and "this group has 4" in r["world_error"]
        assert r["reset"]["iteration"] == RESUME_N + 5
        assert r["reset"]["buckets"] == [0, 1, 2]
    _assert_same_on_all_ranks([r["reset"] for r in res])


# ------------------------------------------------------- single process ---
def test_start_iter_must_be_at_least_two():
    with pytest.raises(ValueError, match="start_iter must be >= 2.*rebuilds"):
        CompressionState(compressor="topk", start_iter=1)
    with pytest.raises(ValueError, match="compressor must be one of"):
        CompressionState(compressor="powersgd")
    with pytest.raises(ValueError, match="multiple of 32"):
        CompressionState(compressor="onebit", block_size=100)


def test_state_pickles_without_process_group():
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    state = CompressionState(process_group=group, compressor="onebit", block_size=64, start_iter=3)
    saved = state.state_dict()
    residual = {"numel": 100, "world_size": 2, "chunk_numel": 64, "method": "onebit",
                "worker": torch.randn(100), "server": [torch.randn(32), torch.randn(18)]}
    state.load_state_dict(dict(saved, iteration=7, engine=dict(saved["engine"], residuals={2: residual})))
    with pytest.raises(TypeError):
        pickle.dumps(group)
    copy = pickle.loads(pickle.dumps(state))  # the group could not be pickled
    assert copy.process_group is None
    assert copy.iteration == 7 and copy.config() == state.config()
    kept = copy.state_dict()["engine"]["residuals"][2]
    assert torch.equal(kept["worker"], residual["worker"])
    assert all(torch.equal(a, b) for a, b in zip(kept["server"], residual["server"]))


def test_rounding_settings():
    with pytest.raises(ValueError, match="rounding='stochastic' is for the " + ", ".join(spec.ROUNDING_METHODS)):
        CompressionState(compressor="topk", rounding="stochastic")
    with pytest.raises(ValueError, match="seed must be an integer"):
        CompressionState(compressor="int4", rounding="stochastic", seed=-3)
    state = CompressionState(compressor="int4", rounding="stochastic", seed=5, start_iter=3)
    saved = state.state_dict()
    assert (saved["config"]["rounding"], saved["config"]["seed"]) == ("stochastic", 5)
    with pytest.raises(ValueError, match=r"state\['config'\]\['seed'\]: seed must be"):
        state.load_state_dict(dict(saved, config=dict(saved["config"], seed=2**32)))
    with pytest.raises(ValueError, match=r"state\['config'\]\['rounding'\]: rounding must be one of"):
        state.load_state_dict(dict(saved, config=dict(saved["config"], rounding="up")))
    assert state.rounding == "stochastic"  # refused whole
    # A state saved before rounding existed rounds to nearest.
    older = dict(saved, config={k: v for k, v in saved["config"].items() if k not in ("rounding", "seed")})
    state.load_state_dict(older)
    assert (state.rounding, state.seed) == ("nearest", 0)
    residual = {"numel": 100, "world_size": 2, "chunk_numel": 64, "method": "int4", "calls": -1,
                "worker": torch.randn(100), "server": [torch.randn(32), torch.randn(18)]}
    with pytest.raises(ValueError, match=r"\['calls'\] must be a non-negative int"):
        state.load_state_dict(dict(saved, engine=dict(saved["engine"], residuals={0: residual})))


def test_state_refuses_other_versions_and_impls():
    state = CompressionState(compressor="onebit", start_iter=3)
    with pytest.raises(ValueError, match="version 3 or 2"):
        state.load_state_dict(dict(state.state_dict(), version=1))
    with pytest.raises(TypeError, match="impl"):  # the hook runs the engine's compiled kernels, no choice
        CompressionState(compressor="onebit", impl="reference")


def _quiet(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = DDP(nn.Linear(32, 32))
        model.register_comm_hook(CompressionState(compressor="int8", start_iter=2), compressed_hook)
        for _ in range(4):
            model(torch.ones(4, 32)).sum().backward()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_hook_over_plain_gloo_prints_no_warning():
    # (torch deprecates collectives the hook's agreement and wrapping could use)
    for caught in run_ranks(_quiet, 2, timeout=60):
        assert caught == [], caught


def _refused_then_trains_on(rank, world):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    state = CompressionState(compressor="onebit", block_size=32, start_iter=2)
    model.register_comm_hook(state, compressed_hook)
    for _ in range(4):
        model(torch.ones(2, 8)).sum().backward()
    saved = state.state_dict()
    # Another model: its first stable bucket does not match the saved layout.
    other = DDP(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)))
    fresh = CompressionState(compressor="onebit", block_size=32, start_iter=2)
    fresh.load_state_dict(saved)
    other.register_comm_hook(fresh, compressed_hook)
    out = {}
    try:
        for _ in range(3):
            other(torch.ones(2, 8)).sum().backward()
    except ValueError as exc:  # raised by backward() as itself
        out["refused"] = str(exc)
    # What the message says to do, and the same DDP model trains on.
    fresh.load_state_dict(saved, reset_error_feedback=True)
    for _ in range(3):
        other(torch.ones(2, 8)).sum().backward()
    out["trains on"] = all(bool(torch.isfinite(p.grad).all()) for p in other.parameters())
    return out


def test_after_a_refused_backward_the_ddp_model_trains_on():
    for r in run_ranks(_refused_then_trains_on, 2, timeout=60):
        assert "another model or bucket_cap_mb" in r.get("refused", ""), r
        assert r["trains on"]
