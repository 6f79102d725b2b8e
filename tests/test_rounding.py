"""Stochastic rounding in the engine (``rounding="stochastic"``, int8/int4).

* The engine's all-reduce, reduce-scatter and all-gather, keyed and
  keyless, equal the simulation with the same seeds bit for bit
  (``spec.rounding_seed``: group seed, key or keyless stream, the call's
  count, collective, rank, chunk, part), over several calls and a
  non-finite one, which keeps the residuals and the count as they were.
* A key's count is saved with its residuals: a new group that loads them
  continues bit for bit; the same seed repeats a run, another seed does not.
* It is unbiased where rounding to nearest is not: averaged over calls, the
  stochastic all-reduce converges to the exact mean.
* Bad settings raise naming the argument; ranks with different seeds raise
  on every rank, naming the field.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from pycomm.distributed import PycommOptions
from pycomm.distributed.simulate import (
    ErrorFeedback,
    simulate_all_gather,
    simulate_allreduce,
    simulate_hierarchical_allreduce,
    simulate_reduce_scatter,
)

N, CHUNK, BLOCK, SEED = 1200, 512, 64, 7  # 3 chunks; N divisible by 2, 3 and 4


def _x(rank, step, n=N):
    x = torch.randn(n, generator=torch.Generator().manual_seed(97 * rank + step))
    if step == 2:
        x[5] = float("inf")  # a non-finite call: residuals and count kept
    return x


def _settings(method):
    return dict(compressor=method, min_compress_numel=1, chunk_numel=CHUNK, block_size=BLOCK,
                rounding="stochastic", seed=SEED)


def _rank_calls(rank, world, method):
    """Every collective, keyed and keyless, in an order that interleaves the
    keyless stream; then the saved state continues on a new group."""
    import pycomm.distributed as pd

    pg = pd.wrap(**_settings(method))
    S = N // world
    out = []
    for step in range(4):
        x = _x(rank, step)
        pd.all_reduce(x, key=1, group=pg, op="avg")
        out.append(x)
        y = _x(rank, 10 + step)
        pd.all_reduce(y, group=pg)                                   # keyless
        out.append(y)
        rs = torch.empty(S)
        pd.reduce_scatter(rs, _x(rank, 20 + step), key=2, group=pg, op="avg")
        out.append(rs)
        ag = torch.empty(S * world)
        pd.all_gather(ag, _x(rank, 30 + step)[:S], key=3 if step % 2 else None, group=pg)  # keyed, keyless
        out.append(ag)
        if step == 1:
            saved = pd.error_feedback_state(pg)
    state = pd.error_feedback_state(pg)
    # A new group (keyless count 0 again) loads the state of step 1 and
    # repeats step 2's and 3's keyed all-reduces.
    pg2 = pd.wrap(**_settings(method))
    pd.load_error_feedback_state(saved, pg2)
    resumed = []
    for step in (2, 3):
        x = _x(rank, step)
        pd.all_reduce(x, key=1, group=pg2, op="avg")
        resumed.append(x)
    # Another seed draws other numbers; round to nearest is not this.
    other = []
    for settings in (dict(_settings(method), seed=SEED + 1), dict(_settings(method), rounding="nearest", seed=0)):
        g = pd.wrap(**settings)
        x = _x(rank, 0)
        pd.all_reduce(x, key=1, group=g, op="avg")
        other.append(x)
    opts = pd.options_of(pg)
    return out, {k: (v["calls"], v["worker"], v["server"]) for k, v in state.items()}, resumed, other, \
        (opts["rounding"], opts["seed"])


def _simulated(world, method):
    kw = dict(chunk_numel=CHUNK, block_size=BLOCK, rounding="stochastic", seed=SEED)
    efs = {k: [ErrorFeedback() for _ in range(world)] for k in (1, 2, 3)}
    S, keyless, out = N // world, 0, []
    for step in range(4):
        out.append(simulate_allreduce([_x(r, step) for r in range(world)], method, "avg", efs=efs[1], key=1, **kw))
        out.append(simulate_allreduce([_x(r, 10 + step) for r in range(world)], method, "sum", call=keyless, **kw))
        keyless += 1
        out.append(simulate_reduce_scatter([_x(r, 20 + step) for r in range(world)], method, "avg", efs=efs[2],
                                           key=2, **kw))
        ins = [_x(r, 30 + step)[:S] for r in range(world)]
        if step % 2:
            out.append(simulate_all_gather(ins, method, efs=efs[3], key=3, **kw))
        else:
            out.append(simulate_all_gather(ins, method, call=keyless, **kw))
            keyless += 1
    return out, efs


@pytest.mark.parametrize("method,world", [("int4", 3), ("int8", 2)])
def test_engine_matches_simulation(method, world):
    results = run_ranks(_rank_calls, world, method)
    want, efs = _simulated(world, method)
    for rank, (out, state, resumed, other, opts) in enumerate(results):
        assert opts == ("stochastic", SEED)
        assert len(out) == len(want)
        for i, (got, w) in enumerate(zip(out, want, strict=True)):
            w = w[rank]
            assert torch.equal(got, w) or (torch.isnan(got) == torch.isnan(w)).all() and torch.equal(
                got.nan_to_num(), w.nan_to_num()), f"call {i} of rank {rank}"
        # Every call that kept its residuals counts: not the non-finite one.
        for key in (1, 2, 3):
            calls, worker, server = state[key]
            ef = efs[key][rank]
            assert calls == ef.calls == {1: 3, 2: 4, 3: 2}[key]
            assert torch.equal(worker, ef.worker)
            sim_server = [ef.server_segment(i) for i in range(len(server))] if server else []
            assert all(torch.equal(a, b) for a, b in zip(server, sim_server, strict=True))
        # Resumed from step 1's state: steps 2 and 3 as the first run had them.
        assert torch.equal(resumed[0].nan_to_num(), out[8].nan_to_num())
        assert torch.equal(resumed[1], out[12])
        # Another seed, or rounding to nearest, gives other results for step 0.
        assert not torch.equal(other[0], out[0]) and not torch.equal(other[1], out[0])


def _rank_hierarchical(rank, world):
    import pycomm.distributed as pd

    pg = pd.wrap(hierarchy=2, **_settings("int4"))
    outs = []
    for step in range(2):
        x = _x(rank, 40 + step)
        pd.all_reduce(x, key=5, group=pg, op="avg")
        y = _x(rank, 50 + step)
        pd.all_reduce(y, group=pg)
        outs += [x, y]
    return outs


def test_hierarchical_matches_simulation():
    results = run_ranks(_rank_hierarchical, 4)
    kw = dict(chunk_numel=CHUNK, block_size=BLOCK, rounding="stochastic", seed=SEED)
    efs = [ErrorFeedback() for _ in range(4)]
    want = []
    for step in range(2):
        want.append(simulate_hierarchical_allreduce([_x(r, 40 + step) for r in range(4)], "int4", 2, "avg",
                                                    efs=efs, key=5, **kw))
        want.append(simulate_hierarchical_allreduce([_x(r, 50 + step) for r in range(4)], "int4", 2, call=step,
                                                    **kw))
    for rank, outs in enumerate(results):
        for got, w in zip(outs, want, strict=True):
            assert torch.equal(got, w[rank])


def _rank_bias(rank, world, rounding):
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="int4", min_compress_numel=1, block_size=64, rounding=rounding, seed=3)
    # Per block of 64: one element at 7 (the absmax: scale 1) and the rest at
    # 0.3 + 0.01 rank: to nearest, those round to 0 on every call.
    x = torch.full((4096,), 0.3 + 0.01 * rank)
    x[::64] = 7.0
    total = torch.zeros(4096)
    calls = 200
    for _ in range(calls):
        y = x.clone()
        pd.all_reduce(y, group=pg, op="avg")
        total += y
    return total / calls


def test_stochastic_is_unbiased_where_nearest_is_not():
    exact = torch.full((4096,), 0.3 + 0.01 * 0.5)
    exact[::64] = 7.0
    stochastic = run_ranks(_rank_bias, 2, "stochastic")[0]
    nearest = run_ranks(_rank_bias, 2, "nearest")[0]
    mask = torch.ones(4096, dtype=torch.bool)
    mask[::64] = False
    err_nearest = (nearest - exact)[mask].abs().mean().item()
    err_stochastic = (stochastic - exact)[mask].abs().mean().item()
    assert err_nearest == pytest.approx(0.305, abs=1e-6)  # every small element sent as 0
    # 200 calls of two roundings (worker and server) of variance <= 1/4:
    # the mean's error is about 0.04 per element; its bias is below 0.01.
    assert err_stochastic < 0.06
    assert abs((stochastic - exact)[mask].mean().item()) < 0.01


@pytest.mark.parametrize("kwargs,words", [
    (dict(compressor="onebit", rounding="stochastic"), ["rounding='stochastic'", "onebit"]),
    (dict(compressor="topk", rounding="stochastic"), ["rounding='stochastic'", "topk"]),
    (dict(compressor="int8", rounding="up"), ["rounding must be one of"]),
    (dict(compressor="int8", rounding="stochastic", seed=-1), ["seed must be"]),
    (dict(compressor="int8", rounding="stochastic", seed=2**32), ["seed must be"]),
    (dict(compressor="int4", rounding="stochastic", seed=True), ["seed must be"]),
    (dict(compressor="int4", rounding="stochastic", seed=1.5), ["seed must be"]),
])
def test_bad_settings_name_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        PycommOptions(**kwargs)
    assert all(w in str(info.value) for w in words)


def test_auto_may_round_stochastically():
    assert PycommOptions(compressor="auto", rounding="stochastic", seed=2**32 - 1).rounding_seed == 2**32 - 1
    assert PycommOptions(compressor="int8").rounding_seed == -1


def _rank_mismatch(rank, world):
    import pycomm.distributed as pd

    pg = pd.wrap(**dict(_settings("int8"), seed=SEED + rank))
    x = torch.ones(N)
    try:
        pd.all_reduce(x, key=0, group=pg)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_with_different_seeds_raise_everywhere():
    for msg in run_ranks(_rank_mismatch, 2):
        assert msg is not None and "rounding seed" in msg and "stochastic, seed 8" in msg


def _rank_bad_calls(rank, world):
    import pycomm.distributed as pd

    pg = pd.wrap(**_settings("int8"))
    x = torch.ones(N)
    pd.all_reduce(x, key=0, group=pg)
    pd.all_reduce(x, key=0, group=pg)
    pd.undo_error_feedback([0], pg)  # the undone call does not count
    state = pd.error_feedback_state(pg)
    errors = []
    for bad in (-1, 1.5, True):
        try:
            pd.load_error_feedback_state({0: dict(state[0], calls=bad)}, pg)
        except ValueError as exc:
            errors.append("['calls']" in str(exc))
    # A state saved before keys counted their calls loads, counting from 0.
    pd.load_error_feedback_state({0: {k: v for k, v in state[0].items() if k != "calls"}}, pg)
    return errors, pd.error_feedback_state(pg)[0]["calls"], state[0]["calls"]


def test_saved_call_counts_are_checked():
    for errors, loaded, saved in run_ranks(_rank_bad_calls, 2):
        assert errors == [True, True, True]
        assert (loaded, saved) == (0, 1)


def test_engine_refuses_bad_rounding_seed():
    import torch.distributed as dist

    from pycomm import _ext

    store = dist.HashStore()
    inner = dist.ProcessGroupGloo(store, 0, 1)
    for bad in (-2, 2**32):
        with pytest.raises(RuntimeError, match="rounding seed must be"):
            _ext._C.CompressedBackend(inner, "int8", 1, CHUNK, 0, 0.01, True, 1, None, None, "{}", bad)
