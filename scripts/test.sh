#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up, builds, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k topk).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
# Doctests run too: the examples in the docstrings of the library (pycomm),
# the benchmark harness (bench/pycomm_bench) and the GPU check (tools) are checked.
exec "$P" -m pytest tests pycomm bench/pycomm_bench tools --doctest-modules -q -p no:cacheprovider --durations=15 "$@"
