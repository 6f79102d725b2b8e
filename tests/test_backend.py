"""The "pycomm" torch.distributed backend, over Gloo with 2 and 4 processes.

Every forwarded collective gives exactly what plain Gloo gives; compressed
all-reduces equal the single-process simulation of docs/allreduce.md, bit
for bit when both use the same compressor kernels, on every rank alike; DDP
runs on it unchanged; a dead or missing peer is an error, never a hang.
"""

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist import reinit_on_a_new_port, run_ranks

from pycomm.distributed.simulate import ErrorFeedback
from pycomm.distributed.simulate import simulate_allreduce
from pycomm.distributed.spec import DEFAULT_CHUNK_NUMEL_BY_INNER

TIMEOUT = 90.0


def _init(compressor="onebit", **settings):
    import pycomm.distributed as pd

    pd.init_process_group(
        compressor=compressor,
        backend="gloo",
        init_method="env://",
        timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])),
        **settings,
    )
    return pd


# ----------------------------------------------------------- forwarding ----
def _inputs(rank, shape=(7, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _collectives(rank, world, group):
    """Runs every collective on `group`; returns the outputs by name."""
    out = {}
    big = 100_000  # above min_compress_numel, so only the op/dtype keeps it exact

    def ar(name, t, op=dist.ReduceOp.SUM):
        dist.all_reduce(t, op=op, group=group)
        out[name] = t

    ar("all_reduce_small_float", _inputs(rank))
    ar("all_reduce_int64_large", _inputs(rank, (big,), torch.int64))
    ar("all_reduce_int32", _inputs(rank, (33,), torch.int32))
    ar("all_reduce_max_large", _inputs(rank, (big,)), dist.ReduceOp.MAX)
    ar("all_reduce_min_large", _inputs(rank, (big,)), dist.ReduceOp.MIN)
    ar("all_reduce_product", _inputs(rank, (64,)), dist.ReduceOp.PRODUCT)
    t = _inputs(rank, (3, 4))
    dist.broadcast(t, src=world - 1, group=group)
    out["broadcast"] = t
    outs = [torch.empty(7, 5) for _ in range(world)]
    dist.all_gather(outs, _inputs(rank), group=group)
    out["all_gather"] = torch.stack(outs)
    o = torch.empty(world * 6, dtype=torch.int64)
    dist.all_gather_into_tensor(o, _inputs(rank, (6,), torch.int64), group=group)
    out["all_gather_into_tensor"] = o
    o = torch.empty(5)
    dist.reduce_scatter_tensor(o, _inputs(rank, (world * 5,)), group=group)
    out["reduce_scatter_tensor"] = o
    o = torch.empty(world * 3)
    dist.all_to_all_single(o, _inputs(rank, (world * 3,)), group=group)
    out["all_to_all_single"] = o
    in_splits = [r + 1 for r in range(world)]
    out_splits = [rank + 1] * world
    o = torch.empty(sum(out_splits))
    dist.all_to_all_single(o, _inputs(rank, (sum(in_splits),)), out_splits, in_splits, group=group)
    out["all_to_all_single_uneven"] = o
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, list(_inputs(rank, (world, 2)).unbind(0)), group=group)
    out["all_to_all"] = torch.stack(outs)
    t = _inputs(rank, (4,))
    dist.reduce(t, dst=0, group=group)
    out["reduce"] = t if rank == 0 else torch.zeros(0)
    gl = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    dist.gather(_inputs(rank, (3,)), gl, dst=0, group=group)
    out["gather"] = torch.stack(gl) if rank == 0 else torch.zeros(0)
    o = torch.empty(3)
    dist.scatter(o, list(_inputs(rank, (world, 3)).unbind(0)) if rank == 0 else None, src=0, group=group)
    out["scatter"] = o
    ts = [_inputs(rank, (5,)), _inputs(rank, (9,), seed=1)]
    dist.all_reduce_coalesced(ts, group=group)
    out["all_reduce_coalesced"] = torch.cat(ts)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "x": [rank] * rank}, group=group)
    out["all_gather_object"] = objs
    lst = [{"from": rank}, rank * 3] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0, group=group)
    out["broadcast_object_list"] = lst
    if rank < 2:  # point to point between ranks 0 and 1
        t = _inputs(rank, (6,))
        if rank == 0:
            dist.send(t, dst=1, group=group)
        else:
            dist.recv(t, src=0, group=group)
        out["send_recv"] = t
    dist.barrier(group=group)
    return out


def _forwarding(rank, world):
    pd = _init("onebit", min_compress_numel=1000)
    assert pd.is_pycomm_group()
    plain = dist.new_group(backend="gloo")
    assert not pd.is_pycomm_group(plain)
    mine, theirs = _collectives(rank, world, None), _collectives(rank, world, plain)
    # AVG: Gloo has none, the wrapper emulates it as SUM then divide.
    a = _inputs(rank, (10,))
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    b = _inputs(rank, (10,))
    dist.all_reduce(b, group=plain)
    mine["all_reduce_avg_small"], theirs["all_reduce_avg_small"] = a, b / world
    return mine, theirs


@pytest.mark.parametrize("world", [2, 4])
def test_forwarded_collectives_match_plain_gloo(world):
    for mine, theirs in run_ranks(_forwarding, world, timeout=TIMEOUT, init_process_group=False):
        assert mine.keys() == theirs.keys()
        for name in mine:
            a, b = mine[name], theirs[name]
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{name}: pycomm differs from plain gloo"
            else:
                assert a == b, name


# ---------------------------------------------------- compressed = spec ----
def _step_inputs(step, world, n, dtype):
    return [(torch.randn(n, generator=torch.Generator().manual_seed(97 * step + r)) * (1 + r)).to(dtype) for r in range(world)]


def _compressed(rank, world, method, n, settings, op, steps, key, dtype):
    pd = _init(method, min_compress_numel=1, **settings)
    results = []
    for step in range(steps):
        x = _step_inputs(step, world, n, dtype)[rank].clone()
        pd.all_reduce(x, key=key, op=op)
        results.append(x)
    state = pd.error_feedback_state()
    return results, {k: v["worker"] for k, v in state.items()}


CASES = [
    # method, n, settings (chunk_numel and the compressor's), op
    ("onebit", 1, dict(chunk_numel=1000, block_size=64), "sum"),
    ("onebit", 5000, dict(chunk_numel=1024, block_size=64), "avg"),  # 5 chunks, small last one
    ("onebit", 70001, dict(chunk_numel=1 << 20, block_size=2048), "avg"),  # one chunk
    ("onebit", 4097, dict(chunk_numel=333 * 32, block_size=32), "sum"),
    ("topk", 33, dict(chunk_numel=1000, density=0.1, approx=False), "sum"),
    ("topk", 70001, dict(chunk_numel=20000, density=0.01, approx=True), "avg"),
    ("topk", 5000, dict(chunk_numel=1024, density=0.05, approx=False), "avg"),
    ("fp16", 5000, dict(chunk_numel=1024), "avg"),
    ("bf16", 4097, dict(), "sum"),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method,n,settings,op", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_compressed_allreduce_equals_simulation(world, method, n, settings, op):
    keyed = method in ("onebit", "topk")
    steps = 3
    results = run_ranks(
        _compressed, world, method, n, settings, op, steps, 0 if keyed else None, torch.float32,
        timeout=TIMEOUT, init_process_group=False,
    )
    chunk = settings.get("chunk_numel", 1 << 20)
    comp_kwargs = {k: v for k, v in settings.items() if k != "chunk_numel"}
    if keyed:
        comp_kwargs["impl"] = "cpu"  # the kernels the backend runs: equal bit for bit
    efs = [ErrorFeedback() for _ in range(world)] if keyed else None
    for step in range(steps):
        expected = simulate_allreduce(_step_inputs(step, world, n, torch.float32), method, op=op,
                                      chunk_numel=chunk, efs=efs, **comp_kwargs)
        for r in range(world):
            got = results[r][0][step]
            assert torch.equal(got, results[0][0][step]), "ranks disagree"
            if method in ("fp16", "bf16") and world > 2:
                # Gloo sums 16-bit values in its own order (see simulate.py).
                torch.testing.assert_close(got, expected[r], rtol=0.02, atol=0.05)
            else:
                assert torch.equal(got, expected[r]), f"step {step} rank {r} differs from the simulation"
    if keyed:
        for r in range(world):
            assert torch.equal(results[r][1][0], efs[r].worker), "worker residuals differ"


def test_reference_simulation_agrees_to_rounding():
    # The simulation with the pure-torch reference compressors agrees with the
    # backend's kernels to float32 rounding of the block scales.
    n, world = 70001, 2
    results = run_ranks(_compressed, world, "onebit", n, dict(block_size=256), "avg", 1, 0, torch.float32,
                        timeout=TIMEOUT, init_process_group=False)
    expected = simulate_allreduce(_step_inputs(0, world, n, torch.float32), "onebit", op="avg",
                                  block_size=256, efs=[ErrorFeedback() for _ in range(world)])
    torch.testing.assert_close(results[0][0][0], expected[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_inputs(dtype):
    world, n = 2, 3001
    results = run_ranks(_compressed, world, "onebit", n, dict(block_size=64), "avg", 1, None, dtype,
                        timeout=TIMEOUT, init_process_group=False)
    expected = simulate_allreduce(_step_inputs(0, world, n, dtype), "onebit", op="avg", block_size=64, impl="cpu")
    assert results[0][0][0].dtype == dtype
    assert torch.equal(results[0][0][0], expected[0]) and torch.equal(results[1][0][0], expected[0])


# ------------------------------------------------ error-feedback state ----
def _ef_state(rank, world, tmpdir):
    pd = _init("topk", min_compress_numel=1, density=0.05, approx=False)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    pd.all_reduce(x.clone(), key=7)
    saved = pd.error_feedback_state()
    assert set(saved) == {7} and saved[7]["world_size"] == world
    torch.save(saved, os.path.join(tmpdir, f"ef{rank}.pt"))
    after_one = x.clone()
    pd.all_reduce(after_one, key=7)
    # Restore and repeat: the same residual gives the same result.
    pd.load_error_feedback_state(torch.load(os.path.join(tmpdir, f"ef{rank}.pt")))
    again = x.clone()
    pd.all_reduce(again, key=7)
    assert torch.equal(after_one, again)
    errors = []
    try:  # same key, other size: refused with a message naming the key
        pd.all_reduce(torch.randn(500), key=7)
    except RuntimeError as e:
        errors.append(str(e))
    pd.reset_error_feedback(7)
    pd.all_reduce(torch.randn(500), key=7)  # after a reset the key is free
    bad = {7: dict(saved[7], world_size=world + 1)}
    try:
        pd.load_error_feedback_state(bad)
    except RuntimeError as e:
        errors.append(str(e))
    # A call without a key never touches the residuals.
    before = pd.error_feedback_state()[7]["worker"]
    pd.all_reduce(torch.randn(500))
    assert torch.equal(before, pd.error_feedback_state()[7]["worker"])
    return errors


def test_error_feedback_state_roundtrip_and_refusals(tmp_path):
    for errors in run_ranks(_ef_state, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False):
        assert len(errors) == 2
        assert "error-feedback key 7 was first used for an all_reduce of 1000 float32" in errors[0]
        assert "saved with world size 3" in errors[1]


# ------------------------------------------------------------------ DDP ----
def _ddp(rank, world, method, steps):
    _init(method, min_compress_numel=1000, chunk_numel=4096, block_size=256, density=0.05)
    torch.manual_seed(0)  # same initial model everywhere (DDP also broadcasts it)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(123))
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        loss = (ddp(x) - torch.tanh(x @ w_true)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("method", ["onebit", "topk", "fp16", "none"])
def test_ddp_trains_on_the_backend(method):
    steps = 120
    (p0, l0), (p1, l1) = run_ranks(_ddp, 2, method, steps, timeout=TIMEOUT, init_process_group=False)
    for a, b in zip(p0, p1):
        assert torch.equal(a, b), "ranks ended with different parameters"
    first, last = sum(l0[:10]) / 10, sum(l0[-10:]) / 10
    assert last < 0.6 * first, f"loss did not decrease enough: {first:.4f} -> {last:.4f}"


# --------------------------------------------------- failures, not hangs ----
_PEER = textwrap.dedent(
    """
    import os, sys, time, torch
    from datetime import timedelta
    import pycomm.distributed as pd
    rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if mode == "absent" and rank == world - 1:
        sys.exit(0)  # never joins
    pd.init_process_group(compressor="onebit", backend="gloo", init_method="env://",
                          rank=rank, world_size=world, timeout=timedelta(seconds=8),
                          min_compress_numel=1)
    x = torch.randn(100_000)
    pd.all_reduce(x, key=0)
    if rank == world - 1:
        os._exit(0)  # dies without a word
    start = time.monotonic()
    try:
        for _ in range(3):
            pd.all_reduce(x, key=0)
        print("NO ERROR", flush=True)
    except Exception as e:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {type(e).__name__}: {str(e)[:300]}", flush=True)
        sys.exit(3)
    """
)


@pytest.mark.parametrize("world,mode", [(2, "dies"), (4, "dies"), (2, "absent")])
def test_dead_or_missing_peer_raises_within_timeout(world, mode, tmp_path):
    from _dist import free_port

    script = tmp_path / "peer.py"
    script.write_text(_PEER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    # Bounded by the communicate() timeouts (a hang fails the test), not by
    # an elapsed-time assert.
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=45)[0])
    finally:
        for p in procs:
            p.kill()
    survivors = range(world - 1)
    for r in survivors:
        assert procs[r].returncode != 0, f"rank {r} did not fail:\n{outputs[r]}"
        if mode == "dies":
            assert "RAISED after" in outputs[r], outputs[r]
        else:  # init cannot complete without the missing rank
            assert "timeout" in outputs[r].lower() or "timed out" in outputs[r].lower(), outputs[r]


# ---------------------------------------------------- plain torch entry ----
def _plain_entry(rank, world):
    import pycomm.distributed as pd  # registers the "pycomm" backend

    timeout = timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"]))
    dist.init_process_group("pycomm", init_method="env://", timeout=timeout,
                            pg_options=pd.PycommOptions(compressor="topk", density=0.5, approx=False,
                                                       min_compress_numel=10))
    got = {"options": pd.options_of(), "default": None}
    x = torch.arange(20, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)  # 20 elements >= min_compress_numel: compressed, exact top 10
    got["x"] = x
    reinit_on_a_new_port(rank)
    dist.init_process_group("pycomm", init_method="env://", timeout=timeout)  # all defaults
    got["default"] = pd.options_of()
    return got


def test_torch_init_process_group_with_pycomm_options():
    for got in run_ranks(_plain_entry, 2, timeout=TIMEOUT, init_process_group=False):
        assert got["options"]["method"] == "topk" and got["options"]["density"] == 0.5
        assert got["default"]["method"] == "onebit" and got["default"]["min_compress_numel"] == 65536
        # The chunk when none is given: the inner backend's (here Gloo's).
        assert got["default"]["chunk_numel"] == DEFAULT_CHUNK_NUMEL_BY_INNER["gloo"]
        # Top half by magnitude of (x0 + x1) = 3 * arange(20), each rank keeping
        # its own top 10: entries 10..19 of both ranks, summed.
        expected = torch.zeros(20)
        expected[10:] = 3 * torch.arange(10, 20, dtype=torch.float32)
        assert torch.equal(got["x"], expected)


def _params_no_grad(rank, world, method):
    import warnings

    _init(method, min_compress_numel=1)
    p = torch.nn.Parameter(torch.full((5000,), float(rank + 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            dist.all_reduce(p, op=dist.ReduceOp.AVG)  # a Parameter that requires grad
    return p.detach(), [str(w.message) for w in caught]


@pytest.mark.parametrize("method", ["onebit", "topk", "int4"])
def test_parameters_reduce_under_no_grad(method):
    # The engine's thread runs without autograd, as the caller does.
    for p, _ in run_ranks(_params_no_grad, 2, method, init_process_group=False, timeout=60):
        assert torch.isfinite(p).all() and p.abs().mean() > 0


def _keyless_twice(rank, world):
    _init("onebit", min_compress_numel=1)
    for _ in range(2):
        dist.all_reduce(torch.ones(100))


def test_keyless_compression_warns_once(capfd):
    # Plain DDP or dist.all_reduce over a pycomm group compress without
    # error feedback: the user is told once, with what to do instead.
    run_ranks(_keyless_twice, 2, init_process_group=False, timeout=60)
    err = capfd.readouterr().err
    assert err.count("compressing an all-reduce without error feedback") == 2  # once per rank
    assert "pycomm.ddp.compressed_hook" in err


def _wrap_pycomm_default(rank, world):
    import pycomm.distributed as pd

    _init("onebit")
    pg = pd.wrap(compressor="int4", min_compress_numel=1)  # wraps the pycomm group's own inner backend
    x = torch.ones(1000)
    pd.all_reduce(x, key=1, group=pg)
    return pd.options_of(pg)["method"], x


def test_wrap_of_a_pycomm_group():
    for method, x in run_ranks(_wrap_pycomm_default, 2, init_process_group=False, timeout=60):
        assert method == "int4" and torch.equal(x, torch.full((1000,), 2.0))


def _rank_calls_on_the_callers_thread(rank, world):
    """Synchronous calls run on the caller's thread when the engine's
    worker is idle (CallerWaits): they must keep the submission order with
    async calls still queued, give the worker's results, and fall back to
    the worker under inference mode (whose tensors could not be kept as
    residuals)."""
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="int8", min_compress_numel=1)
    ref = pd.wrap(compressor="int8", min_compress_numel=1)
    out = {}
    xs = [torch.randn(4096, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(6)]
    # The same calls, all async on `ref` (the worker), mixed sync/async on `pg`.
    expected = [x.clone() for x in xs]
    works = [pd.all_reduce(t, key=i % 2, group=ref, async_op=True) for i, t in enumerate(expected)]
    for w in works:
        w.wait()
    got = [x.clone() for x in xs]
    pending = []
    for i, t in enumerate(got):
        if i % 3 == 2:
            pd.all_reduce(t, key=i % 2, group=pg)  # while the async ones may still be queued
        else:
            pending.append(pd.all_reduce(t, key=i % 2, group=pg, async_op=True))
    for w in pending:
        w.wait()
    out["same"] = all(torch.equal(a, b) for a, b in zip(got, expected))
    # Inference mode: the call runs (on the worker) and later calls outside it work.
    def inputs(i):
        return torch.randn(4096, generator=torch.Generator().manual_seed(100 * rank + i))

    with torch.inference_mode():
        y = inputs(0)
        pd.all_reduce(y, key=5, group=pg)
    z = inputs(1)
    pd.all_reduce(z, key=5, group=pg)
    pd.error_feedback_state(group=pg)[5]["worker"].add_(0)  # an ordinary tensor outside inference mode
    # A parameter that requires grad, reduced in place without autograd complaining.
    p = torch.nn.Parameter(inputs(2))
    pd.all_reduce(p, key=5, group=pg)
    ref_out = [inputs(i) for i in range(3)]
    for t in ref_out:
        pd.all_reduce(t, key=5, group=ref, async_op=True).wait()
    out["inference_and_param"] = all(torch.equal(a, b) for a, b in zip((y, z, p.detach()), ref_out))
    return out


def test_calls_on_the_callers_thread_keep_order_and_results():
    results = run_ranks(_rank_calls_on_the_callers_thread, 2, timeout=120)
    for res in results:
        assert res["same"] and res["inference_and_param"], res


def _rank_kept_nbytes(rank, world):
    import pycomm.distributed as pd

    n = (1 << 21) + 5
    seen = {}
    for method in ("fp16", "none"):
        pg = pd.wrap(compressor=method, min_compress_numel=1)
        pd.all_reduce(torch.ones(1 << 20), group=pg, op="avg")  # not above 2^20: nothing kept
        seen[(method, "small")] = pd.kept_nbytes(pg)
        pd.all_reduce(torch.ones(n), group=pg)  # a sum: the send buffer only
        seen[(method, "sum")] = pd.kept_nbytes(pg)
        pd.all_reduce(torch.ones(n // 2), group=pg, op="avg")  # smaller: the buffer is reused
        seen[(method, "avg")] = pd.kept_nbytes(pg)
    return seen


def test_kept_nbytes_is_the_send_buffer_and_scratch():
    n = (1 << 21) + 5
    for seen in run_ranks(_rank_kept_nbytes, 2, timeout=120):
        assert seen[("fp16", "small")] == 0 and seen[("none", "small")] == 0, seen
        assert seen[("fp16", "sum")] == 2 * (n + 1), seen
        assert seen[("fp16", "avg")] == 2 * (n + 1) + 4 * (1 << 20), seen  # a 16-bit average divides in a scratch
        assert seen[("none", "sum")] == seen[("none", "avg")] == 4 * (n + 1), seen  # exact divides after
