"""topk: every compiled implementation against the pure-torch reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pycomm
from pycomm.compressors import topk as tk

from _data import DTYPES, IMPL_DEVICES, KINDS, SIZES, make_grad

IMPLS = [pytest.param(i, d, id=i, marks=[pytest.mark.gpu] if d == "cuda" else []) for i, d in IMPL_DEVICES]
WITH_REFERENCE = [pytest.param("reference", "cpu", id="reference"), *IMPLS]


def run_both(impl, device, grad, residual, density, approx):
    r_ref = residual.clone() if residual is not None else None
    r_imp = residual.to(device).clone() if residual is not None else None
    ref = pycomm.get_compressor("topk", density=density, approx=approx, impl="reference")
    imp = pycomm.get_compressor("topk", density=density, approx=approx, impl=impl)
    return ref.compress(grad, r_ref), imp.compress(grad.to(device), r_imp), r_ref, r_imp


def assert_same(p_ref, p_imp, r_ref, r_imp):
    assert p_imp.indices.dtype == torch.int32 and p_imp.values.dtype == torch.float32
    assert torch.equal(p_imp.indices.cpu(), p_ref.indices), "selected indices differ from the reference"
    # Values and residuals are copies of c = grad + residual: bit-identical.
    torch.testing.assert_close(p_imp.values.cpu(), p_ref.values, equal_nan=True, rtol=0, atol=0)
    if r_ref is not None:
        torch.testing.assert_close(r_imp.cpu(), r_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("approx", [False, True], ids=["exact", "approx"])
@pytest.mark.parametrize("density", [0.001, 0.3])
def test_compress_matches_reference(impl, device, n, dtype, kind, approx, density):
    grad = make_grad(kind, n, dtype, seed=n)
    residual = torch.randn(n) * 0.1 if kind != "zeros" else torch.zeros(n)
    p_ref, p_imp, r_ref, r_imp = run_both(impl, device, grad, residual, density, approx)
    assert_same(p_ref, p_imp, r_ref, r_imp)
    k = tk.topk_k(n, density)
    count = p_imp.indices.numel()
    if approx:
        assert k <= count <= k + k // 4
    else:
        assert count == k
    assert bool((p_imp.indices[1:] > p_imp.indices[:-1]).all()), "indices not strictly ascending"


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("approx", [False, True], ids=["exact", "approx"])
@pytest.mark.parametrize("n", [1, 33, 4097, 100_000])
def test_without_residual(impl, device, approx, n):
    grad = make_grad("random", n, seed=5)
    p_ref, p_imp, _, _ = run_both(impl, device, grad, None, 0.01, approx)
    assert_same(p_ref, p_imp, None, None)
    assert torch.equal(grad, make_grad("random", n, seed=5)), "grad must not be modified"


def test_ties_and_nonfinite_by_hand():
    # Ties go to the lowest index; NaN ranks above +Inf above everything else.
    grad = torch.tensor([1.0, -3.0, 3.0, float("nan"), 0.5, -float("inf"), 3.0, 2.0])
    for impl in ["reference", "cpu"]:
        c = pycomm.get_compressor("topk", density=4 / 8, approx=False, impl=impl)
        p = c.compress(grad)
        assert p.indices.tolist() == [1, 2, 3, 5]
        zeros = pycomm.get_compressor("topk", density=0.25, approx=True, impl=impl).compress(torch.zeros(16))
        assert zeros.indices.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_approx_count_and_recall(impl, device, kind, density):
    n = 1 << 20
    grad = make_grad(kind, n, seed=11).to(device)
    k = tk.topk_k(n, density)
    approx = pycomm.get_compressor("topk", density=density, approx=True, impl=impl).compress(grad)
    exact = pycomm.get_compressor("topk", density=density, approx=False, impl=impl).compress(grad)
    assert k <= approx.indices.numel() <= k + k // 4
    recall = torch.isin(exact.indices, approx.indices).float().mean().item()
    assert recall >= 0.95
    # Exact top-k agrees with torch.topk on the magnitudes (no ties in random data).
    expected = torch.topk(grad.abs(), k).indices.sort().values.to(torch.int32)
    assert torch.equal(exact.indices, expected)


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("n", [1, 33, 70001])
def test_decompress_matches_reference(impl, device, n):
    ref = pycomm.get_compressor("topk", density=0.1, impl="reference")
    imp = pycomm.get_compressor("topk", density=0.1, impl=impl)
    p = ref.compress(make_grad("nonfinite", n, seed=2))
    expected = ref.decompress(p)
    p_dev = tk.TopKPayload(p.indices.to(device), p.values.to(device), p.numel, p.shape)
    out = torch.full((n,), float("nan"), device=device)  # poisoned: unwritten entries show
    imp.decompress(p_dev, out=out)
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, rtol=0, atol=0)
    base = torch.randn(n)
    acc = base.clone().to(device)
    imp.decompress(p_dev, out=acc, accumulate=True)
    torch.testing.assert_close(acc.cpu(), base + expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
@pytest.mark.parametrize("approx", [False, True], ids=["exact", "approx"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_invariant(impl, device, approx, dtype):
    n = 50_001
    c = pycomm.get_compressor("topk", density=0.01, approx=approx, impl=impl)
    grad = make_grad("random", n, dtype, seed=7, device=device)
    residual = torch.randn(n, device=device)
    total = grad.float() + residual
    p = c.compress(grad, residual)
    # Selection moves values, it does no arithmetic: the invariant is exact.
    assert torch.equal(c.decompress(p) + residual, total)
    assert bool((residual[p.indices.long()] == 0).all())


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
def test_error_feedback_over_many_steps(impl, device):
    n, steps, density = 5_000, 400, 0.01
    c = pycomm.get_compressor("topk", density=density, approx=True, impl=impl)
    gen = torch.Generator().manual_seed(4)
    residual = torch.zeros(n, device=device)
    sum_grad = torch.zeros(n, dtype=torch.float64, device=device)
    sum_sent = torch.zeros(n, dtype=torch.float64, device=device)
    norms = []
    for _ in range(steps):
        g = (torch.randn(n, generator=gen) + 0.05).to(device)
        sum_grad += g.double()
        sum_sent += c.decompress(c.compress(g, residual)).double()
        norms.append(residual.norm().item())
    torch.testing.assert_close(sum_sent + residual.double(), sum_grad, rtol=0, atol=1e-3)
    # With ~1% sent per step, the residual saturates instead of growing forever.
    assert max(norms[-50:]) < 1.3 * max(norms[150:200])


@pytest.mark.parametrize("approx", [False, True], ids=["exact", "approx"])
@pytest.mark.parametrize("order", ["ascending", "descending", "ties"])
@pytest.mark.parametrize("n,k", [(1024, 64), (1024, 65), (16384, 10), (16385, 10), (4096, 1), (64, 64)])
def test_small_selection_orders(approx, order, n, k):
    # The CPU kernel selects on a small tensor among the keys at or above
    # the groups' k-th largest maximum (k small next to n / 16), or over
    # every key, above with histograms: magnitudes rising, falling, and few
    # distinct values (ties at the threshold), each against the reference.
    mag = torch.arange(1, n + 1, dtype=torch.float32)
    if order == "descending":
        mag = mag.flip(0)
    elif order == "ties":
        mag = (mag % 7).float()
    grad = mag * torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    p_ref, p_imp, r_ref, r_imp = run_both("cpu", "cpu", grad, torch.zeros(n), k / n, approx)
    assert_same(p_ref, p_imp, r_ref, r_imp)


@pytest.mark.parametrize("approx", [False, True], ids=["exact", "approx"])
@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.one_of(
            st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
            st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0]),
        ),
        min_size=1,
        max_size=3000,
    ),
    density=st.floats(1e-4, 1.0),
)
def test_property_cpu_matches_reference(approx, data, density):
    grad = torch.tensor(data, dtype=torch.float32)
    residual = torch.zeros(grad.numel())
    p_ref, p_imp, r_ref, r_imp = run_both("cpu", "cpu", grad, residual, density, approx)
    assert_same(p_ref, p_imp, r_ref, r_imp)


def test_payload_nbytes():
    n = 100_000
    exact = pycomm.get_compressor("topk", density=0.01, approx=False)
    approx = pycomm.get_compressor("topk", density=0.01, approx=True)
    g = torch.randn(n)
    assert exact.payload_nbytes(n) == exact.compress(g).nbytes == 8 * 1000
    assert approx.payload_nbytes(n) == 8 * 1250 >= approx.compress(g).nbytes
    assert exact.k(1) == 1 and exact.k(101) == math.ceil(0.01 * 101)


def test_opcheck():
    g, r = torch.randn(3001), torch.randn(3001)
    for approx in (False, True):
        torch.library.opcheck(torch.ops.pycomm.topk_compress, (g, r, 30, approx))
        torch.library.opcheck(torch.ops.pycomm.topk_compress, (g.bfloat16(), None, 30, approx))
    idx, vals = torch.ops.pycomm.topk_compress(g, r.clone(), 30, True)
    torch.library.opcheck(torch.ops.pycomm.topk_decompress, (torch.zeros(3001), idx, vals, True))
