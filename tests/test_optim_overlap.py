"""``attach(model, overlap=True)``: the compressed-momentum optimizers send
the momenta from DDP's hook, one compressed all-reduce per bucket, while
backward runs. On 2 Gloo ranks, with several DDP buckets:

* parameters, momenta and every bucket's residuals equal a single-process
  replay with one simulated all-reduce per bucket, bit for bit (AdamW with
  onebit, SGD with int4);
* under GradScaler (passed as ``scaler``) the run is the same bits, and a
  step with an Inf on one rank changes nothing on any rank: the buckets that
  were finite have their residuals undone;
* a run resumed from each rank's state continues bit for bit; a state saved
  with overlap is refused by an optimizer without it;
* gradient accumulation under ``model.no_sync()`` sends each bucket once
  per step, and the ranks stay identical;
* what overlap cannot serve is refused, naming the argument: a GradScaler
  that was not passed (nothing changes), two backwards without a step,
  ``scaler`` without overlap, a warm-up of one step.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from test_optim import (
    ADAM,
    BAD_STEPS,
    SETTINGS,
    SGD_NESTEROV,
    STEPS,
    WORLD,
    Net,
    _assert_params_equal,
    _loss,
    _make,
    _replay,
    _result,
    _run,
    _same,
    _snapshot,
    assert_resumed_exactly,
    assert_skipped_unchanged,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.optim import KEY_BASE, OneBitAdam

BUCKET_MB = 0.001  # ~1 KB: the test model's ~3 KB of parameters in several buckets
SAVE = 6
# name -> (optimizer, hyperparameters, compressor, other settings)
CONFIGS = {
    "adam-onebit": ("adam", ADAM, "onebit", {}),
    "sgd-int4": ("sgd", SGD_NESTEROV, "int4", {}),
    # Exact variance updates (the hook averages, no bucket is sent) at steps 5 and 8.
    "adam-onebit-variance": ("adam", ADAM, "onebit", {"variance_update_every": 3}),
}


def _ddp(net):
    return DDP(net, bucket_cap_mb=BUCKET_MB)


def _setup(kind, hyper, method, extra=None):
    """(net, its DDP model in several buckets, an unattached optimizer)."""
    net = Net(unused=False)
    return net, _ddp(net), _make(kind, hyper, method, net=net, **(extra or {}))


def _buckets(opt, net):
    """The optimizer's buckets (saved as their element count and positions in its parameter groups)
    as lists of indices into ``net.parameters()``, by bucket index."""
    index = {id(p): i for i, p in enumerate(net.parameters())}
    order = [index[id(p)] for g in opt.param_groups for p in g["params"]]
    saved = opt.state_dict()["pycomm"]["buckets"]
    assert sorted(saved) == list(range(len(saved)))
    return [[order[i] for i in saved[b][1]] for b in sorted(saved)]  # (numel, positions)


def _rank_overlap(rank, world, directory):
    out = {}
    for name, (kind, hyper, method, extra) in CONFIGS.items():
        net, model, opt = _setup(kind, hyper, method, extra)
        opt.attach(model, overlap=True)
        for step in range(STEPS):
            if step == SAVE:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, f"{directory}/{name}_{rank}.pt")
            _run(rank, model, opt, step, step + 1)
        out[name] = _result(net, opt)
        out[name + " buckets"] = _buckets(opt, net)
        out[name + " bytes"] = (opt.bytes_per_step(), opt.bytes_per_step(compressed=False))

    # With a GradScaler and Inf iterations.
    net, model, opt = _setup("adam", ADAM, "onebit")
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    opt.attach(model, overlap=True, scaler=scaler)
    record = []
    _run(rank, model, opt, 0, STEPS, scaler=scaler, bad=BAD_STEPS, record=record)
    out["scaler"] = _result(net, opt)
    out["scaler record"] = record
    out["scaler skipped"] = opt.skipped_steps

    # Gradient accumulation as documented: the first micro-batch under no_sync.
    net, model, opt = _setup("adam", ADAM, "onebit")
    opt.attach(model, overlap=True)
    for step in range(STEPS):
        opt.zero_grad()
        with model.no_sync():
            _loss(model, rank, 100 + step).backward()
        _loss(model, rank, step).backward()
        opt.step()
    out["no_sync"] = ([p.detach().clone() for p in net.parameters()], opt.step_count,
                      sorted(opt.state_dict()["pycomm"]["engine"]["residuals"]))

    errors = {}
    # A GradScaler the optimizer was not given: refused, nothing changed.
    net, model, opt = _setup("adam", ADAM, "onebit")
    opt.attach(model, overlap=True)
    _run(rank, model, opt, 0, 4)
    before = _snapshot(model, opt)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(_loss(model, rank, 4)).backward()
    try:
        scaler.step(opt)
    except ValueError as exc:
        errors["no scaler"] = str(exc)
    errors["no scaler unchanged"] = _same(before, _snapshot(model, opt))
    # Two backwards without a step: refused from the second backward.
    opt.zero_grad()
    _loss(model, rank, 5).backward()
    try:
        _loss(model, rank, 6).backward()
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    errors["twice unchanged"] = _same(before, _snapshot(model, opt))
    # ... and the next step goes on normally, on every rank alike.
    _run(rank, model, opt, 7, 8)
    errors["after"] = [p.detach().clone() for p in net.parameters()]
    # Keys: one per bucket, above key_base.
    import pycomm.distributed as pd

    errors["keys"] = sorted(pd.error_feedback_state(opt._engine))
    errors["nbuckets"] = len(opt._ddp.buckets)
    for what, kw in (("scaler without overlap", dict(scaler=torch.amp.GradScaler("cpu"))),
                     ("overlap type", dict(overlap=1)), ("scaler type", dict(overlap=True, scaler=object()))):
        net = Net(unused=False)
        try:
            _make("adam", ADAM, "onebit", net=net).attach(_ddp(net), **kw)
        except (ValueError, TypeError) as exc:
            errors[what] = str(exc)
    net = Net(unused=False)
    try:
        _make("adam", ADAM, "onebit", net=net, warmup=1).attach(_ddp(net), overlap=True)
    except ValueError as exc:
        errors["warmup 1"] = str(exc)
    out["errors"] = errors
    return out


def _rank_resumed(rank, world, directory):
    out = {}
    for name, (kind, hyper, method, extra) in CONFIGS.items():
        net, model, opt = _setup(kind, hyper, method, extra)
        ck = torch.load(f"{directory}/{name}_{rank}.pt", weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])  # before attach: checked when attached
        opt.attach(model, overlap=True)
        if name == "adam-onebit":
            # Loading again into the attached optimizer keeps its engine and coupling.
            engine = opt._engine
            opt.load_state_dict(ck["opt"])
            out["kept"] = opt._engine is engine and opt._overlap and bool(opt._ddp.param_ids)
        _run(rank, model, opt, SAVE, STEPS)
        out[name] = _result(net, opt)
    # Overlap's residuals are per bucket: an optimizer without overlap refuses them.
    net, model, opt = _setup("adam", ADAM, "onebit")
    opt.attach(model)
    _run(rank, model, opt, 0, 4)  # past the warm-up, the engine exists: refused at load
    saved = torch.load(f"{directory}/adam-onebit_{rank}.pt", weights_only=True)["opt"]
    try:
        opt.load_state_dict(saved)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    # Before the engine exists, the check waits for the first compressed step.
    net, model, opt = _setup("adam", ADAM, "onebit")
    opt.attach(model)
    opt.load_state_dict(saved)
    try:
        _run(rank, model, opt, SAVE, SAVE + 1)
        out["mismatch-later"] = None
    except ValueError as exc:
        out["mismatch-later"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("overlap"))
    full = run_ranks(_rank_overlap, WORLD, directory, timeout=300)
    resumed = run_ranks(_rank_resumed, WORLD, directory, timeout=240)
    return full, resumed


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_the_per_bucket_simulation(runs, name):
    kind, hyper, method, extra = CONFIGS[name]
    buckets = runs[0][0][name + " buckets"]
    assert len(buckets) >= 3, f"the test wants several buckets, DDP made {buckets}"
    assert runs[0][1][name + " buckets"] == buckets
    net, ref, efs = _replay(kind, hyper, method, buckets=buckets, unused=False, **extra)
    want = [p.detach() for p in net.parameters()]
    key = "exp_avg" if kind == "adam" else "momentum_buffer"
    for rank in range(WORLD):
        res = runs[0][rank][name]
        _assert_params_equal(res["params"], want, f"rank {rank} {name}")
        for i, st in ref.state_dict()["state"].items():
            assert torch.equal(res["state"][i][key], st[key]), (name, rank, i)
        saved = res["pycomm"]["engine"]["residuals"]
        assert sorted(saved) == [1 + b for b in range(len(buckets))]  # relative keys: 1 + bucket index
        for b in range(len(buckets)):
            ef = saved[1 + b]
            assert torch.equal(ef["worker"], efs[b][rank].worker), (name, rank, b)
            assert torch.equal(torch.cat(list(ef["server"])), efs[b][rank].server), (name, rank, b)
        assert sum(float(efs[b][rank].worker.abs().sum()) for b in range(len(buckets))) > 0
        assert res["pycomm"]["overlap"] is True


def test_scaler_run_is_the_same_and_nonfinite_steps_change_nothing(runs):
    for rank in range(WORLD):
        plain, scaled = runs[0][rank]["adam-onebit"], runs[0][rank]["scaler"]
        _assert_params_equal(scaled["params"], plain["params"], f"rank {rank} scaler")
        assert _same(scaled["state"], plain["state"])
        assert _same(scaled["pycomm"]["engine"]["residuals"], plain["pycomm"]["engine"]["residuals"])
    assert_skipped_unchanged(runs, "scaler")  # every bucket's residuals too


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_exact(runs, name):
    assert_resumed_exactly(runs, name)


def test_accumulation_under_no_sync(runs):
    params0, steps, keys = runs[0][0]["no_sync"]
    assert steps == STEPS and len(keys) >= 3 and keys == [1 + b for b in range(len(keys))]
    params1 = runs[0][1]["no_sync"][0]
    _assert_params_equal(params1, params0, "ranks after accumulating under no_sync")
    start = [p.detach() for p in Net(unused=False).parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(params0, start, strict=True))


def test_load_into_an_attached_optimizer_keeps_it_attached(runs):
    assert all(runs[1][rank]["kept"] for rank in range(WORLD))


def test_refusals(runs):
    for rank in range(WORLD):
        e = runs[0][rank]["errors"]
        assert "scaler=scaler" in e["no scaler"] and "Nothing was changed" in e["no scaler"]
        assert e["no scaler unchanged"]
        assert "bucket" in e["twice"] and "no_sync" in e["twice"]
        assert e["twice unchanged"]
        assert "scaler=" in e["scaler without overlap"]
        assert "overlap must be a bool" in e["overlap type"]
        assert "scaler must be" in e["scaler type"]
        assert "warmup_steps >= 2" in e["warmup 1"]
        assert e["keys"] == [KEY_BASE + 1 + b for b in range(e["nbuckets"])]
        for k in ("mismatch", "mismatch-later"):
            msg = runs[1][rank][k]
            assert msg is not None and "overlap=True" in msg and "reset_error_feedback=True" in msg, (k, msg)
    _assert_params_equal(runs[0][1]["errors"]["after"], runs[0][0]["errors"]["after"], "ranks after the refusals")


def test_bytes_per_step_counts_each_bucket(runs):
    from pycomm.distributed.spec import wire_bytes

    buckets = runs[0][0]["adam-onebit buckets"]
    compressed, plain = runs[0][0]["adam-onebit bytes"]
    sizes = [sum(p.numel() for i, p in enumerate(Net(unused=False).parameters()) if i in b) for b in buckets]
    settings = {k: v for k, v in SETTINGS.items() if k in ("chunk_numel", "block_size")}
    want = sum(wire_bytes("onebit", n, WORLD, **settings) for n in sizes)
    # Adam's frozen elements (zero variance) are not sent: at most this many.
    assert 0 < compressed <= want < plain


def test_overlap_needs_ddp_arguments():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        OneBitAdam(Net().parameters()).attach(Net(), overlap=True)
