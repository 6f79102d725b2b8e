"""The compressed-momentum optimizers used wrongly, on 2 Gloo ranks: ranks
that disagree on a setting raise on every rank naming it (no abort inside
the backend, no hang at the end of the warm-up); a parameter frozen after
the warm-up stays where it is; overlap under a GradScaler whose scale was
already taken off is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import pycomm._ext as ext
from pycomm.optim import OneBitAdam

pytestmark = pytest.mark.skipif(ext.why_no_cpu_ops() is not None, reason=str(ext.why_no_cpu_ops()))
WORLD = 2


def _steps(opt, params, n):
    for _ in range(n):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()


def _disagree(rank, world, case):
    from pycomm.optim import OneBitAdam

    params = [torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(8))]
    kwargs = dict(lr=1e-2, warmup_steps=3, block_size=32)
    if case == "warmup_steps" and rank == 1:
        kwargs["warmup_steps"] = 2
    if case == "variance_update_every" and rank == 1:
        kwargs["variance_update_every"] = 2
    if case == "process_group":  # made by every rank, passed by rank 0 only
        import pycomm.distributed as pd

        pg = dist.new_group(backend="pycomm", pg_options=pd.PycommOptions(compressor="onebit", block_size=32))
        kwargs["process_group"] = pg if rank == 0 else None
    if case == "add_param_group":
        opt = OneBitAdam(params[:1], **kwargs)
        _steps(opt, params[:1], 1)
        if rank == 1:  # during the warm-up, on one rank only
            opt.add_param_group({"params": [params[1]]})
    elif case == "warmup_steps_later":  # a setting of the same flat size, changed on one rank
        opt = OneBitAdam(params, **kwargs)
        _steps(opt, params, 1)
        if rank == 1:
            opt.warmup_steps = 4
    else:
        opt = OneBitAdam(params, **kwargs)
    try:
        _steps(opt, params, 4)
        return None
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("case,named", [
    ("warmup_steps", "warmup_steps (rank 0: 3, rank 1: 2)"),
    ("variance_update_every", "variance_update_every (rank 0: 20, rank 1: 2)"),
    ("add_param_group", "parameter sizes (rank 0: [64], rank 1: [64, 8])"),
    ("warmup_steps_later", "warmup_steps (rank 0: 3, rank 1: 4)"),
    ("process_group", "different process groups"),
])
def test_ranks_that_disagree_raise_on_every_rank_naming_the_setting(case, named):
    msgs = run_ranks(_disagree, WORLD, case, timeout=120)
    for msg in msgs:
        assert msg is not None and named in msg, msg
    if case == "process_group":  # each rank names both groups, not a timeout
        assert "over ranks [0, 1] (pycomm)" in msgs[1] and "over ranks [0, 1] (gloo)" in msgs[0], msgs
    else:
        assert all("the ranks disagree on" in m for m in msgs), msgs


def _warmup_collectives(rank, world):
    from pycomm.optim import OneBitAdam
    from pycomm.optim import base

    params = [torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(8))]
    opt = OneBitAdam(params, lr=1e-2, warmup_steps=5, block_size=32)
    counts = {"agree": 0, "all_reduce": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    agree, all_reduce = base.agree, dist.all_reduce
    base.agree, dist.all_reduce = counted("agree", agree), counted("all_reduce", all_reduce)
    try:
        per_step = []
        for _ in range(5):
            before = dict(counts)
            _steps(opt, params, 1)
            per_step.append({k: counts[k] - before[k] for k in counts})
    finally:
        base.agree, dist.all_reduce = agree, all_reduce
    return per_step


def test_the_warm_up_compares_settings_once_then_in_band():
    """The settings are exchanged at the first step; later warm-up steps
    carry the check in their flat all-reduce (a flag of a rank whose
    settings changed), one collective a step."""
    for per_step in run_ranks(_warmup_collectives, WORLD, timeout=120):
        assert per_step[0] == {"agree": 1, "all_reduce": 2}, per_step  # the digests, then the gradients
        assert per_step[1:] == [{"agree": 0, "all_reduce": 1}] * 4, per_step


def _attach_overlap_mismatch(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.optim import OneBitAdam

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    model = DDP(net)
    opt = OneBitAdam(net.parameters(), lr=1e-2, warmup_steps=3, block_size=32)
    try:
        opt.attach(model, overlap=rank == 0)  # refused before any group is made on one rank only
        for _ in range(4):
            opt.zero_grad()
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
        return None
    except ValueError as exc:
        return str(exc)


def test_attach_overlap_that_differs_is_named():
    for msg in run_ranks(_attach_overlap_mismatch, WORLD, timeout=120):
        assert msg is not None and "attach(overlap=...) (rank 0: True, rank 1: False)" in msg, msg


def _frozen_after_warmup(rank, world):
    from pycomm.optim import OneBitAdam, OneBitSGD

    out = {}
    for cls, kw in ((OneBitAdam, {}), (OneBitSGD, {"momentum": 0.9})):
        params = [torch.nn.Parameter(torch.full((40,), 1.0 + rank)), torch.nn.Parameter(torch.ones(40))]
        opt = cls(params, lr=1e-2, warmup_steps=2, block_size=32, **kw)
        _steps(opt, params, 3)
        params[1].requires_grad_(False)
        params[1].grad = None
        before = params[1].detach().clone()
        for _ in range(3):
            params[0].grad = torch.ones(40)
            opt.step()
        out[cls.__name__] = torch.equal(params[1].detach(), before)
    return out


def test_a_parameter_frozen_after_the_warmup_does_not_move():
    for out in run_ranks(_frozen_after_warmup, WORLD, timeout=120):
        assert out == {"OneBitAdam": True, "OneBitSGD": True}


def _overlap_scaler_unscaled(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.optim import OneBitAdam

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    model = DDP(net)
    opt = OneBitAdam(net.parameters(), lr=1e-2, warmup_steps=2, block_size=32)
    opt.attach(model, overlap=True)  # no scaler=
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).sum()).backward()
        scaler.unscale_(opt)  # the clipping recipe: grad_scale is None in step()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        try:
            scaler.step(opt)
        except ValueError as exc:
            return step, str(exc)
        scaler.update()
    return None


def test_overlap_under_an_unscaled_gradscaler_without_scaler_is_refused():
    for got in run_ranks(_overlap_scaler_unscaled, WORLD, timeout=120):
        assert got is not None, "the momenta went out from scaled gradients unnoticed"
        step, msg = got
        # Refused at the first step a GradScaler it was not given steps it
        # (in the warm-up too: a skipped step must be recorded in the scaler).
        assert step == 0 and "attach(model, overlap=True, scaler=scaler)" in msg


def test_key_span_is_importable():
    from pycomm.optim import KEY_BASE, KEY_SPAN

    assert KEY_SPAN == 1 << 20 and KEY_BASE % KEY_SPAN == 0
    assert dist.is_available()


def _accumulate_in_the_wrong_order(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.optim import OneBitAdam

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    model = DDP(net)
    opt = OneBitAdam(net.parameters(), lr=1e-2, warmup_steps=2, block_size=32)
    opt.attach(model, overlap=True)
    out = {}
    for step in range(4):
        opt.zero_grad()
        wrong = step == 3
        if wrong:  # the backward outside no_sync first: the hook sends, then a micro-batch more
            model(torch.ones(2, 16)).sum().backward()
            with model.no_sync():
                model(torch.full((2, 16), 2.0)).sum().backward()
        else:  # the right order
            with model.no_sync():
                model(torch.full((2, 16), 2.0)).sum().backward()
            model(torch.ones(2, 16)).sum().backward()
        before = [p.detach().clone() for p in net.parameters()]
        try:
            opt.step()
        except ValueError as exc:
            out["error"] = (step, str(exc), all(torch.equal(a, b) for a, b in zip(before, net.parameters())))
    return out


def test_overlap_refuses_a_micro_batch_after_the_send():
    for out in run_ranks(_accumulate_in_the_wrong_order, WORLD, timeout=120):
        step, msg, unchanged = out["error"]
        assert step == 3 and "LAST backward outside it" in msg and unchanged


def _block_size_changed_at_load(rank, world):
    from pycomm.optim import OneBitAdam

    out = {}
    for compressor in ("onebit", "int8", "int4"):
        params = [torch.nn.Parameter(torch.ones(300))]
        opt = OneBitAdam(params, lr=1e-2, warmup_steps=1, block_size=32, compressor=compressor)
        _steps(opt, params, 3)
        saved = opt.state_dict()
        # A new optimizer, before its first step (no engine yet): the saved
        # residuals are checked against the block size it runs, at the load
        # (300 elements over 2 ranks: segments of 160 at block_size=32, 192 at 64).
        fresh_params = [torch.nn.Parameter(torch.ones(300))]
        other = OneBitAdam(fresh_params, lr=1e-2, warmup_steps=1, block_size=64, compressor=compressor)
        try:
            other.load_state_dict(saved)
            out[compressor] = None
        except ValueError as exc:
            out[compressor] = str(exc)
        out[(compressor, "untouched")] = other.step_count == 0 and not other.state
        same = OneBitAdam(fresh_params, lr=1e-2, warmup_steps=1, block_size=32, compressor=compressor)
        same.load_state_dict(saved)  # the saved block size: loads, and steps
        _steps(same, fresh_params, 1)
        out[(compressor, "resumed")] = same.step_count
    return out


def test_a_block_size_change_in_a_loaded_state_is_refused_at_the_load():
    for rank, out in enumerate(run_ranks(_block_size_changed_at_load, WORLD, timeout=120)):
        for compressor in ("onebit", "int8", "int4"):
            msg = out[compressor]
            assert msg is not None and "the residuals were saved with another block_size" in msg, msg
            assert f"rank {rank}'s segment" in msg and "block_size=64" in msg, msg
            assert out[(compressor, "untouched")], compressor
            assert out[(compressor, "resumed")] == 4, compressor


def _sharded_or_sparse(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pycomm.optim import OneBitAdam, OneBitSGD

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]))
    try:
        OneBitAdam([sharded], lr=1e-2)
        out["dtensor"] = None
    except ValueError as exc:
        out["dtensor"] = str(exc)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    opt = OneBitSGD(emb.parameters(), lr=0.1, momentum=0.9, warmup_steps=1)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    before = emb.weight.detach().clone()
    try:
        opt.step()
        out["sparse"] = None
    except ValueError as exc:
        out["sparse"] = str(exc)
    out["sparse unchanged"] = torch.equal(before, emb.weight) and opt.step_count == 0
    return out


def test_sharded_parameters_and_sparse_gradients_are_refused_naming_the_fix():
    for out in run_ranks(_sharded_or_sparse, WORLD, timeout=120):
        assert out["dtensor"] is not None and "DTensor parameter" in out["dtensor"], out["dtensor"]
        assert "pycomm.fsdp.compress" in out["dtensor"], out["dtensor"]
        assert out["sparse"] is not None and "takes dense gradients" in out["sparse"], out["sparse"]
        assert "nn.Embedding(sparse=True)" in out["sparse"] and out["sparse unchanged"]


def test_a_loaded_state_brings_its_warm_up_and_a_malformed_one_changes_nothing():
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    saved = OneBitAdam(net.parameters(), lr=1e-3, warmup_steps=5).state_dict()
    opt = OneBitAdam(net.parameters(), lr=1e-3, warmup_steps=2)
    with pytest.warns(UserWarning, match=r"warmup_steps=5 \(was 2\)"):
        opt.load_state_dict(saved)
    assert opt.warmup_steps == 5
    for bad, match in ((0, r"\['warmup_steps'\] must be a positive int, got 0"),
                       ("5", r"\['warmup_steps'\] must be a positive int, got '5'"),
                       (-1, r"\['step_count'\] must be a non-negative int, got -1")):
        state = copy.deepcopy(saved)
        state["pycomm"]["warmup_steps" if bad != -1 else "step_count"] = bad
        opt.step_count = 3
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(state)
        assert opt.warmup_steps == 5 and opt.step_count == 3
