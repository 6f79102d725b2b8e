#!/usr/bin/env bash
# The benchmark harness, from a fresh machine: sets up, builds, runs.
# Arguments go to pycomm-bench; without any, it runs the kernel benchmark and
# then the all-reduce benchmark (about 6 minutes on a 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
if [ $# -gt 0 ]; then
  exec "$P" -m pycomm.bench "$@"
fi
"$P" -m pycomm.bench kernels
"$P" -m pycomm.bench allreduce
