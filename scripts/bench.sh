#!/usr/bin/env bash
# The benchmark harness, from a fresh machine: sets up, builds, runs.
# Without arguments it runs the end-to-end comparison a user needs first,
# `pycomm-bench ddp` (how long: README.md, "Two commands"): DDP training on
# emulated 100 Mbit/s, 1 Gbit/s, 2.5 Gbit/s and unshaped links, pycomm against
# plain all-reduce, PyTorch's fp16 and PowerSGD hooks. Arguments go to
# pycomm-bench instead, e.g. `bash scripts/bench.sh all` (every benchmark) or
# `bash scripts/bench.sh kernels --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
# The harness is the package pycomm_bench (bench/, installed by setup_env.sh).
if [ $# -gt 0 ]; then
  exec "$P" -m pycomm_bench "$@"
fi
exec "$P" -m pycomm_bench ddp
