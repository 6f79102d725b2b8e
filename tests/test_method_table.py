"""Every list of methods derives from one table, ``spec.METHOD_TABLE``.

Adding a method is adding its row (and its C++ mirror's, compared in
tests/test_spec.py): no list of method names may be spelled out anywhere
else, or it would silently miss the new row.
"""

from __future__ import annotations

import ast
import os
from typing import List

import pytest
import torch

from pycomm.distributed import spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where pycomm's code lives: the package, the benchmark harness (bench/),
#: the benchmarks, the repository tools and the examples.
SCANNED = ("pycomm", "bench", "benchmarks", "tools", "examples")
#: The one file that spells the names out.
SPEC_FILE = os.path.join("pycomm", "distributed", "spec.py")
#: pycomm's own names only: a registered compressor is a user's, not pycomm's.
NAMES = frozenset(spec.GROUP_METHODS)


def _python_files() -> List[str]:
    out = []
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in sorted(filenames) if f.endswith(".py")]
    return out


def literal_method_lists(source: str, filename: str = "<source>") -> List[str]:
    """``"file:line: [names]"`` for each tuple, list, set or dict (its keys)
    in ``source`` holding 2 or more string constants that are all method
    names (other elements aside)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]  # None: a ``**other`` entry
        else:
            continue
        strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(strings) >= 2 and all(s in NAMES for s in strings):
            found.append(f"{filename}:{node.lineno}: {strings}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_the_scanner_finds_every_shape():
    src = '''
a = ("onebit", "topk")
b = ["int8", "int4", 3]
c = {"fp16", "bf16"}
d = {"none": 1, "auto": 2, **e}
if m in ("int8", "int4", "auto"):
    pass
ok = ("auto", "flat"), ("sum", "avg"), ["onebit"], {"onebit": {"block_size": 1}}
'''
    assert literal_method_lists(src, "x.py") == [
        "x.py:2: ['onebit', 'topk']", "x.py:3: ['int8', 'int4']", "x.py:4: ['fp16', 'bf16']",
        "x.py:5: ['none', 'auto']", "x.py:6: ['int8', 'int4', 'auto']"]


def test_no_literal_list_of_methods_outside_the_spec():
    files = _python_files()
    assert SPEC_FILE in files and len(files) > 20  # the walk reached the code
    offenders = []
    for path in files:
        if path == SPEC_FILE:
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            offenders += literal_method_lists(f.read(), path)
    assert not offenders, (
        "literal lists of method names (derive them from pycomm.distributed.spec: METHODS, BLOCK_METHODS, "
        "CAST_METHODS, methods(kind=...), method_spec(name).kind, ...):\n" + "\n".join(offenders))


def test_derived_lists_are_the_table_s():
    # Each derived constant is what the table says, so a new row reaches
    # every one of them with no other edit.
    table = spec.METHOD_TABLE
    assert spec.METHODS == tuple(m.name for m in table)
    assert len(set(spec.METHODS)) == len(table)
    assert spec.GROUP_METHODS == spec.METHODS + (spec.AUTO_METHOD,)
    assert spec.BLOCK_METHODS == tuple(m.name for m in table if m.kind == "block")
    assert spec.DEFAULT_BLOCK_SIZE == {m.name: m.block_size for m in table if m.block_size}
    assert spec.EF_METHODS == tuple(m.name for m in table if m.residuals)
    assert spec.ROUNDING_METHODS == tuple(m.name for m in table if m.rounds)
    assert spec.CAST_METHODS == tuple(m.name for m in table if m.kind == "cast")
    assert spec.UNCOMPRESSED_METHODS == spec.CAST_METHODS + tuple(m.name for m in table if m.kind == "exact")
    assert (spec.EXACT_METHOD,) == tuple(m.name for m in table if m.kind == "exact")
    candidates = [m for m in table if m.auto_candidate]
    assert spec.AUTO_METHODS == tuple(m.name for m in sorted(candidates, key=lambda m: -m.bits))
    for m in table:
        assert spec.method_spec(m.name) is m
        assert spec.method_code(m.name) == table.index(m)
        assert m.kind in ("block", "sparse", "cast", "exact")  # "plugin" is for registered compressors only
        assert (m.block_size > 0) == (m.kind == "block")
        assert (m.dtype is not None) == (m.kind == "cast")
        assert not m.rounds or m.kind == "block"


def test_the_table_s_users_read_it():
    import pycomm
    from pycomm import plan
    from pycomm.distributed.spec import is_plugin
    from pycomm.distributed import auto

    assert auto.CANDIDATES == spec.AUTO_METHODS
    assert auto.CANDIDATES[0] == spec.EXACT_METHOD  # exact wins a tie
    assert plan.COMPRESSORS == (spec.EXACT_METHOD,) + tuple(m for m in spec.METHODS if m != spec.EXACT_METHOD)
    assert not any(is_plugin(m) for m in spec.GROUP_METHODS)
    for m in spec.EF_METHODS:  # every method that keeps residuals has a compressor
        assert pycomm.get_compressor(m).name == m
    for m in spec.CAST_METHODS:
        assert spec.method_spec(m).dtype.itemsize * 8 == spec.method_spec(m).bits


def test_a_registered_compressor_gets_a_plugin_row():
    import pycomm

    class Halves:
        def compress(self, grad, residual):
            return [grad.half()]

        def decompress(self, payload, out, accumulate):
            out.add_(payload[0].float()) if accumulate else out.copy_(payload[0])

    name = "halves-method-table"
    if name not in pycomm.compressor_names():
        pycomm.register_compressor(name, Halves)
    row = spec.method_spec(name)
    assert (row.kind, row.residuals, row.auto_candidate) == ("plugin", True, False)
    assert name not in spec.METHODS
    # Its bytes: its payload and the tag, to each of the W-1 peers.
    assert spec.wire_bytes(name, 1000, 4, payload_nbytes=lambda m: 2 * m) == 3 * (2000 + 4 * spec.TAG_WORDS)
    with pytest.raises(ValueError, match="needs payload_nbytes"):
        spec.wire_bytes(name, 1000, 4)
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        spec.method_spec("int3")


def test_methods_filter():
    assert spec.methods(kind="block", rounds=False) == tuple(
        m.name for m in spec.METHOD_TABLE if m.kind == "block" and not m.rounds)
    assert spec.methods(dtype=torch.bfloat16) == tuple(m.name for m in spec.METHOD_TABLE if m.dtype == torch.bfloat16)
    with pytest.raises(TypeError, match="no field 'colour'"):
        spec.methods(colour="red")


#: The kernel files: every layer of every kernel family (CPU, CUDA, Triton,
#: the C++ ops). The shared math header is where the methods' rules live.
KERNEL_DIRS = ("kernels", os.path.join("csrc", "ops"), os.path.join("pycomm", "triton"))
MATH_HEADER = os.path.join("kernels", "include", "pycomm", "compress_math.h")


def test_kernel_files_name_no_method_but_their_symbols():
    """A kernel file speaks of widths and families, not of the methods the
    table builds from them: a method name (comments included) may appear in
    one only where it is also a symbol there: a kernel family's name, which
    starts its functions (``onebit_...``, ``topk_...``) and names its file
    in each layer (``onebit.cu``, ``topk.py``)."""
    import re

    compressed = [m for m in spec.METHODS if spec.method_spec(m).kind in ("block", "sparse")]
    files = []
    for top in KERNEL_DIRS:
        for dirpath, _, filenames in os.walk(os.path.join(ROOT, top)):
            files += [os.path.join(dirpath, f) for f in filenames if f.endswith((".py", ".cpp", ".cu", ".cuh", ".h"))]
    assert len(files) > 10  # the walk reached the kernels
    offenders = []
    for path in sorted(files):
        rel = os.path.relpath(path, ROOT)
        if rel == MATH_HEADER:
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in compressed:
            family = any(f.split(".")[0] == name for f in os.listdir(os.path.dirname(path)))
            if re.search(rf"\b{name}\b", text) and not family and not re.search(rf"\b{name}_\w", text):
                line = next(i for i, s in enumerate(text.splitlines(), 1) if re.search(rf"\b{name}\b", s))
                offenders.append(f"{rel}:{line}: {name}")
    assert not offenders, "method names in kernel files (speak of bits and families):\n" + "\n".join(offenders)
