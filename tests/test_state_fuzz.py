"""Fuzzing the state loaders: randomly damaged error-feedback states
(pd.load_error_feedback_state), DDP hook states (CompressionState.
load_state_dict) and calibration files. No input may crash or hang the
process: each is loaded exactly or refused with ValueError / TypeError /
RuntimeError, a refusal changes nothing, and the group keeps working."""

from __future__ import annotations

import copy
import json
import math

import torch
from _dist import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REFUSALS = (ValueError, TypeError, RuntimeError, KeyError)

# Values a damaged field may take.
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3),
    st.sampled_from([torch.zeros(0), torch.full((3,), math.nan), torch.ones(5, dtype=torch.float64),
                     torch.ones(2, 2), torch.ones(7, dtype=torch.int32)]),
)


def _mutations():
    """(path, op, value): replace, delete or truncate one field, somewhere."""
    return st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=3),
                     st.sampled_from(["replace", "delete", "truncate", "nan"]), ODD)


def _mutate(obj, path, op, value):
    """Applies one mutation at the path (indices into the keys / items met)."""
    node = obj
    for depth, i in enumerate(path):
        if isinstance(node, dict) and node:
            k = sorted(node, key=str)[i % len(node)]
        elif isinstance(node, list) and node:
            k = i % len(node)
        else:
            return obj
        last = depth == len(path) - 1
        child = node[k]
        if last or not isinstance(child, (dict, list)):
            if op == "delete" and isinstance(node, (dict, list)):
                del node[k]
            elif op == "truncate" and isinstance(child, torch.Tensor) and child.numel():
                node[k] = child[:-1].clone()
            elif op == "truncate" and isinstance(child, list) and child:
                node[k] = child[:-1]
            elif op == "nan" and isinstance(child, torch.Tensor) and child.is_floating_point() and child.numel():
                node[k] = child.clone()
                node[k].view(-1)[0] = math.nan
            else:
                node[k] = value
            return obj
        node = child
    return obj


def _rank(rank, world, examples):
    import pycomm.distributed as pd
    from pycomm.ddp import CompressionState, compressed_hook

    pg = pd.wrap(compressor="onebit", min_compress_numel=1, chunk_numel=300, block_size=32)
    pd.all_reduce(torch.randn(700), key=1, group=pg)
    pd.all_reduce(torch.randn(64), key=2, group=pg)
    good = pd.error_feedback_state(pg)

    # A hook state with residuals: a small DDP model trained a few steps.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(20, 30))
    state = CompressionState(compressor="onebit", start_iter=2, block_size=32)
    model.register_comm_hook(state, compressed_hook)
    for _ in range(4):
        model(torch.randn(4, 20)).sum().backward()
    hook_good = state.state_dict()
    stats = {"ef": [0, 0], "hook": [0, 0]}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(muts=st.lists(_mutations(), min_size=1, max_size=3))
    def fuzz_ef(muts):
        bad = copy.deepcopy(good)
        for m in muts:
            bad = _mutate(bad, *m)
        before = pd.error_feedback_state(pg)
        try:
            pd.load_error_feedback_state(bad, group=pg)
            stats["ef"][0] += 1
        except REFUSALS:
            stats["ef"][1] += 1
            now = pd.error_feedback_state(pg)
            assert sorted(now) == sorted(before)
            for k in now:
                assert torch.equal(now[k]["worker"], before[k]["worker"])
        pd.load_error_feedback_state(good, group=pg)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(muts=st.lists(_mutations(), min_size=1, max_size=3))
    def fuzz_hook(muts):
        bad = copy.deepcopy(hook_good)
        for m in muts:
            bad = _mutate(bad, *m)
        fresh = CompressionState(compressor="onebit", start_iter=2, block_size=32)
        before = repr(fresh)
        try:
            fresh.load_state_dict(bad)
            stats["hook"][0] += 1
        except REFUSALS:
            stats["hook"][1] += 1
            assert repr(fresh) == before  # all or nothing

    fuzz_ef()
    fuzz_hook()
    # Still in step and working.
    x = torch.ones(700)
    pd.all_reduce(x, key=1, group=pg, op="avg")
    return stats, x


def test_damaged_states_are_loaded_or_refused():
    # Both ranks draw the same examples (derandomized), so their engine
    # calls stay in step; every damaged load is local.
    res = run_ranks(_rank, 2, 60, timeout=300)
    for stats, x in res:
        assert stats["ef"][1] > 10 and stats["hook"][1] > 10, stats  # refusals were exercised
        assert torch.isfinite(x).all()


CAL_ODD = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10, 2**40), st.floats(allow_nan=True), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, database=None)
@given(doc=CAL_ODD, field=st.sampled_from(["seconds", "sizes", "settings", "world_size", "version", "device", None]))
def test_calibration_files_are_loaded_or_measured_again(tmp_path_factory, doc, field):
    from pycomm.distributed.auto import CANDIDATES, SIZES, Calibration, _load

    good = Calibration(2, 1, "cpu", {"chunk_numel": 1 << 20}, list(SIZES), {m: [0.001, 0.01] for m in CANDIDATES})
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    d = good.to_dict()
    if field is None:
        d = doc
    else:
        d[field] = doc
    try:
        path.write_text(json.dumps(d))
    except (TypeError, ValueError):
        return
    loaded = _load(str(path), good.key())  # never raises: a bad file is measured again
    assert loaded is None or loaded.key() == good.key()
