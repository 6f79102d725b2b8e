#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up, builds, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k topk).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
# Doctests of the public API run too: the examples in docstrings are checked.
exec "$P" -m pytest tests pycomm --doctest-modules -q -p no:cacheprovider --durations=15 "$@"
