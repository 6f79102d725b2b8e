"""The spec is defined once (pycomm/distributed/spec.py) and mirrored by the
C++ engine (csrc/distributed/spec.h): the two copies must agree, and every
other part of pycomm must take its method names from the spec."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pycomm._ext as ext
from pycomm.distributed import spec

pytestmark = pytest.mark.skipif(ext.why_no_cpu_ops() is not None, reason=str(ext.why_no_cpu_ops()))


@pytest.fixture(scope="module")
def cpp():
    return ext._C.spec()


def test_names_and_codes_match(cpp):
    assert cpp["methods"] == spec.METHODS
    assert cpp["call_fields"] == spec.CALL_FIELDS
    assert cpp["default_chunk_numel"] == spec.DEFAULT_CHUNK_NUMEL
    assert [spec.method_code(m) for m in spec.METHODS] == list(range(len(spec.METHODS)))
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        spec.method_code("int3")


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 1 << 40), c=st.integers(1, sys.maxsize))
def test_chunk_length_matches(cpp, n, c):
    assert cpp["chunk_length"](n, c) == spec.chunk_length(n, c)


@pytest.mark.parametrize("n", [0, 1, 20_000, 1 << 40])
def test_never_chunk_does_not_overflow(cpp, n):
    # chunk_numel=sys.maxsize means one chunk, whatever the size.
    assert cpp["chunk_length"](n, sys.maxsize) == spec.chunk_length(n, sys.maxsize) == max(1, n)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 1 << 22), world=st.integers(1, 16), words=st.integers(1, 64))
def test_onebit_segments_match(cpp, m, world, words):
    block = 32 * words
    seg, bounds, sizes = cpp["onebit_segments"](m, world, block)
    assert (seg, bounds) == spec.onebit_segments(m, world, block)
    assert sizes == [spec.onebit_wire_numel(e - b, block) for b, e in bounds]


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 1 << 24), density=st.floats(1e-6, 1.0), approx=st.booleans())
def test_topk_wire_numel_matches(cpp, m, density, approx):
    assert cpp["topk_wire_numel"](m, density, approx) == spec.topk_wire_numel(m, density, approx)


def test_method_names_come_from_the_spec():
    import pycomm.distributed as pd
    from pycomm.ddp import hook

    assert set(spec.METHODS) < set(spec.GROUP_METHODS)
    assert set(hook.COMPRESSORS) == set(spec.GROUP_METHODS) - {"none"}
    with pytest.raises(ValueError, match="compressor must be one of"):
        pd.PycommOptions(compressor="int3")
