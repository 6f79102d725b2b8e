"""The engine client every entry point uses (pycomm/distributed/session.py):
one validator of residuals, one check of a pycomm group's settings, key
ranges that may not overlap in one group, and loads that change nothing
when they refuse. Run on 2 Gloo ranks where a group is needed; every
refusal must come on every rank, naming the argument."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import pycomm._ext as ext
import pycomm.distributed as pd
from pycomm.distributed import spec
from pycomm.distributed.session import KEY_SPAN, EngineSession, check_key_base, check_residual, check_residuals

pytestmark = pytest.mark.skipif(ext.why_no_cpu_ops() is not None, reason=str(ext.why_no_cpu_ops()))
WORLD = 2


def _residual(method="onebit", numel=100, chunk=64):
    chunks = spec.chunk_bounds(numel, chunk)
    server = [torch.zeros(hi - lo) for lo, hi in chunks] if spec.method_spec(method).kind == "block" else []
    return {"numel": numel, "world_size": 2, "chunk_numel": chunk, "method": method,
            "worker": torch.zeros(numel), "server": server}


# ----------------------------------------------------------- validator ---
def test_a_good_residual_is_copied():
    ef = _residual()
    got = check_residual("r", ef, ("onebit",))
    assert torch.equal(got["worker"], ef["worker"]) and got["worker"].data_ptr() != ef["worker"].data_ptr()


@pytest.mark.parametrize("where,value", [("worker", math.nan), ("worker", math.inf), ("server", -math.inf)])
def test_a_non_finite_residual_is_refused_naming_the_field(where, value):
    ef = _residual()
    (ef["worker"] if where == "worker" else ef["server"][1])[7] = value
    field = "['worker']" if where == "worker" else "['server'][1]"
    with pytest.raises(ValueError, match=re.escape(f"state[3]{field} holds a NaN or Inf")):
        check_residuals("state", {3: ef}, ("onebit",))


@pytest.mark.parametrize("bad,match", [
    (lambda ef: ef.pop("numel"), r"missing \['numel'\]"),
    (lambda ef: ef.update(method="int8"), r"\['method'\] is 'int8'"),
    (lambda ef: ef.update(worker=torch.zeros(99)), r"\['worker'\] must be a 1-D float32 tensor of numel=100"),
    (lambda ef: ef.update(worker=torch.zeros(100, dtype=torch.float64)), r"got a torch.float64 tensor"),
    (lambda ef: ef["server"].pop(), r"one tensor per chunk \(2 chunks"),
    (lambda ef: ef.update(chunk_numel=0), r"\['chunk_numel'\] must be a positive int"),
])
def test_a_malformed_residual_is_refused_naming_the_field(bad, match):
    ef = _residual()
    bad(ef)
    with pytest.raises((ValueError, TypeError), match=match):
        check_residuals("state", {0: ef}, ("onebit",))


def test_reduce_scatter_residuals_keep_no_server_part():
    ef = _residual("int8")
    ef["method"], ef["server"] = "int8" + spec.REDUCE_SCATTER_SUFFIX, []
    assert check_residual("r", ef, (ef["method"],))["server"] == []


def test_keys_outside_the_span_are_refused():
    with pytest.raises(ValueError, match=r"state\[1048576\]: a key must be an int in \[0, 1048576\)"):
        check_residuals("state", {KEY_SPAN: _residual()}, ("onebit",), span=KEY_SPAN)


@pytest.mark.parametrize("key_base", [2**63, -1, 2**63 - 5])
def test_key_base_outside_int64_is_refused(key_base):
    with pytest.raises(ValueError, match="key_base must be in"):
        check_key_base(key_base)
    from pycomm.optim import OneBitAdam

    with pytest.raises(ValueError, match="key_base must be in"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(3))], key_base=key_base)


def test_key_base_must_be_an_int():
    with pytest.raises(TypeError, match="key_base must be an int"):
        EngineSession("x", "onebit", {}, key_base=1.5)


# ------------------------------------------------------- over a group ---
def _overlapping_clients(rank, world):
    from pycomm.optim import KEY_BASE, OneBitSGD

    pg = pd.wrap(compressor="onebit", block_size=64)
    out = {}
    params = [torch.nn.Parameter(torch.full((200,), float(rank)))]
    a = OneBitSGD(params, lr=0.1, momentum=0.9, warmup_steps=1, process_group=pg, block_size=64)
    b = OneBitSGD(params, lr=0.1, momentum=0.9, warmup_steps=1, process_group=pg, block_size=64,
                  key_base=KEY_BASE + KEY_SPAN // 2)
    for opt in (a, a, b, b):  # b refused at its first compressed step, the first that uses its keys
        params[0].grad = torch.ones(200)
        try:
            opt.step()
            out.setdefault("ok", 0)
            out["ok"] += 1
        except ValueError as exc:
            out["refused"] = str(exc)
    # Far enough apart: accepted.
    c = OneBitSGD(params, lr=0.1, momentum=0.9, warmup_steps=1, process_group=pg, block_size=64,
                  key_base=KEY_BASE + KEY_SPAN)
    params[0].grad = torch.ones(200)
    c.step()
    c.step()
    out["c keys"] = sorted(c.state_dict()["pycomm"]["engine"]["residuals"])
    return out


def test_overlapping_key_ranges_on_one_group_are_refused_on_every_rank():
    for out in run_ranks(_overlapping_clients, WORLD, timeout=120):
        assert out["ok"] == 3  # a: warm-up and compressed; b: warm-up
        assert "OneBitSGD would use the keys" in out["refused"] and "another key_base" in out["refused"]
        assert out["c keys"] == [0]


def _group_settings_checked(rank, world):
    from pycomm.optim import OneBitAdam

    pg = pd.wrap(compressor="int8", block_size=64)
    params = [torch.nn.Parameter(torch.zeros(10))]
    out = {}
    for name, kwargs in (("method", dict(compressor="onebit")), ("block", dict(compressor="int8", block_size=128))):
        try:
            OneBitAdam(params, process_group=pg, **kwargs)
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_the_optimizer_checks_a_pycomm_group_as_the_hook_does():
    for out in run_ranks(_group_settings_checked, WORLD, timeout=120):
        assert "compressor='onebit'" in out["method"] and "compressor='int8'" in out["method"]
        assert "block_size=128" in out["block"] and "block_size=64" in out["block"]


# ---------------------------------------------- loads: whole or nothing ---
def _optimizer_loads(rank, world):
    from pycomm.optim import OneBitAdam

    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(300))]
    opt = OneBitAdam(params, lr=1e-2, warmup_steps=1, block_size=64)
    for _ in range(3):
        params[0].grad = torch.randn(300)
        opt.step()
    good = opt.state_dict()
    before = (params[0].detach().clone(), opt.state_dict())
    out = {}

    def attempt(name, sd):
        try:
            opt.load_state_dict(sd)
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
        after = opt.state_dict()
        out[name + " unchanged"] = (after["pycomm"]["step_count"] == before[1]["pycomm"]["step_count"]
                                    and _same(after["state"], before[1]["state"])
                                    and _same(after["pycomm"]["engine"]["residuals"], before[1]["pycomm"]["engine"]["residuals"]))

    nan = {**good, "pycomm": {**good["pycomm"], "engine": {**good["pycomm"]["engine"], "residuals": {
        0: {**good["pycomm"]["engine"]["residuals"][0], "worker": torch.full_like(
            good["pycomm"]["engine"]["residuals"][0]["worker"], math.nan)}}}}}
    nan["state"] = {0: {k: (v + 1 if k == "exp_avg" else v) for k, v in good["state"][0].items()}}
    attempt("nan", nan)
    missing = {**good, "pycomm": {k: v for k, v in good["pycomm"].items() if k != "step_count"}}
    missing["state"] = nan["state"]
    attempt("missing", missing)
    attempt("good", good)
    return out


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_an_optimizer_load_refuses_whole():
    for out in run_ranks(_optimizer_loads, WORLD, timeout=120):
        assert "['engine']['residuals'][0]['worker'] holds a NaN or Inf" in out["nan"]
        assert "missing ['step_count']" in out["missing"]
        assert out["nan unchanged"] and out["missing unchanged"]
        assert out["good"] is None


def _refusal_stays(rank, world, path):
    from pycomm.optim import OneBitSGD

    params = [torch.nn.Parameter(torch.ones(50))]
    opt = OneBitSGD(params, lr=0.1, momentum=0.9, warmup_steps=1, block_size=64)
    params[0].grad = torch.ones(50)
    opt.step()
    opt.step()
    torch.save(opt.state_dict(), f"{path}/opt{rank}.pt")
    dist.barrier()
    fresh = OneBitSGD(params, lr=0.1, momentum=0.9, warmup_steps=1, block_size=64)
    # A state loaded before the group is known is checked at the first step.
    from _dist import reinit_on_a_new_port

    reinit_on_a_new_port(rank)
    fresh.load_state_dict(torch.load(f"{path}/opt{1 - rank}.pt", weights_only=True))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    out = []
    for _ in range(2):
        params[0].grad = torch.ones(50)
        try:
            fresh.step()
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_a_rank_mismatch_refusal_stays_a_refusal(tmp_path):
    for rank, out in enumerate(run_ranks(_refusal_stays, WORLD, str(tmp_path), timeout=120)):
        assert all(m is not None and f"rank {1 - rank} of 2's residuals" in m for m in out), out


def _hook_disagrees(rank, world, over_pycomm):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook

    out = {"timeouts": None}
    group = pd.wrap(compressor="int8") if over_pycomm else None
    if over_pycomm:
        out["timeouts"] = (pd.timeout_of(group), pd.timeout_of(None))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2), process_group=group)
    state = CompressionState(process_group=group, compressor="int8", start_iter=3 + rank)
    model.register_comm_hook(state, compressed_hook)
    try:
        model(torch.ones(2, 8)).sum().backward()
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    return out


@pytest.mark.parametrize("over_pycomm", [False, True])
def test_hooks_that_disagree_on_start_iter_fail_at_the_first_bucket(over_pycomm):
    for out in run_ranks(_hook_disagrees, WORLD, over_pycomm, timeout=120):
        assert out["error"] is not None and "start_iter (rank 0: 3, rank 1: 4)" in out["error"], out
        if over_pycomm:  # the group pycomm made keeps the user's timeout
            made, world = out["timeouts"]
            assert made == world and made is not None


def _overlapping_buffers(rank, world):
    pg = pd.wrap(compressor="int8")
    out = {}
    x = torch.arange(8 * world, dtype=torch.float32)
    for name, call in (
        ("rs other shard", lambda: pd.reduce_scatter(x[(1 - rank) * 8:(2 - rank) * 8], x, group=pg)),
        ("ag other shard", lambda: pd.all_gather(x, x[(1 - rank) * 8:(2 - rank) * 8], group=pg)),
        ("key too large", lambda: pd.all_reduce(torch.ones(4), key=2**63, group=pg)),
        ("meta", lambda: pd.all_reduce(torch.ones(4, device="meta"), group=pg)),
    ):
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    # In place, each rank's own shard: allowed, and right.
    y = torch.arange(8 * world, dtype=torch.float32) * (rank + 1)
    pd.reduce_scatter(y[rank * 8:(rank + 1) * 8], y, group=pg, op="sum")
    out["in place"] = y[rank * 8:(rank + 1) * 8].clone()
    return out


def test_collectives_refuse_overlapping_or_impossible_buffers():
    for rank, out in enumerate(run_ranks(_overlapping_buffers, WORLD, timeout=120)):
        assert "overlaps input's memory outside this rank's own shard" in out["rs other shard"]
        assert "overlaps input's memory outside this rank's own shard" in out["ag other shard"]
        assert "key must be an int in [0, 2**63)" in out["key too large"]
        assert "meta device" in out["meta"]
        want = torch.arange(8 * WORLD, dtype=torch.float32)[rank * 8:(rank + 1) * 8] * 3
        assert torch.allclose(out["in place"], want, rtol=0.02, atol=0.05)


def test_a_hook_state_that_loads_another_compressor_says_so():
    from pycomm.ddp import CompressionState

    a = CompressionState(compressor="onebit", start_iter=4)
    b = CompressionState(compressor="topk", start_iter=2)
    with pytest.warns(UserWarning, match=r"compressor='onebit' \(was 'topk'\)"):
        b.load_state_dict(a.state_dict())
    assert b.compressor == "onebit"


def _groups_that_differ(rank, world):
    import plugin_int8  # noqa: F401 - registers "int8-absmax", as a user's file would

    out = {}
    for name, kwargs in (("min_compress_numel", dict(compressor="int8", min_compress_numel=1000 * (rank + 1))),
                         ("options", dict(compressor="int8-absmax", compressor_options={"levels": 127 - rank}))):
        try:
            pd.wrap(**kwargs)
            out[name] = None
        except (ValueError, RuntimeError) as exc:
            out[name] = str(exc)
    return out


def test_groups_created_with_different_settings_name_them():
    for out in run_ranks(_groups_that_differ, WORLD, timeout=120):
        assert "min_compress_numel (rank 0: 1000, rank 1: 2000)" in out["min_compress_numel"], out
        assert "compressor_options (rank 0: {'levels': 127}, rank 1: {'levels': 126})" in out["options"], out


def _hook_over_plain_gloo_warns_nothing(rank, world):
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DDP(torch.nn.Linear(256, 256))
        model.register_comm_hook(CompressionState(process_group=None, compressor="int8", start_iter=2),
                                 compressed_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):  # the plain warm-up, then the settings check, then compressed steps
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_hook_over_plain_gloo_prints_no_warning():
    # torch 2.13 deprecates all_gather_into_tensor with a FutureWarning; the
    # settings check at the first compressed step must not print it.
    assert run_ranks(_hook_over_plain_gloo_warns_nothing, WORLD, timeout=120) == [[]] * WORLD
