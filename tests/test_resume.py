"""Resume: a run saved at step N (model, optimizer, GradScaler, pycomm
state), stopped, and restarted from that checkpoint in fresh processes
reaches bit-identical parameters at step 2N, with the hook over plain Gloo
and over a "pycomm" group (whose first iteration in a fresh process, before
DDP rebuilds its buckets, must use the saved residuals too), for every way
of naming the group: None, ``dist.group.WORLD``, a new group and
``pd.wrap``, with the default group itself a pycomm group
(``pd.init_process_group``, the README's combination) or plain Gloo.

Several states in one process share the default pycomm group, and so its
error-feedback keys (the bucket indices): each state owns the keys it uses,
so none picks up another's residuals, and ``reset_error_feedback=True``
starts the residuals over even where the group still holds some.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.ddp import CompressionState, compressed_hook

N = 12
CONFIGS = {
    "gloo-onebit": dict(compressor="onebit", block_size=256, start_iter=4, chunk_numel=40000),
    "pycomm-onebit": dict(compressor="onebit", block_size=256, start_iter=4, chunk_numel=40000),
    "pycomm-topk": dict(compressor="topk", density=0.01, start_iter=4),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _setup(name):
    import pycomm.distributed as pd

    cfg = dict(CONFIGS[name])
    pg = None
    if name.startswith("pycomm"):
        settings = {k: cfg[k] for k in ("block_size", "density", "chunk_numel") if k in cfg}
        pg = pd.wrap(compressor=cfg["compressor"], min_compress_numel=1, **settings)
    model = DDP(_model(), bucket_cap_mb=0.25)  # three buckets after the rebuild
    state = CompressionState(pg, **cfg)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)  # its scale changes too
    return model, opt, scaler, state


def _steps(model, opt, scaler, rank, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.sin(x[:, :10]))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rank_uninterrupted(rank, world, directory):
    out = {}
    for name in CONFIGS:
        model, opt, scaler, state = _setup(name)
        _steps(model, opt, scaler, rank, 0, N)
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                    "hook": state.state_dict()}, f"{directory}/{name}_{rank}.pt")
        _steps(model, opt, scaler, rank, N, 2 * N)
        out[name] = (_params(model), scaler.get_scale())
    return out


def _rank_resumed(rank, world, directory):
    out = {}
    for name in CONFIGS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt, scaler, state = _setup(name)
            ck = torch.load(f"{directory}/{name}_{rank}.pt", weights_only=True)
            model.module.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            scaler.load_state_dict(ck["scaler"])
            state.load_state_dict(ck["hook"])
            _steps(model, opt, scaler, rank, N, 2 * N)
        out[name] = (_params(model), scaler.get_scale())
        out[name + " warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("resume"))
    full = run_ranks(_rank_uninterrupted, 2, directory, timeout=120)
    return full, run_ranks(_rank_resumed, 2, directory, timeout=120)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_exact(runs, name):
    for rank in range(2):
        full, resumed = runs[0][rank][name], runs[1][rank][name]
        assert torch.equal(full[0], resumed[0]), (rank, name)
        assert full[1] == resumed[1] and full[1] > 65536.0  # the scale grew, from the checkpoint on
        assert runs[1][rank][name + " warnings"] == []


# ------------------------------------- the default group is a pycomm group ---
# pd.init_process_group(...) makes the default group compress; the states
# name it (or a group beside it) in every way a user can.
DEFAULT_SETTINGS = dict(compressor="onebit", block_size=256, chunk_numel=40000)
NAMED = ("none", "world", "new_group", "wrap")
STATE_CFG = dict(compressor="onebit", block_size=256, start_iter=4, chunk_numel=40000)


def _init_pycomm_default():
    import os
    from datetime import timedelta

    import pycomm.distributed as pd

    pd.init_process_group(backend="gloo", init_method="env://", min_compress_numel=1,
                          timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])),
                          **DEFAULT_SETTINGS)


def _named_setup(how, reset_ef=None):
    """Model, optimizer, scaler and state with the state's group named ``how``."""
    import torch.distributed as dist

    import pycomm.distributed as pd

    ddp_group = None
    if how == "none":
        group = None
    elif how == "world":
        group = dist.group.WORLD
    elif how == "new_group":  # a plain group beside the pycomm default: the hook wraps it
        group = ddp_group = dist.new_group(backend="gloo")
    else:  # a pycomm group of its own, over the world
        group = pd.wrap(inner="gloo", min_compress_numel=1, **DEFAULT_SETTINGS)
    model = DDP(_model(), bucket_cap_mb=0.25, process_group=ddp_group)
    state = CompressionState(group, **STATE_CFG)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    return model, opt, scaler, state


def _named_uninterrupted(rank, world, directory):
    _init_pycomm_default()
    out = {}
    for how in NAMED:
        model, opt, scaler, state = _named_setup(how)
        _steps(model, opt, scaler, rank, 0, N)
        saved = state.state_dict()
        out[how + " keys"] = sorted(saved["engine"]["residuals"])
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                    "hook": saved}, f"{directory}/{how}_{rank}.pt")
        _steps(model, opt, scaler, rank, N, 2 * N)
        out[how] = (_params(model), scaler.get_scale())
    return out


def _restore_named(how, saved_as, rank, directory, reset=False):
    model, opt, scaler, state = _named_setup(how)
    ck = torch.load(f"{directory}/{saved_as}_{rank}.pt", weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    scaler.load_state_dict(ck["scaler"])
    state.load_state_dict(ck["hook"], reset_error_feedback=reset)
    return model, opt, scaler, state


def _named_resumed(rank, world, directory):
    _init_pycomm_default()
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for how in NAMED:
            model, opt, scaler, state = _restore_named(how, how, rank, directory)
            _steps(model, opt, scaler, rank, N, 2 * N)
            out[how] = (_params(model), scaler.get_scale())
        # A state saved with one naming, loaded with another.
        for how, saved_as in (("none", "wrap"), ("wrap", "world"), ("world", "new_group")):
            model, opt, scaler, state = _restore_named(how, saved_as, rank, directory)
            _steps(model, opt, scaler, rank, N, 2 * N)
            out[f"{saved_as} as {how}"] = _params(model)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    # reset_error_feedback=True: over the default group, which still holds
    # the residuals of the states above under the same keys and sizes, the
    # run must be the one of a group that never held any (a new one).
    import pycomm.distributed as pd

    out["stale keys"] = sorted(pd.error_feedback_state())
    for how in ("none", "new_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # first iteration: uncompressed
            model, opt, scaler, state = _restore_named(how, "none", rank, directory, reset=True)
            out[f"reset {how} keys at load"] = sorted(state.state_dict()["engine"]["residuals"])
            _steps(model, opt, scaler, rank, N, 2 * N)
        out[f"reset {how}"] = _params(model)
        out[f"reset {how} keys"] = sorted(state.state_dict()["engine"]["residuals"])
    return out


@pytest.fixture(scope="module")
def named_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("resume_named"))
    full = run_ranks(_named_uninterrupted, 2, directory, timeout=120, init_process_group=False)
    return full, run_ranks(_named_resumed, 2, directory, timeout=120, init_process_group=False)


@pytest.mark.parametrize("how", NAMED)
def test_resume_bit_exact_for_every_group_naming(named_runs, how):
    full, resumed = named_runs
    for rank in range(2):
        # state_dict() holds the engine's residuals, one per bucket.
        assert full[rank][how + " keys"] == [0, 1], (rank, how)
        assert torch.equal(full[rank][how][0], resumed[rank][how][0]), (rank, how)
        assert full[rank][how][1] == resumed[rank][how][1]
        assert resumed[rank]["warnings"] == []


@pytest.mark.parametrize("pair", [("none", "wrap"), ("wrap", "world"), ("world", "new_group")])
def test_state_loads_under_another_naming(named_runs, pair):
    how, saved_as = pair
    full, resumed = named_runs
    for rank in range(2):
        # Every naming runs the same engine algorithm with the same settings.
        assert torch.equal(resumed[rank][f"{saved_as} as {how}"], full[rank][saved_as][0]), (rank, pair)


def test_reset_error_feedback_over_a_shared_group(named_runs):
    _, resumed = named_runs
    for r in resumed:
        assert r["stale keys"] == [0, 1]  # what the reset state must not pick up
        assert r["reset none keys at load"] == [] and r["reset new_group keys at load"] == []
        assert torch.equal(r["reset none"], r["reset new_group"])
        assert not torch.equal(r["reset none"], r["none"][0])  # the residuals did matter
        assert r["reset none keys"] == [0, 1]
