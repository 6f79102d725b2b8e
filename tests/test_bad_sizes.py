"""Bad sizes and overflow: settings that a C++ int64 (or a kernel's int)
cannot hold are refused where they are given, naming the argument, instead
of wrapping around deep inside an op."""

from __future__ import annotations

import sys

import pytest
import torch

import pycomm
import pycomm.distributed as pd

HUGE = [2**31, 2**63 - 32, 2**63, 2**64 + 1]


@pytest.mark.parametrize("name", ["onebit", "int8", "int4"])
@pytest.mark.parametrize("block_size", [2**30 + 32, *HUGE])
def test_block_size_beyond_the_kernels_limit_is_refused(name, block_size):
    with pytest.raises(ValueError, match="block_size"):
        pycomm.get_compressor(name, block_size=block_size)


@pytest.mark.parametrize("name", ["onebit", "int8", "int4"])
def test_largest_block_size_works(name):
    # 2^30: one block for any tensor; the kernels take it without overflow.
    c = pycomm.get_compressor(name, block_size=2**30)
    g = torch.randn(1000)
    r = torch.zeros(1000)
    p = c.compress(g, r)
    assert torch.allclose(c.decompress(p) + r, g, atol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("chunk_numel", 2**63), ("chunk_numel", 2**64 + 1), ("min_compress_numel", 2**63),
    ("block_size", 2**31), ("block_size", 2**63 - 32), ("block_size", 48), ("block_size", 0),
    ("chunk_numel", 0), ("min_compress_numel", -1), ("chunk_numel", True),
])
def test_group_settings_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        pd.PycommOptions(**{field: value})


def test_never_chunk_is_accepted():
    assert pd.PycommOptions(chunk_numel=sys.maxsize).chunk_numel == sys.maxsize
    assert pd.PycommOptions(block_size=None).block_size is None  # each method's default


@pytest.mark.parametrize("op, args", [
    ("quant_compress", (torch.ones(8), None, 8, 2**31, -1)),
    ("quant_compress", (torch.ones(8), None, 4, 3, -1)),
    ("quant_compress", (torch.ones(8), None, 5, 8, -1)),
    ("quant_compress", (torch.ones(8), None, 8, 8, 2**32)),
    ("onebit_compress", (torch.ones(8), None, 2**31 + 32 - 2**31 % 32)),
])
def test_ops_refuse_out_of_range_arguments(op, args):
    with pytest.raises(RuntimeError, match="block_size|bits|seed"):
        getattr(torch.ops.pycomm, op)(*args)
