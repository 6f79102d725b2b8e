"""pytest-benchmark versions of the main kernel cases, on 4M float32 elements.

Run explicitly (not part of the unit tests)::

    python -m pytest benchmarks/ --benchmark-group-by=group

Every contender's result is checked against the pure-torch reference on the
same input before it is timed. pytest-benchmark times one test after another,
so on a shared machine its ratios drift more than those of ``pycomm-bench
kernels``, which interleaves the contenders: quote the latter.
"""

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

from pycomm_bench import kernels as K  # noqa: E402
from pycomm.compressors import onebit as onebit_ref  # noqa: E402
from pycomm.compressors import topk as topk_ref  # noqa: E402

N = 1 << 22
BLOCK = 2048
DENSITY = 0.01
ROUNDS = 10
WARMUP_ROUNDS = 2

ONEBIT_CONTENDERS = K.benchmarkable_impls("onebit", "cpu") + [K.PEER]
TOPK_CONTENDERS = K.benchmarkable_impls("topk", "cpu") + [K.PEER, K.TOPK_BASELINE]


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(K.SEED)
    g = torch.randn(N, generator=gen)
    r0 = torch.randn(N, generator=gen) * K.RESIDUAL_SCALE  # non-zero: EF does real work
    return g, r0


def _time(benchmark, call, r, r0, nbytes):
    """Time call() with r restored to r0 before every round (untimed)."""

    def setup():
        r.copy_(r0)

    benchmark.pedantic(call, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    benchmark.extra_info.update(numel=N, bytes_moved=nbytes)
    if benchmark.stats is not None:  # None under --benchmark-disable (one plain call)
        benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.benchmark(group="onebit compress b=2048, EF, 4M")
@pytest.mark.parametrize("impl", ONEBIT_CONTENDERS)
def test_onebit_compress(benchmark, data, impl):
    g, r0 = data
    compress, _ = K.block_runners(K.ONEBIT, impl, BLOCK)

    want_r = r0.clone()
    want_bits, want_scales = onebit_ref.compress_reference(g, want_r, BLOCK)
    r = r0.clone()
    bits, scales = compress(g, r)
    K.check_equal("bits", bits.view(torch.int32), want_bits)
    K.check_close("scales", scales, want_scales, **K.SCALE_TOL)
    K.check_close("residual", r, want_r, **K.VALUE_TOL)

    _time(benchmark, lambda: compress(g, r), r, r0, K.onebit_bytes(N, BLOCK, "compress"))


@pytest.mark.benchmark(group=f"topk approx d={DENSITY}, EF, 4M")
@pytest.mark.parametrize("impl", TOPK_CONTENDERS)
def test_topk_approx_compress(benchmark, data, impl):
    g, r0 = data
    k = topk_ref.topk_k(N, DENSITY)
    # The peer and torch.topk are exact: they are held to the exact reference.
    approx = impl not in (K.PEER, K.TOPK_BASELINE)
    want_r = r0.clone()
    want_idx, want_vals = topk_ref.compress_reference(g, want_r, k, approx)

    if impl == K.TOPK_BASELINE:
        mags = (g + r0).abs()
        idx = torch.topk(mags, k, sorted=False).indices.sort().values
        K.check_equal("indices", idx, want_idx.long())
        r = r0.clone()  # untouched: torch.topk alone does no EF
        _time(benchmark, lambda: torch.topk(mags, k, sorted=False), r, r0, K.torch_topk_bytes(N, k))
        return

    compress = K.topk_runner(impl, DENSITY, True)
    r = r0.clone()
    idx, vals = compress(g, r)
    idx, order = idx.long().sort()
    K.check_equal("indices", idx, want_idx.long())
    K.check_close("values", vals[order], want_vals, **K.VALUE_TOL)
    K.check_close("residual", r, want_r, **K.VALUE_TOL)

    _time(benchmark, lambda: compress(g, r), r, r0, K.topk_bytes(N, idx.numel()))
    benchmark.extra_info.update(k=k, count=idx.numel())


QUANT_BLOCK = 256


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_compress(benchmark, data, bits, impl):
    """int8 / int4 compress with error feedback, round to nearest (the
    engine's), checked bit for bit against the reference first."""
    import pycomm
    from pycomm.compressors import quant as quant_ref

    benchmark.group = f"int{bits} compress b={QUANT_BLOCK}, EF, 4M"
    g, r0 = data
    comp = pycomm.get_compressor(f"int{bits}", block_size=QUANT_BLOCK, impl=impl)
    want_r = r0.clone()
    want_data, want_scales = quant_ref.compress_reference(g, want_r, bits, QUANT_BLOCK, -1)
    r = r0.clone()
    payload = comp.compress(g, r)
    K.check_equal("data", payload.data, want_data)
    K.check_equal("scales", payload.scales, want_scales)
    K.check_equal("residual", r, want_r)
    payload_bytes = want_data.numel() + 4 * want_scales.numel()
    _time(benchmark, lambda: comp.compress(g, r), r, r0, 12 * N + payload_bytes)


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_decompress_accumulate(benchmark, data, bits, impl):
    import pycomm

    benchmark.group = f"int{bits} decompress (accumulate) b={QUANT_BLOCK}, 4M"
    g, r0 = data
    comp = pycomm.get_compressor(f"int{bits}", block_size=QUANT_BLOCK, impl=impl)
    payload = pycomm.get_compressor(f"int{bits}", block_size=QUANT_BLOCK, impl="reference").compress(g)
    want = r0.clone()
    pycomm.get_compressor(f"int{bits}", block_size=QUANT_BLOCK, impl="reference").decompress(
        payload, want, accumulate=True)
    out = r0.clone()
    comp.decompress(payload, out, accumulate=True)
    K.check_equal("out", out, want)
    payload_bytes = payload.data.numel() + 4 * payload.scales.numel()
    _time(benchmark, lambda: comp.decompress(payload, out, accumulate=True), out, r0, 8 * N + payload_bytes)
