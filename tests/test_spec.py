"""The spec is defined once (pycomm/distributed/spec.py) and mirrored by the
C++ engine (csrc/distributed/spec.h): the two copies must agree, and every
other part of pycomm must take its method names from the spec
(tests/test_method_table.py)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pycomm._ext as ext
import pycomm.distributed as pd
from pycomm.distributed import spec

pytestmark = pytest.mark.skipif(ext.why_no_cpu_ops() is not None, reason=str(ext.why_no_cpu_ops()))


@pytest.fixture(scope="module")
def cpp():
    return ext._C.spec()


def test_names_and_codes_match(cpp):
    assert cpp["methods"] == spec.METHODS
    assert cpp["call_fields"] == spec.CALL_FIELDS
    assert cpp["default_chunk_numel"] == spec.DEFAULT_CHUNK_NUMEL
    assert cpp["tag_words"] == spec.TAG_WORDS
    assert cpp["gather_numel"] == spec.GATHER_NUMEL
    assert cpp["collectives"] == spec.COLLECTIVES
    assert cpp["reduce_scatter_suffix"] == spec.REDUCE_SCATTER_SUFFIX
    assert cpp["all_gather_suffix"] == spec.ALL_GATHER_SUFFIX
    assert [spec.method_code(m) for m in spec.METHODS] == list(range(len(spec.METHODS)))
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        spec.method_code("int3")


#: Every field of a MethodSpec: the engine's rows hold them all.
CPP_FIELDS = tuple(f.name for f in dataclasses.fields(spec.MethodSpec))


def _python_value(m, field):
    """A row's field as the engine's row holds it: no family or dtype is ""
    there, a dtype its name."""
    v = getattr(m, field)
    if field == "dtype":
        return "" if v is None else str(v).removeprefix("torch.")
    return "" if v is None else v


def test_method_tables_match_row_by_row(cpp):
    # Same rows in the same order (the order is the code on the wire), and
    # each field the engine keeps equal, named where it is not.
    rows = cpp["method_table"]
    assert [r["name"] for r in rows] == [m.name for m in spec.METHOD_TABLE]
    for r, m in zip(rows, spec.METHOD_TABLE):
        assert set(r) == set(CPP_FIELDS)
        for f in CPP_FIELDS:
            want = _python_value(m, f)
            assert r[f] == want, f"{m.name}.{f}: C++ {r[f]!r}, Python {want!r}"
    # The engine's derived names come from its rows.
    assert cpp["methods"] == tuple(r["name"] for r in rows)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 1 << 40), c=st.integers(1, sys.maxsize))
def test_chunk_length_matches(cpp, n, c):
    assert cpp["chunk_length"](n, c) == spec.chunk_length(n, c)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stream=st.integers(-1, 2**63 - 1), call=st.integers(0, 2**63 - 1),
       collective=st.integers(0, 2), rank=st.integers(0, 1 << 20), chunk=st.integers(0, 1 << 40),
       part=st.integers(0, 1 << 20))
def test_rounding_seed_matches(cpp, seed, stream, call, collective, rank, chunk, part):
    got = cpp["rounding_seed"](seed, stream, call, collective, rank, chunk, part)
    assert got == spec.rounding_seed(seed, stream, call, collective, rank, chunk, part)
    assert 0 <= got < 2**32


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 40), world=st.integers(1, 1 << 12), method=st.sampled_from(spec.METHODS))
def test_all_reduce_gathers_matches(cpp, n, world, method):
    # The rule that picks the gathered or the two-phase all-reduce, on both
    # sides of the bound.
    assert cpp["all_reduce_gathers"](method, n, world) == spec.all_reduce_gathers(method, n, world)
    for m in (spec.GATHER_NUMEL // world, spec.GATHER_NUMEL // world + 1):
        assert cpp["all_reduce_gathers"](method, m, world) == spec.all_reduce_gathers(method, m, world)


@pytest.mark.parametrize("n", [0, 1, 20_000, 1 << 40])
def test_never_chunk_does_not_overflow(cpp, n):
    # chunk_numel=sys.maxsize means one chunk, whatever the size.
    assert cpp["chunk_length"](n, sys.maxsize) == spec.chunk_length(n, sys.maxsize) == max(1, n)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 1 << 22), world=st.integers(1, 16), words=st.integers(1, 64),
       method=st.sampled_from(spec.BLOCK_METHODS))
def test_block_segments_match(cpp, m, world, words, method):
    block, bits = 32 * words, spec.method_spec(method).bits
    seg, bounds, sizes = cpp["block_segments"](m, world, block, bits)
    assert (seg, bounds) == spec.block_segments(m, world, block)
    assert sizes == [spec.block_wire_numel(e - b, block, bits) for b, e in bounds]


def test_block_defaults_match(cpp):
    assert cpp["default_block_size"] == spec.DEFAULT_BLOCK_SIZE
    for m in spec.BLOCK_METHODS:
        # Each compressor's own default is the engine's.
        import pycomm

        assert pycomm.get_compressor(m).block_size == spec.DEFAULT_BLOCK_SIZE[m]


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


def test_default_chunk_by_inner_backend():
    # Gloo keeps the spec's default (the C++ side's too); NCCL's is larger,
    # and a group made without chunk_numel reports the one it runs.
    assert spec.DEFAULT_CHUNK_NUMEL_BY_INNER["gloo"] == spec.DEFAULT_CHUNK_NUMEL
    assert spec.DEFAULT_CHUNK_NUMEL_BY_INNER["nccl"] > spec.DEFAULT_CHUNK_NUMEL
    assert pd.PycommOptions().chunk_numel is None
    with pytest.raises(ValueError, match="chunk_numel"):
        pd.PycommOptions(chunk_numel=0)
