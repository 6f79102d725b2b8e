"""Fuzzing with hypothesis: every compressor implementation that runs on CPU
against the reference, and the engine's compressed all-reduce against the
simulation (an empty tensor refused on every rank), over sizes (0, 1, odd, not a multiple of the block),
dtypes, and values (subnormals, magnitudes near the dtype's maximum, all
equal, zeros, mixed signs, NaN/Inf), block sizes and densities.

Deterministic and bounded: derandomized, no example database, a fixed
number of examples, no deadline.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_onebit import assert_payloads_equal

import pycomm
from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce

# Triton's interpreter computes in numpy, which warns where the kernels mean
# to produce Inf or NaN (as the reference does).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

# A longer hunt, outside CI: PYCOMM_FUZZ_EXAMPLES=500 python -m pytest tests/test_fuzz.py
EXAMPLES = int(os.environ.get("PYCOMM_FUZZ_EXAMPLES", 0))
FUZZ = settings(max_examples=EXAMPLES or 60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("normal", "subnormal", "huge", "equal", "zeros", "mixed", "nonfinite")


def _finfo(dtype):
    return torch.finfo(dtype)


@st.composite
def tensors(draw, max_numel=3000, allow_empty=False):
    """A 1-D tensor of a drawn dtype and kind: a drawn pattern of up to 64
    values, tiled to a drawn length."""
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    special = [1, 2, 31, 33, 63, 65, 2047, 2049] + ([0] if allow_empty else [])
    n = draw(st.one_of(st.sampled_from(special), st.integers(1, max_numel)))
    fi = _finfo(dtype)
    finite = dict(allow_nan=False, allow_infinity=False)
    if kind == "normal":
        elem = st.floats(-10.0, 10.0, **finite)
    elif kind == "subnormal":
        elem = st.floats(-fi.tiny, fi.tiny, allow_subnormal=True, **finite)
    elif kind == "huge":  # within a factor 2 of the dtype's largest value
        elem = st.builds(lambda m, s: s * m, st.floats(fi.max / 2, fi.max, **finite), st.sampled_from([1.0, -1.0]))
    elif kind == "equal":
        v = draw(st.floats(-1e3, 1e3, **finite))
        elem = st.just(v)
    elif kind == "zeros":
        elem = st.sampled_from([0.0, -0.0])
    elif kind == "mixed":
        elem = st.floats(-float(fi.max), float(fi.max), allow_subnormal=True, **finite)
    else:
        elem = st.one_of(st.floats(-10.0, 10.0, **finite),
                         st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    pattern = draw(st.lists(elem, min_size=1, max_size=64))
    x = torch.tensor(pattern, dtype=torch.float64).repeat(-(-n // len(pattern)))[:n]
    return x.to(dtype), kind


def _impls(name):
    # Triton runs interpreted here: only on small inputs (see test_triton.py).
    return [i for i in pycomm.available_impls(name, "cpu") if i != "reference"]


# ------------------------------------------------------------ compressors ---
@FUZZ
@given(data=tensors(), block_words=st.integers(1, 8), ef=st.booleans())
def test_onebit_impls_match_reference(data, block_words, ef):
    x, _ = data
    bs = 32 * block_words
    ref = pycomm.get_compressor("onebit", block_size=bs, impl="reference")
    r0 = torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)) if ef else None
    r_ref = r0.clone() if ef else None
    p_ref = ref.compress(x, r_ref)
    for impl in _impls("onebit"):
        if impl == "triton" and x.numel() > 300:
            continue
        imp = pycomm.get_compressor("onebit", block_size=bs, impl=impl)
        r_imp = r0.clone() if ef else None
        p_imp = imp.compress(x, r_imp)
        assert_payloads_equal(p_ref, p_imp, r_ref, r_imp)
        torch.testing.assert_close(imp.decompress(p_ref), ref.decompress(p_ref), equal_nan=True, rtol=0, atol=0)


@FUZZ
@given(data=tensors(), density=st.floats(1e-3, 1.0), approx=st.booleans(), ef=st.booleans())
def test_topk_impls_match_reference(data, density, approx, ef):
    x, _ = data
    ref = pycomm.get_compressor("topk", density=density, approx=approx, impl="reference")
    r0 = torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)) if ef else None
    r_ref = r0.clone() if ef else None
    p_ref = ref.compress(x, r_ref)
    for impl in _impls("topk"):
        if impl == "triton" and x.numel() > 300:
            continue
        imp = pycomm.get_compressor("topk", density=density, approx=approx, impl=impl)
        r_imp = r0.clone() if ef else None
        p_imp = imp.compress(x, r_imp)
        assert torch.equal(p_imp.indices, p_ref.indices), impl
        torch.testing.assert_close(p_imp.values, p_ref.values, equal_nan=True, rtol=0, atol=0)
        if ef:
            torch.testing.assert_close(r_imp, r_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("name,kw", [("onebit", {"block_size": 64}), ("topk", {"density": 0.1})])
def test_empty_tensor_is_refused_by_every_impl(name, kw):
    for impl in ["reference", *_impls(name)]:
        with pytest.raises(ValueError, match="grad is empty"):
            pycomm.get_compressor(name, impl=impl, **kw).compress(torch.empty(0))


# ---------------------------------------------------------- all-reduce ---
# Two rank processes live for the whole module and run whatever example the
# test sends them, so hypothesis can drive the collective without spawning
# processes per example.
WORLD = 2


def _serve(rank, port, tasks, results):
    import pycomm.distributed as pd

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    groups, serial = {}, 0
    while True:
        task = tasks.get()
        if task is None:
            break
        xs, method, op, chunk, kw, steps = task
        try:
            out = {"backend": [], "empty_error": None}
            keyed = method in ("onebit", "topk")
            settings_key = (method, chunk, tuple(sorted(kw.items())))
            if settings_key not in groups:  # same task order on both ranks: same new_group order
                groups[settings_key] = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=chunk, **kw)
            serial += 1
            key = serial if keyed else None  # a fresh residual per example
            if xs[0][rank].numel() == 0:
                try:  # refused alike on every rank, before any collective
                    pd.all_reduce(xs[0][rank].clone(), key=key, group=groups[settings_key], op=op)
                except RuntimeError as exc:
                    out["empty_error"] = str(exc)
            else:
                for step in range(steps):
                    y = xs[step][rank].clone()
                    pd.all_reduce(y, key=key, group=groups[settings_key], op=op)
                    out["backend"].append(y)
            results.put((rank, "ok", out))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, "err", f"{type(exc).__name__}: {exc}"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue() for _ in range(WORLD)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(r, port, tasks[r], results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()

    def run(task):
        for q in tasks:
            q.put(task)
        got = {}
        for _ in range(WORLD):
            rank, status, value = results.get(timeout=60)
            assert status == "ok", f"rank {rank}: {value}"
            got[rank] = value
        return [got[r] for r in range(WORLD)]

    yield run
    for q in tasks:
        q.put(None)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


METHOD_SETTINGS = st.one_of(
    st.tuples(st.just("onebit"), st.builds(lambda w: {"block_size": 32 * w}, st.integers(1, 6))),
    st.tuples(st.just("topk"), st.builds(lambda d, a: {"density": d, "approx": a},
                                         st.floats(0.01, 1.0), st.booleans())),
    st.tuples(st.sampled_from(["fp16", "bf16"]), st.just({})),
)


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@settings(max_examples=EXAMPLES or 25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), ms=METHOD_SETTINGS, op=st.sampled_from(["sum", "avg"]),
       chunk=st.sampled_from([64, 100, 1000, 1 << 20]))
def test_allreduce_matches_simulation(ranks, data, ms, op, chunk):
    method, kw = ms
    x0, kind = data.draw(tensors(max_numel=1500, allow_empty=True))
    n, dtype = x0.numel(), x0.dtype
    steps = 2 if method in ("onebit", "topk") else 1  # the second step uses the residuals
    xs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        # Rank 0 gets the drawn tensor, rank 1 a shuffled, scaled copy.
        perm = torch.randperm(n, generator=g)
        xs.append([x0 if step == 0 else x0.flip(0), (x0[perm].double() * 0.5).to(dtype)])
    got = ranks((xs, method, op, chunk, kw, steps))
    if n == 0:
        for rank in range(WORLD):
            assert "empty tensor" in (got[rank]["empty_error"] or ""), got[rank]
        return
    # The engine runs the compiled kernels: the simulation with the same ones
    # is its oracle bit for bit.
    efs = [ErrorFeedback() for _ in range(WORLD)] if steps == 2 else None
    extra = {"impl": "cpu"} if method in ("onebit", "topk") else {}
    for step in range(steps):
        want = simulate_allreduce(xs[step], method, op, chunk, efs, **kw, **extra)
        for rank in range(WORLD):
            assert _same(got[rank]["backend"][step], want[rank]), (rank, step)


# ------------------------------------------- denormals-are-zero mode ----
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_fp16_subnormals_survive_flush_denormal_mode(impl):
    # torch.set_flush_denormal(True) makes the CPU treat float32 denormals as
    # zero: an fp16 -> float32 conversion that goes through one would turn
    # every fp16 subnormal into 0. All 65536 fp16 values, read back through
    # exact top-k (density 1: every value is sent as it was read).
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    want = x.float()
    c = pycomm.get_compressor("topk", density=1.0, approx=False, impl=impl)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        p = c.compress(x)
        scale = pycomm.get_compressor("onebit", block_size=32, impl=impl).compress(x[1:4]).scales
    finally:
        torch.set_flush_denormal(False)
    got = torch.empty(x.numel())
    got[p.indices.long()] = p.values
    ok = ~want.isnan()  # signalling NaNs may come back quiet
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))
    assert torch.equal(got.isnan(), want.isnan())
    assert scale.item() == want[1:4].abs().mean().item() > 0  # three subnormals: 1, 2, 3 x 2^-24
