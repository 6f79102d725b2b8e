#!/usr/bin/env bash
# Sets up everything pycomm needs on a fresh machine, idempotently:
#   1. a virtual environment (.venv, or $PYCOMM_VENV);
#   2. torch: a CUDA torch already installed system-wide is reused (GPU
#      machines); otherwise torch 2.13.0 CPU (pip takes it from the local
#      wheel when the machine has one);
#   3. the build and test tools (requirements-dev.txt);
#   4. pycomm itself, built against that torch (editable, so Python edits
#      need no rebuild and C++ rebuilds are incremental in build/);
#   5. the benchmark harness, bench/ (the package pycomm_bench and the
#      pycomm-bench command; pure Python, editable, its dependencies from
#      requirements-dev.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PYCOMM_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "setup: reusing the system's CUDA torch"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
P="$VENV/bin/python"
PIP=("$P" -m pip install --quiet --disable-pip-version-check)

if ! "$P" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU)"
  "${PIP[@]}" "torch==2.13.0"
fi
# What is up to date is skipped, so that an up-to-date checkout starts its
# tests at once: the tools when requirements-dev.txt and torch are unchanged,
# the build when no file it is built from changed (content hashes, kept in
# the environment so a new environment always builds).
tools_stamp="$VENV/.pycomm-tools"
build_stamp="$VENV/.pycomm-build"
tools_hash=$( { cat requirements-dev.txt; "$P" -c "import torch; print(torch.__version__)"; } | sha1sum)
build_hash=$( { find CMakeLists.txt pyproject.toml cmake csrc kernels -type f -print0 | sort -z | xargs -0 sha1sum;
                echo "$tools_hash"; } | sha1sum)
if [ "$(cat "$tools_stamp" 2>/dev/null)" != "$tools_hash" ]; then
  echo "setup: build and test tools"
  # torch pinned to the one installed: no tool (lightning, accelerate) may swap it.
  "${PIP[@]}" -r requirements-dev.txt "torch==$("$P" -c "import torch; print(torch.__version__)")"
  echo "$tools_hash" > "$tools_stamp"
fi
if [ "$(cat "$build_stamp" 2>/dev/null)" != "$build_hash" ] || ! "$P" -c "import pycomm._C" 2>/dev/null; then
  echo "setup: building pycomm (build/ keeps the objects for fast rebuilds)"
  rm -f "$build_stamp"
  "${PIP[@]}" --no-build-isolation --no-deps -e .
  echo "$build_hash" > "$build_stamp"
fi
# After pycomm: a reinstall of pycomm must not leave the harness without its
# command (an older pycomm wheel had a pycomm-bench script of its own).
bench_stamp="$VENV/.pycomm-bench"
bench_hash=$( { sha1sum bench/pyproject.toml; echo "$tools_hash"; } | sha1sum)
if [ "$(cat "$bench_stamp" 2>/dev/null)" != "$bench_hash" ] || [ ! -x "$VENV/bin/pycomm-bench" ] \
   || ! "$P" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('pycomm_bench') is None)" 2>/dev/null; then
  echo "setup: installing the benchmark harness (bench/, editable)"
  rm -f "$bench_stamp"
  "${PIP[@]}" --no-build-isolation --no-deps -e bench
  echo "$bench_hash" > "$bench_stamp"
fi
"$P" -c "import pycomm; print('setup: pycomm', pycomm.__version__, 'impls:', pycomm.available_impls('onebit'))"
