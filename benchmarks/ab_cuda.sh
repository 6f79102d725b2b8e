#!/usr/bin/env bash
# Two builds of pycomm side by side on one GPU: each source tree is built
# and installed into a directory of its own (over the machine's CUDA torch,
# python3), then `pycomm-bench allreduce --device cuda` runs ROUNDS times
# for each, the order alternating per round, so that drift of the machine
# hits both alike. The harness is NEW_TREE's (bench/) for both: one
# benchmark, two libraries.
#   bash benchmarks/ab_cuda.sh OLD_TREE NEW_TREE ROUNDS OUT_DIR
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3; out=$(mkdir -p "$4" && cd "$4" && pwd)
# The GPU machine's CXX is a wrapper that links libstdc++ statically, which
# the build refuses: the system compiler instead.
export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
build() {  # name tree
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "/tmp/ab-$1" "$2" \
    --config-settings=cmake.define.PYCOMM_CUDA=ON --config-settings=cmake.define.PYCOMM_CUDA_ARCHS=90a-real \
    --config-settings=build-dir="/tmp/ab-build-$1" > "$out/build-$1.log" 2>&1
}
build old "$old" & build new "$new" & wait
cd /tmp  # import pycomm from the installs, not from a source tree
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    PYTHONPATH="/tmp/ab-$side:$new/bench" python3 -m pycomm_bench allreduce --device cuda --no-progress \
      --json "$out/$side-round$r.json" > "$out/$side-round$r.log" 2>&1
    echo "round $r $side done"
  done
done
