"""Triton kernels (pycomm/triton) against the pure-torch references.

Without a GPU the kernels run on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set below before triton or pycomm is imported), which is
slow: sizes stay small and the product of parameters is trimmed by hand.
Bits, indices and counts must match the reference exactly; scales, values and
residuals to float32 rounding (onebit's block sums are reduced in another
order), or exactly where no arithmetic differs (topk).
"""

import ast
import os
import pathlib
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import _data  # noqa: E402
import pycomm  # noqa: E402
import pycomm.compressors.onebit as ob  # noqa: E402
import pycomm.compressors.topk as tk  # noqa: E402
from pycomm import _ext  # noqa: E402
from pycomm.triton import onebit as tri_ob  # noqa: E402
from pycomm.triton import topk as tri_tk  # noqa: E402

# The interpreter evaluates Inf - Inf in numpy, which warns; the kernels are
# meant to produce that NaN (it is what the reference produces too).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 31, 32, 33, 2047, 2049, 4097]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = _data.KINDS
# Block sums are reduced in another order than the reference's: scales differ
# by float32 rounding, and residuals (c -+ scale) inherit an ulp of the scale.
SCALE_TOL = dict(rtol=4e-6, atol=0.0)
RESIDUAL_TOL = dict(rtol=4e-6, atol=1e-6)


def make_grad(n, dtype=torch.float32, kind="random", seed=0):
    if kind == "ties":
        # Few distinct magnitudes: many keys equal the threshold.
        gen = torch.Generator().manual_seed(seed)
        g = torch.randint(-3, 4, (n,), generator=gen).float()
    else:
        g = _data.make_grad(kind, n, seed=seed)
        if kind == "nonfinite":
            g[1::7] = -0.0  # a 1 bit in onebit (>= 0), key 0 in topk
    return g.to(dtype).to(DEVICE)


def make_residual(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(n, generator=gen)).to(DEVICE)


def clone(t):
    return None if t is None else t.clone()


def poisoned(n):
    return torch.full((n,), float("nan"), device=DEVICE)


# ------------------------------------------------------------------ onebit ---
def check_onebit_compress(n, dtype, kind, with_residual, block_size):
    grad = make_grad(n, dtype, kind)
    residual = make_residual(n) if with_residual else None
    res_ref, res_tri = clone(residual), clone(residual)
    bits_ref, scales_ref = ob.compress_reference(grad, res_ref, block_size)
    bits, scales = tri_ob.compress(grad, res_tri, block_size)
    assert bits.dtype == torch.int32 and scales.dtype == torch.float32
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(scales, scales_ref, equal_nan=True, **SCALE_TOL)
    if with_residual:
        torch.testing.assert_close(res_tri, res_ref, equal_nan=True, **RESIDUAL_TOL)
    return grad, residual, bits, scales, res_tri


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_onebit_compress(n, dtype, kind, with_residual):
    check_onebit_compress(n, dtype, kind, with_residual, block_size=2048)


# One program per block: 32-element blocks mean many (slow, interpreted)
# programs, so this axis gets fewer combinations.
@pytest.mark.parametrize("n", SIZES)
def test_onebit_compress_block32(n):
    check_onebit_compress(n, torch.float32, "random", True, block_size=32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_onebit_compress_block32_kinds(dtype, kind):
    check_onebit_compress(97, dtype, kind, True, block_size=32)


# 96: a tile wider than the block; 4096 / 65536: blocks looped over in tiles.
@pytest.mark.parametrize("n,block_size", [(2049, 96), (4097, 4096), (9000, 4096), (70000, 65536)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_onebit_compress_block_shapes(n, block_size, with_residual):
    check_onebit_compress(n, torch.float32, "nonfinite", with_residual, block_size)


def test_onebit_large():
    check_onebit_compress(1 << 16, torch.float32, "random", True, block_size=2048)


def test_onebit_padding_bits_zero():
    # Bits past n must be 0 although padding would compare >= 0.
    bits, _ = tri_ob.compress(torch.ones(33, device=DEVICE), None, 32)
    assert bits.tolist() == [-1, 1]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("block_size", [32, 2048])
@pytest.mark.parametrize("n", SIZES)
def test_onebit_decompress(n, block_size, accumulate):
    grad = make_grad(n, kind="nonfinite")
    bits, scales = ob.compress_reference(grad, None, block_size)
    if accumulate:
        out_ref = make_residual(n, seed=2)
    else:
        out_ref = poisoned(n)  # every element must be written
    out = out_ref.clone()
    ob.decompress_reference(bits, scales, block_size, out_ref, accumulate)
    tri_ob.decompress(bits, scales, block_size, out, accumulate)
    torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block_size", [(4097, 32), (4097, 2048), (9000, 4096)])
def test_onebit_error_feedback(n, block_size, dtype):
    grad = make_grad(n, dtype)
    residual = make_residual(n)
    expected = grad.float() + residual
    bits, scales = tri_ob.compress(grad, residual, block_size)
    out = poisoned(n)
    tri_ob.decompress(bits, scales, block_size, out, False)
    torch.testing.assert_close(out + residual, expected)


# -------------------------------------------------------------------- topk ---
@pytest.fixture
def accept_calls(monkeypatch):
    """Records every (count, k) passed to topk's accept rule: the reference
    and the Triton impl must reach the same decisions from the same counts.
    Both modules call the rule through their own global name (pycomm.wire's
    function), so each is spied on, into one list."""
    calls = []

    def spy_on(module):
        real = module.accept

        def spy(count, k):
            calls.append((count, k))
            return real(count, k)

        monkeypatch.setattr(module, "accept", spy)

    spy_on(tk)
    spy_on(tri_tk)
    return calls


def check_topk_compress(grad, with_residual, k, approx, accept_calls=None):
    n = grad.numel()
    residual = make_residual(n) if with_residual else None
    res_ref, res_tri = clone(residual), clone(residual)
    if accept_calls is not None:
        accept_calls.clear()
    idx_ref, val_ref = tk.compress_reference(grad, res_ref, k, approx)
    ref_calls = list(accept_calls) if accept_calls is not None else None
    if accept_calls is not None:
        accept_calls.clear()
    idx, val = tri_tk.compress(grad, res_tri, k, approx)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(val, val_ref, equal_nan=True, rtol=0, atol=0)
    if with_residual:
        torch.testing.assert_close(res_tri, res_ref, equal_nan=True, rtol=0, atol=0)
    if approx:
        assert k <= idx.numel() <= tk.topk_capacity(k)
    else:
        assert idx.numel() == k
    if accept_calls is not None:
        assert accept_calls == ref_calls
    return idx, val, residual, res_tri


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("density", [0.01, 0.3])
@pytest.mark.parametrize("n", SIZES)
def test_topk_compress(n, density, approx, with_residual, accept_calls):
    grad = make_grad(n)
    check_topk_compress(grad, with_residual, tk.topk_k(n, density), approx, accept_calls)


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("density", [0.01, 0.3])
@pytest.mark.parametrize("kind", ["zeros", "negative", "nonfinite", "ties"])
@pytest.mark.parametrize("n", [33, 4097])
def test_topk_compress_kinds(n, kind, density, approx, accept_calls):
    grad = make_grad(n, kind=kind)
    check_topk_compress(grad, kind != "ties", tk.topk_k(n, density), approx, accept_calls)


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("kind", ["random", "nonfinite", "ties"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_compress_half(dtype, kind, approx, accept_calls):
    grad = make_grad(2049, dtype, kind)
    check_topk_compress(grad, True, tk.topk_k(2049, 0.3), approx, accept_calls)
    check_topk_compress(grad, False, tk.topk_k(2049, 0.01), approx, accept_calls)


@pytest.mark.parametrize("approx", [False, True])
def test_topk_k_equals_n(approx, accept_calls):
    grad = make_grad(2049, kind="nonfinite")
    check_topk_compress(grad, True, 2049, approx, accept_calls)


def _retry_then_accept_grad():
    # n = 16384, k = 4916 -> stride 4, sample at 4j + 2 (4096 keys 1..4096).
    # The other 12288 keys are spread over [2048, 4096), so the first count is
    # ~2x the target, and the corrected rank lands inside [k, 1.25 k].
    n = 16384
    g = torch.empty(n)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[2::4] = True
    g[sampled] = torch.randperm(4096, generator=torch.Generator().manual_seed(3)).float() + 1
    g[~sampled] = 2048 + torch.arange(12288).float() / 6
    g[1::3] *= -1
    return g, 0.3


def _rank_cannot_move_grad():
    # density 0.9 -> the sample rank clamps at s; the sampled (odd) entries
    # dominate, so the count is far below k and the corrected rank is s again:
    # the retry is skipped and the exact threshold used.
    n = 8192
    g = torch.full((n,), 0.5)
    g[1::2] = 2.0 + torch.arange(4096).float()
    return g, 0.9


@pytest.mark.parametrize(
    "case,counts",
    [
        ("retry_then_accept", 2),
        ("rank_cannot_move", 1),
        ("reject_twice", 2),
    ],
)
def test_topk_approx_paths(case, counts, accept_calls, monkeypatch):
    """Each branch of select_reference's approximate mode, checked to be taken."""
    if case == "retry_then_accept":
        g, density = _retry_then_accept_grad()
    elif case == "rank_cannot_move":
        g, density = _rank_cannot_move_grad()
    else:
        g, density = torch.zeros(3000), 0.01  # every count is n
    g = g.to(DEVICE)
    k = tk.topk_k(g.numel(), density)
    kth_calls = []
    real_kth = tri_tk._Pass.kth_largest_key

    def spy(self, k):
        kth_calls.append(k)
        return real_kth(self, k)

    monkeypatch.setattr(tri_tk._Pass, "kth_largest_key", spy)
    # No residual for the all-zeros case: it has to stay all ties.
    check_topk_compress(g, case != "reject_twice", k, True, accept_calls)
    assert len(accept_calls) == counts
    accepted = tk.topk_capacity(k) >= accept_calls[-1][0] >= k
    assert accepted == (case == "retry_then_accept")
    assert kth_calls == ([] if accepted else [k])


@pytest.mark.parametrize("approx", [False, True])
def test_topk_large(approx, accept_calls):
    # 1<<16 at 0.01: sample stride 2, so the sample is a strict subset.
    n = 1 << 16
    assert tk.sample_stride(n, tk.topk_k(n, 0.01)) > 1
    check_topk_compress(make_grad(n), True, tk.topk_k(n, 0.01), approx, accept_calls)


def test_topk_radix_state():
    grad = make_grad(4097, kind="ties")
    state = tri_tk._Pass(grad, None).kth_largest_key(100)
    keys = tk.keys_reference(grad.float())
    thr = int(torch.topk(keys, 100).values[-1])
    assert state.tolist() == [thr, 100 - int((keys > thr).sum())]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("n", [1, 33, 4097])
def test_topk_decompress(n, accumulate):
    grad = make_grad(n, kind="nonfinite")
    idx, val = tk.compress_reference(grad, None, tk.topk_k(n, 0.3), False)
    out_ref = make_residual(n, seed=2) if accumulate else poisoned(n)
    out = out_ref.clone()
    tk.decompress_reference(idx, val, out_ref, accumulate)
    tri_tk.decompress(idx, val, out, accumulate)
    torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_error_feedback(dtype, approx):
    n = 4097
    grad = make_grad(n, dtype)
    residual = make_residual(n)
    expected = grad.float() + residual
    idx, val = tri_tk.compress(grad, residual, tk.topk_k(n, 0.01), approx)
    out = poisoned(n)
    tri_tk.decompress(idx, val, out, False)
    # Nothing is rounded: sent entries move to the payload, the rest stay.
    assert torch.equal(out + residual, expected)


# ------------------------------------------------------- random shapes ---
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3000),
    words_per_block=st.sampled_from([1, 3, 64, 65]),
    dtype=st.sampled_from(DTYPES),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_onebit_random_shapes(n, words_per_block, dtype, with_residual, seed):
    grad = make_grad(n, dtype, seed=seed)
    residual = make_residual(n, seed=seed + 1) if with_residual else None
    res_ref, res_tri = clone(residual), clone(residual)
    block_size = 32 * words_per_block
    bits_ref, scales_ref = ob.compress_reference(grad, res_ref, block_size)
    bits, scales = tri_ob.compress(grad, res_tri, block_size)
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(scales, scales_ref, **SCALE_TOL)
    if with_residual:
        torch.testing.assert_close(res_tri, res_ref, **RESIDUAL_TOL)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3000),
    density=st.floats(1e-4, 1.0),
    approx=st.booleans(),
    kind=st.sampled_from(["random", "ties"]),
    seed=st.integers(0, 2**16),
)
def test_topk_random_shapes(n, density, approx, kind, seed):
    grad = make_grad(n, kind=kind, seed=seed)
    k = tk.topk_k(n, density)
    idx_ref, val_ref = tk.compress_reference(grad, None, k, approx)
    idx, val = tri_tk.compress(grad, None, k, approx)
    assert torch.equal(idx, idx_ref)
    assert torch.equal(val, val_ref)


# -------------------------------------------------------------- public API ---
def _require_triton_impl(name):
    devices = pycomm.compressors.compressor_class(name).impls["triton"].devices
    if DEVICE not in devices:
        pytest.skip(
            "pycomm was imported before TRITON_INTERPRET=1 was set (another test "
            "module imported it first), so its triton impl only accepts "
            f"{list(devices)} tensors; run this file alone or export TRITON_INTERPRET=1"
        )


def test_public_onebit():
    _require_triton_impl("onebit")
    c = pycomm.get_compressor("onebit", block_size=64, impl="triton")
    ref = pycomm.get_compressor("onebit", block_size=64, impl="reference")
    grad = make_grad(1000).view(10, 100)
    res = make_residual(1000).view(10, 100)
    res_ref = res.clone()
    expected = grad + res
    p = c.compress(grad, res)
    p_ref = ref.compress(grad, res_ref)
    assert torch.equal(p.bits, p_ref.bits)
    torch.testing.assert_close(p.scales, p_ref.scales, **SCALE_TOL)
    torch.testing.assert_close(res, res_ref, **RESIDUAL_TOL)
    out = c.decompress(p)
    assert out.shape == (10, 100)
    torch.testing.assert_close(out + res, expected)
    assert p.nbytes == c.payload_nbytes(1000)


def test_public_topk():
    _require_triton_impl("topk")
    for approx in (False, True):
        c = pycomm.get_compressor("topk", density=0.05, approx=approx, impl="triton")
        ref = pycomm.get_compressor("topk", density=0.05, approx=approx, impl="reference")
        grad = make_grad(1000).view(20, 50)
        res = make_residual(1000).view(20, 50)
        res_ref = res.clone()
        expected = grad + res
        p = c.compress(grad, res)
        p_ref = ref.compress(grad, res_ref)
        assert torch.equal(p.indices, p_ref.indices)
        assert torch.equal(p.values, p_ref.values)
        out = torch.full((20, 50), float("nan"), device=DEVICE)
        c.decompress(p, out=out)
        assert torch.equal(out + res, expected)


# ----------------------------------------------------------------- the ops ---
# Each Triton op -> the C++ op whose schema and semantics it mirrors.
TRITON_OPS = {
    "onebit_compress_triton": "onebit_compress",
    "onebit_compress_into_triton": "onebit_compress_into",
    "onebit_decompress_triton": "onebit_decompress",
    "topk_compress_triton": "topk_compress",
    "topk_decompress_triton": "topk_decompress",
}
ODD_SIZES = [1, 31, 33, 4097]


def _signature(name):
    """The schema of pycomm::name without its name, written as csrc/ops does:
    triton_op infers schemas from Python annotations, which makes an int a
    SymInt and numbers the alias sets (a0!, a1!, ...)."""
    schema = str(getattr(torch.ops.pycomm, name).default._schema)
    schema = schema.replace(f"pycomm::{name}(", "(", 1).replace("SymInt ", "int ")
    for i in range(8):
        schema = schema.replace(f"(a{i}!)", "(a!)")
    return schema


@pytest.mark.parametrize("name", sorted(TRITON_OPS))
def test_op_registered(name):
    qualname = f"pycomm::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
    # triton_op's bookkeeping (what torch.compile / AOTInductor consult).
    assert qualname in torch._library.triton.triton_ops_to_kernels
    if not _ext.has_ops():
        pytest.skip("the C++ ops to compare schemas with are not built")
    assert _signature(name) == _signature(TRITON_OPS[name])


def test_ops_through_the_dispatcher():
    # How the C++ engine calls an impl: c10::Dispatcher::findSchemaOrThrow by
    # name, then a call that Python does not mediate.
    def call(name, *args):
        handle = torch._C._dispatch_find_schema_or_throw(f"pycomm::{name}", "")
        return torch._C._dispatch_call_boxed(handle, *args)

    grad, residual = make_grad(33, kind="nonfinite"), make_residual(33)
    res_ref, res_op = residual.clone(), residual.clone()
    bits_ref, scales_ref = ob.compress_reference(grad, res_ref, 32)
    bits, scales = call("onebit_compress_triton", grad, res_op, 32)
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(scales, scales_ref, equal_nan=True, **SCALE_TOL)
    torch.testing.assert_close(res_op, res_ref, equal_nan=True, **RESIDUAL_TOL)
    out, out_ref = poisoned(33), poisoned(33)
    call("onebit_decompress_triton", out, bits_ref, scales_ref, 32, False)
    ob.decompress_reference(bits_ref, scales_ref, 32, out_ref, False)
    torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)

    idx_ref, val_ref = tk.compress_reference(grad, None, 5, True)
    idx, val = call("topk_compress_triton", grad, None, 5, True)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(val, val_ref, equal_nan=True, rtol=0, atol=0)
    out, out_ref = poisoned(33), poisoned(33)
    call("topk_decompress_triton", out, idx_ref, val_ref, False)
    tk.decompress_reference(idx_ref, val_ref, out_ref, False)
    torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_onebit_ops_match_reference(n, kind):
    grad = make_grad(n, kind=kind)
    residual = make_residual(n)
    res_ref, res_op = residual.clone(), residual.clone()
    bits_ref, scales_ref = ob.compress_reference(grad, res_ref, 64)
    bits, scales = torch.ops.pycomm.onebit_compress_triton(grad, res_op, 64)
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(scales, scales_ref, equal_nan=True, **SCALE_TOL)
    torch.testing.assert_close(res_op, res_ref, equal_nan=True, **RESIDUAL_TOL)

    # compress_into: the same payload and new residual, in a second buffer;
    # the old residual left as it was.
    res_in, res_out = residual.clone(), poisoned(n)
    bits2, scales2 = torch.ops.pycomm.onebit_compress_into_triton(grad, res_in, res_out, 64)
    assert torch.equal(bits2, bits)
    torch.testing.assert_close(scales2, scales, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(res_out, res_op, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(res_in, residual)
    # ... or in place, when both are one tensor.
    res_same = residual.clone()
    torch.ops.pycomm.onebit_compress_into_triton(grad, res_same, res_same, 64)
    torch.testing.assert_close(res_same, res_op, equal_nan=True, rtol=0, atol=0)

    for accumulate in (False, True):
        out_ref = make_residual(n, seed=2) if accumulate else poisoned(n)
        out = out_ref.clone()
        ob.decompress_reference(bits_ref, scales_ref, 64, out_ref, accumulate)
        torch.ops.pycomm.onebit_decompress_triton(out, bits_ref, scales_ref, 64, accumulate)
        torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_topk_ops_match_reference(n, kind, approx):
    grad = make_grad(n, kind=kind)
    residual = make_residual(n)
    res_ref, res_op = residual.clone(), residual.clone()
    k = tk.topk_k(n, 0.1)
    idx_ref, val_ref = tk.compress_reference(grad, res_ref, k, approx)
    idx, val = torch.ops.pycomm.topk_compress_triton(grad, res_op, k, approx)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(val, val_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(res_op, res_ref, equal_nan=True, rtol=0, atol=0)

    for accumulate in (False, True):
        out_ref = make_residual(n, seed=2) if accumulate else poisoned(n)
        out = out_ref.clone()
        tk.decompress_reference(idx_ref, val_ref, out_ref, accumulate)
        torch.ops.pycomm.topk_decompress_triton(out, idx_ref, val_ref, accumulate)
        torch.testing.assert_close(out, out_ref, equal_nan=True, rtol=0, atol=0)


# opcheck compares outputs without equal_nan: finite inputs only (NaN and
# Inf are covered by the tests above).
@pytest.mark.parametrize("kind", ["random", "zeros"])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_opcheck_onebit(n, kind):
    # 2048-element blocks: opcheck runs each op several times, and every
    # block is one (slow, interpreted) program.
    grad, residual = make_grad(n, kind=kind), make_residual(n)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.pycomm.onebit_compress_triton, (grad, residual, 2048))
    opcheck(torch.ops.pycomm.onebit_compress_triton, (grad.half(), None, 2048))
    opcheck(torch.ops.pycomm.onebit_compress_into_triton, (grad, residual, torch.zeros_like(grad), 2048))
    bits, scales = ob.compress_reference(grad, residual.clone(), 64)
    for acc in (False, True):
        opcheck(torch.ops.pycomm.onebit_decompress_triton, (make_residual(n, 2), bits, scales, 64, acc))


@pytest.mark.parametrize("kind", ["random", "zeros"])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_opcheck_topk(n, kind):
    grad, residual = make_grad(n, kind=kind), make_residual(n)
    k = tk.topk_k(n, 0.1)
    opcheck = torch.library.opcheck
    for approx in (False, True):
        opcheck(torch.ops.pycomm.topk_compress_triton, (grad, residual, k, approx))
        opcheck(torch.ops.pycomm.topk_compress_triton, (grad.bfloat16(), None, k, approx))
    idx, val = tk.compress_reference(grad, residual.clone(), k, True)
    for accumulate in (False, True):
        opcheck(torch.ops.pycomm.topk_decompress_triton, (make_residual(n, 2), idx, val, accumulate))


def test_ops_under_torch_compile():
    def roundtrip(grad, residual):
        bits, scales = torch.ops.pycomm.onebit_compress_triton(grad, residual, 64)
        dense = torch.empty_like(residual)
        torch.ops.pycomm.onebit_decompress_triton(dense, bits, scales, 64, False)
        idx, val = torch.ops.pycomm.topk_compress_triton(dense, residual, 10, True)
        torch.ops.pycomm.topk_decompress_triton(dense, idx, val, True)
        return dense * 2

    grad, residual = make_grad(1000), make_residual(1000)
    res_eager, res_compiled = residual.clone(), residual.clone()
    expected = roundtrip(grad, res_eager)
    got = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)(grad, res_compiled)
    assert torch.equal(got, expected)
    assert torch.equal(res_compiled, res_eager)


def _overlapping_residuals():
    buf = torch.ones(65)
    return torch.ones(64), buf[:64], buf[1:], 32


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


ones = torch.ones
ERROR_CASES = [
    ("onebit_compress", lambda: (ones(64), None, 48), "positive multiple of 32"),
    ("onebit_compress", lambda: (ones(64, dtype=torch.int32), None, 32), "grad must be float32"),
    ("onebit_compress", lambda: (ones(0), None, 32), "grad is empty"),
    ("onebit_compress", lambda: (ones(64), ones(64).half(), 32), "residual must be float32"),
    ("onebit_compress", lambda: (ones(64), ones(63), 32), "residual has 63 elements"),
    ("onebit_compress_into", _overlapping_residuals, "must be the same tensor or not overlap"),
    ("onebit_decompress", lambda: (ones(64), _i32(0, 0, 0), ones(2), 32, False), "bits has 3 words"),
    ("onebit_decompress", lambda: (ones(64).half(), _i32(0, 0), ones(2), 32, False), "out must be float32"),
    ("topk_compress", lambda: (ones(64), None, 0, False), "k must be in"),
    ("topk_compress", lambda: (ones(64), None, 65, True), "k must be in"),
    ("topk_decompress", lambda: (ones(8), torch.tensor([1, 2]), ones(2), False), "indices must be"),
    ("topk_decompress", lambda: (ones(8), _i32(1, 8), ones(2), False),
     r"indices must be strictly ascending and lie in \[0, 8\)"),
    ("topk_decompress", lambda: (ones(8), _i32(3, 3), ones(2), False), r"strictly ascending"),
]


@pytest.mark.parametrize("name,args,message", ERROR_CASES)
def test_op_errors_match_cpp(name, args, message):
    # The same RuntimeError as the C++ op (TORCH_CHECK), for the same input.
    ops = [name + "_triton"] + ([name] if _ext.has_ops() else [])
    for op in ops:
        with pytest.raises(RuntimeError, match=message):
            getattr(torch.ops.pycomm, op)(*args())


# ----------------------------------------------------------------- layering ---
PKG_DIR = pathlib.Path(pycomm.__file__).parent
TRITON_FILES = sorted((PKG_DIR / "triton").glob("*.py"))


def _imported_modules(path):
    """Absolute names of every module a file in pycomm/triton imports,
    wherever the import statement is (lazy ones inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = ["pycomm", "triton"][: 3 - node.level] if node.level else []
            module = ".".join(package + ([node.module] if node.module else []))
            # `from .. import compressors` imports pycomm.compressors.
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", TRITON_FILES, ids=lambda p: p.name)
def test_triton_package_does_not_import_compressors(path):
    names = _imported_modules(path)
    if path.name != "__init__.py":  # a docstring only
        assert "torch" in names  # the walk sees the file's imports
    assert not [m for m in names if m == "pycomm.compressors" or m.startswith("pycomm.compressors.")]


def test_triton_modules_load_without_compressors():
    # Importing pycomm itself imports the compressors, so the modules are
    # loaded under a bare "pycomm" package whose __init__ never runs: whatever
    # they import shows in sys.modules. They register their ops without
    # pycomm's C++ extension.
    code = f"""
import sys, types
import torch
pkg = types.ModuleType("pycomm")
pkg.__path__ = [{str(PKG_DIR)!r}]
sys.modules["pycomm"] = pkg
import pycomm.triton.onebit, pycomm.triton.topk
loaded = sorted(m for m in sys.modules if m.startswith("pycomm"))
assert loaded == ["pycomm", "pycomm.triton", "pycomm.triton._common", "pycomm.triton.onebit",
                  "pycomm.triton.topk", "pycomm.wire"], loaded
for name in {sorted(TRITON_OPS)!r}:
    getattr(torch.ops.pycomm, name).default
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=os.environ.copy())


def test_kernels_and_reference_share_the_rules():
    # One copy of the wire constants and top-k's rules (pycomm/wire.py): the
    # kernels and the reference read the same objects.
    assert tri_ob.WORD_BITS == ob.WORD_BITS == 32
    for name in ("NAN_KEY", "INF_KEY", "sample_stride", "sample_rank", "retry_rank", "accept", "topk_capacity"):
        assert getattr(tri_tk, name) is getattr(tk, name), name
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("inf"), -float("inf"), float("nan")])
    nans = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    c = torch.cat([make_grad(4097, kind="nonfinite").cpu(), special, nans])
    assert torch.equal(tri_tk.keys(c).long(), tk.keys_reference(c))


def test_compressors_import_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch, pycomm
assert "triton" not in pycomm.available_impls("onebit", "cpu")
c = pycomm.get_compressor("topk", density=0.1)
c.decompress(c.compress(torch.randn(100)))
assert not [m for m in sys.modules if m.startswith("pycomm.triton")]
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=os.environ.copy())
