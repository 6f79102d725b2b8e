"""pycomm.optim (OneBitAdam, OneBitSGD) on 2 Gloo ranks.

* the warm-up IS torch's AdamW / SGD on exactly averaged gradients, bit for
  bit (2 ranks: the average of two float32 gradients does not depend on how
  the all-reduce cuts the tensor, so the optimizer's one flat all-reduce and
  a per-parameter one give the same bits), with and without DDP;
* after the warm-up every rank's parameters, momenta and engine residuals
  equal a single-process replay of the algorithm (docs/optim.md) whose
  compressed all-reduce is ``pycomm.distributed.simulate.simulate_allreduce``
  with the engine's kernels, bit for bit;
* DDP with ``attach`` gives the same bits as the optimizer alone;
* elements whose gradient is always zero (or absent) stay where torch's
  optimizer leaves them;
* under GradScaler a step with an Inf on one rank changes nothing on any rank
  (state, residuals, step count) and backs the scale off on every rank;
* a run resumed from each rank's state_dict in fresh processes continues bit
  for bit (saved after the warm-up and during it);
* bad arguments raise, naming the argument.

Every configuration runs in the same two spawned jobs (spawning costs
seconds here); the tests check their results.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.distributed import spec
from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce
from pycomm.optim import KEY_BASE, OneBitAdam, OneBitSGD

WORLD = 2
WARMUP = 3
STEPS = 10
SETTINGS = dict(block_size=32, chunk_numel=256)  # several chunks, segments and blocks
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
SGD_PLAIN = dict(lr=0.05, momentum=0.9, weight_decay=0.0, nesterov=False)
SGD_NESTEROV = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
METHODS = ["onebit"] + (["int4"] if "int4" in spec.METHODS else [])

# name -> (optimizer, hyperparameters, compressor, step after which it is saved, other settings)
SIM_CONFIGS = {
    "adam-onebit": ("adam", ADAM, "onebit", 5, {}),
    "sgd-onebit": ("sgd", SGD_PLAIN, "onebit", 5, {}),
    "sgd-nesterov-onebit": ("sgd", SGD_NESTEROV, "onebit", 2, {}),  # saved during the warm-up
}
for _m in METHODS[1:]:
    SIM_CONFIGS[f"adam-{_m}"] = ("adam", ADAM, _m, None, {})
# Stochastic rounding: the key's call count is saved with the residuals.
SIM_CONFIGS["adam-int4-stochastic"] = ("adam", ADAM, "int4", 6, {"rounding": "stochastic", "seed": 4})
# Exact variance updates at steps 5 and 8 (the 3rd and 6th after the warm-up), saved in between.
SIM_CONFIGS["adam-onebit-variance"] = ("adam", ADAM, "onebit", 6, {"variance_update_every": 3})
BAD_STEPS = (1, 5)  # an extra iteration with an Inf on rank 1 before these steps (warm-up, compressed)
DDP_SAVE = 6


class Net(nn.Module):
    """Embedding rows 12..15 are never looked up, ``dead``'s gradient is
    exactly zero, ``unused`` gets none."""

    def __init__(self, unused: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 48)
        self.fc2 = nn.Linear(48, 4)
        self.dead = nn.Parameter(torch.randn(40))
        self.unused = nn.Parameter(torch.randn(3)) if unused else None

    def forward(self, tokens):
        return self.fc2(torch.relu(self.fc1(self.emb(tokens)))) + 0.0 * self.dead.sum()


def _batch(rank, step, bad=False):
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, 12, (16,), generator=g)
    y = torch.randn(16, 4, generator=g)
    if bad and rank == 1:
        y[0, 0] = float("inf")
    return tokens, y


def _groups(net):
    """Two groups (no weight decay on biases): the buffer spans groups."""
    no_decay = [net.fc1.bias, net.fc2.bias]
    decay = [p for p in net.parameters() if all(p is not q for q in no_decay)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _make(kind, hyper, method, warmup=WARMUP, **kw):
    net = kw.pop("net")
    cls = OneBitAdam if kind == "adam" else OneBitSGD
    return cls(_groups(net), **hyper, warmup_steps=warmup, compressor=method, **SETTINGS, **kw)


def _loss(model, rank, step, bad=False):
    tokens, y = _batch(rank, step, bad)
    return nn.functional.mse_loss(model(tokens), y)


def _run(rank, model, opt, start, stop, scaler=None, bad=(), record=None):
    for step in range(start, stop):
        if step in bad:
            # One extra iteration in which rank 1's loss is Inf.
            before = _snapshot(model, opt)
            exact = opt.exact_now
            scale = scaler.get_scale()
            opt.zero_grad()
            scaler.scale(_loss(model, rank, step, bad=True)).backward()
            scaler.step(opt)
            scaler.update()
            record.append({"same": _same(before, _snapshot(model, opt)), "scale": (scale, scaler.get_scale()),
                           "exact": exact})
        opt.zero_grad()
        loss = _loss(model, rank, step)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _snapshot(model, opt):
    return {"params": [p.detach().clone() for p in model.parameters()], "opt": copy.deepcopy(opt.state_dict())}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _result(net, opt):
    sd = opt.state_dict()
    return {"params": _params(net), "state": copy.deepcopy(sd["state"]), "pycomm": sd["pycomm"]}


# ------------------------------------------------------------ rank bodies ---
def _rank_warmup_exact(rank, world, out):
    """OneBit* before the end of its warm-up vs torch's optimizer on
    all-reduced gradients (each divided by W, then summed: as DDP's hook)."""
    for kind, hyper, torch_cls in (("adam", ADAM, torch.optim.AdamW), ("sgd", SGD_NESTEROV, torch.optim.SGD)):
        net = Net()
        opt = _make(kind, hyper, "onebit", warmup=100, net=net)
        _run(rank, net, opt, 0, 4)
        ref_net = Net()
        ref = torch_cls(_groups(ref_net), **hyper)
        for step in range(4):
            ref.zero_grad()
            _loss(ref_net, rank, step).backward()
            for p in ref_net.parameters():
                if p.grad is not None:
                    p.grad.div_(world)
                    dist.all_reduce(p.grad)
            ref.step()
        out[f"warmup-{kind}"] = (_params(net), _params(ref_net), opt.state_dict()["state"], ref.state_dict()["state"])
    # DDP: attach vs plain DDP + AdamW.
    net = Net(unused=False)
    model = DDP(net)
    opt = _make("adam", ADAM, "onebit", warmup=100, net=net)
    opt.attach(model)
    _run(rank, model, opt, 0, 4)
    ref_net = Net(unused=False)
    ref_model = DDP(ref_net)
    ref = torch.optim.AdamW(_groups(ref_net), **ADAM)
    _run(rank, ref_model, ref, 0, 4)
    out["warmup-ddp"] = (_params(net), _params(ref_net), opt.state_dict()["state"], ref.state_dict()["state"])


def _rank_uninterrupted(rank, world, directory):
    out = {}
    _rank_warmup_exact(rank, world, out)

    for name, (kind, hyper, method, save, extra) in SIM_CONFIGS.items():
        net = Net()
        opt = _make(kind, hyper, method, net=net, **extra)
        for step in range(STEPS):
            if step == save:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, f"{directory}/{name}_{rank}.pt")
            _run(rank, net, opt, step, step + 1)
        out[name] = _result(net, opt)
        if name == "adam-onebit":
            out["bytes"] = (opt.bytes_per_step(compressed=False), opt.bytes_per_step(compressed=True),
                            opt.bytes_per_step())
            big = OneBitAdam([nn.Parameter(torch.zeros(1 << 20))], warmup_steps=1)
            out["bytes-default"] = (big.bytes_per_step(compressed=False), big.bytes_per_step(compressed=True))

    # DDP: the optimizer alone, then attached to DDP, then attached with a
    # GradScaler and Inf iterations: all the same bits.
    net = Net(unused=False)
    opt = _make("adam", ADAM, "onebit", net=net)
    _run(rank, net, opt, 0, STEPS)
    out["alone"] = _result(net, opt)

    net = Net(unused=False)
    model = DDP(net)
    opt = _make("adam", ADAM, "onebit", net=net)
    opt.attach(model)
    _run(rank, model, opt, 0, STEPS)
    out["ddp"] = _result(net, opt)

    # Exact variance updates: through DDP (its hook averages on those steps) as alone.
    for name, use_ddp in (("alone-variance", False), ("ddp-variance", True)):
        net = Net(unused=False)
        model = DDP(net) if use_ddp else net
        opt = _make("adam", ADAM, "onebit", net=net, variance_update_every=3)
        if use_ddp:
            opt.attach(model)
        _run(rank, model, opt, 0, STEPS)
        out[name] = _result(net, opt)

    # Over a "pycomm" group: used as it is (no group of its own), same bits.
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="onebit", **SETTINGS)
    net = Net(unused=False)
    opt = _make("adam", ADAM, "onebit", net=net, process_group=pg)
    _run(rank, net, opt, 0, STEPS)
    out["pycomm-group"] = _result(net, opt)
    out["pycomm-group keys"] = sorted(pd.error_feedback_state(pg))

    # attach() refuses what it cannot serve.
    errors = {}
    net = Net(unused=False)
    opt = OneBitAdam([net.fc1.weight], warmup_steps=2)
    try:
        opt.attach(DDP(net))
    except ValueError as exc:
        errors["missing"] = str(exc)
    opt = OneBitAdam(net.parameters(), warmup_steps=2)
    model = DDP(net)
    opt.attach(model)
    try:
        opt.attach(model)
    except ValueError as exc:
        errors["twice"] = str(exc)
    out["attach errors"] = errors

    # The Inf iterations come before steps 1 (warm-up) and 5 (with
    # variance_update_every=3: an exact variance update).
    for name, use_ddp, every in (("ddp-scaler", True, 0), ("scaler", False, 0), ("ddp-scaler-variance", True, 3)):
        net = Net(unused=False)
        model = DDP(net) if use_ddp else net
        opt = _make("adam", ADAM, "onebit", net=net, variance_update_every=every)
        if use_ddp:
            opt.attach(model)
        scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
        if not use_ddp:
            # A GradScaler the optimizer was not given: refused, nothing changed.
            before = _snapshot(net, opt)
            opt.zero_grad()
            scaler.scale(_loss(net, rank, 0)).backward()
            try:
                scaler.step(opt)
                out["unknown scaler"] = None
            except ValueError as exc:
                out["unknown scaler"] = (str(exc), _same(before, _snapshot(net, opt)))
            scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
        opt.scaler = scaler
        record = []
        for step in range(STEPS):
            if name == "ddp-scaler" and step == DDP_SAVE:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
                           f"{directory}/{name}_{rank}.pt")
            _run(rank, model, opt, step, step + 1, scaler=scaler, bad=BAD_STEPS, record=record)
        out[name] = _result(net, opt)
        out[name + " record"] = record
        out[name + " scale"] = scaler.get_scale()
        out[name + " skipped"] = opt.skipped_steps
        if not use_ddp:
            # Without a GradScaler: skipped as well, with a warning.
            before = _snapshot(net, opt)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.zero_grad()
                _loss(net, rank, STEPS, bad=True).backward()
                opt.step()
            out["no-scaler"] = (_same(before, _snapshot(net, opt)), [str(w.message) for w in caught])
    return out


def _rank_resumed(rank, world, directory):
    out = {}
    for name, (kind, hyper, method, save, extra) in SIM_CONFIGS.items():
        if save is None:
            continue
        net = Net()
        opt = _make(kind, hyper, method, net=net, **extra)
        ck = torch.load(f"{directory}/{name}_{rank}.pt", weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        _run(rank, net, opt, save, STEPS)
        out[name] = _result(net, opt)

    net = Net(unused=False)
    model = DDP(net)
    opt = _make("adam", ADAM, "onebit", net=net)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    opt.scaler = scaler
    opt.attach(model)
    ck = torch.load(f"{directory}/ddp-scaler_{rank}.pt", weights_only=True)
    net.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    scaler.load_state_dict(ck["scaler"])
    _run(rank, model, opt, DDP_SAVE, STEPS, scaler=scaler)
    out["ddp-scaler"] = _result(net, opt)

    # Another rank's state is refused (its residuals are not this rank's).
    opt = _make("adam", ADAM, "onebit", net=Net())
    other = torch.load(f"{directory}/adam-onebit_{1 - rank}.pt", weights_only=True)["opt"]
    try:
        opt.load_state_dict(other)
        out["other-rank"] = None
    except ValueError as exc:
        out["other-rank"] = str(exc)
    opt.load_state_dict(other, reset_error_feedback=True)
    out["other-rank-reset"] = opt.state_dict()["pycomm"]["engine"]["residuals"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("optim"))
    full = run_ranks(_rank_uninterrupted, WORLD, directory, timeout=300)
    resumed = run_ranks(_rank_resumed, WORLD, directory, timeout=240)
    return full, resumed


# ------------------------------------------------------------- the oracle ---
def _local_grads(net, rank, step):
    net.zero_grad(set_to_none=True)
    _loss(net, rank, step).backward()
    return [p.grad.clone() if p.grad is not None else None for p in net.parameters()]


def _replay(kind, hyper, method, steps=STEPS, buckets=None, unused=True, variance_update_every=0, **rounding):
    """The algorithm of docs/optim.md in one process: torch's optimizer on
    averaged gradients for WARMUP steps, then every rank's local momentum,
    the simulated compressed all-reduce, and the update with it; every
    ``variance_update_every``-th step after the warm-up instead the momentum
    and the variance from the exactly averaged gradient (AdamW).
    ``buckets``: lists of parameter indices, one compressed all-reduce (and
    residuals) per list, in its order (``attach(model, overlap=True)``);
    None: one for all. ``rounding``: the group's ``rounding`` and ``seed``.
    Returns the residuals per rank (per bucket, per rank with
    ``buckets``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same matmul bits
    try:
        net = Net(unused=unused)
        ref = (torch.optim.AdamW if kind == "adam" else torch.optim.SGD)(_groups(net), **hyper)
        index = {id(p): i for i, p in enumerate(net.parameters())}
        calls = [None] if buckets is None else buckets
        efs = [[ErrorFeedback() for _ in range(WORLD)] for _ in calls]
        seen, frozen_at = {}, {}
        def average(p, grads):
            gs = [g[index[id(p)]] for g in grads]
            if all(g is None for g in gs):
                return None
            parts = [(g if g is not None else torch.zeros_like(p)) / WORLD for g in gs]
            out = parts[0]
            for part in parts[1:]:  # each rank divides, the all-reduce sums
                out = out + part
            return out

        for step in range(steps):
            grads = [_local_grads(net, r, step) for r in range(WORLD)]
            if step < WARMUP:
                for p in net.parameters():
                    p.grad = average(p, grads)
                    if p.grad is not None and kind == "sgd":
                        seen[id(p)] = seen.get(id(p), torch.zeros_like(p, dtype=torch.bool)) | (p.grad != 0)
                ref.step()
                continue
            if variance_update_every and (step - WARMUP + 1) % variance_update_every == 0:
                for group in ref.param_groups:
                    for p in group["params"]:
                        state = ref.state.get(p)
                        if not state:
                            continue
                        frozen_at.setdefault(id(p), float(state["step"]))
                        beta1, beta2 = group["betas"]
                        g = average(p, grads)
                        g = torch.zeros_like(p) if g is None else g.masked_fill(state["exp_avg_sq"] == 0, 0)
                        torch.lerp(state["exp_avg"], g, 1 - beta1, out=state["exp_avg"])
                        state["step"] += 1
                        decay = beta2 ** int(state["step"] - frozen_at[id(p)])
                        state["exp_avg_sq"].mul_(decay).addcmul_(g, g, value=1 - decay)
                        frozen_at[id(p)] = float(state["step"])
                        if group["weight_decay"]:
                            p.data.mul_(1 - group["lr"] * group["weight_decay"])
                        step_size = group["lr"] / (1 - beta1 ** float(state["step"]))
                        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** frozen_at[id(p)]) ** 0.5).add_(
                            group["eps"])
                        p.data.addcdiv_(state["exp_avg"], denom, value=-step_size)
                continue
            entries = []  # (group, p, active mask, per-rank local momentum)
            for group in ref.param_groups:
                for p in group["params"]:
                    state = ref.state.get(p)
                    if not state:
                        continue
                    if kind == "adam":
                        mask = state["exp_avg_sq"] != 0
                        frozen_at.setdefault(id(p), float(state["step"]))
                    else:
                        mask = seen[id(p)]
                    local = []
                    for r in range(WORLD):
                        g = grads[r][index[id(p)]]
                        g = torch.zeros_like(p) if g is None else g.masked_fill(~mask, 0)
                        if kind == "adam":
                            local.append(torch.lerp(state["exp_avg"], g, 1 - group["betas"][0]))
                        else:
                            d_p = g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g
                            local.append(torch.mul(state["momentum_buffer"], group["momentum"]).add_(d_p))
                    entries.append((group, p, mask.reshape(-1), local))
            by_index = {index[id(e[1])]: e for e in entries}
            updates = []
            for i, (call, call_efs) in enumerate(zip(calls, efs, strict=True)):
                part = entries if call is None else [by_index[i] for i in call if i in by_index]
                bufs = [torch.cat([e[3][r].reshape(-1)[e[2]] for e in part]) for r in range(WORLD)]
                key = KEY_BASE if call is None else KEY_BASE + 1 + i  # the engine's keys
                avg = simulate_allreduce(bufs, method, op="avg", chunk_numel=SETTINGS["chunk_numel"], efs=call_efs,
                                         key=key, impl="cpu", block_size=SETTINGS["block_size"], **rounding)[0]
                offset = 0
                for group, p, mask, local in part:
                    new = local[0].clone()  # frozen elements: the same on every rank
                    count = int(mask.sum())
                    new.view(-1)[mask] = avg[offset:offset + count]
                    offset += count
                    updates.append((group, p, new))
            for group, p, new in updates:
                state = ref.state[p]
                if kind == "adam":
                    beta1, beta2 = group["betas"]
                    state["exp_avg"].copy_(new)
                    state["step"] += 1
                    if group["weight_decay"]:
                        p.data.mul_(1 - group["lr"] * group["weight_decay"])
                    step_size = group["lr"] / (1 - beta1 ** float(state["step"]))
                    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** frozen_at[id(p)]) ** 0.5).add_(group["eps"])
                    p.data.addcdiv_(state["exp_avg"], denom, value=-step_size)
                else:
                    buf = state["momentum_buffer"]
                    if group["nesterov"]:
                        d_p = torch.add(new, torch.sub(new, buf), alpha=group["momentum"])
                        buf.copy_(new)
                        p.data.add_(d_p, alpha=-group["lr"])
                    else:
                        buf.copy_(new)
                        p.data.add_(buf, alpha=-group["lr"])
        return net, ref, (efs[0] if buckets is None else efs)
    finally:
        torch.set_num_threads(threads)


def _assert_params_equal(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs by up to {(a - b).abs().max().item():.3g}"


# ------------------------------------------------------------------ tests ---
@pytest.mark.parametrize("name", ["warmup-adam", "warmup-sgd", "warmup-ddp"])
def test_warmup_is_torch_bit_for_bit(runs, name):
    for rank in range(WORLD):
        got, want, got_state, want_state = runs[0][rank][name]
        _assert_params_equal(got, want, f"rank {rank} {name}")
        for i, st in want_state.items():
            for k, v in st.items():
                assert _same(got_state[i][k], v), (name, rank, i, k)


@pytest.mark.parametrize("name", list(SIM_CONFIGS))
def test_matches_the_simulation(runs, name):
    kind, hyper, method, _, extra = SIM_CONFIGS[name]
    net, ref, efs = _replay(kind, hyper, method, **extra)
    want = [p.detach() for p in net.parameters()]
    key = "exp_avg" if kind == "adam" else "momentum_buffer"
    for rank in range(WORLD):
        res = runs[0][rank][name]
        _assert_params_equal(res["params"], want, f"rank {rank} {name}")
        ref_state = ref.state_dict()["state"]
        for i, st in ref_state.items():
            assert torch.equal(res["state"][i][key], st[key]), (name, rank, i)
        assert res["pycomm"]["step_count"] == STEPS
        ef = res["pycomm"]["engine"]["residuals"][0]
        assert ef["method"] == method and ef["world_size"] == WORLD
        assert torch.equal(ef["worker"], efs[rank].worker)
        assert torch.equal(torch.cat(list(ef["server"])), efs[rank].server)
        assert efs[rank].worker.abs().sum() > 0  # the residuals hold something


@pytest.mark.parametrize("name", ["adam-onebit", "sgd-onebit"])
def test_zero_gradient_elements_stay_put(runs, name):
    """Where torch's optimizer leaves an element with a zero gradient:
    AdamW decays it (p *= 1 - lr * wd each step), SGD without weight decay
    does not move it; a parameter without a gradient is never touched."""
    kind, hyper, _, _, _ = SIM_CONFIGS[name]
    init = Net()
    dead, rows, unused = init.dead.detach().clone(), init.emb.weight.detach()[12:].clone(), init.unused.detach()
    if kind == "adam":
        for _ in range(STEPS):
            dead.mul_(1 - hyper["lr"] * hyper["weight_decay"])
            rows.mul_(1 - hyper["lr"] * hyper["weight_decay"])
    names = [n for n, _ in init.named_parameters()]
    for rank in range(WORLD):
        got = dict(zip(names, runs[0][rank][name]["params"], strict=True))
        assert torch.equal(got["dead"], dead)
        assert torch.equal(got["emb.weight"][12:], rows)
        assert not torch.equal(got["emb.weight"][:12], init.emb.weight.detach()[:12])
        assert torch.equal(got["unused"], unused)


def test_ddp_attach_is_the_optimizer_alone(runs):
    for rank in range(WORLD):
        for alone_name, names in (("alone", ("ddp", "ddp-scaler", "scaler", "pycomm-group")),
                                  ("alone-variance", ("ddp-variance", "ddp-scaler-variance"))):
            alone = runs[0][rank][alone_name]
            for name in names:
                got = runs[0][rank][name]
                _assert_params_equal(got["params"], alone["params"], f"rank {rank} {name}")
                assert _same(got["state"], alone["state"]), (rank, name)
                assert _same(got["pycomm"]["engine"]["residuals"], alone["pycomm"]["engine"]["residuals"]), (rank, name)
        # The variance moved after the warm-up (at steps 5 and 8): not the frozen one.
        frozen, updated = runs[0][rank]["alone"]["state"], runs[0][rank]["alone-variance"]["state"]
        assert all(updated[i]["variance_step"] == STEPS - 1 for i in updated)
        assert all(frozen[i]["variance_step"] == WARMUP for i in frozen)
        assert not all(torch.equal(frozen[i]["exp_avg_sq"], updated[i]["exp_avg_sq"]) for i in frozen)


def test_pycomm_group_is_used_as_it_is(runs):
    from pycomm.optim import KEY_BASE

    for rank in range(WORLD):
        assert runs[0][rank]["pycomm-group keys"] == [KEY_BASE]


def test_attach_refusals(runs):
    errors = runs[0][0]["attach errors"]
    assert "not in this OneBitAdam" in errors["missing"] and "'fc1.bias'" in errors["missing"]
    assert "already attached" in errors["twice"]
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        OneBitAdam(nn.Linear(2, 2).parameters()).attach(nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["ddp-scaler", "scaler", "ddp-scaler-variance"])
def test_nonfinite_step_changes_nothing_on_every_rank(runs, name):
    assert_skipped_unchanged(runs, name)
    assert runs[0][0][name + " scale"] == runs[0][1][name + " scale"]
    # Compressed and exact (a variance update) steps skip alike.
    exact = [r["exact"] for r in runs[0][0][name + " record"]]
    assert exact == ([True, True] if name.endswith("variance") else [True, False])


def assert_skipped_unchanged(runs, name):
    """Every Inf iteration of run ``name`` changed nothing and backed the
    GradScaler off, on every rank."""
    for rank in range(WORLD):
        record = runs[0][rank][name + " record"]
        assert len(record) == len(BAD_STEPS)
        for r in record:
            assert r["same"], (rank, name)  # params, m, v, steps, residuals: untouched
            assert r["scale"][1] == r["scale"][0] / 2  # backed off, on the rank with finite gradients too
        assert runs[0][rank][name + " skipped"] == len(BAD_STEPS)


def test_nonfinite_step_without_scaler_is_skipped_with_a_warning(runs):
    for rank in range(WORLD):
        same, messages = runs[0][rank]["no-scaler"]
        assert same
        assert any("not finite" in m and "skipped on every rank" in m for m in messages), messages


def test_a_scaler_must_be_handed_over(runs):
    for rank in range(WORLD):
        message, unchanged = runs[0][rank]["unknown scaler"]
        assert "scaler=scaler" in message and "Nothing was changed" in message and unchanged, message


@pytest.mark.parametrize("name", [n for n, c in SIM_CONFIGS.items() if c[3] is not None] + ["ddp-scaler"])
def test_resume_is_bit_exact(runs, name):
    assert_resumed_exactly(runs, name)


def assert_resumed_exactly(runs, name):
    """The resumed run's ``name`` (second job) equals the uninterrupted one's."""
    for rank in range(WORLD):
        full, resumed = runs[0][rank][name], runs[1][rank][name]
        _assert_params_equal(resumed["params"], full["params"], f"rank {rank} {name}")
        assert _same(resumed["state"], full["state"])
        assert _same(resumed["pycomm"], full["pycomm"])


def test_another_ranks_state_is_refused(runs):
    for rank in range(WORLD):
        msg = runs[1][rank]["other-rank"]
        assert msg is not None and f"rank {1 - rank} of 2" in msg and "reset_error_feedback=True" in msg
        assert runs[1][rank]["other-rank-reset"] == {}


def test_bytes_per_step(runs):
    plain, compressed, now = runs[0][0]["bytes"]
    n = sum(p.numel() for p in Net().parameters())
    assert plain == 2 * (WORLD - 1) * 4 * n // WORLD
    assert now == compressed < plain
    # Default onebit (blocks of 2048) on a large buffer: ~31x less than plain.
    plain, compressed = runs[0][0]["bytes-default"]
    assert plain / compressed > 16


# ---------------------------------------------------------- bad arguments ---
@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (OneBitAdam, dict(lr=-1.0), "lr"),
        (OneBitAdam, dict(betas=(1.0, 0.999)), r"betas\[0\]"),
        (OneBitAdam, dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (OneBitAdam, dict(betas=0.9), "betas"),
        (OneBitAdam, dict(eps=-1e-8), "eps"),
        (OneBitAdam, dict(weight_decay=-0.1), "weight_decay"),
        (OneBitAdam, dict(warmup_steps=-1), "warmup_steps"),
        (OneBitAdam, dict(warmup_steps=0), "warmup_steps"),
        (OneBitAdam, dict(compressor="nope"), "compressor"),
        (OneBitAdam, dict(block_size=33), "block_size"),
        (OneBitAdam, dict(key_base=-1), "key_base"),
        (OneBitAdam, dict(variance_update_every=-1), "variance_update_every"),
        (OneBitSGD, dict(lr=-0.1), "lr"),
        (OneBitSGD, dict(momentum=1.5), "momentum"),
        (OneBitSGD, dict(momentum=0.0, nesterov=True), "nesterov"),
        (OneBitSGD, dict(warmup_steps=-5), "warmup_steps"),
        (OneBitSGD, dict(compressor="bogus"), "compressor"),
    ],
)
def test_bad_arguments_are_named(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(nn.Linear(2, 2).parameters(), **kwargs)


def test_bad_argument_types():
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="warmup_steps"):
        OneBitAdam(params, warmup_steps=2.5)
    for bad in (2.5, True, "3"):
        with pytest.raises(TypeError, match="variance_update_every"):
            OneBitAdam(params, variance_update_every=bad)
    with pytest.raises(TypeError, match="unknown compressor settings"):
        OneBitAdam(params, bloc_size=64)
    with pytest.raises(TypeError, match="process_group"):
        OneBitSGD(params, process_group="gloo")
    with pytest.raises(ValueError, match="lr"):
        OneBitAdam([{"params": params, "lr": -1.0}])
    with pytest.raises(ValueError, match="floating-point"):
        OneBitAdam([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(RuntimeError, match="init_process_group"):
        OneBitAdam(params, warmup_steps=1).step()
