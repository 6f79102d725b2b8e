#!/usr/bin/env bash
# The benchmark harness, from a fresh machine: sets up, builds, runs.
# Arguments go to pycomm-bench (default: the kernel benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
if [ $# -eq 0 ]; then set -- kernels; fi
exec "$P" -m pycomm.bench "$@"
