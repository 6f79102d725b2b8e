"""The CUDA kernels (kernels/cuda/*.cu) compile with plain nvcc.

No GPU is needed: this catches build breaks of the CUDA sources on machines
that cannot run them. Each source is compiled on its own, for both targets
the package ships (sm_80 and sm_90a), exactly as a developer would by hand.
Skipped when nvcc is not installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "kernels" / "cuda"
INCLUDE_DIR = ROOT / "kernels" / "include"
CUDA_SOURCES = sorted(CUDA_DIR.glob("*.cu"))
EXPECTED_SOURCES = {"onebit.cu", "quant.cu", "topk.cu"}
COMPILE_TIMEOUT_S = 600


def _find_nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


NVCC = _find_nvcc()


def _cuda_include_dir() -> Path:
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", str(Path(NVCC).resolve().parents[1])):
        if cand and (Path(cand) / "include" / "cuda_runtime.h").exists():
            return Path(cand) / "include"
    pytest.skip("nvcc found but no cuda_runtime.h next to it")


def test_cuda_sources_present():
    names = {p.name for p in CUDA_SOURCES}
    missing = EXPECTED_SOURCES - names
    assert not missing, f"missing CUDA sources in {CUDA_DIR}: {sorted(missing)} (found {sorted(names)})"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (not on PATH, not at /usr/local/cuda/bin/nvcc)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source: Path, tmp_path: Path):
    cmd = [
        NVCC, "-c", "-std=c++17", "-O3",
        "-I", str(INCLUDE_DIR),
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90a,code=sm_90a",
        "-Xptxas", "-v",
        str(source), "-o", str(tmp_path / f"{source.stem}.o"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"nvcc failed with exit code {proc.returncode}\n$ {' '.join(cmd)}\n--- stderr ---\n{proc.stderr}"
        f"\n--- stdout ---\n{proc.stdout}"
    )


@pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize("source", ["onebit.cpp", "quant.cpp", "topk.cpp"])
def test_cuda_op_registration_compiles(source: str, tmp_path: Path):
    """The CUDA half of csrc/ops (built only against a CUDA torch) type-checks
    against torch's headers and the CUDA launcher API, so the glue between
    torch and kernels/cuda cannot rot on CPU-only machines either."""
    import sysconfig

    import torch.utils.cpp_extension as cpp_ext

    # A CPU build of torch ships c10/cuda headers but not the one header its
    # CUDA build generates at configure time; supply it.
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    # nvcc may be a wrapper script on PATH: ask it where the toolkit lives.
    cuda_include = _cuda_include_dir()
    includes = [tmp_path, *cpp_ext.include_paths(), cuda_include, INCLUDE_DIR, CUDA_DIR, sysconfig.get_paths()["include"]]
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-DPYCOMM_WITH_CUDA"]
    cmd += [f"-I{p}" for p in includes] + [str(ROOT / "csrc" / "ops" / source)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-5000:]
