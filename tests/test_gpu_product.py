"""The product on a GPU, and the same test bodies on CPU.

What the GPU check runs (``pytest tests/test_gpu_product.py -m gpu``): every
entry point of pycomm on CUDA tensors against the single-process simulation
(pycomm.distributed.simulate), not only the kernels. Each test is
parametrized over the device: the ``cuda`` cases carry the ``gpu`` marker
(tests/conftest.py skips them without CUDA); the ``cpu`` cases run the same
bodies over Gloo, so CI exercises the logic and on the GPU only the device
changes.

* engine, one rank (NCCL on cuda, Gloo on cpu): every method (onebit, int8,
  int4, topk, fp16, bf16, none) through each collective: the keyed
  all-reduce over 3 calls with error feedback (results and the residuals
  of ``pd.error_feedback_state`` after every call), a keyed reduce-scatter
  and a keyed all-gather over 2 calls each; sizes that are multiples of
  neither the block nor the chunk, ``chunk_numel`` small enough for several
  chunks;
* two ranks over Gloo (on cuda: both processes on cuda:0, CUDA tensors,
  ``pd.init_process_group(backend="gloo")``): onebit, int8, topk keyed
  all-reduces, an int8 reduce-scatter and all-gather;
* the DDP hook on a small model in several buckets: each bucket call
  against the simulation (per key, with its residuals), and the model's
  parameters equal AdamW applied to the hook's outputs, bit for bit;
* OneBitAdam / OneBitSGD attached to DDP, with and without overlap: the
  warm-up is torch's AdamW / SGD bit for bit, every compressed call the
  optimizer makes matches the simulation, the averaged momenta become the
  optimizer's momenta, and (fp16, which keeps no residuals and does not
  depend on the bucket layout) overlap gives the same bits as no overlap;
* pycomm.fsdp.compress on a fully_shard model (one rank: FSDP2 skips its
  collectives at world size 1, so the run must equal plain fully_shard bit
  for bit, and the module's compressed collectives are called directly
  against the simulation);
* one keyed all-reduce under ``torch.cuda.set_sync_debug_mode("error")``:
  no host synchronization inside the call (fails while the engine still
  reads tags and finiteness with ``.item()``);
* the engine benchmark (``pycomm-bench allreduce --device cuda``): its core
  runs here on CPU with tiny sizes, its helpers are checked, and without
  CUDA it refuses with a clear message.

What "equal" means is the simulation's docstring: bit for bit for int8,
int4, topk, fp16, bf16 and none (one or two ranks); onebit with compiled
kernels to float32 rounding of the block scales, and a near-zero value's
sign may rarely flip in the server stage (pycomm_bench.engine_cuda.compare).
For onebit each call is simulated from the engine's own residuals before
it, so rounding cannot accumulate over calls; the other methods are
simulated over all calls from zero, bit for bit.

Each job runs once per device in fresh processes (tests/_dist.py), bounded
in time: a hung collective fails the tests, never the suite.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import traceback
import warnings
import zlib
from datetime import timedelta

import pytest
import torch
from _dist import run_ranks, subprocess_env

from pycomm.distributed.simulate import (
    ErrorFeedback,
    simulate_all_gather,
    simulate_allreduce,
    simulate_reduce_scatter,
)
from pycomm.distributed.spec import BLOCK_METHODS, block_segments, block_size_for, chunk_bounds
from pycomm_bench import engine_cuda as ec

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
METHODS = ("onebit", "int8", "int4", "topk", "fp16", "bf16", "none")
EF = ("onebit", "int8", "int4", "topk")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
CHUNK = 16384
#: One rank: elements per input (multiples of neither the blocks nor CHUNK).
SIZES = {"all_reduce": 70001, "reduce_scatter": 40003, "all_gather": 30001}
STEPS = {"all_reduce": 3, "reduce_scatter": 2, "all_gather": 2}
KEYS = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3}
#: Two ranks over Gloo: (method, collective) cases and per-rank input sizes.
GLOO2 = [("onebit", "all_reduce"), ("int8", "all_reduce"), ("topk", "all_reduce"),
         ("int8", "reduce_scatter"), ("int8", "all_gather")]
SIZES2 = {"all_reduce": 70001, "reduce_scatter": 2 * 20001, "all_gather": 20001}
STEPS2 = 2
#: The small model's buckets and chunks (DDP hook and optimizers): ~11k
#: parameters in 3 buckets of ~0.01 MB, chunks of 3000 elements.
BUCKET_MB = 0.01
HOOK_CHUNK = 3000
HOOK_STEPS = 5
HOOK_START = 2
HOOK_METHODS = ("onebit", "int8", "int4", "topk")
OPT_STEPS = 6
OPT_WARMUP = 2
OPT_SETTINGS = {"chunk_numel": HOOK_CHUNK}
ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False}
#: name -> (optimizer, compressor, block_size or None)
OPT_CONFIGS = {"adam-onebit": ("adam", "onebit", 256), "sgd-int4": ("sgd", "int4", 256),
               "adam-fp16": ("adam", "fp16", None)}
FSDP_STEPS = 4
SYNC_NUMEL = (3 << 20) + 5
#: Seconds per job (a hung collective raises in the rank at 85% of it). On
#: the GPU the jobs take seconds; the limits bound what a hang can cost.
TIMEOUT = {"engine": 90.0, "gloo2": 90.0, "training": 120.0, "sync": 60.0, "forwarded": 60.0, "bench": 180.0}


# ------------------------------------------------------------------ helpers ---
def _data(tag: str, step: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s input of call ``step`` of case ``tag`` (the same in
    every process: seeded from a CRC of the name, not Python's hash)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{step}/{rank}".encode()))
    return torch.randn(n, generator=g) * (1.0 + 0.37 * rank)


def _cpu(state):
    """One key's residual state with its tensors on the CPU."""
    if state is None:
        return None
    out = dict(state)
    out["worker"] = state["worker"].detach().cpu()
    out["server"] = [t.detach().cpu() for t in state["server"]]
    return out


def _part(out: dict, name: str, fn, *args) -> None:
    """``out[name]``: ``{"ok": fn(*args)}``, or ``{"error": traceback}``
    (one failing part does not hide the others)."""
    try:
        out[name] = {"ok": fn(*args)}
    except Exception:  # noqa: BLE001 - reported by the test that reads it
        out[name] = {"error": traceback.format_exc()}


def _get(results: dict, name: str):
    entry = results.get(name)
    if entry is None:
        pytest.fail(f"the rank did not report {name!r}")
    if "error" in entry:
        pytest.fail(f"{name} raised in the rank process:\n{entry['error']}")
    return entry["ok"]


def _init_one_rank(device: str) -> None:
    """The default group of a job: NCCL on cuda, Gloo on cpu."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])))


_JOBS: dict = {}


@pytest.fixture(scope="module")
def jobs():
    """``jobs(name, device)``: the per-rank results of job ``name`` on
    ``device``, run once for the module (spawning costs seconds)."""

    def get(name: str, device: str, *args):
        key = (name, device, args)
        if key not in _JOBS:
            fn, world = JOBS[name]
            try:
                _JOBS[key] = ("ok", run_ranks(fn, world, device, *args, timeout=TIMEOUT[name],
                                              init_process_group=False))
            except (RuntimeError, TimeoutError) as exc:  # RankError, a hang, a dead process
                _JOBS[key] = ("error", f"{type(exc).__name__}: {exc}")
        status, value = _JOBS[key]
        if status != "ok":
            pytest.fail(f"the {name!r} job on {device} failed as a whole:\n{value}")
        return value

    return get


# ------------------------------------------------------- the comparisons ---
def _efs_from(states, block):
    """The engine's residual states (one per rank) as the simulation's
    :class:`ErrorFeedback` objects."""
    efs = []
    for rank, st in enumerate(states):
        layout = ErrorFeedback.make_layout(method=st["method"], numel=st["numel"], world_size=st["world_size"],
                                           rank=rank, chunk_numel=st["chunk_numel"], block_size=block)
        server = None
        if layout["method"] in BLOCK_METHODS:
            parts = list(st["server"])
            server = torch.cat(parts) if parts else torch.zeros(0)
        ef = ErrorFeedback()
        ef.load_state_dict({"layout": layout, "worker": st["worker"], "server": server,
                            "calls": st.get("calls", 0)})
        efs.append(ef)
    return efs


def _server_positions(n: int, world: int, rank: int, chunk: int, block: int) -> torch.Tensor:
    """Where, in the tensor, each element of rank ``rank``'s server residual
    lies (its segment of every chunk, in chunk order)."""
    pos = []
    for b, e in chunk_bounds(n, chunk):
        _, segs = block_segments(e - b, world, block)
        lo, hi = segs[rank]
        pos.append(torch.arange(b + lo, b + hi))
    return torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)


def _residuals(states):
    out = []
    for st in states or ():
        if st is not None:
            out.append(st["worker"])
            out.extend(st["server"])
    return out


def _check_step(coll, method, xs, gots, befores, afters, cont_efs, chunk, settings, what, op="avg"):
    """One call of collective ``coll`` on ``len(xs)`` ranks: the engine's
    outputs ``gots`` (and, keyed, its residual states ``afters`` after the
    call) against the simulation. onebit is simulated from the engine's
    states before the call (``befores``; None: the first call), the others
    with ``cont_efs`` (the simulation's own residuals, carried over calls)."""
    world = len(xs)
    keyed = afters is not None
    block = settings.get("block_size") or block_size_for(method, None)
    efs = None
    if keyed:
        if method == "onebit":
            efs = _efs_from(befores, block) if befores is not None else [ErrorFeedback() for _ in xs]
        else:
            efs = cont_efs
    if coll == "all_reduce":
        if method == "none":
            total = xs[0].clone()
            for x in xs[1:]:
                total = total + x
            want = [total / world if op == "avg" else total] * world
        else:
            want = simulate_allreduce(xs, method, op=op, chunk_numel=chunk, efs=efs, **settings)
    elif coll == "reduce_scatter":
        want = simulate_reduce_scatter(xs, method, op, chunk, efs, **settings)
    else:
        want = simulate_all_gather(xs, method, chunk, efs, **settings)
    sim_res = [t for ef in efs or () for t in (ef.worker, ef.server) if t is not None]
    scale = ec.magnitude(*xs, *want, *gots, *_residuals(befores), *_residuals(afters), *sim_res)
    flips = None
    for r in range(world):
        problem, f = ec.compare(method, gots[r], want[r], scale, allow_flips=coll == "all_reduce",
                                what=f"{what}: rank {r}'s {coll} output")
        assert problem is None, problem
        flips = f if flips is None or f is None else flips | f
    if coll in ("all_reduce", "all_gather"):
        for r in range(1, world):
            assert ec.same_bits(gots[r], gots[0]), f"{what}: ranks 0 and {r} got different {coll} results"
    if not keyed:
        return
    n = xs[0].numel()
    for r in range(world):
        problem, _ = ec.compare(method, afters[r]["worker"], efs[r].worker, scale,
                                what=f"{what}: rank {r}'s worker residual after the call")
        assert problem is None, problem
        if coll == "all_reduce" and method in BLOCK_METHODS:
            server = afters[r]["server"]
            got_server = torch.cat(list(server)) if len(server) else torch.zeros(0)
            allowed = None
            if method == "onebit" and flips is not None:
                allowed = flips.reshape(-1)[_server_positions(n, world, r, chunk, block)]
            problem, _ = ec.compare(method, got_server, efs[r].server, scale, allowed=allowed,
                                    what=f"{what}: rank {r}'s server residual after the call")
            assert problem is None, problem


def _check_calls(coll, method, steps_by_rank, inputs, chunk, settings, what, op="avg"):
    """Every call of a keyed (or, without residuals, keyless) sequence.
    ``steps_by_rank[r][s] = (output, residual state or None)``;
    ``inputs(s)``: the ranks' inputs of call ``s``."""
    world = len(steps_by_rank)
    nsteps = len(steps_by_rank[0])
    keyed = steps_by_rank[0][0][1] is not None
    cont = [ErrorFeedback() for _ in range(world)] if keyed and method != "onebit" else None
    befores = None
    for s in range(nsteps):
        gots = [steps_by_rank[r][s][0] for r in range(world)]
        afters = [steps_by_rank[r][s][1] for r in range(world)] if keyed else None
        _check_step(coll, method, inputs(s), gots, befores, afters, cont, chunk, settings,
                    f"{what}, call {s}", op=op)
        befores = afters
    if keyed:  # error feedback holds something (else the residual checks say little)
        assert any(float(steps_by_rank[r][-1][1]["worker"].abs().sum()) > 0 for r in range(world)), what


# ------------------------------------------------------- job: the engine ---
def _collective_calls(pd, pg, method, coll, device, rank, world, n, steps, key):
    out = []
    for step in range(steps):
        x = _data(f"{method}/{coll}", step, rank, n).to(device)
        if coll == "all_reduce":
            pd.all_reduce(x, key=key, group=pg, op="avg")
            got = x
        elif coll == "reduce_scatter":
            got = torch.empty(n // world, device=device)
            pd.reduce_scatter(got, x, key=key, group=pg, op="avg")
        else:
            got = torch.empty(world * n, device=device)
            pd.all_gather(got, x, key=key, group=pg)
        state = None
        if key is not None:
            state = _cpu(pd.error_feedback_state(pg, device, keys=[key])[key])
        out.append((got.cpu(), state))
    return out


def _job_engine(rank, world, device):
    _init_one_rank(device)
    import pycomm.distributed as pd

    out = {}
    for method in METHODS:
        _part(out, f"{method}/group", lambda m=method: pd.wrap(compressor=m, min_compress_numel=1, chunk_numel=CHUNK))
        if "error" in out[f"{method}/group"]:
            for name in ("options", *COLLECTIVES):
                out[f"{method}/{name}"] = out[f"{method}/group"]
            del out[f"{method}/group"]
            continue
        pg = out.pop(f"{method}/group")["ok"]
        _part(out, f"{method}/options", pd.options_of, pg, device)
        for coll in COLLECTIVES:
            key = KEYS[coll] if method in EF else None
            _part(out, f"{method}/{coll}", _collective_calls, pd, pg, method, coll, device, rank, world,
                  SIZES[coll], STEPS[coll], key)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("method", METHODS)
def test_engine_one_rank_matches_simulation(jobs, device, method, coll):
    res = jobs("engine", device)[0]
    opts = _get(res, f"{method}/options")
    steps = _get(res, f"{method}/{coll}")
    assert opts["method"] == method and opts["chunk_numel"] == CHUNK, opts
    n = SIZES[coll]
    assert len(chunk_bounds(n, CHUNK)) >= 2 and len(steps) == STEPS[coll]
    _check_calls(coll, method, [steps], lambda s: [_data(f"{method}/{coll}", s, 0, n)], CHUNK,
                 ec.sim_settings(method, opts), f"{device} one rank, {method} {coll}")


# ------------------------------------------------ job: two ranks over Gloo ---
def _job_gloo2(rank, world, device):
    import pycomm.distributed as pd

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU: Gloo carries CUDA tensors
    pd.init_process_group(compressor="onebit", backend="gloo", init_method="env://", rank=rank, world_size=world,
                          timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])),
                          min_compress_numel=1, chunk_numel=CHUNK)
    groups = {"onebit": None}  # the default group (pd.init_process_group)
    for m in ("int8", "topk"):  # every rank creates them in the same order
        groups[m] = pd.wrap(compressor=m, min_compress_numel=1, chunk_numel=CHUNK)
    out = {"options": {m: pd.options_of(g, device) for m, g in groups.items()}}
    for i, (method, coll) in enumerate(GLOO2):
        _part(out, f"{method}/{coll}", _collective_calls, pd, groups[method], method, coll, device, rank, world,
              SIZES2[coll], STEPS2, 10 + i)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,coll", GLOO2, ids=[f"{m}-{c}" for m, c in GLOO2])
def test_two_ranks_over_gloo_match_simulation(jobs, device, method, coll):
    res = jobs("gloo2", device)
    opts = res[0]["options"][method]
    assert opts["method"] == method and opts["chunk_numel"] == CHUNK, opts
    steps = [_get(r, f"{method}/{coll}") for r in res]
    n = SIZES2[coll]
    _check_calls(coll, method, steps, lambda s: [_data(f"{method}/{coll}", s, r, n) for r in range(2)], CHUNK,
                 ec.sim_settings(method, opts), f"{device} two ranks over Gloo, {method} {coll}")


# ----------------------------------------------- job: training entry points ---
def _mlp(seed: int) -> torch.nn.Module:
    """~11k parameters in 8 tensors; Tanh: no exact zero gradients (none frozen)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                   torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 8))


def _batch(step: int, device: str):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)


def _loss(model, step, device):
    x, y = _batch(step, device)
    return torch.nn.functional.mse_loss(model(x), y)


class _Recorder:
    """The DDP hook's state: the CompressionState and a log of every bucket."""

    def __init__(self, state, params) -> None:
        self.state = state
        self.log = []
        self.pos = {id(p): i for i, p in enumerate(params)}


def _recording_hook(rec: _Recorder, bucket):
    from pycomm.ddp import compressed_hook

    buf = bucket.buffer()
    esize = buf.element_size()
    entry = {
        "it": rec.state.iteration, "index": bucket.index(), "input": buf.detach().clone(),
        "layout": [(rec.pos[id(p)], (g.data_ptr() - buf.data_ptr()) // esize, g.numel())
                   for p, g in zip(bucket.parameters(), bucket.gradients())],
    }
    rec.log.append(entry)
    fut = compressed_hook(rec.state, bucket)

    def done(f):
        value = f.value()
        t = value[0] if isinstance(value, (list, tuple)) else value
        entry["output"] = t.detach().clone()
        return t

    return fut.then(done)


def _hook_run(device, method):
    import pycomm.distributed as pd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState

    model = _mlp(1).to(device)
    replica = _mlp(1).to(device)
    params = list(model.parameters())
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onebit's advice about momentum optimizers
        # Error feedback on: the residuals' path is what this compares.
        state = CompressionState(compressor=method, start_iter=HOOK_START, chunk_numel=HOOK_CHUNK,
                                 error_feedback=True)
    rec = _Recorder(state, params)
    ddp.register_comm_hook(rec, _recording_hook)
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, states = [], []
    for step in range(HOOK_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(ddp, step, device)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        states.append({k: _cpu(v) for k, v in state.state_dict()["engine"]["residuals"].items()})
    options = pd.options_of(state._engine, device)
    # The same steps with the hook's outputs as the gradients.
    rparams = list(replica.parameters())
    ropt = torch.optim.AdamW(rparams, lr=1e-2)
    for step in range(HOOK_STEPS):
        for p in rparams:
            p.grad = None
        for e in rec.log:
            if e["it"] != step:
                continue
            for pos, off, num in e["layout"]:
                assert 0 <= off and off + num <= e["output"].numel(), (pos, off, num)
                rparams[pos].grad = e["output"][off:off + num].view_as(rparams[pos]).clone()
        ropt.step()
    same = [torch.equal(a, b) for a, b in zip(params, rparams)]
    worst = max(float((a - b).abs().max()) for a, b in zip(params, rparams))
    log = [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in e.items()} for e in rec.log]
    return {"losses": losses, "log": log, "states": states, "options": options, "same": same, "worst": worst,
            "params_finite": all(bool(torch.isfinite(p).all()) for p in params)}


def _optim_run(device, name, overlap):
    import pycomm.distributed as pd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.optim import OneBitAdam, OneBitSGD

    kind, method, block = OPT_CONFIGS[name]
    model, replica = _mlp(2).to(device), _mlp(2).to(device)
    params = list(model.parameters())
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    settings = dict(OPT_SETTINGS, **({"block_size": block} if block else {}))
    if kind == "adam":
        opt = OneBitAdam(params, warmup_steps=OPT_WARMUP, compressor=method, **ADAM, **settings)
        ref = torch.optim.AdamW(replica.parameters(), **ADAM)
    else:
        opt = OneBitSGD(params, warmup_steps=OPT_WARMUP, compressor=method, **SGD, **settings)
        ref = torch.optim.SGD(replica.parameters(), **SGD)
    opt.attach(ddp, overlap=overlap)

    calls, step_now = [], [0]
    real = pd.all_reduce
    sig = inspect.signature(real)

    def recording(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("compress", True):
            calls.append({"step": step_now[0], "key": a["key"], "op": a["op"], "input": a["tensor"].detach().clone(),
                          "tensor": a["tensor"]})
        return real(*args, **kwargs)

    pd.all_reduce = recording
    losses, states, warm_same = [], [], None
    try:
        for step in range(OPT_STEPS):
            step_now[0] = step
            opt.zero_grad(set_to_none=True)
            loss = _loss(ddp, step, device)
            loss.backward()
            opt.step()
            losses.append(float(loss))
            for c in calls:
                if c["step"] == step and "tensor" in c:
                    c["output"] = c.pop("tensor").detach().clone()
            engine = opt._engine
            states.append({k: _cpu(v) for k, v in pd.error_feedback_state(engine, device).items()}
                          if engine is not None else {})
            if step < OPT_WARMUP:  # torch's own optimizer on the same gradients
                ref.zero_grad(set_to_none=True)
                _loss(replica, step, device).backward()
                ref.step()
                if step == OPT_WARMUP - 1:
                    warm_same = [torch.equal(a, b) for a, b in zip(params, replica.parameters())]
    finally:
        pd.all_reduce = real
    key = "exp_avg" if kind == "adam" else "momentum_buffer"
    momenta = torch.cat([opt.state[p][key].reshape(-1) for p in params]).cpu()
    options = pd.options_of(opt._engine, device) if opt._engine is not None else None
    return {
        "losses": losses, "states": states, "warm_same": warm_same, "momenta": momenta, "options": options,
        "calls": [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in c.items()} for c in calls],
        "params": [p.detach().cpu() for p in params], "step_count": opt.step_count,
        "skipped": opt.skipped_steps, "key_base": opt.key_base,
    }


def _fsdp_model(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(37, 65), torch.nn.Tanh(), torch.nn.Linear(65, 3))


def _fsdp_run(device):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import pycomm.fsdp as pf
    from _fsdp_record import record_calls

    records = {}

    def build(compressed):
        m = _fsdp_model(3).to(device)
        fully_shard(m[0])
        fully_shard(m[2])
        fully_shard(m)
        comp = None
        if compressed:
            comp = pf.compress(m, "int8", weights="int8", min_compress_numel=1, chunk_numel=1000)
            records[id(comp)] = record_calls(comp)
        return m, comp, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def train(m, opt):
        losses = []
        for s in range(FSDP_STEPS):
            g = torch.Generator().manual_seed(700 + s)
            loss = m(torch.randn(8, 37, generator=g).to(device)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses, [p.to_local().detach().cpu().clone() for p in m.parameters()]

    m, comp, opt = build(True)
    losses, shards = train(m, opt)
    record = [(kind, key, t.cpu(), str(op)) for kind, key, t, op in records[id(comp)]]
    pm, _, popt = build(False)
    plain_losses, plain_shards = train(pm, popt)
    # The modules' compressed collectives, called as FSDP2 calls them with more ranks.
    fqn, key = next(iter(comp.keys.items()))
    world = dist.get_world_size()
    x = _data("fsdp/reduce_scatter", 0, 0, 4003 * world).to(device)
    y = torch.empty(4003, device=device)
    pf.CompressedReduceScatter(comp, key, fqn)(y, x, dist.group.WORLD, dist.ReduceOp.AVG)
    xg = _data("fsdp/all_gather", 0, 0, 3001).to(device)
    yg = torch.empty(3001 * world, device=device)
    pf.CompressedAllGather(comp, fqn)(yg, xg, dist.group.WORLD)
    return {"losses": losses, "shards": shards, "plain_losses": plain_losses, "plain_shards": plain_shards,
            "record": record, "rs": y.cpu(), "ag": yg.cpu(), "keys": dict(comp.keys),
            "error_feedback": comp.error_feedback}


def _diloco_run(device):
    """DiLoCo on one rank of ``device``'s backend: exact with outer lr 1 and
    no momentum is the inner optimizer alone (the average of one rank's
    pseudo-gradient is itself); int8 with two streamed fragments stays close
    to it, its outer updates applied a step after they were sent."""
    from pycomm.optim import DiLoCo

    out = {}
    for name, kw in (("alone", None),
                     ("exact", dict(compressor="none", outer_lr=1.0, outer_momentum=0.0)),
                     ("int8", dict(compressor="int8", fragments=2, delay=1, chunk_numel=HOOK_CHUNK))):
        model = _mlp(3).to(device)
        inner = torch.optim.AdamW(model.parameters(), **ADAM)
        opt = inner if kw is None else DiLoCo(model, inner, sync_every=4, **kw)
        losses = []
        for step in range(OPT_STEPS):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, step, device)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        if kw is not None:
            opt.finish(sync_all=False)  # the sync in flight applied: the run's own syncs
            out[name + " syncs"] = opt.syncs
        out[name] = {"losses": losses, "params": [p.detach().cpu() for p in model.parameters()]}
    return out


def _job_training(rank, world, device):
    _init_one_rank(device)
    out = {}
    _part(out, "diloco", _diloco_run, device)
    for method in HOOK_METHODS:
        _part(out, f"hook/{method}", _hook_run, device, method)
    for name in OPT_CONFIGS:
        for overlap in (False, True):
            _part(out, f"optim/{name}/{overlap}", _optim_run, device, name, overlap)
    _part(out, "fsdp", _fsdp_run, device)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", HOOK_METHODS)
def test_ddp_hook_matches_simulation(jobs, device, method):
    r = _get(jobs("training", device)[0], f"hook/{method}")
    what = f"{device} DDP hook {method}"
    assert all(math.isfinite(v) for v in r["losses"]) and r["params_finite"], (what, r["losses"])
    assert all(r["same"]), (
        f"{what}: DDP's parameters differ from AdamW applied to the hook's outputs (worst {r['worst']:.3g}): "
        f"the hook's result did not become the gradients")
    opts = r["options"]
    assert opts["method"] == method and opts["chunk_numel"] == HOOK_CHUNK, opts
    settings = ec.sim_settings(method, opts)
    by_it = {}
    for e in r["log"]:
        by_it.setdefault(e["it"], []).append(e)
    assert sorted(by_it) == list(range(HOOK_STEPS)), sorted(by_it)
    assert all(len(by_it[it]) >= 2 for it in range(1, HOOK_STEPS)), (
        f"{what}: the test wants several buckets, DDP made {[len(v) for v in by_it.values()]}")
    cont, before = {}, {}
    for it in range(HOOK_STEPS):
        for e in by_it[it]:
            assert "output" in e, f"{what}: bucket {e['index']} of iteration {it} never completed"
            label = f"{what}, iteration {it}, bucket {e['index']}"
            if it < HOOK_START:  # exact (one rank: the average is the input)
                assert ec.same_bits(e["output"], e["input"]), f"{label}: the warm-up all-reduce is not exact"
                continue
            k = e["index"]
            after = r["states"][it][k]
            _check_step("all_reduce", method, [e["input"]], [e["output"]],
                        [before[k]] if k in before else None, [after],
                        cont.setdefault(k, [ErrorFeedback()]), HOOK_CHUNK, settings, label)
            before[k] = after
    assert sorted(r["states"][-1]) == sorted(e["index"] for e in by_it[HOOK_STEPS - 1])


def _check_optim_calls(r, method, what):
    """Every compressed call the optimizer made against the simulation, per
    key (onebit from the engine's residuals after the previous step)."""
    opts = r["options"]
    assert opts is not None and opts["method"] == method and opts["chunk_numel"] == HOOK_CHUNK, opts
    settings = ec.sim_settings(method, opts)
    cont, before = {}, {}
    for c in r["calls"]:
        assert c["op"] == "avg" and "output" in c, (what, c["step"], c["key"])
        label = f"{what}, step {c['step']}, key {c['key']}"
        k = c["key"]
        if k is None:
            _check_step("all_reduce", method, [c["input"]], [c["output"]], None, None, None, HOOK_CHUNK, settings,
                        label)
            continue
        after = r["states"][c["step"]][k]
        _check_step("all_reduce", method, [c["input"]], [c["output"]], [before[k]] if k in before else None,
                    [after], cont.setdefault(k, [ErrorFeedback()]), HOOK_CHUNK, settings, label)
        before[k] = after


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True], ids=["attach", "overlap"])
@pytest.mark.parametrize("name", list(OPT_CONFIGS))
def test_optimizers_attached_to_ddp(jobs, device, name, overlap):
    r = _get(jobs("training", device)[0], f"optim/{name}/{overlap}")
    kind, method, _ = OPT_CONFIGS[name]
    what = f"{device} {name} attach(overlap={overlap})"
    assert all(math.isfinite(v) for v in r["losses"]), (what, r["losses"])
    assert all(bool(torch.isfinite(p).all()) for p in r["params"]), what
    assert r["step_count"] == OPT_STEPS and r["skipped"] == 0, (what, r["step_count"], r["skipped"])
    assert r["warm_same"] is not None and all(r["warm_same"]), (
        f"{what}: after the warm-up the parameters are not torch's "
        f"{'AdamW' if kind == 'adam' else 'SGD'}'s bit for bit ({r['warm_same']})")
    steps = sorted({c["step"] for c in r["calls"]})
    assert steps == list(range(OPT_WARMUP, OPT_STEPS)), (what, steps)  # compressed from the end of the warm-up
    keys = sorted({c["key"] for c in r["calls"]}, key=lambda k: -1 if k is None else k)
    base = r["key_base"]
    if method == "fp16":
        assert keys == [None], (what, keys)  # no residuals, no key
    elif overlap:
        assert len(keys) >= 2 and keys == [base + 1 + i for i in range(len(keys))], (what, keys)
    else:
        assert keys == [base], (what, keys)
    _check_optim_calls(r, method, what)
    # The averaged momenta became the optimizer's (one rank: every element is
    # communicated, none frozen), as a multiset when overlap cuts them per bucket.
    last = [c["output"] for c in r["calls"] if c["step"] == OPT_STEPS - 1]
    sent = torch.cat(last)
    assert sent.numel() == r["momenta"].numel(), (what, sent.numel(), r["momenta"].numel())
    assert torch.equal(torch.sort(sent).values, torch.sort(r["momenta"]).values), (
        f"{what}: the momenta after the last step are not the all-reduced ones")


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_overlap_is_no_overlap_bit_for_bit_with_fp16(jobs, device):
    res = jobs("training", device)[0]
    plain, over = _get(res, "optim/adam-fp16/False"), _get(res, "optim/adam-fp16/True")
    # fp16 keeps no residuals and rounds each element alone: per-bucket calls
    # and one flat call give the same bits, so overlap changes nothing.
    assert plain["losses"] == over["losses"]
    for i, (a, b) in enumerate(zip(plain["params"], over["params"])):
        worst = float((a - b).abs().max())
        assert torch.equal(a, b), f"{device}: parameter {i} differs with overlap (worst {worst:.3g})"


@pytest.mark.parametrize("device", DEVICES)
def test_diloco(jobs, device):
    r = _get(jobs("training", device)[0], "diloco")
    assert r["exact syncs"] == OPT_STEPS // 4 and r["int8 syncs"] >= OPT_STEPS // 2
    for a, b in zip(r["exact"]["params"], r["alone"]["params"]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    for a, b in zip(r["int8"]["losses"], r["alone"]["losses"]):
        assert math.isfinite(a) and abs(a - b) <= 0.05 * abs(b) + 1e-3, (r["int8"]["losses"], r["alone"]["losses"])


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp_compress(jobs, device):
    r = _get(jobs("training", device)[0], "fsdp")
    assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
    assert not r["error_feedback"] and len(r["keys"]) == 3, (r["error_feedback"], r["keys"])
    if not r["record"]:
        # World size 1: FSDP2 copies instead of reduce-scattering and
        # all-gathering, so compress() changes nothing: exactly plain FSDP2.
        assert r["losses"] == r["plain_losses"], (r["losses"], r["plain_losses"])
        for a, b in zip(r["shards"], r["plain_shards"]):
            assert torch.equal(a, b)
    else:
        # A torch that runs its collectives at world size 1: int8 through
        # the engine, so close to plain FSDP2 (and each call's output finite).
        kinds = [kind for kind, _, _, _ in r["record"]]
        assert set(kinds) <= {"reduce_scatter", "reduce_scatter_out", "all_gather", "all_gather_out"}, kinds
        assert all(bool(torch.isfinite(t).all()) for _, _, t, _ in r["record"])
        for a, b in zip(r["losses"], r["plain_losses"]):
            assert abs(a - b) <= 0.05 * abs(b) + 1e-3, (r["losses"], r["plain_losses"])
    # The module's collectives on this device, called directly.
    x = _data("fsdp/reduce_scatter", 0, 0, r["rs"].numel())
    want = simulate_reduce_scatter([x], "int8", "avg", 1000)[0]
    problem, _ = ec.compare("int8", r["rs"], want, 1.0, what=f"{device} CompressedReduceScatter output")
    assert problem is None, problem
    xg = _data("fsdp/all_gather", 0, 0, r["ag"].numel())
    want = simulate_all_gather([xg], "int8", 1000)[0]
    problem, _ = ec.compare("int8", r["ag"], want, 1.0, what=f"{device} CompressedAllGather output")
    assert problem is None, problem


# ------------------------------------------- job: no host synchronization ---
def _job_sync(rank, world, device):
    _init_one_rank(device)
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="onebit", min_compress_numel=1)
    x = _data("sync", 0, rank, SYNC_NUMEL).to(device)
    # The first use of a key: the call check and the residuals' allocation.
    pd.all_reduce(x, key=11, group=pg, op="avg")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    error = None
    try:
        pd.all_reduce(x, key=11, group=pg, op="avg")
    except Exception as exc:  # noqa: BLE001 - c10::Error, AcceleratorError: whatever the engine raised
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    if cuda:
        torch.cuda.synchronize()
    return {"error": error, "finite": bool(torch.isfinite(x).all()),
            "chunk_numel": pd.options_of(pg, device)["chunk_numel"]}


@pytest.mark.parametrize("device", DEVICES)
def test_keyed_allreduce_does_not_synchronize(jobs, device):
    try:
        r = jobs("sync", device)[0]
    except pytest.fail.Exception as exc:
        pytest.fail(f"a keyed all-reduce under torch.cuda.set_sync_debug_mode('error') did not come back "
                    f"(crashed or hung):\n{exc}")
    assert r["error"] is None, (
        f"pd.all_reduce(t, key=11, op='avg') synchronized the host with the {device} device inside the call "
        f"(under torch.cuda.set_sync_debug_mode('error') it raised: {r['error']}). The engine still reads the "
        f"call's tags and finiteness with .item() or a blocking copy (DESIGN.md, 'Facts measured on a GPU'); "
        f"this test passes once a keyed all-reduce issues no host synchronization.")
    assert r["finite"]


# --------------------------------------- job: forwarded collectives ---
def _job_forwarded(rank, world, device):
    _init_one_rank(device)
    import torch.distributed as dist
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="onebit", min_compress_numel=1 << 20)  # everything here is forwarded
    small = torch.arange(1000, dtype=torch.float32, device=device)
    ints = torch.arange(10, device=device)
    mx = torch.full((7,), 3.0, device=device)
    dist.all_reduce(small, group=pg)                        # below min_compress_numel
    dist.all_reduce(ints, group=pg)                         # integers
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=pg)     # MAX
    b = torch.arange(5, dtype=torch.float32, device=device)
    dist.broadcast(b, src=0, group=pg)
    gathered = torch.empty(1000 * world, device=device)
    dist.all_gather_into_tensor(gathered, small, group=pg)
    # On a side stream: the collective follows the work queued there before it.
    side = None
    if device == "cuda":
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            side = torch.full((4096,), 2.0, device=device).mul_(3.0)
            dist.all_reduce(side, group=pg)
        torch.cuda.current_stream().wait_stream(s)
        side = side.cpu()
    return {"small": small.cpu(), "ints": ints.cpu(), "mx": mx.cpu(), "b": b.cpu(),
            "gathered": gathered.cpu(), "side": side, "world": world}


@pytest.mark.parametrize("device", DEVICES)
def test_forwarded_collectives(jobs, device):
    # Everything the engine does not compress goes to the inner backend as
    # it is, on the caller's stream (world size 1: the inputs come back).
    r = jobs("forwarded", device)[0]
    assert torch.equal(r["small"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(r["ints"], torch.arange(10))
    assert torch.equal(r["mx"], torch.full((7,), 3.0))
    assert torch.equal(r["b"], torch.arange(5, dtype=torch.float32))
    assert torch.equal(r["gathered"], torch.arange(1000, dtype=torch.float32))
    if device == "cuda":
        assert torch.equal(r["side"], torch.full((4096,), 6.0))


# --------------------------------------------------- the engine benchmark ---
BENCH_CFG = {
    "numel": 70001, "methods": list(ec.METHODS), "chunk_numel": CHUNK, "repeats": 2, "warmup": 1,
    "bucket_numel": 40000, "bucket_calls": 2, "ddp_methods": list(ec.DDP_METHODS),
    "gpt": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16}, "batch": 2, "seed": 5, "quick": True,
}


def _job_bench(rank, world, device, cfg, broken):
    _init_one_rank(device)
    import pycomm.distributed as pd

    if broken is not None:  # an engine that gets one element of one method wrong
        real = pd.all_reduce

        def wrong(tensor, *args, **kwargs):
            work = real(tensor, *args, **kwargs)
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if pd.options_of(group, device)["method"] == broken:
                tensor.view(-1)[7] += 1.0
            return work

        pd.all_reduce = wrong
    return ec.run_engine(cfg, torch.device(device))


def test_bench_core_runs_and_reports(jobs, tmp_path):
    from pycomm_bench.report import write_json

    doc = jobs("bench", "cpu", json.dumps(BENCH_CFG), None)[0]
    assert doc["failures"] == [], doc["failures"]
    assert doc["ranks"] == 1 and doc["numel"] == BENCH_CFG["numel"] and doc["backend"] == "gloo"
    by = {r["method"]: r for r in doc["records"]}
    assert list(by) == list(ec.METHODS)
    assert doc["plain_ms"] > 0 and doc["plain_gbps"] > 0
    for m, r in by.items():
        assert r["status"] == "ok" and r["verified"] is True, (m, r["error"])
        if m != "plain":  # the engine's own account of the timed calls
            assert r["profile"]["calls"] == BENCH_CFG["warmup"] + BENCH_CFG["repeats"], (m, r["profile"])
            assert r["profile"]["run_ms_per_call"] > 0, (m, r["profile"])
        assert r["engine_ms"] > 0 and r["engine_gbps"] > 0 and r["engine_p10_ms"] <= r["engine_p90_ms"], m
        if m == "plain":
            assert r["kernels_ms"] is None
            continue
        assert r["chunk_numel"] == CHUNK and r["chunks"] == len(chunk_bounds(BENCH_CFG["numel"], CHUNK))
        assert r["kernels_ms"] > 0 and r["kernels_gbps"] > 0 and r["engine_over_kernels"] > 0, m
        assert r["vs_plain"] > 0
        assert set(r["variants"]) == {"1M", "whole"}
        for label, v in r["variants"].items():
            assert v["status"] == "ok" and v["engine_ms"] > 0, (m, label, v)
        assert r["variants"]["whole"]["chunks"] == 1
    b = doc["bucket"]
    assert b["numel"] == 40000 and set(b["methods"]) == set(ec.METHODS)
    for m, r in b["methods"].items():
        assert r["gpu_ms"] is None  # events only on CUDA
        assert r["host_per_call_ms"] > 0 and r["return_sync_ms"] > 0 and r["return_async_ms"] > 0, m
    d = doc["ddp"]
    assert set(d["methods"]) == set(ec.DDP_METHODS) and d["parameters"] > 0
    for m, r in d["methods"].items():
        assert r["finite"] and r["step_ms"] > 0 and r["overhead_pct"] is not None, m
    assert d["methods"]["plain"]["overhead_pct"] == 0.0
    text = ec.format_table(doc)
    for needle in ("engine ms", "kernels ms", "engine/kernels", "host ms/call", "overhead %", "onebit", "bf16"):
        assert needle in text, needle
    path = tmp_path / "r" / "e.json"
    write_json(str(path), doc)  # strict JSON: no NaN anywhere
    assert json.loads(path.read_text())["records"][2]["engine_over_kernels"] > 0


def test_bench_verification_catches_a_wrong_engine(jobs):
    # ... and a DDP part that raises (a GPT whose width its heads do not divide)
    # is reported with the rest kept.
    cfg = dict(BENCH_CFG, methods=["plain", "onebit", "int8"], bucket_calls=0, ddp_methods=["plain"],
               gpt={"n_layers": 1, "d_model": 32, "n_heads": 3, "seq_len": 16})
    doc = jobs("bench", "cpu", json.dumps(cfg), "int8")[0]
    by = {r["method"]: r for r in doc["records"]}
    r = by["int8"]
    assert r["status"] == "verify_failed" and r["verified"] is False and r["engine_ms"] is None
    assert "int8 must match it bit for bit" in r["error"], r["error"]
    assert by["onebit"]["status"] == "ok" and by["onebit"]["engine_ms"] > 0
    assert any(f.startswith("int8") for f in ec.failed(doc))
    assert "VERIFY_FAILED" in ec.format_table(doc)
    assert doc["bucket"] is None and "ValueError" in doc["ddp"]["error"]
    assert any(f.startswith("DDP: ValueError") for f in ec.failed(doc))
    assert "DDP: FAILED: ValueError" in ec.format_table(doc)


def test_bench_compare_rules():
    x = _data("compare", 0, 0, 5000)
    # Exact methods: one ulp anywhere is a difference; NaN equals NaN.
    assert ec.compare("int8", x, x.clone(), 1.0) == (None, None)
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(math.inf))
    problem, _ = ec.compare("topk", y, x, 1.0)
    assert problem is not None and "1 of 5000" in problem and "first at 17" in problem
    assert ec.same_bits(torch.tensor([math.nan]), torch.tensor([math.nan]))
    assert not ec.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    # onebit: float32 rounding of the scale passes, a wrong element does not.
    scale = ec.magnitude(x)
    assert ec.compare("onebit", x * (1 + 4 * ec.F32_EPS), x, scale)[0] is None
    y = x.clone()
    y[3] += 1e-3 * scale
    assert "1 of 5000" in ec.compare("onebit", y, x, scale)[0]
    # Sign flips: only with allow_flips, at most max_flips, and where allowed
    # (a flipped element's residual) a difference up to twice the scale.
    y = x.clone()
    y[[5, 9]] = -y[[5, 9]]
    assert ec.compare("onebit", y, x, scale)[0] is not None
    problem, flips = ec.compare("onebit", y, x, scale, allow_flips=True)
    assert problem is None and flips.nonzero().reshape(-1).tolist() == [5, 9]
    y[[11, 12, 13]] = -y[[11, 12, 13]]
    assert "5 sign flips" in ec.compare("onebit", y, x, scale, allow_flips=True)[0]
    r = x.clone()
    r[[5, 9]] += scale
    assert ec.compare("onebit", r, x, scale, allowed=flips)[0] is None
    assert ec.compare("onebit", r, x, scale)[0] is not None
    assert ec.compare("onebit", x[:10], x, scale)[0].startswith("result has 10 elements")
    assert ec.magnitude(torch.tensor([math.inf, -2.0]), None) == 2.0
    assert ec.max_flips(10) == 2 and ec.max_flips(70001) == 7


def test_bench_timing_and_report_helpers():
    t = ec.time_rounds({"a": (lambda: torch.ones(8).sum(), None), "b": (lambda: None, lambda: None)}, 3, 1,
                       torch.device("cpu"))
    assert len(t["a"]["wall"]) == len(t["b"]["wall"]) == 3 and t["a"]["gpu"] == []
    assert ec.timed_ms(t["a"])["median_ms"] > 0
    assert ec.gbps(1 << 26, None) is None and ec.ratio(1.0, 0.0) is None and ec.ratio(3.0, 2.0) == 1.5
    assert ec.json_path("NVIDIA H200", quick=True).endswith("-quick.json")
    assert ec.json_path("NVIDIA H200").endswith("allreduce/cuda-nvidia-h200.json")
    out, res = torch.empty(4099), torch.zeros(4099)
    xs = _data("kernels", 0, 0, 4099)
    for m in ("onebit", "int8", "int4", "topk", "fp16", "bf16"):
        ec.kernel_fn(m, xs, out, res, {"block_size": None, "density": 0.01, "approx": True})()
        assert bool(torch.isfinite(out).all()), m
    with pytest.raises(ValueError):
        ec.kernel_fn("plain", xs, out, res, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_without_cuda_says_so(capsys):
    from pycomm_bench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["allreduce", "--device", "cuda", "--json", "/nonexistent/never.json"])
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ec.make_args()
    # Through the real entry point: a message, no traceback.
    proc = subprocess.run([sys.executable, "-m", "pycomm_bench", "allreduce", "--device", "cuda"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_bench_config_of_arguments():
    import argparse

    a = argparse.Namespace(sizes=[1 << 26], methods=list(ec.METHODS), chunk_numel=None, repeats=15, warmup=3,
                           quick=False)
    cfg = ec.config_from_args(a)
    assert cfg["numel"] == 1 << 26 and cfg["bucket_numel"] == 6553600 and cfg["ddp_methods"] == list(ec.DDP_METHODS)
    assert cfg["gpt"] == {"n_layers": 4, "d_model": 512, "n_heads": 8, "seq_len": 128} and cfg["batch"] == 16
    a.quick, a.methods = True, ["plain", "onebit", "fp16"]
    cfg = ec.config_from_args(a)
    assert cfg["bucket_calls"] == ec.QUICK_BUCKET_CALLS and cfg["ddp_methods"] == ["plain", "onebit"]


@pytest.mark.gpu
def test_bench_arguments_on_cuda():
    args = ec.make_args()
    assert args.device.type == "cuda" and args.sizes == [ec.DEFAULT_NUMEL] and args.ranks == [1]
    assert args.methods == list(ec.METHODS) and ec.gpu_slug(torch.cuda.get_device_name()) in args.json
    quick = ec.make_args(quick=True)
    assert quick.sizes == [ec.QUICK_NUMEL] and quick.repeats < args.repeats and quick.json.endswith("-quick.json")
    for bad, name in ((dict(ranks="2"), "--ranks"), (dict(sizes="1M,2M"), "--sizes"), (dict(methods="x"), "--methods")):
        with pytest.raises(ValueError, match=name):
            ec.make_args(**bad)


def _job_bench_entry(rank, world, device, cfg_json, broken):
    return _job_bench(rank, world, device, json.loads(cfg_json), broken)


#: name -> (rank function, world size)
JOBS = {
    "engine": (_job_engine, 1),
    "gloo2": (_job_gloo2, 2),
    "training": (_job_training, 1),
    "sync": (_job_sync, 1),
    "forwarded": (_job_forwarded, 1),
    "bench": (_job_bench_entry, 1),
}
