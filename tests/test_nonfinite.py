"""Non-finite gradients: a NaN or Inf on any rank makes the reduced tensor
non-finite on every rank, and a step whose result is non-finite leaves every
error-feedback residual (worker and server) exactly as it was, in the engine
(every entry point runs it) and in the simulation that is its oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks

from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce

N, CHUNK, BLOCK = 1000, 512, 64  # two chunks, several blocks per segment
INF, NAN = math.inf, math.nan
# Settings of every compressor; the backend groups get the same ones.
SETTINGS = {
    "onebit": dict(block_size=BLOCK),
    "topk-exact": dict(density=0.01, approx=False),
    "topk-approx": dict(density=0.01, approx=True),
    "fp16": {},
    "bf16": {},
}
# (name, {rank: {index: value}}): where the non-finite values go.
CASES = [
    ("nan", {1: {5: NAN}}),
    ("inf", {0: {700: INF}}),
    ("-inf", {1: {999: -INF}}),
    ("+inf and -inf in one block", {0: {3: INF, 4: -INF}}),
    ("opposite infs cancel", {0: {10: INF}, 1: {10: -INF}}),
    # More non-finite entries than top-k sends per chunk (k = 6): most stay behind.
    ("many infs", {1: {i: (INF if i % 2 else -INF) for i in range(0, 900, 9)}}),
    ("nan and inf on different ranks", {0: {600: NAN}, 1: {601: INF}}),
]


def _method(name):
    return name.split("-")[0]


def _input(rank, step, dtype=torch.float32, poison=None):
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(N, generator=g)
    for i, v in (poison or {}).get(rank, {}).items():
        x[i] = v
    return x.to(dtype)


def _ef_snapshot(ef):
    if isinstance(ef, ErrorFeedback):
        return [ef.worker.clone(), ef.server.clone() if ef.server is not None else None]
    return [ef["worker"].clone(), [s.clone() for s in ef["server"]]]


def _rank_nonfinite(rank, world):
    """For each compressor, case and entry point: one finite step (non-zero
    residuals), the poisoned step, one finite step. Returns the results and
    the residuals before and after the poisoned step."""
    import pycomm.distributed as pd

    out = {}
    for name, settings in SETTINGS.items():
        method = _method(name)
        pg = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=CHUNK, **settings)
        for ci, (case, poison) in enumerate(CASES):
            for dtype in (torch.float32, torch.float16):
                keyed = method in ("onebit", "topk")
                # The backend, error feedback under a key of its own.
                key = 100 * ci + (dtype == torch.float16)
                res = {}
                for step, p in enumerate((None, poison, None)):
                    x = _input(rank, step, dtype, p)
                    if step == 1 and keyed:
                        res["ef_before"] = _ef_snapshot(pd.error_feedback_state(pg)[key])
                    pd.all_reduce(x, key=key, group=pg, op="avg")
                    res[f"x{step}"] = x
                    if step == 1 and keyed:
                        res["ef_after"] = _ef_snapshot(pd.error_feedback_state(pg)[key])
                out[("backend", name, case, str(dtype))] = res
    return out


@pytest.fixture(scope="module")
def nonfinite_results():
    return run_ranks(_rank_nonfinite, 2, timeout=240, init_process_group=True)


def _equal_state(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_nonfinite_input_gives_nonfinite_result_everywhere(nonfinite_results, name):
    r0, r1 = nonfinite_results
    checked = 0
    for key, res in r0.items():
        if key[1] != name:
            continue
        other = r1[key]
        assert not torch.isfinite(res["x1"]).all(), f"{key}: result is finite"
        assert not torch.isfinite(other["x1"]).all(), f"{key}: rank 1's result is finite"
        # The results are identical on both ranks (NaN where NaN).
        assert torch.equal(res["x1"].isnan(), other["x1"].isnan()), key
        assert torch.equal(res["x1"].nan_to_num(), other["x1"].nan_to_num()), key
        # The steps around it are finite: nothing leaked into the next step.
        assert torch.isfinite(res["x0"]).all() and torch.isfinite(res["x2"]).all(), key
        checked += 1
    assert checked == len(CASES) * 2  # every case, float32 and float16


@pytest.mark.parametrize("name", ["onebit", "topk-exact", "topk-approx"])
def test_nonfinite_step_leaves_residuals_untouched(nonfinite_results, name):
    checked = 0
    for results in nonfinite_results:
        for key, res in results.items():
            if key[1] != name:
                continue
            assert _equal_state(res["ef_before"], res["ef_after"]), f"{key}: residuals changed"
            # Non-zero residuals, so the comparison means something.
            assert res["ef_before"][0].abs().sum() > 0, key
            checked += 1
    assert checked == 2 * len(CASES) * 2  # both ranks, every case, both dtypes


# ------------------------------------------------------- simulation ----
@pytest.mark.parametrize("name", ["onebit", "topk-exact", "topk-approx"])
def test_simulation_rolls_back_and_then_matches_finite_steps(name):
    method, settings = _method(name), SETTINGS[name]
    efs = [ErrorFeedback() for _ in range(2)]
    simulate_allreduce([_input(r, 0) for r in range(2)], method, "avg", CHUNK, efs, **settings)
    before = [_ef_snapshot(ef) for ef in efs]
    outs = simulate_allreduce([_input(r, 1, poison={0: {3: INF}}) for r in range(2)], method, "avg",
                              CHUNK, efs, **settings)
    assert not torch.isfinite(outs[0]).all()
    assert all(_equal_state(b, _ef_snapshot(ef)) for b, ef in zip(before, efs))
    # A run that never saw the poisoned step continues identically.
    ref = [ErrorFeedback() for _ in range(2)]
    simulate_allreduce([_input(r, 0) for r in range(2)], method, "avg", CHUNK, ref, **settings)
    a = simulate_allreduce([_input(r, 2) for r in range(2)], method, "avg", CHUNK, efs, **settings)
    b = simulate_allreduce([_input(r, 2) for r in range(2)], method, "avg", CHUNK, ref, **settings)
    assert torch.equal(a[0], b[0])


def test_topk_sum_overflow_of_finite_values_rolls_back():
    # Finite inputs whose sum overflows float32: the result is non-finite, so
    # GradScaler skips the step, and the residuals must not change either.
    efs = [ErrorFeedback() for _ in range(2)]
    simulate_allreduce([_input(r, 0) for r in range(2)], "topk", "sum", CHUNK, efs, density=0.01)
    before = [_ef_snapshot(ef) for ef in efs]
    xs = [_input(r, 1, poison={0: {8: 3e38}, 1: {8: 3e38}}) for r in range(2)]
    outs = simulate_allreduce(xs, "topk", "sum", CHUNK, efs, density=0.01)
    assert outs[0][8] == INF
    assert all(_equal_state(b, _ef_snapshot(ef)) for b, ef in zip(before, efs))
