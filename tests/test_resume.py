"""Resume: a run saved at step N (model, optimizer, GradScaler, pycomm
state), stopped, and restarted from that checkpoint in fresh processes
reaches bit-identical parameters at step 2N, with the hook over plain Gloo
and over a "pycomm" group (whose first iteration in a fresh process, before
DDP rebuilds its buckets, must use the saved residuals too).
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
