"""The CPU kernels' hot loops are vectorized by the compiler.

Every loop under `#pragma omp simd` in kernels/cpu must be reported as
vectorized by GCC's -fopt-info-vec with the flags the build uses: a change
that silently turns one scalar (a branch, an aliasing doubt, a call) fails
here rather than showing up later as a slow benchmark.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "kernels" / "cpu").glob("*.cpp"))
CXX = shutil.which("g++")


def test_sources_found():
    assert {p.name for p in SOURCES} >= {"onebit.cpp", "quant.cpp", "topk.cpp"}


@pytest.mark.skipif(CXX is None, reason="g++ not found")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_simd_loops_vectorize(src, tmp_path):
    cmd = [CXX, "-std=c++17", "-O3", "-march=native", "-fopenmp-simd", f"-I{ROOT / 'kernels' / 'include'}",
           "-c", str(src), "-o", str(tmp_path / "k.o"), "-fopt-info-vec-optimized"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    vectorized = {int(m.group(1)) for m in re.finditer(rf"{re.escape(src.name)}:(\d+):\d+: optimized: loop vectorized", proc.stderr)}
    lines = src.read_text().splitlines()
    # Lines of the element-load functors: GCC reports a loop whose body starts
    # with an inlined call at the callee's line.
    loader_lines = {i + 1 for i, line in enumerate(lines) if "operator()(int64_t i)" in line}
    # ... or at the shared functors' lines in load.h.
    loader_in_header = bool(re.search(r"load\.h:\d+:\d+: optimized: loop vectorized", proc.stderr))
    missed = []
    pragmas = [i for i, line in enumerate(lines) if line.strip().startswith("#pragma omp simd")]
    assert pragmas, "no simd loops found"
    for i in pragmas:
        span = set(range(i + 1, loop_end(lines, i + 1) + 1))  # 0-based for line .. its end
        report_lines = {n - 1 for n in vectorized}
        calls_loader = any(re.search(r"\b(g|c_of)\(", lines[j]) for j in span)
        ok = bool(span & report_lines) or (
            calls_loader and (bool({n - 1 for n in loader_lines} & report_lines) or loader_in_header))
        if not ok:
            missed.append(i + 1)
    assert not missed, f"loops not vectorized at {src.name} lines {missed}:\n{proc.stderr[-3000:]}"


def loop_end(lines, start):
    """Last line (0-based) of the loop whose `for` is on line `start`."""
    depth = 0
    for j in range(start, len(lines)):
        depth += lines[j].count("{") - lines[j].count("}")
        if depth <= 0 and (j > start or "{" not in lines[j]):
            return j
    return start
