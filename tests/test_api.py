"""The public API: registry, impl selection, and clear errors for bad input."""

import pytest
import torch

import pycomm
from pycomm import _ext


def test_extension_is_built():
    # The test command builds the extension; without it every cpu test would vanish.
    assert _ext.has_ops(), _ext.why_no_cpu_ops()
    assert "cpu" in pycomm.available_impls("onebit", "cpu")
    assert "cpu" in pycomm.available_impls("topk", "cpu")


def test_registry_and_auto_choice():
    assert {"onebit", "topk"} <= set(pycomm.compressor_names())
    for name in ("onebit", "topk"):
        c = pycomm.get_compressor(name)
        assert c.impl == "auto"
        assert c.resolve_impl(torch.device("cpu")).name == "cpu"  # fastest on CPU
        assert pycomm.available_impls(name)[0] == "reference"


def test_unknown_names_and_parameters():
    with pytest.raises(ValueError, match="unknown compressor 'nope'.*onebit"):
        pycomm.get_compressor("nope")
    with pytest.raises(TypeError, match="onebit.*density"):
        pycomm.get_compressor("onebit", density=0.1)
    with pytest.raises(ValueError, match="impl='gpu'.*choose one of"):
        pycomm.get_compressor("topk", impl="gpu")


@pytest.mark.parametrize("bad", [0, -32, 33, 1.5, True, "64"])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        pycomm.get_compressor("onebit", block_size=bad)


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, float("nan")])
def test_bad_density(bad):
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        pycomm.get_compressor("topk", density=bad)
    with pytest.raises(TypeError, match="density"):
        pycomm.get_compressor("topk", density="0.1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_unavailable_impl_says_why():
    with pytest.raises(RuntimeError, match="impl='cuda' cannot run here"):
        pycomm.get_compressor("onebit", impl="cuda")


@pytest.mark.parametrize("name,kw", [("onebit", {"block_size": 64}), ("topk", {"density": 0.1})])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_bad_tensors(name, kw, impl):
    c = pycomm.get_compressor(name, impl=impl, **kw)
    g = torch.randn(100)
    with pytest.raises(TypeError, match="grad must be float32, float16 or bfloat16"):
        c.compress(torch.ones(100, dtype=torch.int64))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        c.compress([1.0, 2.0])
    with pytest.raises(ValueError, match="grad is empty"):
        c.compress(torch.empty(0))
    with pytest.raises(ValueError, match="residual has 99 elements but grad has 100"):
        c.compress(g, torch.zeros(99))
    with pytest.raises(TypeError, match="residual must be float32"):
        c.compress(g, torch.zeros(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual must be contiguous"):
        c.compress(g, torch.zeros(200)[::2])
    with pytest.raises(ValueError, match="residual is on meta"):
        c.compress(g, torch.zeros(100, device="meta"))
    p = c.compress(g)
    with pytest.raises(ValueError, match="out has 10 elements"):
        c.decompress(p, out=torch.zeros(10))
    with pytest.raises(TypeError, match="out must be float32"):
        c.decompress(p, out=torch.zeros(100, dtype=torch.float16))
    with pytest.raises(TypeError, match="payload must be"):
        c.decompress((p,))


def test_ops_check_their_inputs():
    # The ops are public too (torch.ops.pycomm.*): they validate on their own.
    with pytest.raises(RuntimeError, match="block_size must be a positive multiple of 32"):
        torch.ops.pycomm.onebit_compress(torch.randn(10), None, 48)
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.pycomm.topk_compress(torch.randn(10), None, 11, False)
    with pytest.raises(RuntimeError, match="grad must be contiguous"):
        torch.ops.pycomm.topk_compress(torch.randn(10, 2).t(), None, 1, False)
    with pytest.raises(RuntimeError, match=r"indices must be strictly ascending and lie in \[0, 10\)"):
        torch.ops.pycomm.topk_decompress(torch.zeros(10), torch.tensor([3, 10], dtype=torch.int32), torch.ones(2), False)
    with pytest.raises(RuntimeError, match="bits has 1 words"):
        torch.ops.pycomm.onebit_decompress(torch.zeros(40), torch.zeros(1, dtype=torch.int32), torch.ones(1), 64, False)


def test_payload_device_mismatch_in_decompress():
    c = pycomm.get_compressor("onebit", block_size=64, impl="reference")
    p = c.compress(torch.randn(100))
    with pytest.raises(ValueError, match="out is on meta"):
        c.decompress(p, out=torch.zeros(100, device="meta"))


def test_onebit_hook_warns_about_momentum_once():
    import warnings

    from pycomm.ddp import CompressionState, hook

    hook._warned_onebit = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CompressionState(compressor="onebit")
        CompressionState(compressor="onebit")
        CompressionState(compressor="int4")
        CompressionState(compressor="onebit", error_feedback=False)
    msgs = [str(w.message) for w in caught if "momentum" in str(w.message)]
    assert msgs == [hook.ONEBIT_MOMENTUM_WARNING]  # once, and only for onebit with error feedback
    assert "OneBitSGD" in msgs[0] and "int8" in msgs[0]
