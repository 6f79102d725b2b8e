"""onebit: every compiled implementation against the pure-torch reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pycomm
from pycomm.compressors import onebit as ob

from _data import DTYPES, IMPL_DEVICES, KINDS, SIZES, make_grad

IMPLS = [pytest.param(i, d, id=i, marks=[pytest.mark.gpu] if d == "cuda" else []) for i, d in IMPL_DEVICES]
WITH_REFERENCE = [pytest.param("reference", "cpu", id="reference"), *IMPLS]


def run_both(impl, device, grad, residual, block_size):
    """Compress with `impl` and with the reference from the same inputs."""
    r_ref = residual.clone() if residual is not None else None
    r_imp = residual.to(device).clone() if residual is not None else None
    ref = pycomm.get_compressor("onebit", block_size=block_size, impl="reference")
    imp = pycomm.get_compressor("onebit", block_size=block_size, impl=impl)
    p_ref = ref.compress(grad, r_ref)
    p_imp = imp.compress(grad.to(device), r_imp)
    return ref, imp, p_ref, p_imp, r_ref, r_imp


def assert_payloads_equal(p_ref, p_imp, r_ref, r_imp):
    assert torch.equal(p_imp.bits.cpu(), p_ref.bits), "sign bits differ from the reference"
    # Scales may differ by float32 rounding (summation order differs per impl)...
    torch.testing.assert_close(p_imp.scales.cpu(), p_ref.scales, equal_nan=True, rtol=4e-6, atol=0)
    if r_ref is not None:
        # ...and residual = c -+ scale inherits that rounding of the scale.
        scale = p_ref.scales.repeat_interleave(p_ref.block_size)[: r_ref.numel()].abs()
        r = r_imp.cpu()
        same_nan = torch.equal(r.isnan(), r_ref.isnan())
        finite = ~r_ref.isnan()
        err = (r[finite] - r_ref[finite]).abs()
        err = torch.where(r[finite] == r_ref[finite], torch.zeros_like(err), err)  # inf == inf
        allowed = 1e-6 + 4e-6 * (r_ref[finite].abs() + scale[finite])
        assert same_nan and bool((err <= allowed).all()), "residual differs from the reference"


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ef", [True, False], ids=["ef", "noef"])
def test_compress_matches_reference(impl, device, n, dtype, kind, ef):
    grad = make_grad(kind, n, dtype, seed=n)
    residual = torch.randn(n) * 0.1 if ef else None
    _, _, p_ref, p_imp, r_ref, r_imp = run_both(impl, device, grad, residual, 2048)
    assert p_imp.bits.dtype == torch.int32 and p_imp.bits.numel() == -(-n // 32)
    assert p_imp.scales.dtype == torch.float32 and p_imp.scales.numel() == -(-n // 2048)
    assert_payloads_equal(p_ref, p_imp, r_ref, r_imp)


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("block_size", [32, 96, 4096])
@pytest.mark.parametrize("n", [1, 33, 95, 97, 5000])
def test_block_sizes(impl, device, block_size, n):
    grad = make_grad("random", n, seed=block_size)
    _, _, p_ref, p_imp, r_ref, r_imp = run_both(impl, device, grad, torch.randn(n), block_size)
    assert_payloads_equal(p_ref, p_imp, r_ref, r_imp)


def test_bit_order_and_scale_by_hand():
    # Element 32w+i is bit i of word w; 1 = non-negative (-0.0 counts), NaN -> 0.
    grad = torch.tensor([1.0, -2.0, -0.0, float("nan")] + [-1.0] * 28 + [3.0])
    for impl in ["reference", "cpu"]:
        c = pycomm.get_compressor("onebit", block_size=32, impl=impl)
        p = c.compress(grad)
        assert p.bits.tolist() == [0b0101, 1]
        assert p.scales[1].item() == 3.0  # the partial block uses its own length
        assert torch.isnan(p.scales[0])


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("n", [1, 33, 2049, 70001])
@pytest.mark.parametrize("kind", KINDS)
def test_decompress_matches_reference(impl, device, n, kind):
    c_ref = pycomm.get_compressor("onebit", block_size=64, impl="reference")
    c_imp = pycomm.get_compressor("onebit", block_size=64, impl=impl)
    p = c_ref.compress(make_grad(kind, n, seed=3))
    expected = c_ref.decompress(p)
    p_dev = ob.OneBitPayload(p.bits.to(device), p.scales.to(device), p.numel, p.shape, p.block_size)
    # Poison the output so an element the kernel forgets to write shows up.
    out = torch.full((n,), float("nan"), device=device)
    c_imp.decompress(p_dev, out=out)
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, rtol=0, atol=0)
    base = torch.randn(n)
    acc = base.clone().to(device)
    c_imp.decompress(p_dev, out=acc, accumulate=True)
    torch.testing.assert_close(acc.cpu(), base + expected, equal_nan=True, rtol=0, atol=0)
    fresh = c_imp.decompress(p_dev)
    assert fresh.shape == p.shape
    torch.testing.assert_close(fresh.cpu(), expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
def test_shapes_and_noncontiguous(impl, device):
    c = pycomm.get_compressor("onebit", block_size=64, impl=impl)
    base = torch.randn(37, 3, 5, device=device)
    grad = base.transpose(0, 2)  # not contiguous
    assert not grad.is_contiguous()
    residual = torch.zeros(grad.numel(), device=device)
    p = c.compress(grad, residual)
    assert p.shape == (5, 3, 37) and p.numel == grad.numel()
    out = c.decompress(p)
    assert out.shape == grad.shape and out.dtype == torch.float32
    # Compression works on the flattened (row-major) view of the shaped tensor.
    ref = pycomm.get_compressor("onebit", block_size=64, impl="reference").compress(grad.contiguous().view(-1))
    assert torch.equal(p.bits.cpu(), ref.bits.cpu())
    torch.testing.assert_close(out.reshape(-1) + residual, grad.reshape(-1))


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 31, 2049, 100_003])
def test_error_feedback_invariant(impl, device, dtype, n):
    # decompress(payload) + residual_new == grad + residual_old: nothing lost.
    c = pycomm.get_compressor("onebit", block_size=128, impl=impl)
    grad = make_grad("random", n, dtype, seed=n, device=device)
    residual = torch.randn(n, device=device) * 0.5
    total = grad.float() + residual
    p = c.compress(grad, residual)
    torch.testing.assert_close(c.decompress(p) + residual, total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl,device", WITH_REFERENCE)
def test_error_feedback_over_many_steps(impl, device):
    # The decoded stream tracks the gradient stream: their running sums differ
    # by exactly the residual, and the residual stays bounded.
    n, steps = 10_000, 300
    c = pycomm.get_compressor("onebit", block_size=256, impl=impl)
    gen = torch.Generator().manual_seed(1)
    residual = torch.zeros(n, device=device)
    sum_grad = torch.zeros(n, dtype=torch.float64, device=device)
    sum_sent = torch.zeros(n, dtype=torch.float64, device=device)
    norms = []
    for _ in range(steps):
        g = (torch.randn(n, generator=gen) + 0.3).to(device)  # a bias that 1-bit alone would distort
        sum_grad += g.double()
        sum_sent += c.decompress(c.compress(g, residual)).double()
        norms.append(residual.norm().item())
    torch.testing.assert_close(sum_sent + residual.double(), sum_grad, rtol=0, atol=1e-3)
    # Bounded: late residuals are no larger than early ones (no drift).
    assert max(norms[-50:]) < 1.5 * max(norms[:50])
    # The mean gradient is recovered (1-bit without EF would lose the 0.3 bias scale).
    assert abs(sum_sent.mean().item() / steps - 0.3) < 0.01


@pytest.mark.parametrize("ef", [True, False])
@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        # Magnitudes up to 2^112 (~5e33) keep a block's sum of |c| finite in every
        # summation order; NaN and +-Inf come in as explicit values.
        st.one_of(
            st.floats(-(2.0**112), 2.0**112, width=32, allow_subnormal=True),
            st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -0.0]),
        ),
        min_size=1,
        max_size=700,
    ),
    block_words=st.integers(1, 8),
)
def test_property_cpu_matches_reference(ef, data, block_words):
    grad = torch.tensor(data, dtype=torch.float32)
    residual = torch.randn(grad.numel()) if ef else None
    _, _, p_ref, p_imp, r_ref, r_imp = run_both("cpu", "cpu", grad, residual, 32 * block_words)
    assert_payloads_equal(p_ref, p_imp, r_ref, r_imp)


def test_payload_nbytes_is_exact():
    c = pycomm.get_compressor("onebit", block_size=2048)
    for n in [1, 32, 33, 2049, 1 << 20]:
        p = c.compress(torch.randn(n))
        assert c.payload_nbytes(n) == p.nbytes == 4 * (-(-n // 32)) + 4 * (-(-n // 2048))


def test_opcheck():
    g, r = torch.randn(3001), torch.randn(3001)
    torch.library.opcheck(torch.ops.pycomm.onebit_compress, (g, r, 64))
    torch.library.opcheck(torch.ops.pycomm.onebit_compress, (g.half(), None, 32))
    bits, scales = torch.ops.pycomm.onebit_compress(g, r.clone(), 64)
    torch.library.opcheck(torch.ops.pycomm.onebit_decompress, (torch.zeros(3001), bits, scales, 64, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_into_a_second_buffer(dtype):
    # The backend's double-buffered error feedback: the same payload and new
    # residual as the in-place compress, the old residual left as it was.
    n = 5000
    g = make_grad("nonfinite", n, dtype, seed=3)
    r = torch.randn(n)
    r_inplace, r_old, r_out = r.clone(), r.clone(), torch.full((n,), 7.0)
    bits, scales = torch.ops.pycomm.onebit_compress(g, r_inplace, 64)
    bits2, scales2 = torch.ops.pycomm.onebit_compress_into(g, r, r_out, 64)
    assert torch.equal(bits2, bits)
    torch.testing.assert_close(scales2, scales, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(r_out, r_inplace, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(r, r_old)
    # The same tensor twice is the in-place compress; a partial overlap is refused.
    buf = torch.cat([r_old, torch.zeros(64)])
    torch.ops.pycomm.onebit_compress_into(g, buf[:n], buf[:n], 64)
    torch.testing.assert_close(buf[:n], r_inplace, equal_nan=True, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="must be the same tensor or not overlap"):
        torch.ops.pycomm.onebit_compress_into(g, buf[:n], buf[32 : n + 32], 64)


# compress_into on each device (CUDA under the gpu marker) against that
# device's in-place compress, bit for bit. Block sizes: the warp kernel's (32,
# 256), the block kernel's in one tile (2048) and in several (6144: pass 2
# re-reads grad + residual_in); sizes not multiples of them; NaN and Inf in
# grad and residual.
INTO_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _raw(t):
    """The bits of a float32 (or int32) tensor, so NaNs compare too."""
    return t.view(torch.int32)


def _nonfinite_residual(n, device):
    r = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    if n > 2:
        r[1], r[n - 2] = float("inf"), float("nan")
    return r.to(device)


@pytest.mark.parametrize("device", INTO_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [32, 256, 2048, 6144])
@pytest.mark.parametrize("n", [1, 31, 33, 4097, 13000])
def test_compress_into_matches_in_place_bit_for_bit(device, dtype, block_size, n):
    g = make_grad("nonfinite", n, dtype, seed=n, device=device)
    r = _nonfinite_residual(n, device)
    r_inplace, r_in, r_out = r.clone(), r.clone(), torch.full((n,), 7.0, device=device)
    bits, scales = torch.ops.pycomm.onebit_compress(g, r_inplace, block_size)
    bits2, scales2 = torch.ops.pycomm.onebit_compress_into(g, r_in, r_out, block_size)
    assert torch.equal(bits2, bits)
    assert torch.equal(_raw(scales2), _raw(scales))
    assert torch.equal(_raw(r_out), _raw(r_inplace))
    assert torch.equal(_raw(r_in), _raw(r)), "the input residual was written"
    # residual_out == residual: the in-place compress.
    bits3, scales3 = torch.ops.pycomm.onebit_compress_into(g, r_in, r_in, block_size)
    assert torch.equal(bits3, bits)
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
                torch.ops.pycomm.onebit_compress_into(g, r_in, r_out, 64)
    assert torch.count_nonzero(buf) == 0, "a refused call wrote"
    if device != "cpu":
        r = torch.zeros(n, device=device)
        with pytest.raises(RuntimeError, match="residual is on cpu"):
            torch.ops.pycomm.onebit_compress_into(g, r, r.cpu(), 64)
