"""int8 / int4: the reference against the rules, every impl against the reference.

The oracle of the oracle is ``scalar_rules`` below: the rules of
compress_math.h (section "quant") element by element in numpy float32
scalars, with pycomm/wire.py's hash. The pure-torch reference
(pycomm/compressors/quant.py) must agree with it bit for bit; every impl
(the C++ ops, the Triton kernels under TRITON_INTERPRET=1 on CPU, CUDA on a
GPU) must agree with the reference bit for bit: data, scales, residual and
decoded values. NaN compares as "both NaN" (its payload bits may differ
between hardware), everything else by its bits, so -0.0 != 0.0.

Triton's interpreter is slow: its cases stay small.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pycomm
from pycomm.compressors import onebit as ob
from pycomm.compressors import quant as qz
from pycomm.distributed import spec
from pycomm.wire import MASK32, MAX_BLOCK_SIZE, quant_hash, quant_num_bytes, quant_per_byte, quant_qmax

# The interpreter and numpy evaluate 0 * Inf, Inf - Inf and qmax / tiny
# (the rules' NaN and overflow cases), which warn.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

F32 = np.float32
INF, NAN = math.inf, math.nan
FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: The widths of the method table's quant rows, and their names: every test
#: below runs each, so a new row is tested with no edit here.
QUANT_METHODS = list(spec.methods(family="quant"))
BITS = [spec.method_spec(m).bits for m in QUANT_METHODS]
NAME_OF = dict(zip(BITS, QUANT_METHODS))


def fit(block_size: int, bits: int) -> int:
    """block_size rounded up to a whole number of bytes of ``bits``-bit levels."""
    per = quant_per_byte(bits)
    return -(-block_size // per) * per


def odd_or_fit(half_block: int, bits: int) -> int:
    """A block of about ``2 * half_block``: odd where one level is a byte
    (blocks start at odd offsets), else a whole number of bytes."""
    per = quant_per_byte(bits)
    return 2 * half_block - 1 if per == 1 else per * half_block
SEEDS = [-1, 12345]  # round to nearest; stochastic
BLOCK_SIZES = [2, 4, 6, 256, 1000, 4096]


def has_cpp_ops() -> bool:
    return hasattr(torch.ops.pycomm, "quant_compress")


def has_triton() -> bool:
    return pycomm.compressors.compressor_class("int8").impls["triton"].why_unavailable() is None


needs_cpp = pytest.mark.skipif(
    not has_cpp_ops(), reason="torch.ops.pycomm.quant_* are not in the built extension (rebuild it)"
)
needs_triton = pytest.mark.skipif(not has_triton(), reason="Triton cannot run here")

# (impl, device) of every implementation under test besides the reference.
IMPLS = [
    pytest.param("cpu", "cpu", id="cpu", marks=needs_cpp),
    pytest.param("cuda", "cuda", id="cuda", marks=[pytest.mark.gpu, needs_cpp]),
    pytest.param("triton", "cuda" if torch.cuda.is_available() else "cpu", id="triton", marks=needs_triton),
]
WITH_REFERENCE = [pytest.param("reference", "cpu", id="reference"), *IMPLS]


# ------------------------------------------------------------- helpers ---
def scalar_rules(values, bits, block_size, seed, residual=None):
    """The rules, one float32 scalar at a time: (levels, scales, new residual)."""
    qmax = quant_qmax(bits)
    c = [F32(v) for v in values]
    if residual is not None:
        c = [F32(x + F32(r)) for x, r in zip(c, residual, strict=True)]
    levels, scales, res = [], [], []
    with np.errstate(all="ignore"):
        for b0 in range(0, len(c), block_size):
            blk = c[b0 : b0 + block_size]
            amax = F32(NAN) if any(math.isnan(x) for x in blk) else max(abs(x) for x in blk)
            scale = F32(amax / F32(qmax))
            inv = F32(F32(qmax) / amax) if amax > 0 else F32(0)
            if not inv <= FLT_MAX:  # the quotient overflowed (a tiny block)
                inv = F32(0)
            scales.append(scale)
            for j, x in enumerate(blk):
                i = b0 + j
                if inv == 0:
                    q = 0
                else:
                    xi = F32(x * inv)
                    if seed < 0:
                        v = np.rint(xi)  # half to even
                    else:
                        u = F32(quant_hash((i & MASK32) ^ quant_hash(seed & MASK32)) >> 8) * F32(2.0**-24)
                        v = np.floor(F32(xi + u))
                    q = int(max(-qmax, min(qmax, v)))
                levels.append(q)
                res.append(F32(x - F32(F32(q) * scale)))
    return levels, np.array(scales, dtype=np.float32), np.array(res, dtype=np.float32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal float32 tensors, except that any NaN equals any NaN."""
    a, b = a.detach().cpu().float().reshape(-1), b.detach().cpu().float().reshape(-1)
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def assert_same(a, b, what):
    if not same(a, b):
        a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)
        diff = [i for i in range(a.numel()) if not same(a[i : i + 1], b[i : i + 1])] if a.shape == b.shape else []
        i = diff[0] if diff else None
        detail = f"first at {i}: {a[i].item()!r} vs {b[i].item()!r}" if diff else f"shapes {a.shape} {b.shape}"
        raise AssertionError(f"{what} differ in {len(diff)} elements; {detail}")


def hostile(n: int, seed: int = 0) -> torch.Tensor:
    """Normal values with every special float32 sprinkled in, and blocks of
    the kinds the rules single out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    specials = [NAN, INF, -INF, 0.0, -0.0, 1e-45, -1e-45, 3e-39, -1e-40, FLT_MAX, -FLT_MAX, 3e38, 1e-30, 0.5]
    for k, v in enumerate(specials):
        x[(k * 7 + 3) % n] = v
    if n >= 64:
        x[16:24] = torch.tensor([1e-38, 0.0, -5e-39, -0.0, 2e-45, 0.0, 1e-39, -0.0])  # qmax / amax overflows
        x[24:32] = torch.tensor([FLT_MAX, -FLT_MAX, 1.0, -3e38, 0.0, 2e38, -1.0, 5.0])  # near float max
        x[32:40] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0])  # ties (scale 1 / 127 ...)
        x[40:48] = 0.0
    return x


def make_grad(kind: str, n: int, dtype=torch.float32, seed: int = 0, device="cpu") -> torch.Tensor:
    if kind == "hostile":
        x = hostile(n, seed)
    else:
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return x.to(dtype).to(device)


def make_residual(n: int, seed: int = 1, device="cpu") -> torch.Tensor:
    return (0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(device)


def residual_of(kind: str, n: int):
    """None, -0.0 (c == grad exactly, tiny values stay tiny) or random."""
    return {"none": None, "zero": torch.full((n,), -0.0), "random": make_residual(n, seed=n)}[kind]


def impl_compress(impl, device, grad, residual, bits, block_size, seed):
    """(data, scales) from impl, through its Impl entry (the ops)."""
    return qz.IMPLS[impl].compress(grad.to(device), residual, bits, block_size, seed)


def impl_decompress(impl, device, data, scales, bits, block_size, out, accumulate):
    qz.IMPLS[impl].decompress(data.to(device), scales.to(device), bits, block_size, out, accumulate)


def check_compress(impl, device, grad, residual, bits, block_size, seed):
    """impl against the reference, from the same inputs; returns the reference's payload."""
    r_ref = residual.clone() if residual is not None else None
    r_imp = residual.clone().to(device) if residual is not None else None
    data_ref, scales_ref = qz.compress_reference(grad, r_ref, bits, block_size, seed)
    data, scales = impl_compress(impl, device, grad, r_imp, bits, block_size, seed)
    assert data.dtype == torch.uint8 and data.shape == (quant_num_bytes(grad.numel(), bits),)
    assert scales.dtype == torch.float32 and scales.shape == (-(-grad.numel() // block_size),)
    assert torch.equal(data.cpu(), data_ref), "data differ from the reference"
    assert_same(scales, scales_ref, "scales")
    if residual is not None:
        assert_same(r_imp, r_ref, "residuals")
    return data_ref, scales_ref


def sizes(block_size):
    return sorted({1, 2, 3, 31, 33, block_size + 1, 3 * block_size + 5})


def poisoned(n, device="cpu"):
    return torch.full((n,), NAN, device=device)


# ----------------------------------------------------- the rules, by hand ---
def test_hash_and_uniform_follow_wire():
    xs = torch.tensor([0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, MASK32], dtype=torch.int64)
    assert qz.hash_reference(xs).tolist() == [quant_hash(int(x)) for x in xs]
    assert quant_hash(0) == 0 and quant_hash(1) == 0x688990C0
    for seed in (0, 7, MASK32):
        u = qz.uniform_reference(seed, 300)
        expected = [(quant_hash(i ^ quant_hash(seed)) >> 8) * 2.0**-24 for i in range(300)]
        assert u.tolist() == expected
        assert 0.0 <= u.min() and u.max() < 1.0


def test_int8_by_hand():
    # Block 0: amax 254 -> scale 2, inv 0.5; levels round half to even.
    grad = torch.tensor([1.0, -2.0, 0.5, 254.0, 3.0, -1.0, 6.0, 5.0])
    r = torch.zeros(8)
    data, scales = qz.compress_reference(grad, r, 8, 4, -1)
    assert data.view(torch.int8).tolist() == [0, -1, 0, 127, 64, -21, 127, 106]
    assert scales.tolist() == [2.0, float(F32(6.0) / F32(127))]
    out = torch.empty(8)
    qz.decompress_reference(data, scales, 8, 4, out, False)
    assert torch.equal(out + r, grad)
    assert r[:4].tolist() == [1.0, 0.0, 0.5, 0.0]


def test_int4_packing_by_hand():
    # Element 2j in the low nibble, 2j+1 in the high one, two's complement;
    # the missing last high nibble is 0.
    grad = torch.tensor([7.0, -3.0, 1.0, -7.0, 14.0])
    data, scales = qz.compress_reference(grad, None, 4, 4, -1)
    assert data.tolist() == [0xD7, 0x91, 0x07]
    assert scales.tolist() == [1.0, 2.0]
    out = poisoned(5)
    qz.decompress_reference(data, scales, 4, 4, out, False)
    assert out.tolist() == [7.0, -3.0, 1.0, -7.0, 14.0]


def test_round_half_to_even():
    # amax 127 -> inv 1: the levels are round(c) itself.
    grad = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0])
    data, _ = qz.compress_reference(grad, None, 8, 8, -1)
    assert data.view(torch.int8).tolist() == [0, 2, 2, 0, -2, -2, 126, 127]


def test_nonfinite_blocks_decode_to_nan():
    grad = torch.tensor([1.0, NAN, 2.0, 3.0, INF, 1.0, -INF, 4.0, 0.0, -0.0, 0.0, 0.0])
    for bits in BITS:
        r = torch.full((12,), -0.0)  # c = grad + -0.0 keeps the sign of a zero
        data, scales = qz.compress_reference(grad, r, bits, 4, -1)
        assert math.isnan(scales[0]) and scales[1] == INF and scales[2].item() == 0.0
        assert torch.equal(qz.unpack_reference(data, bits, 12), torch.zeros(12, dtype=torch.int32))
        out = torch.empty(12)
        qz.decompress_reference(data, scales, bits, 4, out, False)
        assert out[:8].isnan().all()  # never a silently finite value
        assert torch.equal(out[8:], torch.zeros(4))
        assert r[:8].isnan().all()
        # An all-zero block: scale 0, residual keeps the zeros' signs.
        assert r[8:].tolist() == [0.0, -0.0, 0.0, 0.0] and math.copysign(1, r[9]) < 0


def test_tiny_amax():
    # amax below qmax / FLT_MAX: qmax / amax would overflow, so inv is 0:
    # the block sends zeros and the residual keeps all of it.
    for bits in BITS:
        tiny = float(F32(0.5 * quant_qmax(bits) / FLT_MAX))
        grad = torch.tensor([tiny, 0.0, -tiny / 2, -0.0])
        assert grad[0] > 0 and quant_qmax(bits) / grad[0].item() > FLT_MAX
        r = torch.zeros(4)
        data, scales = qz.compress_reference(grad, r, bits, 4, -1)
        assert qz.unpack_reference(data, bits, 4).tolist() == [0, 0, 0, 0]
        assert torch.equal(r, grad)  # nothing lost
        levels, sc, res = scalar_rules(grad.tolist(), bits, 4, -1, [0.0] * 4)
        assert same(r, torch.from_numpy(res)) and same(scales, torch.from_numpy(sc))


def test_stochastic_rounding_is_unbiased():
    # x = c * inv = 0.3 for every element: q is 1 with probability 0.3.
    n = 20000
    grad = torch.full((n,), 0.3)
    grad[0] = 127.0  # amax 127 -> inv 1 (in the one block)
    data, _ = qz.compress_reference(grad, None, 8, n, 99)
    q = data.view(torch.int8)[1:].float()
    assert set(q.unique().tolist()) == {0.0, 1.0}
    assert abs(q.mean().item() - 0.3) < 0.015


# ------------------------------------------- reference against the rules ---
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", [-1, 0, 12345, MASK32])
@pytest.mark.parametrize("block_size", [2, 6, 64, 1000])
def test_reference_matches_scalar_rules(bits, seed, block_size):
    n, block_size = 301, fit(block_size, bits)
    grad, residual = hostile(n, seed=block_size), make_residual(n)
    r = residual.clone()
    data, scales = qz.compress_reference(grad, r, bits, block_size, seed)
    levels, sc, res = scalar_rules(grad.tolist(), bits, block_size, seed, residual.tolist())
    assert qz.unpack_reference(data, bits, n).tolist() == levels
    assert torch.equal(qz.pack_reference(torch.tensor(levels, dtype=torch.int32), bits), data)
    assert_same(scales, torch.from_numpy(sc), "scales")
    assert_same(r, torch.from_numpy(res), "residuals")


FLOATS = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    st.floats(-4.0, 4.0, width=32),
    st.sampled_from([NAN, INF, -INF, 0.0, -0.0, 1e-45, FLT_MAX]),
)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(FLOATS, min_size=1, max_size=200),
    bits=st.sampled_from(BITS),
    half_block=st.integers(1, 40),
    seed=st.sampled_from([-1, 0, 1, 2**31, MASK32]),
    ef=st.sampled_from(["none", "zero", "random"]),
)
def test_property_reference_matches_scalar_rules(values, bits, half_block, seed, ef):
    n = len(values)
    block_size = odd_or_fit(half_block, bits)
    grad = torch.tensor(values, dtype=torch.float32)
    residual = residual_of(ef, n)
    r = residual.clone() if residual is not None else None
    data, scales = qz.compress_reference(grad, r, bits, block_size, seed)
    levels, sc, res = scalar_rules(values, bits, block_size, seed, None if r is None else residual.tolist())
    assert qz.unpack_reference(data, bits, n).tolist() == levels
    assert_same(scales, torch.from_numpy(sc), "scales")
    if r is not None:
        assert_same(r, torch.from_numpy(res), "residuals")


def test_reference_block_far_longer_than_tensor():
    # Memory follows n, not block_size.
    grad = torch.tensor([1.0, -2.0, 3.0, 0.25, 5.0])
    for bits in BITS:
        data, scales = qz.compress_reference(grad, None, bits, MAX_BLOCK_SIZE, -1)
        levels, sc, _ = scalar_rules(grad.tolist(), bits, MAX_BLOCK_SIZE, -1)
        assert qz.unpack_reference(data, bits, 5).tolist() == levels and scales.numel() == 1


# ------------------------------------------------ impls against reference ---
@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sizes_and_block_sizes(impl, device, bits, seed, block_size):
    block_size = fit(block_size, bits)
    for n in sizes(block_size):
        grad = make_grad("hostile" if n >= 64 else "random", n, seed=n)
        data, scales = check_compress(impl, device, grad, make_residual(n, n), bits, block_size, seed)
        # Decompress the reference's payload: written over a poisoned output.
        out, expected = poisoned(n, device), torch.empty(n)
        impl_decompress(impl, device, data, scales, bits, block_size, out, False)
        qz.decompress_reference(data, scales, bits, block_size, expected, False)
        assert_same(out, expected, f"decoded values (n={n})")


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("block_size", [1, 3, 33, 257])
def test_int8_odd_block_sizes(impl, device, seed, block_size):
    # int8 takes any block size: blocks (and element pairs) start at odd offsets.
    for n in sizes(block_size):
        grad = make_grad("hostile" if n >= 64 else "random", n, seed=n)
        data, scales = check_compress(impl, device, grad, make_residual(n, n), 8, block_size, seed)
        out, expected = make_residual(n, 5).to(device), make_residual(n, 5)
        impl_decompress(impl, device, data, scales, 8, block_size, out, True)
        qz.decompress_reference(data, scales, 8, block_size, expected, True)
        assert_same(out, expected, f"accumulated values (n={n})")


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ef", [True, False], ids=["ef", "noef"])
def test_dtypes_and_values(impl, device, bits, seed, dtype, ef):
    n = 1001
    for kind, block_size in (("hostile", fit(6, bits)), ("hostile", 256), ("random", 64)):
        grad = make_grad(kind, n, dtype, seed=block_size)
        check_compress(impl, device, grad, make_residual(n) if ef else None, bits, block_size, seed)


# Blocks the rules single out, each a block of its own: all zeros, NaN,
# +-Inf, values near float max, denormals, and an amax below qmax / FLT_MAX
# (qmax / amax would overflow: inv is 0, the block sends zeros).
SPECIAL_BLOCKS = [
    [0.0, -0.0, 0.0, -0.0],
    [1.0, NAN, -2.0, 0.0],
    [INF, 1.0, -0.0, 3.0],
    [-INF, INF, 0.0, 1.0],
    [FLT_MAX, -FLT_MAX, 0.0, 1e30],
    [3e38, -1.0, 2e38, -0.0],
    [1e-45, -1e-45, 0.0, 3e-45],
    [1e-38, 0.0, -5e-39, -0.0],
    [2e-37, -1e-37, 0.0, 5e-38],
    [0.5, 1.5, -2.5, 127.0],
]


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
def test_special_blocks(impl, device, bits, seed):
    grad = torch.tensor([v for block in SPECIAL_BLOCKS for v in block])
    # A residual of -0.0 leaves c == grad, signs of zeros included.
    residual = torch.full_like(grad, -0.0)
    for dtype in DTYPES:
        check_compress(impl, device, grad.to(dtype), residual, bits, 4, seed)
    check_compress(impl, device, grad, None, bits, 4, seed)
    levels, _, res = scalar_rules(grad.tolist(), bits, 4, seed, residual.tolist())
    r = residual.clone().to(device)
    data, _ = impl_compress(impl, device, grad, r, bits, 4, seed)
    assert qz.unpack_reference(data.cpu(), bits, grad.numel()).tolist() == levels
    assert_same(r, torch.from_numpy(res), "residuals")


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("bits", BITS)
def test_block_size_limit(impl, device, bits):
    # The largest block size on a small tensor: one block, no loop to 2^30.
    grad = make_grad("hostile", 77, seed=5)
    for seed in SEEDS:
        check_compress(impl, device, grad, make_residual(77), bits, MAX_BLOCK_SIZE, seed)


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("bits", BITS)
def test_decompress_accumulate(impl, device, bits):
    n, block_size = 1001, 64
    data, scales = qz.compress_reference(make_grad("hostile", n), None, bits, block_size, 7)
    base = make_residual(n, seed=3)
    expected = base.clone()
    qz.decompress_reference(data, scales, bits, block_size, expected, True)
    out = base.clone().to(device)
    impl_decompress(impl, device, data, scales, bits, block_size, out, True)
    assert_same(out, expected, "accumulated values")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
@needs_cpp
@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(FLOATS, min_size=1, max_size=600),
    half_block=st.sampled_from([1, 2, 3, 16, 128, 500]),
    ef=st.sampled_from(["none", "zero", "random"]),
)
def test_property_cpu_matches_reference(bits, seed, values, half_block, ef):
    grad = torch.tensor(values, dtype=torch.float32)
    block_size = odd_or_fit(half_block, bits)
    check_compress("cpu", "cpu", grad, residual_of(ef, grad.numel()), bits, block_size, seed)


@needs_triton
@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    values=st.lists(FLOATS, min_size=1, max_size=300),
    bits=st.sampled_from(BITS),
    half_block=st.sampled_from([1, 3, 16, 1000]),
    seed=st.sampled_from([-1, 3]),
)
def test_property_triton_matches_reference(values, bits, half_block, seed):
    grad = torch.tensor(values, dtype=torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_compress("triton", device, grad, residual_of("zero", grad.numel()), bits, fit(2 * half_block, bits), seed)


# ------------------------------------------------------- compressor API ---
@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
@pytest.mark.parametrize("name", QUANT_METHODS)
def test_error_feedback_invariant(impl, device, name):
    # decoded + new residual == c to float rounding; the residual is exactly
    # c minus what the receiver decodes, and exactly c where the level is 0.
    c = pycomm.get_compressor(name, block_size=64, rounding="stochastic", impl=impl)
    n = 1001
    grad = make_grad("random", n, seed=2, device=device) * 10
    residual = make_residual(n, device=device)
    total = grad + residual
    p = c.compress(grad, residual)
    decoded = c.decompress(p)
    assert_same(residual, total - decoded, "residual vs c - decoded")
    zero = qz.unpack_reference(p.data.cpu(), p.bits, n) == 0
    assert_same(residual.cpu()[zero], total.cpu()[zero], "residual where q == 0")
    scale = p.scales.cpu().repeat_interleave(64)[:n]
    err = (decoded + residual - total).abs().cpu()
    assert bool((err <= 1e-6 * (total.abs().cpu() + scale)).all())
    # And the quantization error is at most a step (stochastic) of the block's scale.
    assert bool((residual.abs().cpu() <= scale * (1 + 1e-6)).all())


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
@pytest.mark.parametrize("name", QUANT_METHODS)
def test_shapes_and_noncontiguous(impl, device, name):
    c = pycomm.get_compressor(name, block_size=16, impl=impl)
    grad = torch.randn(37, 3, 5, device=device).transpose(0, 2)
    assert not grad.is_contiguous()
    residual = torch.zeros(grad.numel(), device=device)
    p = c.compress(grad, residual)
    assert p.shape == (5, 3, 37) and p.numel == grad.numel() and (p.bits, p.block_size) == (c.bits, 16)
    out = c.decompress(p)
    assert out.shape == grad.shape and out.dtype == torch.float32
    ref = pycomm.get_compressor(name, block_size=16, impl="reference").compress(grad.contiguous())
    assert torch.equal(p.data.cpu(), ref.data.cpu())
    acc = torch.ones_like(out)
    c.decompress(p, out=acc, accumulate=True)
    assert_same(acc, out + 1, "accumulated values")


def test_payload_nbytes_is_exact():
    for name, bits in zip(QUANT_METHODS, BITS):
        for block_size in (fit(2, bits), 256, 1000):
            c = pycomm.get_compressor(name, block_size=block_size, impl="reference")
            for n in (1, 2, 3, 255, 256, 257, 1001):
                p = c.compress(torch.randn(n))
                expected = quant_num_bytes(n, bits) + 4 * (-(-n // block_size))
                assert c.payload_nbytes(n) == p.nbytes == expected
                assert p.data.numel() + 4 * p.scales.numel() == expected


def test_stochastic_seed_advances_per_call():
    g = torch.randn(500)
    a = pycomm.get_compressor("int8", block_size=100, rounding="stochastic", seed=5, impl="reference")
    b = pycomm.get_compressor("int8", block_size=100, rounding="stochastic", seed=5, impl="reference")
    first = a.compress(g).data
    assert a.next_seed() == 6
    second = a.compress(g).data
    assert not torch.equal(first, second)  # call 1 uses seed 6
    assert torch.equal(b.compress(g).data, first)  # the same seed, the same order
    assert torch.equal(b.compress(g).data, second)
    data, _ = qz.compress_reference(g, None, 8, 100, 6)
    assert torch.equal(data, second)
    # The seed wraps at 2^32; round to nearest ignores it.
    w = pycomm.get_compressor("int4", rounding="stochastic", seed=MASK32, impl="reference")
    w.compress(g)
    assert w.next_seed() == 0
    nearest = pycomm.get_compressor("int8", impl="reference")
    assert nearest.next_seed() == -1 and torch.equal(nearest.compress(g).data, nearest.compress(g).data)


@pytest.mark.parametrize("name", QUANT_METHODS)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-2), "block_size"),
        (dict(block_size=2**30 + 2), "block_size"),
        (dict(block_size=2**63), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(block_size=64.0), "block_size"),
        (dict(block_size="64"), "block_size"),
        (dict(rounding="up"), "rounding"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(seed=True), "seed"),
    ],
)
def test_constructor_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pycomm.get_compressor(name, **kwargs)


def test_block_size_rules_per_family():
    assert pycomm.get_compressor("int8", block_size=1).block_size == 1
    assert pycomm.get_compressor("int8", block_size=2**30 - 1).block_size == 2**30 - 1
    assert pycomm.get_compressor("int4", block_size=2**30).block_size == 2**30
    for name, bits in zip(QUANT_METHODS, BITS):
        per = quant_per_byte(bits)
        if per > 1:
            with pytest.raises(ValueError, match=f"block_size must be a multiple of {per} for {bits}-bit levels"):
                pycomm.get_compressor(name, block_size=per + 1)
    with pytest.raises(ValueError, match=f"block_size must be at most {2**30}, got {2**30 + 1}"):
        pycomm.get_compressor("int8", block_size=2**30 + 1)
    c = pycomm.get_compressor("int4")
    assert (c.block_size, c.rounding, c.seed, c.bits) == (256, "nearest", 0, 4)
    assert repr(c) == "Int4Compressor(block_size=256, rounding='nearest', seed=0, impl='auto')"
    assert isinstance(c, pycomm.compressors.Int4Compressor)
    assert pycomm.compressors.QuantPayload is qz.QuantPayload


def test_decompress_errors():
    c8 = pycomm.get_compressor("int8", block_size=64, impl="reference")
    c4 = pycomm.get_compressor("int4", block_size=64, impl="reference")
    p = c8.compress(torch.randn(100))
    wrong = ob.OneBitPayload(torch.zeros(4, dtype=torch.int32), torch.zeros(1), 100, (100,), 64)
    with pytest.raises(TypeError, match="payload must be a QuantPayload"):
        c8.decompress(wrong)
    with pytest.raises(ValueError, match="bits=8"):
        c4.decompress(p)
    with pytest.raises(ValueError, match="block_size=64"):
        pycomm.get_compressor("int8", block_size=32, impl="reference").decompress(p)
    with pytest.raises(TypeError, match="out must be float32"):
        c8.decompress(p, out=torch.zeros(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="out has 99 elements"):
        c8.decompress(p, out=torch.zeros(99))
    with pytest.raises(ValueError, match="out must be contiguous"):
        c8.decompress(p, out=torch.zeros(100, 2)[:, 0])
    with pytest.raises(TypeError, match="grad must be float32"):
        c8.compress(torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="residual has 9 elements"):
        c8.compress(torch.zeros(10), torch.zeros(9))


# --------------------------------------------------------------- the ops ---
def _ops(name):
    """The op under test in every implementation present here."""
    ops = []
    if has_cpp_ops():
        ops.append(getattr(torch.ops.pycomm, name))
    if has_triton():
        from pycomm.triton import quant  # noqa: F401  (registers the Triton ops)

        ops.append(getattr(torch.ops.pycomm, name + "_triton"))
    if not ops:
        pytest.skip("neither the C++ quant ops nor Triton are available")
    return ops


ones = torch.ones
OP_ERRORS = [
    ("quant_compress", lambda: (ones(64), None, 5, 64, -1), r"bits must be one of \[2, 4, 8\]"),
    ("quant_compress", lambda: (ones(64), None, 1, 64, -1), r"bits must be one of \[2, 4, 8\]"),
    ("quant_compress", lambda: (ones(64), None, 8, 0, -1), r"block_size must be in \[1, 2\^30\]"),
    ("quant_compress", lambda: (ones(64), None, 8, 2**30 + 1, -1), r"block_size must be in \[1, 2\^30\]"),
    ("quant_compress", lambda: (ones(64), None, 4, 63, -1), "block_size must be a multiple of 2 for 4-bit"),
    ("quant_compress", lambda: (ones(64), None, 2, 66, -1), "block_size must be a multiple of 4 for 2-bit"),
    ("quant_compress", lambda: (ones(64), None, 8, 64, -2), "seed must be -1"),
    ("quant_compress", lambda: (ones(64), None, 8, 64, 2**32), "seed must be -1"),
    ("quant_compress", lambda: (ones(64, dtype=torch.int32), None, 8, 64, -1), "grad must be float32"),
    ("quant_compress", lambda: (ones(0), None, 8, 64, -1), "grad is empty"),
    ("quant_compress", lambda: (ones(64), ones(63), 8, 64, -1), "residual has 63 elements"),
    ("quant_decompress", lambda: (ones(64), ones(64, dtype=torch.uint8), ones(1), 4, 64, False), "data has 64 bytes"),
    ("quant_decompress", lambda: (ones(64), ones(64, dtype=torch.int8), ones(1), 8, 64, False), "data must be"),
    ("quant_decompress", lambda: (ones(64), ones(64, dtype=torch.uint8), ones(2), 8, 64, False), "scales has 2"),
    ("quant_decompress", lambda: (ones(64).half(), ones(64, dtype=torch.uint8), ones(1), 8, 64, False), "out must"),
    ("quant_decompress", lambda: (ones(64), ones(64, dtype=torch.uint8), ones(1), 8, 0, False), "block_size"),
]


@pytest.mark.parametrize("name,args,message", OP_ERRORS, ids=[f"{n}: {m}" for n, _, m in OP_ERRORS])
def test_op_errors(name, args, message):
    # The same RuntimeError (TORCH_CHECK) from the C++ op and the Triton op.
    for op in _ops(name):
        with pytest.raises(RuntimeError, match=message):
            op(*args())


def _schema(op_name):
    schema = str(getattr(torch.ops.pycomm, op_name).default._schema)
    schema = schema.replace(f"pycomm::{op_name}(", "(", 1).replace("SymInt ", "int ")
    for i in range(8):
        schema = schema.replace(f"(a{i}!)", "(a!)")
    return schema


@needs_cpp
@needs_triton
@pytest.mark.parametrize("name", ["quant_compress", "quant_compress_into", "quant_decompress"])
def test_triton_op_schemas_match_cpp(name):
    from pycomm.triton import quant  # noqa: F401

    assert _schema(name + "_triton") == _schema(name)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
def test_compress_into_a_second_buffer(bits, seed):
    # The backend's double-buffered error feedback: the payload and new
    # residual of the in-place compress, the old residual left as it was.
    n, block = 301, fit(6, bits)
    g = make_grad("hostile", n, torch.float16, seed=3)
    r = make_residual(n)
    r_inplace = r.clone()
    data_ref, scales_ref = qz.compress_reference(g, r_inplace, bits, block, seed)
    for op in _ops("quant_compress_into"):
        r_in, r_out = r.clone(), poisoned(n)
        data, scales = op(g, r_in, r_out, bits, block, seed)
        assert torch.equal(data, data_ref)
        assert_same(scales, scales_ref, "scales")
        assert_same(r_out, r_inplace, "residuals")
        assert torch.equal(r_in, r)
        # The same tensor twice is the in-place compress; a partial overlap is refused.
        buf = torch.cat([r, torch.zeros(8)])
        op(g, buf[:n], buf[:n], bits, block, seed)
        assert_same(buf[:n], r_inplace, "in-place residuals")
        with pytest.raises(RuntimeError, match="must be the same tensor or not overlap"):
            op(g, buf[:n], buf[4 : n + 4], bits, block, seed)


# opcheck compares outputs without equal_nan: finite inputs only.
@pytest.mark.parametrize("bits", BITS)
def test_opcheck(bits):
    n = 301
    g, r = make_grad("random", n, seed=4), make_residual(n)
    data, scales = qz.compress_reference(g, r.clone(), bits, 64, -1)
    names = ["quant_compress", "quant_compress_into", "quant_decompress"]
    ops = {name: _ops(name) for name in names}
    for compress, compress_into, decompress in zip(*(ops[name] for name in names), strict=True):
        torch.library.opcheck(compress, (g, r.clone(), bits, 64, -1))
        torch.library.opcheck(compress, (g.bfloat16(), None, bits, 64, 17))
        torch.library.opcheck(compress_into, (g, r.clone(), torch.zeros(n), bits, 64, 3))
        for accumulate in (False, True):
            torch.library.opcheck(decompress, (make_residual(n, 2), data, scales, bits, 64, accumulate))


@needs_triton
def test_triton_ops_under_torch_compile():
    from pycomm.triton import quant  # noqa: F401  (registers the ops)

    def roundtrip(grad, residual):
        data, scales = torch.ops.pycomm.quant_compress_triton(grad, residual, 4, 64, 11)
        dense = torch.empty_like(residual)
        torch.ops.pycomm.quant_decompress_triton(dense, data, scales, 4, 64, False)
        return dense * 2

    device = "cuda" if torch.cuda.is_available() else "cpu"
    grad, residual = make_grad("random", 300, device=device), make_residual(300, device=device)
    res_eager, res_compiled = residual.clone(), residual.clone()
    expected = roundtrip(grad, res_eager)
    got = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)(grad, res_compiled)
    assert torch.equal(got, expected) and torch.equal(res_compiled, res_eager)


def test_fakes_give_payload_shapes():
    if not has_cpp_ops():
        pytest.skip("the C++ quant ops are not built")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = torch.empty(1001)
        for bits, nbytes in ((8, 1001), (4, 501)):
            data, scales = torch.ops.pycomm.quant_compress(g, None, bits, 100, -1)
            assert data.shape == (nbytes,) and data.dtype == torch.uint8
            assert scales.shape == (11,) and scales.dtype == torch.float32


def test_no_warnings_from_reference():
    # The reference itself is warning-free (torch does not warn on 0 * Inf).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qz.compress_reference(hostile(100), torch.zeros(100), 8, 8, 3)


# compress_into on each device (CUDA under the gpu marker) against that
# device's in-place compress, bit for bit. Block sizes: the group kernel's
# (2, 6, 256), the block kernel's in one tile (258) and in several (6000:
# pass 2 re-reads grad + residual_in); sizes not multiples of them; NaN and
# Inf in grad and residual.
INTO_DEVICES = [
    pytest.param("cpu", id="cpu", marks=needs_cpp),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_cpp]),
]


def _raw(t):
    """The bits of a float32 tensor, so NaNs compare too."""
    return t.view(torch.int32)


@pytest.mark.parametrize("device", INTO_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", SEEDS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("block_size", [2, 6, 256, 258, 6000])
@pytest.mark.parametrize("n", [1, 33, 4097, 13001])
def test_compress_into_matches_in_place_bit_for_bit(device, dtype, bits, seed, block_size, n):
    block_size = fit(block_size, bits)
    g = make_grad("hostile", n, dtype, seed=n, device=device)
    r = make_residual(n, seed=n + 1)
    if n > 2:
        r[1], r[n - 2] = INF, NAN
    r = r.to(device)
    r_inplace, r_in, r_out = r.clone(), r.clone(), poisoned(n, device)
    data, scales = torch.ops.pycomm.quant_compress(g, r_inplace, bits, block_size, seed)
    data2, scales2 = torch.ops.pycomm.quant_compress_into(g, r_in, r_out, bits, block_size, seed)
    assert torch.equal(data2, data)
    assert torch.equal(_raw(scales2), _raw(scales))
    assert torch.equal(_raw(r_out), _raw(r_inplace))
    assert torch.equal(_raw(r_in), _raw(r)), "the input residual was written"
    # residual_out == residual: the in-place compress.
    data3, scales3 = torch.ops.pycomm.quant_compress_into(g, r_in, r_in, bits, block_size, seed)
    assert torch.equal(data3, data)
    assert torch.equal(_raw(scales3), _raw(scales))
    assert torch.equal(_raw(r_in), _raw(r_inplace))


@pytest.mark.parametrize("device", INTO_DEVICES)
def test_compress_into_refuses_partial_overlap(device):
    n = 4097
    g = make_grad("random", n, device=device)
    buf = torch.zeros(n + 64, device=device)
    for shift in (1, 32, 64):
        for r_in, r_out in ((buf[:n], buf[shift : n + shift]), (buf[shift : n + shift], buf[:n])):
            with pytest.raises(RuntimeError, match="must be the same tensor or not overlap"):
                torch.ops.pycomm.quant_compress_into(g, r_in, r_out, 8, 64, -1)
    assert torch.count_nonzero(buf) == 0, "a refused call wrote"
    if device != "cpu":
        r = torch.zeros(n, device=device)
        with pytest.raises(RuntimeError, match="residual is on cpu"):
            torch.ops.pycomm.quant_compress_into(g, r, r.cpu(), 8, 64, -1)
