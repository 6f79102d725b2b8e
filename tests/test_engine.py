"""The engine's compressed all-reduce (the C++ backend behind pycomm groups)
over real Gloo ranks, against the single-process simulation built from the
reference compressors (pycomm.distributed.simulate), which follows
docs/allreduce.md: every method, odd sizes, chunkings that leave short or
single-element chunks, 16-bit, 2-D and non-contiguous inputs, error feedback
over several steps (worker and server residuals).

Spawning ranks costs seconds on this machine, so each world size runs ONE
multi-process job that computes every case (module-scoped fixture); the
parametrized tests then check the case they are named after.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import pycomm
from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce
from pycomm.distributed.spec import (BLOCK_METHODS, DEFAULT_CHUNK_NUMEL, all_reduce_gathers, block_segments,
                                     block_size_for, chunk_bounds)

WORLD_SIZES = [2, 4]
SIZES = [1, 33, 5000, 70001]
# Per size: a chunking that leaves a short last chunk (or cuts a tiny tensor
# into single elements) and one larger than the tensor.
# sys.maxsize: "never chunk", which must not overflow the chunk arithmetic.
CHUNKS = {1: [1, 4096], 33: [32, 4096], 5000: [1664, sys.maxsize], 70001: [7000, 1 << 20]}
METHODS = [
    ("onebit", {"block_size": 64}),
    ("onebit", {"block_size": 2048}),
    ("int8", {"block_size": 64}),
    ("int4", {}),
    ("topk", {"density": 0.01, "approx": True}),
    ("topk", {"density": 0.05, "approx": False}),
    ("fp16", {}),
    ("bf16", {}),
]
OPS = ["sum", "avg"]
F32_EPS = torch.finfo(torch.float32).eps


def _method_id(method, kwargs):
    return method + "".join(f"-{k}={v}" for k, v in sorted(kwargs.items()))


def _cases():
    """(case id, method, kwargs, n, shape, chunk_numel, op, dtype, layout)."""
    cases = []
    for method, kwargs in METHODS:
        for n in SIZES:
            for chunk in CHUNKS[n]:
                for op in OPS:
                    cid = f"{_method_id(method, kwargs)}-n{n}-c{chunk}-{op}"
                    cases.append((cid, method, kwargs, n, (n,), chunk, op, torch.float32, "contig"))
        # 16-bit inputs, a 2-D shape, a non-contiguous tensor, the default chunking.
        for dtype in (torch.float16, torch.bfloat16):
            cid = f"{_method_id(method, kwargs)}-{str(dtype)[6:]}-2d-avg"
            cases.append((cid, method, kwargs, 5000, (50, 100), 1664, "avg", dtype, "contig"))
        cid = f"{_method_id(method, kwargs)}-transposed-default-chunk-sum"
        cases.append((cid, method, kwargs, 5000, (50, 100), None, "sum", torch.float32, "transposed"))
    # A 16-bit average longer than the engine's division on a CPU takes at
    # once (2^20 elements): its parts meet at a boundary.
    n = (1 << 20) + 33
    for method in ("fp16", "bf16"):
        cases.append((f"{method}-n{n}-avg", method, {}, n, (n,), None, "avg", torch.float32, "contig"))
    return cases


CASES = _cases()
CASE_IDS = [c[0] for c in CASES]
# onebit, int8, int4 and topk: the simulation with the engine's own kernels
# (impl="cpu") must be bit-exact, whatever the dtype, shape or layout.
EXACT_CASES = [c for c in CASES if c[1] in ("onebit", "topk", "int8", "int4")]

# Error-feedback runs: several steps, residuals kept across them.
EF_STEPS = 4
EF_CASES = [
    ("onebit-b64-n5000-c1664-avg", "onebit", {"block_size": 64}, 5000, 1664, "avg"),
    ("onebit-b2048-n70001-c7000-sum", "onebit", {"block_size": 2048}, 70001, 7000, "sum"),
    ("onebit-b32-n33-c32-avg", "onebit", {"block_size": 32}, 33, 32, "avg"),
    ("int8-b64-n5000-c1664-avg", "int8", {"block_size": 64}, 5000, 1664, "avg"),
    ("int4-default-n70001-c7000-sum", "int4", {}, 70001, 7000, "sum"),
    ("int4-b32-n33-c32-avg", "int4", {"block_size": 32}, 33, 32, "avg"),
    ("topk-approx-n70001-c7000-avg", "topk", {"density": 0.01, "approx": True}, 70001, 7000, "avg"),
    ("topk-exact-n5000-c1664-sum", "topk", {"density": 0.05, "approx": False}, 5000, 1664, "sum"),
    # Either side of spec.GATHER_NUMEL (n x W): 4096 is gathered over 2 and
    # 4 ranks (the bound itself), 4097 over 2 only, 8193 over neither.
    ("onebit-b64-n4096-avg", "onebit", {"block_size": 64}, 4096, 1 << 20, "avg"),
    ("int8-b64-n4097-sum", "int8", {"block_size": 64}, 4097, 1 << 20, "sum"),
    ("int4-b32-n8193-avg", "int4", {"block_size": 32}, 8193, 1 << 20, "avg"),
]


def _input(seed, rank, shape, dtype=torch.float32, layout="contig"):
    """Rank `rank`'s input for a case: normal values, a different scale per
    rank (so that no two ranks' block scales coincide)."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if layout == "transposed":
        base = torch.randn(tuple(reversed(shape)), generator=gen) * (1.0 + 0.37 * rank)
        return base.to(dtype).t()  # the logical shape, not contiguous
    return (torch.randn(shape, generator=gen) * (1.0 + 0.37 * rank)).to(dtype)


# ------------------------------------------------------------ rank bodies ---
def _rank_all_cases(rank, world):
    import pycomm.distributed as pd

    groups = {}

    def group(method, kwargs, chunk):
        # One engine group per setting (the settings belong to the group).
        key = (method, tuple(sorted(kwargs.items())), chunk)
        if key not in groups:
            extra = {} if chunk is None else {"chunk_numel": chunk}
            groups[key] = pd.wrap(compressor=method, min_compress_numel=1, **extra, **kwargs)
        return groups[key]

    out = {"cases": {}, "ef": {}, "errors": {}}
    for seed, (cid, method, kwargs, n, shape, chunk, op, dtype, layout) in enumerate(CASES):
        x = _input(seed, rank, shape, dtype, layout)
        pd.all_reduce(x, group=group(method, kwargs, chunk), op=op)
        out["cases"][cid] = x
    for seed, (cid, method, kwargs, n, chunk, op) in enumerate(EF_CASES):
        pg = group(method, kwargs, chunk)
        steps = []
        for step in range(EF_STEPS):
            x = _input(10_000 + 100 * seed + step, rank, (n,))
            pd.all_reduce(x, key=seed, group=pg, op=op)
            steps.append((x, pd.error_feedback_state(pg)[seed]))
        out["ef"][cid] = steps

    # Misuse is refused on every rank alike; the group is still in step
    # afterwards.
    pg = group("topk", {"density": 0.1}, None)
    pd.all_reduce(torch.ones(100), key=99, group=pg)
    for name, call in [
        ("size", lambda: pd.all_reduce(torch.ones(101), key=99, group=pg)),
        ("op", lambda: pd.all_reduce(torch.ones(100), group=pg, op="max")),
    ]:
        try:
            call()
            out["errors"][name] = None
        except (ValueError, RuntimeError) as exc:
            out["errors"][name] = str(exc)
    check = torch.tensor([1.0])
    dist.all_reduce(check)
    pd.all_reduce(torch.ones(100), key=99, group=pg)
    out["after_errors"] = check.item()
    return out


@pytest.fixture(scope="module")
def dist_results():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(_rank_all_cases, world, timeout=240.0)
        return cache[world]

    return get


# -------------------------------------------------------------- checking ---
def _onebit_worker_mag(cs, chunk, block_size, world, op):
    """Per element, sum over ranks of the worker-stage block scale of
    ``c_i`` (/ W for AVG): the magnitude of what the server stage adds up."""
    comp = pycomm.get_compressor("onebit", block_size=block_size, impl="reference")
    flat = [c.float().reshape(-1) for c in cs]
    mag = torch.zeros_like(flat[0])
    for b, e in chunk_bounds(flat[0].numel(), chunk or DEFAULT_CHUNK_NUMEL):
        for c in flat:
            mag[b:e] += comp.decompress(comp.compress(c[b:e])).abs()
    return mag / (world if op == "avg" else 1)


def _assert_close_to_sim(got, want, method, world, inputs, op, dtype, chunk=None, block_size=None):
    got32, want32 = got.float().reshape(-1), want.float().reshape(-1)
    out_eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    if method in ("topk", "int8", "int4"):
        # topk: selection is exact and values are copies; int8/int4: absmax,
        # levels and products are elementwise, in any order alike. Decoding
        # adds in rank order in both: equal, bit for bit.
        assert torch.equal(got32, want32)
        return
    if method == "onebit":
        # Compiled kernels sum |c| in another order than the reference, so
        # block scales differ by float32 rounding; the server adds W of them
        # (which may cancel) and averages |acc| per block. The error is a few
        # ulps of the worker scales that were added (measured: <= 14 ulps of
        # the result), plus one rounding of a 16-bit output.
        mag = _onebit_worker_mag(inputs, chunk, block_size, world, op)
        tol = 16 * F32_EPS * (mag + want32.abs()) + out_eps * want32.abs()
    else:
        # Gloo sums the 16-bit values in its own order, the simulation in rank
        # order: each of the W-1 additions rounds once (half an ulp of the
        # partial sum, <= sum |y_i|), in both, so they differ by at most
        # 2 (W-1) u sum|y_i|, u = 2^-11 (fp16) / 2^-8 (bf16); W = 2 is exact.
        u = 2.0**-11 if method == "fp16" else 2.0**-8
        ys = [(x.float().reshape(-1) / (world if op == "avg" else 1)) for x in inputs]
        mag = torch.stack([y.abs() for y in ys]).sum(0)
        tol = 2 * (world - 1) * u * mag * (1 + u) + out_eps * want32.abs()
        if world == 2:
            tol = out_eps * want32.abs()
    err = (got32 - want32).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {got32.numel()} elements off; worst at {int((err - tol).argmax())}: "
        f"got {got32[(err - tol).argmax()].item()}, want {want32[(err - tol).argmax()].item()}"
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_simulation(dist_results, world, case):
    cid, method, kwargs, n, shape, chunk, op, dtype, layout = case
    res = dist_results(world)
    got = [r["cases"][cid] for r in res]
    # Identical on every rank, bit for bit (every rank decodes the same bytes).
    for g in got[1:]:
        assert torch.equal(g, got[0])
    assert got[0].shape == shape and got[0].dtype == dtype
    seed = CASES.index(case)
    inputs = [_input(seed, r, shape, dtype, layout) for r in range(world)]
    want = simulate_allreduce(inputs, method, op=op, chunk_numel=chunk, **kwargs)
    _assert_close_to_sim(got[0], want[0], method, world, inputs, op, dtype, chunk, kwargs.get("block_size"))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_same_kernels_are_bit_exact(dist_results, world, case):
    """With the engine's kernels in the simulation too, wire format, segment
    slicing, accumulation order and AVG division leave no difference at all."""
    cid, method, kwargs, n, shape, chunk, op, dtype, layout = case
    got = [r["cases"][cid] for r in dist_results(world)]
    inputs = [_input(CASES.index(case), r, shape, dtype, layout) for r in range(world)]
    want = simulate_allreduce(inputs, method, op=op, chunk_numel=chunk, impl="cpu", **kwargs)
    for g in got:
        assert torch.equal(g, want[0])


def _server_full(efs, n, chunk, block_size):
    """The server residuals of all ranks laid out over the whole tensor:
    chunk by chunk, rank j's residual in segment j (docs/allreduce.md)."""
    world = len(efs)
    full = torch.zeros(n)
    for ci, (b, e) in enumerate(chunk_bounds(n, chunk)):
        _, segs = block_segments(e - b, world, block_size)
        for j, (sb, se) in enumerate(segs):
            full[b + sb : b + se] = efs[j].server_segment(ci)
    return full


def _efs_from(states, kwargs):
    """The engine's residuals (``pd.error_feedback_state()[key]`` of each
    rank) in the simulation's container."""
    efs = []
    for rank, st in enumerate(states):
        layout = ErrorFeedback.make_layout(method=st["method"], numel=st["numel"], world_size=st["world_size"],
                                           rank=rank, chunk_numel=st["chunk_numel"],
                                           block_size=block_size_for(st["method"], kwargs.get("block_size")))
        server = torch.cat(st["server"]) if st["method"] in BLOCK_METHODS else None
        ef = ErrorFeedback()
        ef.load_state_dict({"layout": layout, "worker": st["worker"], "server": server})
        efs.append(ef)
    return efs


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", EF_CASES, ids=[c[0] for c in EF_CASES])
def test_error_feedback_invariant(dist_results, world, case):
    """Nothing is lost, only deferred. Per step, from the spec:

    worker (every rank i): c_i = x_i + e_i, e_i' = c_i - D(p_i), so
        D(p_i) = x_i + e_i - e_i'.
    block codecs' server (segment of rank j): c = acc + s, s' = c - D(q), the result is
        D(q) = acc + s - s', acc = sum_i D(p_i) (/ W for AVG).
    topk, and a block codec on a small tensor (spec.all_reduce_gathers):
        result = sum_i D(p_i) (/ W for AVG), no server residual used.

    With w = W for AVG and 1 for SUM, and S the server residuals of all
    ranks laid over the tensor (segment j from rank j):

        sum_i x_i - w * result = sum_i (e_i' - e_i) + w * (S' - S)

    exactly in real arithmetic; in float32 every term above carries O(1)
    roundings, so the two sides agree to a few ulps of the magnitudes involved.
    """
    cid, method, kwargs, n, chunk, op = case
    res = dist_results(world)
    w = world if op == "avg" else 1
    seed = EF_CASES.index(case)
    prev_e = [torch.zeros(n) for _ in range(world)]
    prev_s = torch.zeros(n)
    sim_efs = [ErrorFeedback() for _ in range(world)]
    for step in range(EF_STEPS):
        xs = [_input(10_000 + 100 * seed + step, r, (n,)) for r in range(world)]
        results = [res[r]["ef"][cid][step][0] for r in range(world)]
        for g in results[1:]:
            assert torch.equal(g, results[0])
        result = results[0]
        efs = _efs_from([res[r]["ef"][cid][step][1] for r in range(world)], kwargs)
        e = [ef.worker for ef in efs]
        block = block_size_for(method, kwargs.get("block_size"))
        s = _server_full(efs, n, chunk, block) if method in BLOCK_METHODS else torch.zeros(n)

        lhs = torch.stack(xs).sum(0) - w * result
        rhs = torch.stack(e).sum(0) - torch.stack(prev_e).sum(0) + w * (s - prev_s)
        mag = (
            torch.stack([x.abs() for x in xs]).sum(0)
            + torch.stack([t.abs() for t in e + prev_e]).sum(0)
            + w * (result.abs() + s.abs() + prev_s.abs())
        )
        err = (lhs - rhs).abs()
        assert (err <= 8 * F32_EPS * mag).all(), f"step {step}: worst {(err / mag).max().item():.3g} x magnitude"
        # The EF actually holds something (else the identity says nothing).
        assert torch.stack(e).abs().sum() > 0
        if method in BLOCK_METHODS:
            # The two-phase all-reduce keeps server residuals; the gathered
            # one leaves them as they were (zero).
            assert bool((s == 0).all()) == all_reduce_gathers(method, n, world), cid
        prev_e, prev_s = e, s

        # The simulation, fed the same inputs with its own residuals, agrees.
        # With the engine's kernels: results and both residuals bit for bit.
        want = simulate_allreduce(xs, method, op=op, chunk_numel=chunk, efs=sim_efs, impl="cpu", **kwargs)
        assert torch.equal(result, want[0])
        for ef_sim, ef_dist in zip(sim_efs, efs):
            assert torch.equal(ef_sim.worker, ef_dist.worker)
            if method in BLOCK_METHODS:
                assert torch.equal(ef_sim.server, ef_dist.server)


def test_misuse_is_refused_on_every_rank(dist_results):
    res = dist_results(2)
    for r in res:
        errs = r["errors"]
        assert "key 99" in errs["size"] and "reset_error_feedback(99)" in errs["size"], errs["size"]
        assert "'sum' or 'avg'" in errs["op"]
        assert r["after_errors"] == 2.0  # the ranks are still in step


# ------------------------------------------------------- single process ---
def test_error_feedback_layout_checks():
    ef = ErrorFeedback()
    assert not ef.bound and repr(ef) == "ErrorFeedback(unbound)"
    layout = dict(method="onebit", numel=5000, world_size=4, rank=3, chunk_numel=4096, block_size=256)
    ef.bind(**layout)
    ef.bind(**layout)  # the same layout again is fine
    for key, value in [("numel", 5001), ("world_size", 2), ("rank", 1), ("chunk_numel", 1024),
                       ("block_size", 64), ("method", "topk")]:
        with pytest.raises(ValueError, match="cannot be used for"):
            ef.bind(**{**layout, key: value})
    # Server residual: this rank's segment of every chunk.
    assert ef.server.numel() == 1024 + 136
    with pytest.raises(ValueError, match="error feedback exists for"):
        ErrorFeedback().bind(method="fp16", numel=1, world_size=1, rank=0, chunk_numel=1)

    # state_dict round trip, and a state whose buffers do not fit is refused.
    ef.worker.normal_()
    ef.server.normal_()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(ef.state_dict())
    assert ef2.layout == ef.layout and torch.equal(ef2.worker, ef.worker) and torch.equal(ef2.server, ef.server)
    bad = ef.state_dict()
    bad["server"] = bad["server"][:-1]
    with pytest.raises(ValueError, match="server residual"):
        ErrorFeedback().load_state_dict(bad)
    ef.reset()
    assert not ef.bound


def test_simulation_checks_and_resume():
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    efs = [ErrorFeedback() for _ in range(3)]
    simulate_allreduce(xs, "onebit", op="avg", chunk_numel=128, efs=efs, block_size=32)
    with pytest.raises(ValueError, match="cannot be used for"):
        simulate_allreduce([x[:299] for x in xs], "onebit", op="avg", chunk_numel=128, efs=efs, block_size=32)
    with pytest.raises(ValueError, match="one ErrorFeedback per rank"):
        simulate_allreduce(xs, "onebit", efs=efs[:2])
    with pytest.raises(ValueError, match="no error feedback"):
        simulate_allreduce(xs, "bf16", efs=efs)
    # Residuals saved and restored continue exactly as if never interrupted.
    saved = [ef.state_dict() for ef in efs]
    a = simulate_allreduce(xs, "onebit", op="avg", chunk_numel=128, efs=efs, block_size=32)
    restored = [ErrorFeedback() for _ in saved]
    for ef, sd in zip(restored, saved):
        ef.load_state_dict(sd)
    b = simulate_allreduce(xs, "onebit", op="avg", chunk_numel=128, efs=restored, block_size=32)
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("n, c, want", [
    (0, 8, []),
    (5, 8, [(0, 5)]),
    (11, 8, [(0, 11)]),                       # 1.375 chunks: one, no 3-element sliver
    (12, 8, [(0, 6), (6, 12)]),               # 1.5 rounds up to two
    (17, 8, [(0, 9), (9, 17)]),               # last one shorter
    (1_050_000, 1 << 20, [(0, 1_050_000)]),   # a DDP bucket just over its cap
    (3 << 20, 1 << 20, [(0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20)]),
])
def test_chunk_bounds_never_leave_a_sliver(n, c, want):
    assert chunk_bounds(n, c) == want
    bounds = chunk_bounds(n, c)
    # contiguous cover of [0, n), at most ~1.5x chunk_numel per chunk
    assert all(b1 == e0 for (_, e0), (b1, _) in zip(bounds, bounds[1:]))
    assert all(e - b <= max(1.5 * c, 1) + 1 for b, e in bounds)
