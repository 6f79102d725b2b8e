"""pycomm.fsdp: FSDP2 (fully_shard) over Gloo with the engine's compressed
reduce-scatter and int8 all-gather. Every rank's reduce-scattered gradient
shard equals simulate_reduce_scatter bit for bit (2 and 4 ranks, odd sizes
with FSDP's padding, fp32/fp16/bf16 reduce dtypes, AVG, pre/post-divide and
PREMUL_SUM factors, error feedback over steps), the weight all-gather equals
simulate_all_gather, a non-finite step leaves the residuals as they were, a
mismatched call names the module, residuals saved with
torch.distributed.checkpoint resume bit for bit, HSDP compresses the
replicate all-reduce, and unsupported setups are refused."""

from __future__ import annotations

import io
import math
import types

import pytest
import torch
from _dist import refusal, run_ranks

from pycomm.distributed import spec
from pycomm.distributed.simulate import (
    ErrorFeedback,
    simulate_all_gather,
    simulate_reduce_scatter,
)

STEPS = 3
CHUNK = 1000
COMMON = {"min_compress_numel": 1, "chunk_numel": CHUNK}
# name -> (compressor, error_feedback, reduce_dtype, gradient_divide_factor, weights, settings)
CASES = {
    "int8-avg": ("int8", False, None, None, "int8", {"block_size": 64}),
    "onebit-fp16": ("onebit", True, torch.float16, None, None, {"block_size": 32}),
    "int4-bf16-premul": ("int4", True, torch.bfloat16, 3.0, None, {}),
    "topk-factor": ("topk", True, None, "world", None, {"density": 0.05, "approx": False}),
    "int8-fp16-factor": ("int8", False, torch.float16, 3.0, None, {}),
    # Stochastic rounding: keyed reduce-scatters, keyless int8 weight all-gathers.
    "int4-stochastic": ("int4", True, None, None, "int8", {"rounding": "stochastic", "seed": 9, "block_size": 64}),
    "plain": (None, False, None, None, None, {}),
}
FOUR = ["int8-avg", "onebit-fp16", "int4-bf16-premul"]


def _model():
    torch.manual_seed(0)
    # Odd sizes: dim 0 of 65 and 3 is padded to a multiple of the world size.
    return torch.nn.Sequential(torch.nn.Linear(37, 65), torch.nn.ReLU(), torch.nn.Linear(65, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 37, generator=g) * (1 + rank)


def _build(case, world, mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import pycomm.fsdp as pf

    compressor, ef, reduce_dtype, factor, weights, settings = case
    m = _model()
    kw = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)} if reduce_dtype else {}
    if mesh is not None:
        kw["mesh"] = mesh
    fully_shard(m[0], **kw)
    fully_shard(m[2], **kw)
    fully_shard(m, **kw)
    if factor is not None:
        for mod in (m[0], m[2], m):
            mod.set_gradient_divide_factor(float(world) if factor == "world" else factor)
    comp = None
    if compressor is not None:
        comp = pf.compress(m, compressor, error_feedback=ef, weights=weights, **COMMON, **settings)
    return m, comp, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _step(m, opt, step, rank):
    loss = m(_batch(step, rank)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _op_desc(op):
    import torch.distributed as dist

    if op is None:
        return None
    if op == dist.ReduceOp.SUM:
        return ("sum", None)
    if op == dist.ReduceOp.AVG:
        return ("avg", None)
    return ("sum", float(op.factor))  # PREMUL_SUM(factor)


def _shards(m):
    return [p.to_local().detach().clone() for p in m.parameters()]


class _Evil:
    """An object a weights_only load refuses: a checkpoint holding it would
    run its class's code when unpickled."""


def _rank(rank, world, names, ckpt):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from _fsdp_record import record_calls

    import pycomm.distributed as pd
    from pycomm.fsdp import CompressedReduceScatter, _param_groups

    out = {}
    for name in names:
        m, comp, opt = _build(CASES[name], world)
        record = record_calls(comp) if comp is not None else None
        losses = [_step(m, opt, s, rank) for s in range(STEPS)]
        rec = [(k, key, t, _op_desc(op)) for k, key, t, op in record] if comp is not None else None
        out[name] = {"losses": losses, "record": rec, "keys": comp.keys if comp else None}
    if world != 2:
        out["hsdp"] = _rank_hsdp(rank, world)
        return out

    # Resume: residuals (with model and optimizer) through torch.distributed.checkpoint.
    case = ("onebit", True, None, None, None, {"block_size": 32})
    m, comp, opt = _build(case, world)
    for s in range(2):
        _step(m, opt, s, rank)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "pycomm": comp}, checkpoint_id=ckpt)
    out["dcp_keys"] = sorted(k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
                             if k.startswith("pycomm."))
    for s in range(2, 4):
        _step(m, opt, s, rank)
    out["resume/first"] = _shards(m)
    out["resume/residual_bytes"] = comp.residual_bytes()
    # Non-finite input through the module's ReduceScatter: residuals stay.
    key = comp.keys["0"]
    pg = comp._session.group
    before = pd.error_feedback_state(pg, keys=[key])[key]["worker"].clone()
    x = torch.randn(before.numel())
    if rank == world - 1:
        x[before.numel() // 2] = math.inf
    y = torch.empty(before.numel() // world)
    CompressedReduceScatter(comp, key, "0")(y, x, _param_groups(m[0])[0].mesh_info.shard_process_group,
                                           dist.ReduceOp.AVG)
    out["nonfinite"] = (before, pd.error_feedback_state(pg, keys=[key])[key]["worker"].clone(),
                        bool(torch.isfinite(y).all()))

    m2, comp2, opt2 = _build(case, world)
    msd2, osd2 = get_state_dict(m2, opt2)
    sd = {"model": msd2, "optim": osd2, "pycomm": comp2}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for s in range(2, 4):
        _step(m2, opt2, s, rank)
    out["resume/second"] = _shards(m2)
    # Bytes that are not a saved state (or would run code when unpickled): refused, naming the entry.
    evil = io.BytesIO()
    torch.save({"keys": comp2.keys, "engine": _Evil()}, evil)
    out["resume/refused"] = [refusal(lambda: comp2.load_state_dict({k: data}))
                             for k, data in ((f"rank{rank}_of_{world}", b"not a checkpoint"),
                                             (f"rank{rank}_of_{world}", evil.getvalue()))]

    # A call that differs between ranks: refused on every rank, naming the module.
    n = 64 * (rank + 1)
    try:
        CompressedReduceScatter(comp2, 50, "blocks.7")(torch.empty(n), torch.randn(world * n), pg, dist.ReduceOp.SUM)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)

    # torch 2.11 has no symmetric-memory collectives (SymmMemAllGather,
    # SymmMemReduceScatter): without them pycomm.fsdp runs as before.
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc

    for n in ("SymmMemAllGather", "SymmMemReduceScatter", "ProcessGroupAllocAllGather",
              "ProcessGroupAllocReduceScatter"):
        if hasattr(fc, n):
            delattr(fc, n)
    m3, _, opt3 = _build(CASES["int8-avg"], world)
    out["without_private_names"] = [_step(m3, opt3, s, rank) for s in range(STEPS)]
    return out


def _rank_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pycomm.distributed as pd
    from pycomm.fsdp import _param_groups

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m, comp, opt = _build(("int8", False, None, None, None, {}), world, mesh=mesh)
    g = _param_groups(m[0])[0]
    losses = [_step(m, opt, s, rank) for s in range(2)]
    return {"losses": losses, "shards": _shards(m), "replicate_is_pycomm": pd.is_pycomm_group(
        g.mesh_info.replicate_process_group), "roles": sorted({role for role, _ in comp.groups})}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    return {2: run_ranks(_rank, 2, list(CASES), ckpt, timeout=240),
            4: run_ranks(_rank, 4, FOUR + ["plain"], ckpt, timeout=240)}


def _replay(results, world, name):
    """Check every recorded reduce-scatter / all-gather against the simulation."""
    compressor, ef, _, _, weights, settings = CASES[name]
    records = [results[world][r][name]["record"] for r in range(world)]
    assert all(len(rec) == len(records[0]) for rec in records)
    efs = {}
    n_rs = n_ag = 0
    keyless = {"reduce_scatter": 0, "all_gather": 0}  # each role's group counts its keyless calls
    for i in range(0, len(records[0]), 2):
        kinds = {rec[i][0] for rec in records}
        assert len(kinds) == 1
        kind, key = records[0][i][0], records[0][i][1]
        inputs = [rec[i][2] for rec in records]
        outs = [rec[i + 1][2] for rec in records]
        assert all(rec[i + 1][0] == kind + "_out" for rec in records)
        if kind == "reduce_scatter":
            op, premul = records[0][i][3]
            xs = [x.mul(premul) if premul is not None else x for x in inputs]
            kw = dict(settings, impl="cpu")
            if ef:
                efs.setdefault(key, [ErrorFeedback() for _ in range(world)])
            want = simulate_reduce_scatter(xs, compressor, op, CHUNK, efs.get(key), key=key if ef else None,
                                           call=keyless[kind], **kw)
            n_rs += 1
        else:
            kw = {k: v for k, v in settings.items() if k in ("block_size", "rounding", "seed")}
            want = simulate_all_gather(inputs, weights, CHUNK, None, impl="cpu", call=keyless[kind], **kw)
            n_ag += 1
        if kind == "all_gather" or not ef:
            keyless[kind] += 1
        for r in range(world):
            assert outs[r].dtype == want[r].dtype and torch.equal(outs[r], want[r]), (name, world, i, kind, r)
    return n_rs, n_ag


@pytest.mark.parametrize("world,name", [(2, n) for n in CASES if n != "plain"] + [(4, n) for n in FOUR])
def test_shards_equal_simulation(results, world, name):
    n_rs, n_ag = _replay(results, world, name)
    assert n_rs == 2 * STEPS  # two modules with parameters, every step
    if CASES[name][4] is not None:
        assert n_ag >= 2 * STEPS  # forward (and backward re-gather)
    if CASES[name][1]:
        assert results[world][0][name]["keys"] == {"": 0, "0": 1, "2": 2}


@pytest.mark.parametrize("world", [2, 4])
def test_trains_close_to_plain(results, world):
    for name in (FOUR if world == 4 else [n for n in CASES if n != "plain"]):
        for r in range(world):
            got = results[world][r][name]["losses"]
            assert all(math.isfinite(v) for v in got)
            if CASES[name][0] == "int8":  # the others need more than 3 steps to be compared
                want = results[world][r]["plain"]["losses"][-1]
                assert abs(got[-1] - want) <= 0.1 * abs(want) + 0.01, (name, r, got, want)


def test_resume_is_bit_exact(results):
    for r in range(2):
        first, second = results[2][r]["resume/first"], results[2][r]["resume/second"]
        assert all(torch.equal(a, b) for a, b in zip(first, second)), r
        # one float32 residual per element of each module's padded unsharded gradient
        assert results[2][r]["resume/residual_bytes"] == 4 * (66 * 37 + 66 + 4 * 65 + 4)
        # Each rank's entry names the world size: a load at another one is
        # refused by DCP naming a key that says so.
        assert results[2][r]["dcp_keys"] == ["pycomm.rank0_of_2", "pycomm.rank1_of_2"]
        garbage, evil = results[2][r]["resume/refused"]
        assert f"state['rank{r}_of_2'] is not a pycomm.fsdp state_dict()" in garbage, garbage
        assert "(UnpicklingError: Unsupported global: GLOBAL" in evil and "_Evil" in evil, evil
        assert "weights_only" not in garbage + evil  # torch's advice to load unsafely is not passed on


def test_nonfinite_step_leaves_residuals(results):
    assert not all(results[2][r]["nonfinite"][2] for r in range(2))  # the shard holding the Inf
    for r in range(2):
        before, after, _ = results[2][r]["nonfinite"]
        assert before.abs().sum() > 0 and torch.equal(before, after)


def test_mismatch_names_the_module(results):
    for r in range(2):
        msg = results[2][r]["mismatch"]
        assert msg is not None and "'blocks.7'" in msg and "different arguments" in msg, msg


def test_hsdp_compresses_the_replicate_all_reduce(results):
    res = [results[4][r]["hsdp"] for r in range(4)]
    for r in range(4):
        assert res[r]["replicate_is_pycomm"] and res[r]["roles"] == ["grad", "replicate"]
        assert all(math.isfinite(v) for v in res[r]["losses"])
    # replicas (same shard index) hold the same shards
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["shards"], res[r + 2]["shards"]))


def _fake_module(comms, singular=False):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    groups = [types.SimpleNamespace(_reduce_scatter_comm=c, _all_gather_comm=DefaultAllGather()) for c in comms]
    if singular:  # a torch before per-parameter meshes: one `_fsdp_param_group` (or None) per module
        state = types.SimpleNamespace(_fsdp_param_group=groups[0] if groups else None)
    else:
        state = types.SimpleNamespace(_fsdp_param_groups=groups)
    return types.SimpleNamespace(_get_fsdp_state=lambda: state)


def test_unsupported_setups_are_refused():
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc

    from pycomm.fsdp import _check_param_group

    with pytest.raises(ValueError, match=r"module 'layers.3' has 2 FSDP parameter groups"):
        _check_param_group(_fake_module([fc.DefaultReduceScatter(), fc.DefaultReduceScatter()]), "layers.3")
    symm_cls = getattr(fc, "SymmMemReduceScatter", None)  # torch >= 2.12 only
    if symm_cls is not None:
        with pytest.raises(ValueError, match=r"module 'layers.3' uses symmetric memory"):
            _check_param_group(_fake_module([symm_cls.__new__(symm_cls)]), "layers.3")
    alloc_cls = fc.ProcessGroupAllocReduceScatter
    with pytest.raises(ValueError, match=r"module 'layers.3' allocates its reduce-scatter buffers"):
        _check_param_group(_fake_module([alloc_cls.__new__(alloc_cls)]), "layers.3")
    with pytest.raises(ValueError, match=r"module 'layers.3' already has a custom reduce-scatter \(object\)"):
        _check_param_group(_fake_module([object()]), "layers.3")
    assert _check_param_group(_fake_module([fc.DefaultReduceScatter()]), "x") is not None


def test_private_torch_names_may_be_missing(monkeypatch):
    """What torch 2.11 lacks (SymmMem* collectives; before per-parameter
    meshes, `_fsdp_param_groups`) is not needed; what pycomm.fsdp cannot run
    without is named in a clear error, not an ImportError from inside."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    from torch.distributed.fsdp import FSDPModule

    import pycomm.fsdp as pf

    for n in ("SymmMemAllGather", "SymmMemReduceScatter", "ProcessGroupAllocAllGather",
              "ProcessGroupAllocReduceScatter"):
        monkeypatch.delattr(fc, n, raising=False)
    assert pf._check_param_group(_fake_module([fc.DefaultReduceScatter()]), "x") is not None
    assert pf._check_param_group(_fake_module([fc.DefaultReduceScatter()], singular=True), "x") is not None
    assert pf._check_param_group(_fake_module([], singular=True), "x") is None
    with pytest.raises(ValueError, match=r"already has a custom reduce-scatter \(object\)"):
        pf._check_param_group(_fake_module([object()], singular=True), "x")
    assert pf._unsupported_torch() is None

    # The plug point itself missing: refused, naming what is missing and the floor.
    monkeypatch.delattr(fc, "DefaultReduceScatter")
    assert "_fsdp_collectives.DefaultReduceScatter" in pf._unsupported_torch()
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11.*lacks .*_fsdp_collectives\.DefaultReduceScatter"):
        pf._check_param_group(_fake_module([object()]), "x")
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11.*lacks set_custom_reduce_scatter"):
        pf.compress(torch.nn.Linear(2, 2))


def test_import_without_the_custom_collective_interfaces():
    """A torch without _fsdp_api.AllGather/ReduceScatter: pycomm.fsdp still
    imports, and compress() says why it cannot run (fresh interpreter: the
    classes are looked up at import)."""
    import pathlib
    import subprocess
    import sys

    code = (
        "import torch.distributed.fsdp._fully_shard._fsdp_api as api\n"
        "del api.AllGather, api.ReduceScatter\n"
        "import torch, pycomm.fsdp as pf\n"
        "try:\n"
        "    pf.compress(torch.nn.Linear(2, 2))\n"
        "except RuntimeError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert res.returncode == 0, res.stderr
    assert "REFUSED pycomm.fsdp needs FSDP2's custom collectives" in res.stdout, res.stdout
    assert "_fsdp_api.AllGather" in res.stdout and "_fsdp_api.ReduceScatter" in res.stdout, res.stdout


def test_runs_without_the_symm_mem_collectives(results):
    """Over 2 Gloo ranks with SymmMem*/ProcessGroupAlloc* deleted from torch
    (as on torch 2.11): the same training as with them, bit for bit."""
    for r in range(2):
        assert results[2][r]["without_private_names"] == results[2][r]["int8-avg"]["losses"], r


def test_arguments_are_checked():
    import pycomm.fsdp as pf

    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        pf.compress("model")
    with pytest.raises(RuntimeError, match="not initialized"):
        pf.compress(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rounding='stochastic' is for the " + ", ".join(spec.ROUNDING_METHODS)):
        pf.compress(torch.nn.Linear(2, 2), "onebit", weights="bf16", rounding="stochastic")
    # Weights are used by the forward pass as decoded: no sign bits, no top-k.
    for weights in ("onebit", "topk"):
        with pytest.raises(ValueError, match=f"weights={weights!r} would run the forward pass"):
            pf.compress(torch.nn.Linear(2, 2), "int8", weights=weights)
    model = torch.nn.Linear(2, 2)
    model._pycomm_fsdp = object()  # what a first compress() leaves
    with pytest.raises(ValueError, match="already called on this model"):
        pf.compress(model, "int8")
