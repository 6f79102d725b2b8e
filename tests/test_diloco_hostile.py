"""DiLoCo used as a hostile user would: ranks resumed from different steps,
replicas that start apart, settings or dtypes that differ across ranks, a
parameter set that changes, an inner optimizer over a copy, a DDP model,
another rank's state loaded before the group is up, a refused load, a sync
in flight whose all-reduce failed, a plain subgroup of the world. Every case
raises on every rank at once naming the problem (both values where there
are two), before anything changes, or gives the right result; nothing hangs.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from _dist import refusal, run_ranks

from pycomm.optim import DiLoCo

IN = 8


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _step(model, opt, rank, t):
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(16, IN, generator=g).to(next(model.parameters()).dtype)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) / 4).backward()
    opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _build(model, **kw):
    return DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), **{"sync_every": 4, **kw})


def _two_ranks(rank, world, directory):
    out = {}
    # Ranks resumed from checkpoints of different steps: refused at the first
    # step, naming both step counts, before any inner step.
    model = _model()
    opt = _build(model, fragments=2)
    for t in range(8):
        _step(model, opt, rank, t)
        if t + 1 == 6 + 2 * rank:  # an asynchronous writer finished a different step on each rank
            saved = {"model": copy.deepcopy(model.state_dict()), "opt": opt.state_dict()}
    opt = _build(model, fragments=2)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    before = _flat(model)
    out["steps"] = refusal(lambda: _step(model, opt, rank, 8))
    out["steps unchanged"] = torch.equal(before, _flat(model)) and opt.step_count == 6 + 2 * rank

    # Replicas that start apart (seeded with seed + rank): refused at once.
    model = _model(seed=rank)
    opt = _build(model)
    out["apart"] = refusal(lambda: _step(model, opt, rank, 0))

    # Parameter dtypes that differ across ranks.
    model = _model().to(torch.float64 if rank else torch.float32)
    opt = _build(model)
    out["dtypes"] = refusal(lambda: _step(model, opt, rank, 0))

    # Settings that differ, with a logging all-reduce after every step (which
    # would meet the settings exchange of a later sync and hang): refused at
    # the first step, on every rank.
    model = _model()
    opt = _build(model, sync_every=2 if rank == 0 else 4)

    def logged():
        for t in range(4):
            _step(model, opt, rank, t)
            dist.all_reduce(torch.ones(1))

    out["settings"] = refusal(logged)

    # One rank passes a pycomm group (made by both), the other none: refused
    # at the first step naming both groups, not at the group timeout.
    pg = dist.new_group(backend="pycomm")
    model = _model()
    opt = _build(model, process_group=pg if rank == 0 else None)
    out["group"] = refusal(logged)

    # Settings equal but written differently run alike.
    model = _model()
    opt = _build(model, compressor="topk", density=1 if rank == 0 else 1.0)
    for t in range(4):
        _step(model, opt, rank, t)
    out["density 1 and 1.0"] = _flat(model)

    # A parameter unfrozen after DiLoCo was built: refused before the next
    # sync step changes anything.
    model = _model()
    model[2].bias.requires_grad_(False)
    opt = _build(model)
    for t in range(3):
        _step(model, opt, rank, t)
    model[2].bias.requires_grad_(True)
    before = _flat(model)
    out["unfrozen"] = refusal(lambda: _step(model, opt, rank, 3))
    out["unfrozen unchanged"] = torch.equal(before, _flat(model)) and opt.step_count == 3

    # Another rank's state: refused at load (the group is up), and in a
    # process that loads it before the group is up, at the first step
    # (test_another_ranks_state_loaded_before_the_group_is_up).
    model = _model()
    opt = _build(model, compressor="int8", error_feedback=True)
    for t in range(4):
        _step(model, opt, rank, t)
    torch.save(opt.state_dict(), os.path.join(directory, f"opt{rank}.pt"))
    dist.barrier()
    other = torch.load(os.path.join(directory, f"opt{1 - rank}.pt"), weights_only=False)
    out["other rank at load"] = refusal(lambda: opt.load_state_dict(other))

    # A state of another chunk_numel: refused at load, before anything changes.
    model = _model()
    opt = _build(model, compressor="int8", error_feedback=True, chunk_numel=64)
    for t in range(4):
        _step(model, opt, rank, t)
    donor_model = _model()
    donor = _build(donor_model, compressor="int8", error_feedback=True, chunk_numel=128)
    for t in range(4):
        _step(donor_model, donor, rank, t)
    state = opt.state_dict()
    out["chunk"] = refusal(lambda: opt.load_state_dict(donor.state_dict()))
    after = opt.state_dict()
    out["chunk unchanged"] = (after["pycomm"]["step_count"] == state["pycomm"]["step_count"]
                              and all(torch.equal(a, b) for a, b in zip(after["anchor"], state["anchor"])))
    # A DiLoCo that goes releases the pycomm group it made (its threads,
    # sockets and residuals): rebuilding one per phase does not grow.
    import gc

    def settled_fds():
        # Sockets close as their threads end: wait until the count holds.
        last = -1
        for _ in range(50):
            gc.collect()
            n = len(os.listdir("/proc/self/fd"))
            if n == last:
                return n
            last = n
            time.sleep(0.05)
        return last

    fds = []
    for i in range(6):
        model = _model()
        opt = _build(model, sync_every=1, compressor="int8", error_feedback=True)
        _step(model, opt, rank, 0)
        del model, opt
        fds.append(settled_fds())
    out["fds"] = fds
    # Outer settings of another run: refused, naming the setting.
    model = _model()
    opt = _build(model, outer_lr=0.3, outer_momentum=0.0)
    out["outer"] = refusal(lambda: opt.load_state_dict(_build(_model()).state_dict()))
    return out


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("diloco"))


@pytest.fixture(scope="module")
def two_ranks(directory):
    return run_ranks(_two_ranks, 2, directory, timeout=120)


def test_ranks_resumed_from_different_steps_are_refused(two_ranks):
    for r in two_ranks:
        assert "the ranks disagree on step_count (rank 0: 6, rank 1: 8)" in r["steps"], r["steps"]
        assert r["steps unchanged"]


def test_replicas_that_start_apart_are_refused(two_ranks):
    for r in two_ranks:
        assert "anchor checksum" in r["apart"], r["apart"]


def test_parameter_dtypes_that_differ_are_refused(two_ranks):
    for r in two_ranks:
        assert "parameter dtypes (rank 0: ['torch.float32'], rank 1: ['torch.float64'])" in r["dtypes"], r["dtypes"]


def test_settings_that_differ_are_refused_at_the_first_step_not_a_later_sync(two_ranks):
    for r in two_ranks:
        assert "the ranks disagree on sync_every (rank 0: 2, rank 1: 4)" in r["settings"], r["settings"]


def test_one_rank_passing_a_group_and_another_none_is_refused_at_the_first_step(two_ranks):
    for r in two_ranks:
        assert "different process groups" in r["group"], r["group"]
        assert "ranks [0, 1] (pycomm)" in r["group"] and "ranks [0, 1] (gloo)" in r["group"], r["group"]


def test_equal_settings_written_differently_run_alike(two_ranks):
    assert torch.equal(two_ranks[0]["density 1 and 1.0"], two_ranks[1]["density 1 and 1.0"])


def test_a_parameter_unfrozen_later_is_refused_before_the_sync(two_ranks):
    for r in two_ranks:
        assert "frozen or unfrozen after DiLoCo was built" in r["unfrozen"], r["unfrozen"]
        assert r["unfrozen unchanged"]


def test_another_ranks_state_is_refused_at_load(two_ranks):
    for rank, r in enumerate(two_ranks):
        assert f"rank {1 - rank} of 2's residuals, this is rank {rank} of 2" in r["other rank at load"]


def _before_init(rank, world, directory):
    model = _model()
    opt = _build(model, compressor="int8", error_feedback=True)
    # torch.distributed is not up: the rank is checked when the group is made.
    opt.load_state_dict(torch.load(os.path.join(directory, f"opt{1 - rank}.pt"), weights_only=False))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    before = _flat(model)
    refusals = [refusal(lambda: _step(model, opt, rank, 4)) for _ in range(2)]
    return refusals, torch.equal(before, _flat(model)) and opt.step_count == 4


def test_another_ranks_state_loaded_before_the_group_is_up(two_ranks, directory):
    # The first step refuses before its inner step, and a retry refuses again.
    for rank, (refusals, unchanged) in enumerate(run_ranks(_before_init, 2, directory, timeout=120,
                                                           init_process_group=False)):
        assert all(m is not None and f"rank {1 - rank} of 2's residuals" in m for m in refusals), refusals
        assert unchanged


def test_a_state_of_another_chunk_is_refused_whole(two_ranks):
    for r in two_ranks:
        assert "['chunk_numel'] is 128, this DiLoCo runs chunk_numel=64" in r["chunk"], r["chunk"]
        assert r["chunk unchanged"]


def test_a_diloco_that_goes_releases_its_group(two_ranks):
    # Without the release each instance kept about 5 descriptors (and 4 threads).
    for r in two_ranks:
        assert r["fds"][-1] - r["fds"][1] <= 2, r["fds"]


def test_a_state_of_other_outer_settings_is_refused(two_ranks):
    for r in two_ranks:
        # every setting that differs, each with both values
        assert "saved with outer_lr=0.7, this DiLoCo has outer_lr=0.3" in r["outer"], r["outer"]
        assert "saved with outer_momentum=0.9, this DiLoCo has outer_momentum=0.0" in r["outer"], r["outer"]


# ------------------------------------------------------------ subgroups ----
def _subgroups(rank, world):
    import pycomm.distributed as pd

    pairs = [[0, 2], [1, 3]]
    plain = [dist.new_group(p) for p in pairs]  # every rank makes every group, in one order
    mine = plain[rank % 2]
    model = _model()
    opt = _build(model, process_group=mine)
    out = {"plain": refusal(lambda: _step(model, opt, rank, 0))}
    # The way the refusal names: pycomm groups made up front by every rank.
    groups = [dist.new_group(p, backend="pycomm", pg_options=pd.PycommOptions(compressor="none")) for p in pairs]
    model = _model()
    opt = _build(model, sync_every=2, process_group=groups[rank % 2])
    for t in range(4):
        _step(model, opt, rank, t + 100 * (rank % 2))  # the pairs see different data
    out["params"] = _flat(model)
    return out


def test_a_plain_subgroup_is_refused_and_pycomm_subgroups_average_within_their_pair():
    res = run_ranks(_subgroups, 4, timeout=120)
    for r in res:
        assert "subgroup (2 of the world's 4 ranks)" in r["plain"] and "backend='pycomm'" in r["plain"], r["plain"]
    assert torch.equal(res[0]["params"], res[2]["params"]) and torch.equal(res[1]["params"], res[3]["params"])
    assert not torch.equal(res[0]["params"], res[1]["params"])


# ------------------------------------------ one setting apart at a time ----
#: (setting, rank 0's value, rank 1's value, what the refusal names).
APART = [("fragments", 2, 1, "fragments (rank 0: 2, rank 1: 1)"),
         ("outer_lr", 0.7, 0.5, "outer_lr (rank 0: 0.7, rank 1: 0.5)"),
         ("outer_momentum", 0.9, 0.5, "outer_momentum (rank 0: 0.9, rank 1: 0.5)"),
         ("nesterov", True, False, "nesterov (rank 0: True, rank 1: False)"),
         ("key_base", 1 << 41, (1 << 41) + 64, f"key_base={1 << 41}"),
         ("error_feedback", True, False, "error_feedback (rank 0: True, rank 1: False)"),
         ("block_size", 256, 128, "block_size', 256]], rank 1: [['block_size', 128]]")]


def _apart(rank, world):
    """Each setting apart in turn, in one process pair (a refusal must leave
    the pair able to meet again): every rank raises at the first step."""
    out = {}
    for name, mine, theirs, _ in APART:
        model = _model()
        opt = _build(model, sync_every=4, compressor="int8", **{name: mine if rank == 0 else theirs})
        out[name] = refusal(lambda: [_step(model, opt, rank, t) for t in range(4)])
        out[name + " unchanged"] = opt.step_count == 0
    return out


def test_a_setting_apart_is_refused_on_every_rank_at_once():
    # A rank left waiting would hit the store's timeout (a RuntimeError, not
    # the refusal) or the run's, and fail the run.
    for r in run_ranks(_apart, 2, timeout=90):
        for name, _, _, named in APART:
            assert r[name] is not None and named in r[name], (name, r[name])
            assert r[name + " unchanged"], name
    # both values named where the two ranks' keys would never meet
    assert f"key_base={(1 << 41) + 64}" in r["key_base"]


# ------------------------------------------------------- one process ----
def test_construction_refuses_what_diloco_cannot_sync():
    model = _model()
    with pytest.raises(ValueError, match="trains 4 parameter.*not the model's"):
        DiLoCo(model, torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1))
    # Zero-element parameters hold nothing to sync: no empty fragment.
    params = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(256)),
              torch.nn.Parameter(torch.zeros(16))]
    opt = DiLoCo(params, torch.optim.SGD(params, lr=0.1), sync_every=2, fragments=2)
    assert opt.fragment_sizes() == [256, 16]


def _with(state, path, value):
    """A deep copy of ``state`` with the entry at ``path`` set to
    ``value`` (removed when ``value`` is ``_GONE``)."""
    state = copy.deepcopy(state)
    *up, last = path
    d = state
    for k in up:
        d = d[k]
    if value is _GONE:
        del d[last]
    else:
        d[last] = value
    return state


_GONE = object()
_N0 = 161  # fragment 0 of _model() with fragments=1: every parameter
_PENDING = {"fragment": 0, "apply_at": 9, "average": torch.zeros(_N0), "local": torch.zeros(_N0)}


@pytest.mark.parametrize("path, value, match", [
    (("anchor",), _GONE, r"state_dict must hold the fields .*missing \['anchor'\]"),
    (("anchor",), [torch.zeros(3)], r"anchor tensors are not this DiLoCo's parameters"),
    (("anchor", 0), torch.full((16, 8), float("nan")), r"state_dict\['anchor'\]\[0\] holds a non-finite value"),
    (("pycomm", "settings"), 3, r"state_dict\['pycomm'\]\['settings'\] must be a dict, got int"),
    (("pycomm", "step_count"), -1, r"\['step_count'\] must be a non-negative int, got -1"),
    (("pycomm", "syncs"), "2", r"\['syncs'\] must be a non-negative int, got '2'"),
    (("pycomm", "pending"), {"fragment": 0}, r"\['pending'\] must hold the fields .*missing"),
    (("pycomm", "pending"), dict(_PENDING, fragment=1), r"\['pending'\]\['fragment'\] must be an int in \[0, 1\), got 1"),
    (("pycomm", "pending"), dict(_PENDING, average=torch.zeros(7)), r"\['average'\] must be fragment 0's 161 finite"),
    (("pycomm", "pending"), dict(_PENDING, local=None), r"\['local'\] must be fragment 0's 161 finite floats, got NoneType"),
    (("pycomm", "pending"), dict(_PENDING, average=torch.full((_N0,), float("inf"))), r"\['average'\] must be"),
])
def test_a_malformed_state_is_refused_whole_naming_the_field(path, value, match):
    model = _model()
    opt = _build(model, delay=1)
    good = _with(opt.state_dict(), ("pycomm", "pending"), _PENDING)
    opt.load_state_dict(good)  # the well-formed state loads, its sync in flight too
    assert opt._pending == {"fragment": 0, "apply_at": 9} and opt.step_count == 0
    opt._pending, opt.step_count = None, 5
    before = ([a.clone() for a in opt.anchor], copy.deepcopy(opt.inner.state_dict()))
    with pytest.raises((TypeError, ValueError), match=match):
        opt.load_state_dict(_with(good, path, value))
    # Refused before anything changed.
    assert opt.step_count == 5 and opt._pending is None
    assert all(torch.equal(a, b) for a, b in zip(before[0], opt.anchor))
    assert opt.inner.state_dict() == before[1]


def test_a_reset_that_is_not_a_bool_is_refused_before_anything_changes():
    opt = _build(_model())
    state = opt.state_dict()
    opt.step_count = 5
    with pytest.raises(TypeError, match="reset_error_feedback must be a bool, got 'yes'"):
        opt.load_state_dict(state, reset_error_feedback="yes")
    assert opt.step_count == 5


class _FailedWork:
    def wait(self):
        raise RuntimeError("connection closed by peer")


def test_a_failed_sync_in_flight_is_never_applied_or_saved():
    model = _model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, delay=1)
    opt._pending = {"fragment": 0, "apply_at": 1, "work": _FailedWork()}
    anchor = [a.clone() for a in opt.anchor]
    with pytest.raises(RuntimeError, match="connection closed"):
        opt.finish()
    assert opt._pending is None and opt.syncs == 0
    assert all(torch.equal(a, b) for a, b in zip(anchor, opt.anchor))
    opt.finish(sync_all=False)  # nothing left to apply
    assert opt.syncs == 0


# ---------------------------------------------------- one final model ----
def _final(rank, world):
    out = {}
    for name, kw, steps in (("H", {}, 7), ("streamed", {"fragments": 2, "delay": 1}, 9),
                            ("int8-ef", {"compressor": "int8", "error_feedback": True, "fragments": 2}, 5)):
        model = _model()
        opt = _build(model, **kw)
        for t in range(steps):
            _step(model, opt, rank, t)
        opt.finish()
        out[name] = (_flat(model), torch.cat([a.reshape(-1) for a in opt.anchor]))
    return out


def test_finish_leaves_one_model_on_every_rank_after_any_step_count():
    res = run_ranks(_final, 2, timeout=60)
    for name in res[0]:
        params0, anchor0 = res[0][name]
        params1, _ = res[1][name]
        assert torch.equal(params0, params1), name  # the same model everywhere
        assert torch.equal(params0, anchor0), name  # the new anchor
