#!/usr/bin/env bash
# The pytest-benchmark suites (kernels and all-reduce, benchmarks/), compared
# with the baseline saved in benchmarks/results/pytest-benchmark/: fails if a
# case's median is more than 20% slower.
#   bash scripts/microbench.sh          # run and compare
#   bash scripts/microbench.sh --save   # run and save as the new baseline
# Extra arguments go to pytest (e.g. -k onebit).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
P="${PYCOMM_VENV:-.venv}/bin/python"
STORE="file://benchmarks/results/pytest-benchmark"
ARGS=(-m pytest benchmarks -q -p no:cacheprovider --benchmark-only --benchmark-storage="$STORE"
      --benchmark-group-by=group --benchmark-columns=min,median,max,iqr,rounds)
if [ "${1:-}" = "--save" ]; then
  shift
  exec "$P" "${ARGS[@]}" --benchmark-save=baseline "$@"
fi
exec "$P" "${ARGS[@]}" --benchmark-compare --benchmark-compare-fail=median:20% "$@"
