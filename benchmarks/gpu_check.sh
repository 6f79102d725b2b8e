#!/usr/bin/env bash
# The GPU check, tools/gpu_check.py (build with CUDA, GPU tests,
# benchmark, report; --dry-run on a machine without a GPU). A file, not a
# module: it needs only the standard library, so it starts before pycomm
# can be imported. Usage: bash benchmarks/gpu_check.sh --help
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec python3 "$ROOT/tools/gpu_check.py" "$@"
