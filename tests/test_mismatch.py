"""Mismatched and wrong calls: ranks that call the compressed all-reduce
differently get, on every rank, an error naming the difference (not a hang,
not garbage), from the engine and through the DDP hook over a plain group;
every public function names the bad argument and the allowed values.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _dist import pg_timeout_for, run_ranks

import pycomm
import pycomm.distributed as pd
from pycomm.ddp import CompressionState, compressed_hook

N = 1000


def _attempt(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def _rank_mismatch(rank, world):
    out = {}
    # The backend: settings differ between the ranks' groups, or the calls do.
    groups = {
        "block_size": pd.wrap(compressor="onebit", min_compress_numel=1, block_size=64 * (rank + 1)),
        "method": pd.wrap(compressor=("onebit", "topk")[rank], min_compress_numel=1),
        "density": pd.wrap(compressor="topk", min_compress_numel=1, density=(0.1, 0.2)[rank]),
    }
    same = pd.wrap(compressor="onebit", min_compress_numel=1)
    for name, pg in groups.items():
        out[("backend", name)] = _attempt(lambda: pd.all_reduce(torch.randn(N), key=3, group=pg))
    out[("backend", "numel")] = _attempt(lambda: pd.all_reduce(torch.randn(N + rank), key=4, group=same))
    out[("backend", "dtype")] = _attempt(
        lambda: pd.all_reduce(torch.randn(N).to((torch.float32, torch.float16)[rank]), group=same))
    out[("backend", "op")] = _attempt(lambda: pd.all_reduce(torch.randn(N), group=same, op=("sum", "avg")[rank]))
    out[("backend", "key")] = _attempt(lambda: pd.all_reduce(torch.randn(N), key=10 + rank, group=same))
    out[("backend", "dist.all_reduce numel")] = _attempt(lambda: dist.all_reduce(torch.randn(N + 5 * rank), group=same))

    # After all that the groups still work: every rank raised at the same point.
    x = torch.full((N,), float(rank + 1))
    pd.all_reduce(x, key=20, group=same)
    out["after"] = x

    # A difference at a call whose signature one rank has already used is
    # caught only when every call is checked (PYCOMM_DEBUG=detail).
    os.environ["PYCOMM_DEBUG"] = "detail"
    debug = pd.wrap(compressor="topk", min_compress_numel=1, density=0.1)
    os.environ.pop("PYCOMM_DEBUG")
    pd.all_reduce(torch.randn(N), group=debug)
    out[("backend", "detail")] = _attempt(lambda: pd.all_reduce(torch.randn(N), group=debug, op=("sum", "avg")[rank]))

    # The DDP hook over a plain group wraps it into an engine group of its
    # own: a rank whose hook settings differ is named there too.
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(100, 100), bucket_cap_mb=1)
    model.register_comm_hook(CompressionState(compressor="topk", density=(0.1, 0.2)[rank], start_iter=2),
                             compressed_hook)

    def train():
        for _ in range(3):
            model(torch.randn(4, 100)).sum().backward()

    out[("hook", "density")] = _attempt(train)
    return out


EXPECTED = {
    "numel": r"numel \(rank 0: 1000, rank 1: 1001\)",
    "dtype": r"dtype \(rank 0: float32, rank 1: (bfloat16|float16)\)",
    "block_size": r"block_size \(rank 0: 64, rank 1: 128\)",
    "method": r"(method|compressor) \(rank 0: onebit, rank 1: topk\)",
    "op": r"op \(rank 0: sum, rank 1: avg\)",
    "key": r"key \(rank 0: (0|10), rank 1: (1|11)\)",
    "density": r"density \(rank 0: 0.1, rank 1: 0.2\)",
    "dist.all_reduce numel": r"numel \(rank 0: 1000, rank 1: 1005\)",
    "detail": r"op \(rank 0: sum, rank 1: avg\)",
}


@pytest.fixture(scope="module")
def mismatch_results():
    return run_ranks(_rank_mismatch, 2, timeout=120)


def test_every_rank_raises_naming_the_difference(mismatch_results):
    import re

    keys = [k for k in mismatch_results[0] if k != "after"]
    assert len(keys) == 10
    for key in keys:
        for rank, results in enumerate(mismatch_results):
            msg = results[key]
            assert msg is not None, f"rank {rank}, {key}: no error"
            assert re.search(EXPECTED[key[1]], msg), (key, msg)
            # Only the field that differs is named.
            assert msg.count("(rank 0:") == 1, (key, msg)
            if key[0] == "hook":  # the hook compares its settings at its first bucket
                assert "CompressionState: the ranks disagree on" in msg, (key, msg)
            else:  # the engine's call check
                assert "different arguments" in msg, (key, msg)
                assert f"pycomm rank {rank} of 2" in msg, (key, msg)


def test_groups_work_after_a_refused_call(mismatch_results):
    for results in mismatch_results:
        assert torch.equal(results["after"], torch.full((N,), 3.0))


# --------------------------------------------------- argument checks ----
def test_options_name_the_argument_and_allowed_values():
    cases = [
        (dict(compressor="zip"), ValueError, r"compressor must be one of .*onebit"),
        (dict(inner="mpi"), ValueError, r"inner must be 'gloo', 'nccl' or None"),
        (dict(block_size=48), ValueError, r"block_size must be a multiple of 32"),
        (dict(chunk_numel=0), ValueError, r"chunk_numel must be a positive integer"),
        (dict(density=2.0), ValueError, r"density must be in \(0, 1\]"),
        (dict(approx="yes"), TypeError, r"approx must be a bool"),
        (dict(check_calls="always"), ValueError, r"check_calls must be one of .*first"),
        (dict(min_compress_numel=-1), ValueError, r"min_compress_numel must be a positive integer"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            pd.PycommOptions(**kwargs)


def test_distributed_functions_name_the_argument():
    t = torch.randn(10)
    with pytest.raises(ValueError, match=r"op must be 'sum' or 'avg', got 'max'"):
        pd.all_reduce(t, op="max")
    with pytest.raises(ValueError, match=r"key must be an int in \[0, 2\*\*63\) \(the engine.s keys are int64\) or None, got -1"):
        pd.all_reduce(t, key=-1)
    with pytest.raises(ValueError, match=r"key must be an int in \[0, 2\*\*63\) \(the engine.s keys are int64\) or None, got 'a'"):
        pd.reset_error_feedback("a")
    with pytest.raises(TypeError, match=r"tensor must be a torch.Tensor, got list"):
        pd.all_reduce([1.0])
    with pytest.raises(TypeError, match=r"async_op must be a bool"):
        pd.all_reduce(t, async_op="no")
    with pytest.raises(TypeError, match=r"group must be a torch.distributed.ProcessGroup or None, got str"):
        pd.is_pycomm_group("world")
    with pytest.raises(TypeError, match=r"device must be a str or torch.device"):
        pd.is_pycomm_group(None, device=0.5)
    with pytest.raises(TypeError, match=r"state must be the dict error_feedback_state\(\) returned"):
        pd.load_error_feedback_state([1, 2])
    with pytest.raises(ValueError, match=r"backend must be 'gloo', 'nccl' or None"):
        pd.init_process_group(backend="mpi")
    with pytest.raises(ValueError, match=r"compressor must be one of"):
        pd.init_process_group(compressor="zip", backend="gloo")
    with pytest.raises(ValueError, match=r"check_calls must be one of"):
        pd.init_process_group(check_calls="sometimes", backend="gloo")
    with pytest.raises(TypeError, match=r"wrap\(\) got unknown settings \['blocksize'\]; allowed: .*block_size"):
        pd.wrap(blocksize=64)


def test_hook_arguments_are_checked():
    with pytest.raises(ValueError, match=r"compressor must be one of \['onebit', 'topk', 'fp16', 'bf16', 'int8', 'int4', "):
        CompressionState(compressor="zip")
    with pytest.raises(TypeError, match=r"process_group must be a torch.distributed.ProcessGroup or None"):
        CompressionState(process_group="world")
    with pytest.raises(ValueError, match=r"check_calls must be one of \['off', 'first', 'every'\]"):
        CompressionState(check_calls="never")
    with pytest.raises(ValueError, match=r"start_iter must be >= 2"):
        CompressionState(start_iter=1)
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        CompressionState(density=0)
    with pytest.raises(TypeError, match=r"private_group must be a bool"):
        CompressionState(private_group=1)
    fut = compressed_hook({"compressor": "topk"}, None)
    # Raised from the future's callback, so DDP shows the type and message.
    with pytest.raises(RuntimeError, match=r"TypeError: compressed_hook needs a pycomm.ddp.CompressionState"):
        fut.wait()


def test_get_compressor_names_the_argument():
    # (other tests register compressors of their own in the same process)
    with pytest.raises(ValueError, match=r"unknown compressor 'zip'; available: (.*, )?onebit, topk"):
        pycomm.get_compressor("zip")
    with pytest.raises(TypeError, match=r"compressor 'topk'.*block_size"):
        pycomm.get_compressor("topk", block_size=64)
    with pytest.raises(TypeError, match=r"approx must be a bool"):
        pycomm.get_compressor("topk", approx=1)


# ------------------------------------------- a key's later calls change ----
def _keyed_calls(pg, world):
    """The three keyed collectives on ``pg`` by name, ``call(tensor, key)``,
    and the reduce-scatter's and all-gather's output buffers they write."""
    rs_out, ag_out = torch.empty(N // world), torch.empty(N * world)
    calls = {
        "all_reduce": lambda t, k: pd.all_reduce(t, key=k, group=pg),
        "reduce_scatter": lambda t, k: pd.reduce_scatter(rs_out[: t.numel() // world], t, key=k, group=pg),
        "all_gather": lambda t, k: pd.all_gather(ag_out[: t.numel() * world], t, key=k, group=pg),
    }
    return calls, rs_out, ag_out


def _rank_key_changes(rank, world):
    """Ranks agree on a key's first call; later, every rank but rank 0
    changes it (or refuses it). The call check compares first calls only:
    a rank that changed takes part in the call it replaces, so every rank
    raises at the same point, nothing changes, and the group goes on."""
    out = {}
    ok = torch.full((N,), float(rank + 1))
    cases = {
        # name: (group settings, collective, the call every rank made first)
        "onebit": dict(compressor="onebit"),
        "topk": dict(compressor="topk", density=0.1),
        "int8": dict(compressor="int8"),
    }
    for name, settings in cases.items():
        pg = pd.wrap(min_compress_numel=1, **settings)
        calls, rs_out, ag_out = _keyed_calls(pg, world)
        for c, (collective, call) in enumerate(calls.items()):
            key = 100 * c
            call(torch.randn(N), key)
            before = pd.error_feedback_state(group=pg)
            changed = {
                "resized": lambda: torch.randn(N - 8 * rank),
                "dtype": lambda: torch.randn(N).to(torch.bfloat16 if rank else torch.float32),
                "refused": lambda: torch.randn(N) if rank == 0 else torch.ones(N, dtype=torch.int32),
            }
            for what, make in changed.items():
                out[(name, collective, what)] = _attempt(lambda: call(make(), key))
            # Both ranks change it alike: refused on both, naming the first call.
            out[(name, collective, "both")] = _attempt(lambda: call(torch.randn(N // 2), key))
            after = pd.error_feedback_state(group=pg)
            out[(name, collective, "kept")] = all(
                torch.equal(before[key][f], after[key][f]) for f in ("worker",)
            ) and all(torch.equal(a, b) for a, b in zip(before[key]["server"], after[key]["server"]))
            # The group is still in step, and the key still runs its first call.
            call(torch.randn(N), key)
            # Reset on every rank: the key is free for another size.
            pd.reset_error_feedback(key, group=pg)
            call(torch.randn(N // 2), key)
        x = ok.clone()
        pd.all_reduce(x, key=999, group=pg)
        out[(name, "after")] = x
    return out


@pytest.fixture(scope="module", params=[2, 4])
def key_change_results(request):
    return run_ranks(_rank_key_changes, request.param, timeout=240)


def test_a_key_changed_on_one_rank_raises_on_every_rank(key_change_results):
    import re

    changed = [k for k in key_change_results[0] if len(k) == 3 and k[2] not in ("kept", "both")]
    assert len(changed) == 3 * 3 * 3
    for name, collective, what in changed:
        for rank, results in enumerate(key_change_results):
            msg = results[(name, collective, what)]
            assert msg is not None, f"rank {rank}, {name} {collective} {what}: no error"
            assert f"pycomm rank {rank} of {len(key_change_results)}" in msg, msg
            if rank == 0:  # ran the key's call: its peers' payloads are not that call's
                assert "a rank refused its call" in msg, msg
                continue
            key = 100 * ("all_reduce", "reduce_scatter", "all_gather").index(collective)
            if what == "resized" or (what, collective) == ("dtype", "all_reduce"):
                # A call it could run: the first call and this one, named.
                assert re.search(rf"error-feedback key {key} was first used for an? {collective} of 1000 "
                                 rf"float32 elements .* this call is .* of ({N - 8 * rank} float32|1000 bfloat16)", msg), msg
                assert f"reset_error_feedback({key})" in msg, msg
            else:  # a call it refuses (an int tensor; input and output dtypes differ)
                assert re.search(r"needs (a )?float32|input is BFloat16|output is Float", msg), msg
                assert f"every rank raises (the call of key {key} was stopped on each)" in msg, msg


def test_a_key_changed_on_every_rank_names_its_first_call(key_change_results):
    for rank, results in enumerate(key_change_results):
        for key, msg in results.items():
            if len(key) == 3 and key[2] == "both":
                assert msg is not None and "of 1000 float32 elements" in msg and "this call is" in msg, (key, msg)


def test_a_refused_change_leaves_the_residuals_and_the_group(key_change_results):
    for results in key_change_results:
        for key, value in results.items():
            if len(key) == 3 and key[2] == "kept":
                assert value is True, key
            if len(key) == 2 and key[1] == "after":  # the same on every rank; exact for a constant
                assert torch.equal(value, key_change_results[0][key]), key
                world = len(key_change_results)
                if key[0] != "topk":  # rank r sends r + 1
                    assert torch.equal(value, torch.full((N,), world * (world + 1) / 2)), key


def _rank_tagless_key_changes(rank, world):
    """The methods whose payloads carry no call tag (the casts and the
    exact path), in every collective: a key's call changed or refused on
    one rank must still raise on every rank, where the rank's stand-in used
    to be summed (or gathered) as zeros by its peers without an error."""
    out = {}
    for method in ("fp16", "bf16", "none"):
        pg = pd.wrap(compressor=method, min_compress_numel=1)
        calls, rs_out, ag_out = _keyed_calls(pg, world)
        for c, (collective, call) in enumerate(calls.items()):
            key = 7 + c
            call(torch.ones(N), key)
            changed = {
                "resized": lambda: torch.full((N - 8 * world * rank,), 2.0),
                "refused": lambda: torch.full((N,), 2.0) if rank == 0 else torch.ones(N, dtype=torch.int32),
            }
            for what, make in changed.items():
                x = make()
                out[(method, collective, what)] = _attempt(lambda: call(x, key))
            # The group goes on: the key's own call, exact for constants.
            x = torch.full((N,), float(rank + 1))
            call(x, key)
            out[(method, collective, "after")] = (x.clone() if collective == "all_reduce" else
                                                  rs_out.clone() if collective == "reduce_scatter" else ag_out.clone())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_key_changed_on_one_rank_raises_on_every_rank_without_tags(world):
    results = run_ranks(_rank_tagless_key_changes, world, timeout=120)
    for rank, res in enumerate(results):
        for method in ("fp16", "bf16", "none"):
            for collective in ("all_reduce", "reduce_scatter", "all_gather"):
                for what in ("resized", "refused"):
                    msg = res[(method, collective, what)]
                    assert msg is not None, f"rank {rank}, {method} {collective} {what}: no error (a stand-in summed in)"
                    assert f"pycomm rank {rank} of {world}" in msg, msg
                    if rank == 0:
                        assert "a rank refused its call" in msg, msg
                after = res[(method, collective, "after")]
                if collective == "all_gather":  # rank r's input, from every rank
                    expected = torch.cat([torch.full((N,), float(r + 1)) for r in range(world)])
                else:
                    expected = torch.full_like(after, world * (world + 1) / 2)
                assert torch.equal(after, expected), (method, collective)


def _rank_old_key_against_a_first_call(rank, world):
    """One rank repeats a key it has used while another makes a key's (or
    a keyless signature's) first call of the same size. With the default
    check only the first call exchanges its descriptor, so the ranks would
    run different collectives; with every call checked
    (``check_calls="every"``, ``PYCOMM_DEBUG=detail``) every rank raises
    naming the keys, and the group goes on."""
    out = {}
    for method in ("onebit", "fp16"):
        pg = pd.wrap(compressor=method, min_compress_numel=1, check_calls="every")
        pd.all_reduce(torch.ones(N), key=5, group=pg)
        out[(method, "new key")] = _attempt(lambda: pd.all_reduce(torch.ones(N), key=5 if rank == 0 else 6, group=pg))
        out[(method, "keyless")] = _attempt(
            lambda: pd.all_reduce(torch.ones(N), key=5, group=pg) if rank == 0 else pd.all_reduce(torch.ones(N), group=pg))
        x = torch.full((N,), float(rank + 1))
        pd.all_reduce(x, key=5, group=pg)
        out[(method, "after")] = x
    return out



def _rank_old_key_against_a_first_call_by_default(rank, world, method, pairing):
    """The same pairing with the default check: rank 1 checks its call (a
    first use) where rank 0 skips the check (a key it has used). Each waits
    in another group (the check's descriptors travel in a Gloo group of
    their own), so both raise at the timeout; had rank 1's descriptor
    exchange met rank 0's payload in one group, Gloo would have aborted the
    process that received the larger message."""
    import time

    pg = pd.wrap(compressor=method, min_compress_numel=1)
    pd.all_reduce(torch.ones(N), key=5, group=pg)
    start = time.monotonic()
    if rank == 0 or pairing == "new key":
        error = _attempt(lambda: pd.all_reduce(torch.ones(N), key=5 + rank, group=pg))
    else:
        error = _attempt(lambda: pd.all_reduce(torch.ones(N), group=pg))
    waited = time.monotonic() - start
    # The group says it is broken at its next use, compressed or forwarded.
    return error, waited, _attempt(lambda: pd.all_reduce(torch.ones(N), key=5, group=pg)), \
        _attempt(lambda: dist.barrier(group=pg))


@pytest.mark.parametrize("method, pairing", [("onebit", "new key"), ("fp16", "keyless")])
def test_an_old_key_against_a_first_call_raises_on_every_rank_by_default(method, pairing):
    timeout = 10
    results = run_ranks(_rank_old_key_against_a_first_call_by_default, 2, method, pairing, timeout=timeout)
    for rank, (error, waited, after, barrier) in enumerate(results):
        assert error is not None and f"pycomm rank {rank} of 2" in error, error
        assert "Timed out" in error, error
        if rank == 1:
            assert "got no answer from every rank" in error and 'check_calls="every"' in error, error
        assert waited < pg_timeout_for(timeout) + 3, waited
        for later in (after, barrier):
            assert later is not None and "cannot run collectives any more" in later, later


def test_an_old_key_against_a_first_call_raises_on_every_rank_when_every_call_is_checked():
    results = run_ranks(_rank_old_key_against_a_first_call, 2, timeout=120)
    for rank, res in enumerate(results):
        for method in ("onebit", "fp16"):
            assert "key (rank 0: 5, rank 1: 6)" in str(res[(method, "new key")]), res[(method, "new key")]
            assert "key (rank 0: 5, rank 1: None)" in str(res[(method, "keyless")]), res[(method, "keyless")]
            assert torch.equal(res[(method, "after")], torch.full((N,), 3.0)), method
