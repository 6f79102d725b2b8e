#!/usr/bin/env bash
# pycomm's GPU check: build with CUDA, run the GPU tests, benchmark, report.
#
# On the GPU machine (one H200; CUDA torch, Triton and CuPy installed
# system-wide; no network), in under 8 minutes:
#   env           what the machine is (nvidia-smi, versions), a venv with
#                 --system-site-packages (the system's CUDA torch/Triton/CuPy),
#                 checks that the build and test tools are there
#   build         nvcc -Xptxas -v of every kernels/cuda/*.cu for sm_90a + PTX
#                 (the register/spill report), Triton kernels compiled ahead
#                 of time for sm_90a (their registers/spills), and
#                 pip install --no-build-isolation --no-deps --no-index -e .
#                 with PYCOMM_CUDA=ON (verbose log in build.log)
#   tests_cuda    pytest tests/test_onebit.py tests/test_topk.py -m gpu
#                 (the impl="cuda" cases against the reference)
#   bench         python -m pycomm.bench kernels --device cuda --numel 256M
#                 (CUDA, Triton, unfused torch, torch.topk, plus an unfused
#                 peer whose packbits is CuPy's), CUDA events, medians,
#                 GB/s against a device-to-device copy timed in the same run
#   tests_triton  pytest tests/test_triton.py (on the GPU: Triton compiled;
#                 last, as the longest: the budget cuts it, not the benchmark)
#   report        summary.json and a short table, printed last
# Every step runs under a time limit taken from one overall budget (default
# 450 s: with the report and the kill grace, all ends within 8 minutes); a
# step that fails does not stop the next; the exit status is 1 if any failed.
#
# tests/test_backend.py and the other multi-process tests are not run here:
# they run Gloo on CPU tensors, which the CPU test suite already covers.
#
# --dry-run (CPU machines, no GPU): everything that runs without one: the
# argument handling, the environment checks (of the interpreter at hand; no
# venv is made), nvcc compiling every kernel for sm_90a with the register
# report, the Triton kernels compiled for sm_90a, a CMake configure of the
# CUDA branch, pip's own check of the build command (pip --dry-run), the CPU
# half of tests/test_onebit.py, the benchmark on cpu with --quick (numpy
# standing in for CuPy in the extra peer), the result files. It says what it
# skipped.
#
# Usage: see usage() below, or bash benchmarks/gpu_check.sh --help.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG="benchmarks/gpu_check.sh"

usage() {
  cat <<EOF
usage: bash $PROG [--dry-run] [--only STEPS] [--budget SECONDS] [--numel N]
                  [--wheelhouse DIR] [-h|--help] [OUT_DIR]

  OUT_DIR            where the results go (default: \$PYCOMM_GPU_OUT, else
                     benchmarks/results/gpu-<date>/, or gpu-dryrun-<date>/
                     with --dry-run)
  --dry-run          CPU machine: run all that needs no GPU, skip the rest
  --only STEPS       comma-separated subset of: build,tests,bench (env and
                     report always run; without build, the venv and the
                     build of an earlier run are reused)
  --budget SECONDS   time for the steps (default 450; 170 with --dry-run)
  --numel N          benchmark size (default 256M; 64k with --dry-run)
  --wheelhouse DIR   install missing build/test tools from wheels in DIR
                     (pip --no-index --find-links DIR, into the venv only)
  -h, --help         this text

environment: PYCOMM_PYTHON (interpreter with CUDA torch; default python3, or
.venv/bin/python with --dry-run), PYCOMM_GPU_VENV (venv to create or reuse;
default \${TMPDIR:-/tmp}/pycomm-gpu-venv; "-" installs into PYCOMM_PYTHON),
PYCOMM_GPU_WORK (build dir, caches; default \${TMPDIR:-/tmp}/pycomm-gpu-check),
PYCOMM_GPU_ARCHS (default "90a-real;90-virtual"), PYCOMM_GPU_OUT, CUDA_HOME.
EOF
}

bad_usage() {
  echo "$PROG: $1" >&2
  usage >&2
  exit 2
}

# ------------------------------------------------------------- arguments ---
MODE=gpu
OUT_ARG=""
ONLY=""
BUDGET=""
NUMEL=""
WHEELHOUSE=${PYCOMM_WHEELHOUSE:-}
positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry ;;
    -h | --help) usage; exit 0 ;;
    --only | --budget | --numel | --wheelhouse)
      [ $# -ge 2 ] || bad_usage "option $1 needs a value"
      case "$1" in
        --only) ONLY=$2 ;;
        --budget) BUDGET=$2 ;;
        --numel) NUMEL=$2 ;;
        --wheelhouse) WHEELHOUSE=$2 ;;
      esac
      shift ;;
    --only=*) ONLY=${1#*=} ;;
    --budget=*) BUDGET=${1#*=} ;;
    --numel=*) NUMEL=${1#*=} ;;
    --wheelhouse=*) WHEELHOUSE=${1#*=} ;;
    --) shift; positional+=("$@"); break ;;
    -*) bad_usage "unknown option: $1" ;;
    *) positional+=("$1") ;;
  esac
  shift
done
[ ${#positional[@]} -le 1 ] || bad_usage "at most one OUT_DIR, got: ${positional[*]}"
[ ${#positional[@]} -eq 0 ] || OUT_ARG=${positional[0]}

if [ "$MODE" = dry ]; then
  BUDGET=${BUDGET:-170}
  NUMEL=${NUMEL:-64k}
else
  BUDGET=${BUDGET:-450}
  NUMEL=${NUMEL:-256M}
fi
[[ "$BUDGET" =~ ^[0-9]+$ ]] && [ "$BUDGET" -ge 30 ] || bad_usage "--budget: an integer >= 30 seconds, got '$BUDGET'"
[[ "$NUMEL" =~ ^[0-9]+[kKmMgG]?$ ]] || bad_usage "--numel: a positive integer with an optional k/M/G suffix, got '$NUMEL'"
SEL_BUILD=1 SEL_TESTS=1 SEL_BENCH=1
if [ -n "$ONLY" ]; then
  SEL_BUILD=0 SEL_TESTS=0 SEL_BENCH=0
  IFS=, read -r -a _only <<<"$ONLY"
  for s in "${_only[@]}"; do
    case "$s" in
      build) SEL_BUILD=1 ;;
      tests) SEL_TESTS=1 ;;
      bench) SEL_BENCH=1 ;;
      *) bad_usage "--only: unknown step '$s' (choose from build,tests,bench)" ;;
    esac
  done
fi
if [ -n "$WHEELHOUSE" ] && [ ! -d "$WHEELHOUSE" ]; then
  bad_usage "--wheelhouse: no such folder: $WHEELHOUSE"
fi
[ -z "$WHEELHOUSE" ] || WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)

DATE=$(date -u +%Y-%m-%d)
if [ -n "$OUT_ARG" ]; then
  OUT=$OUT_ARG
elif [ -n "${PYCOMM_GPU_OUT:-}" ]; then
  OUT=$PYCOMM_GPU_OUT
elif [ "$MODE" = dry ]; then
  OUT=$ROOT/benchmarks/results/gpu-dryrun-$DATE
else
  OUT=$ROOT/benchmarks/results/gpu-$DATE
fi
mkdir -p "$OUT" || { echo "$PROG: cannot create the output folder $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)

# --------------------------------------------------------- the whole log ---
LOG=$OUT/gpu_check.log
: >"$LOG"
exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
WORK=${PYCOMM_GPU_WORK:-${TMPDIR:-/tmp}/pycomm-gpu-check}
mkdir -p "$WORK"
RUN_DIR=$(mktemp -d "$WORK/run.XXXXXX")
finish() {
  local rc=$?
  [ "${PYCOMM_GPU_KEEP_WORK:-0}" = 1 ] || rm -rf "$RUN_DIR"
  exec 1>&3 2>&4
  wait "$TEE_PID" 2>/dev/null || true
  exit "$rc"
}
trap finish EXIT

START_S=$(date +%s)
DEADLINE=$((START_S + BUDGET))
STEPS_TSV=$OUT/steps.tsv
printf 'step\tstatus\trc\tseconds\tlimit_s\tnote\n' >"$STEPS_TSV"

echo "== pycomm GPU check ($([ "$MODE" = dry ] && echo "DRY RUN, no GPU" || echo GPU)) =="
echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "host:    $(hostname 2>/dev/null || echo '?')  ($(nproc 2>/dev/null || echo '?') CPUs)"
echo "repo:    $ROOT @ $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(
  [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null | head -1)" ] && echo ' (uncommitted changes)')"
echo "out:     $OUT"
echo "budget:  ${BUDGET}s; benchmark numel $NUMEL"

# -------------------------------------------------------- configuration ---
if [ "$MODE" = dry ]; then
  if [ -n "${PYCOMM_PYTHON:-}" ]; then
    PY=$PYCOMM_PYTHON
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
  else
    PY=$(command -v python3 || echo python3)
  fi
  BASE_PY=$PY
  VENV=""
else
  BASE_PY=${PYCOMM_PYTHON:-$(command -v python3 || echo python3)}
  VENV=${PYCOMM_GPU_VENV:-${TMPDIR:-/tmp}/pycomm-gpu-venv}
  if [ "$VENV" = - ]; then PY=$BASE_PY; else PY=$VENV/bin/python; fi
fi
ARCHS=${PYCOMM_GPU_ARCHS:-90a-real;90-virtual}
BUILD_DIR=$WORK/build
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if [ "$MODE" = gpu ]; then
  unset TRITON_INTERPRET  # on the GPU, Triton must compile, not interpret
  # torch's CMake config adds nvcc -gencode flags of its own (detected from
  # the GPU unless this is set): keep them to the one target of this check.
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
fi

find_nvcc() {  # CUDA_HOME first (the user's choice), then PATH, then /usr/local/cuda*
  local d
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then echo "$d/bin/nvcc"; return 0; fi
  done
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  for d in /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV); do
    if [ -x "$d/bin/nvcc" ]; then echo "$d/bin/nvcc"; return 0; fi
  done
  return 1
}
NVCC=$(find_nvcc || true)
CUDA_ROOT=""
if [ -n "$NVCC" ]; then
  # nvcc may be a wrapper script: ask it where its toolkit is, and point every
  # finder (CMake's CUDA language, torch's FindCUDA, FindCUDAToolkit) at that
  # one toolkit, or torch's CMake config stops on "two conflicting CUDA versions".
  CUDA_ROOT=$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  if [ -n "$CUDA_ROOT" ] && [ -x "$CUDA_ROOT/bin/nvcc" ]; then
    CUDA_ROOT=$(cd "$CUDA_ROOT" && pwd -P)
    NVCC=$CUDA_ROOT/bin/nvcc
    if [ "$MODE" = gpu ]; then
      export CUDA_HOME=$CUDA_ROOT CUDA_PATH=$CUDA_ROOT CUDAToolkit_ROOT=$CUDA_ROOT
    fi
  else
    CUDA_ROOT=""
  fi
  NVCC_DIR=$(dirname "$NVCC")
  case ":$PATH:" in *":$NVCC_DIR:"*) ;; *) export PATH="$NVCC_DIR:$PATH" ;; esac
  export CUDACXX=$NVCC
fi

export ROOT OUT WORK RUN_DIR MODE PY BASE_PY VENV NVCC CUDA_ROOT ARCHS BUILD_DIR NUMEL WHEELHOUSE DATE

# ------------------------------------------------- Python helper scripts ---
# Written once per run into RUN_DIR; the report uses the standard library only.

cat >"$RUN_DIR/env_probe.py" <<'PY'
"""Versions and devices, as JSON (argv[1]); a missing module is a None."""
import importlib, json, os, platform, sys

info = {"python": platform.python_version(), "executable": sys.executable, "prefix": sys.prefix}
def version(name):
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - report any import failure
        return None, f"{type(exc).__name__}: {exc}"[:300]
    return getattr(mod, "__version__", "?"), None
errors = {}
for key, mod in [("torch", "torch"), ("triton", "triton"), ("cupy", "cupy"), ("numpy", "numpy"),
                 ("scikit_build_core", "scikit_build_core"), ("pytest", "pytest"),
                 ("hypothesis", "hypothesis"), ("pytest_timeout", "pytest_timeout"),
                 ("tabulate", "tabulate"), ("tqdm", "tqdm"), ("ninja_py", "ninja"), ("cmake_py", "cmake"),
                 ("pip", "pip")]:
    info[key], err = version(mod)
    if err:
        errors[key] = err
info["import_errors"] = errors
try:
    import torch
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), device_name=p.name,
                    capability=list(torch.cuda.get_device_capability(0)), sm_count=p.multi_processor_count,
                    total_mem_gib=round(p.total_memory / 2**30, 1))
except Exception as exc:  # noqa: BLE001
    info["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
try:
    import cupy
    info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
except Exception:  # noqa: BLE001
    pass
json.dump(info, open(sys.argv[1], "w"), indent=2)
for k, v in info.items():
    if k != "import_errors":
        print(f"  {k:18} {v}")
for k, v in errors.items():
    print(f"  {k:18} not importable ({v})")
PY

cat >"$RUN_DIR/ptxas_table.py" <<'PY'
"""Parse `ptxas -v` output (argv[1]) into JSON (argv[2]) and print a table."""
import json, re, shutil, subprocess, sys

text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
rows, cur, source = [], None, None
for line in text.splitlines():
    m = re.match(r"### (\S+)", line)
    if m:
        source = m.group(1)
        continue
    m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
    if m:
        cur = {"source": source, "mangled": m.group(1), "arch": m.group(2), "registers": None,
               "stack_bytes": None, "spill_stores": None, "spill_loads": None, "smem_bytes": 0}
        rows.append(cur)
        continue
    if cur is None:
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", line)
    if m:
        cur["registers"] = int(m.group(1))
        s = re.search(r"(\d+) bytes smem", line)
        cur["smem_bytes"] = int(s.group(1)) if s else 0
names = [r["mangled"] for r in rows]
if names and shutil.which("c++filt"):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    if len(out) == len(names):
        for r, d in zip(rows, out):
            r["demangled"] = d
def short(r):
    d = r.get("demangled", r["mangled"]).replace("(anonymous namespace)::", "")
    d = re.sub(r"^void ", "", d).split("(")[0]
    if d.startswith("cub::"):  # cub::CUB_300001_SM_900::detail::scan::DeviceScanKernel<...long...>
        d = "cub::" + d.split("<")[0].split("::")[-1] + ("<...>" if "<" in d else "")
    return d.replace("pycomm::cuda::", "")
for r in rows:
    r["kernel"] = short(r)
json.dump(rows, open(sys.argv[2], "w"), indent=2)
print(f"  {'kernel':58} {'arch':7} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}")
for r in rows:
    print(f"  {r['kernel'][:58]:58} {r['arch']:7} {r['registers'] if r['registers'] is not None else '?':>4} "
          f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>11} {r['stack_bytes']!s:>5} {r['smem_bytes']:>6}")
spills = [r for r in rows if (r["spill_stores"] or 0) + (r["spill_loads"] or 0) > 0]
print(f"  {len(rows)} kernels, max {max([r['registers'] or 0 for r in rows], default=0)} registers, "
      f"{len(spills)} with spills" + (": " + ", ".join(r["kernel"] for r in spills) if spills else ""))
sys.exit(0 if rows else 1)
PY

cat >"$RUN_DIR/triton_aot.py" <<'PY'
"""Compile pycomm's Triton kernels for sm_90a ahead of time, without a GPU.

A stand-in Triton driver names the target (cuda, capability 90, warp 32);
JITFunction.warmup compiles exactly what a launch with these argument types
and constexprs would compile (the call sites in pycomm/triton/*.py), and
launches nothing. Registers and local memory come from cuobjdump on the
cubin. Exit 1: a kernel failed to compile; 3: this Triton has no API for it.
"""
import json, os, re, shutil, subprocess, sys, tempfile, time

out_json = sys.argv[1]
sys.path.insert(0, os.environ["ROOT"])  # pycomm from the source tree, built or not
try:
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
except Exception as exc:  # noqa: BLE001
    print(f"  Triton ahead-of-time compile not possible here: {type(exc).__name__}: {exc}")
    sys.exit(3)

class TargetOnlyDriver:
    """Enough of a Triton driver to compile; it cannot launch."""
    def __init__(self):
        self.target = GPUTarget("cuda", 90, 32)
    def get_current_target(self):
        return self.target
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0
    def is_active(self):
        return True

try:
    driver.set_active(TargetOnlyDriver())
    from pycomm.triton import onebit as tob
    from pycomm.triton import topk as ttk
except Exception as exc:  # noqa: BLE001
    print(f"  Triton ahead-of-time compile not possible here: {type(exc).__name__}: {exc}")
    sys.exit(3)

f32, f16, bf16, i32, i64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
N = 1 << 20  # divisible by 16, as large tensors are (Triton specializes on it)
W = tob.MAX_TILE // 32
TK = dict(BLOCK=ttk.TILE, num_warps=ttk.NUM_WARPS)
variants = [
    # (kernel, label, args, kwargs): mirrors the launches in pycomm/triton/*.py
    (tob._compress_kernel, "onebit compress f32 EF b=2048", (f32, f32, i32, f32, N, 2048),
     dict(HAS_RES=True, WORDS=W, ONE_TILE=True, num_warps=8)),
    (tob._compress_kernel, "onebit compress f32 noEF b=2048", (f32, f32, i32, f32, N, 2048),
     dict(HAS_RES=False, WORDS=W, ONE_TILE=True, num_warps=8)),
    (tob._compress_kernel, "onebit compress bf16 EF b=2048", (bf16, f32, i32, f32, N, 2048),
     dict(HAS_RES=True, WORDS=W, ONE_TILE=True, num_warps=8)),
    (tob._compress_kernel, "onebit compress f16 EF b=2048", (f16, f32, i32, f32, N, 2048),
     dict(HAS_RES=True, WORDS=W, ONE_TILE=True, num_warps=8)),
    (tob._compress_kernel, "onebit compress f32 EF b=32", (f32, f32, i32, f32, N, 32),
     dict(HAS_RES=True, WORDS=1, ONE_TILE=True, num_warps=1)),
    (tob._compress_kernel, "onebit compress f32 EF b=65536", (f32, f32, i32, f32, N, 65536),
     dict(HAS_RES=True, WORDS=W, ONE_TILE=False, num_warps=8)),
    (tob._decompress_kernel, "onebit decompress", (i32, f32, f32, N, 2048),
     dict(ACCUMULATE=False, WORDS=tob.DECOMPRESS_TILE // 32, num_warps=8)),
    (tob._decompress_kernel, "onebit decompress acc", (i32, f32, f32, N, 2048),
     dict(ACCUMULATE=True, WORDS=tob.DECOMPRESS_TILE // 32, num_warps=8)),
    (ttk._radix_hist_kernel, "topk radix_hist f32 EF shift=24", (f32, f32, N, i32, i32),
     dict(SHIFT=24, HAS_RES=True, **TK)),
    (ttk._radix_hist_kernel, "topk radix_hist f32 EF shift=16", (f32, f32, N, i32, i32),
     dict(SHIFT=16, HAS_RES=True, **TK)),
    (ttk._radix_hist_kernel, "topk radix_hist bf16 noEF shift=0", (bf16, bf16, N, i32, i32),
     dict(SHIFT=0, HAS_RES=False, **TK)),
    (ttk._radix_pick_kernel, "topk radix_pick shift=24", (i32, i32), dict(SHIFT=24, num_warps=1)),
    (ttk._radix_pick_kernel, "topk radix_pick shift=0", (i32, i32), dict(SHIFT=0, num_warps=1)),
    (ttk._count_kernel, "topk count f32 EF", (f32, f32, N, i32, i32, i32), dict(HAS_RES=True, **TK)),
    (ttk._compact_kernel, "topk compact f32 EF", (f32, f32, N, i32, i64, i64, i64, i32, f32),
     dict(HAS_RES=True, LIMIT_EQ=False, **TK)),
    (ttk._compact_kernel, "topk compact f32 EF limit_eq", (f32, f32, N, i32, i64, i64, i64, i32, f32),
     dict(HAS_RES=True, LIMIT_EQ=True, **TK)),
    (ttk._scatter_kernel, "topk scatter", (i32, f32, f32, 4096), dict(ACCUMULATE=False, BLOCK=ttk.SCATTER_TILE, num_warps=4)),
    (ttk._scatter_kernel, "topk scatter acc", (i32, f32, f32, 4096), dict(ACCUMULATE=True, BLOCK=ttk.SCATTER_TILE, num_warps=4)),
]

bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
cuobjdump = next((p for p in [os.path.join(bindir, "cuobjdump"), shutil.which("cuobjdump")] if p and os.access(p, os.X_OK)), None)
rows, failed = [], 0
tmp = tempfile.mkdtemp()
print(f"  triton {triton.__version__}, target sm_90a (cuda 90, warp 32), cache {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')}")
print(f"  {'variant':36} {'kernel':20} {'regs':>4} {'local':>5} {'smem':>6} {'s':>5}")
for kernel, label, args, kwargs in variants:
    row = {"variant": label, "kernel": getattr(kernel, "__name__", str(kernel)), "ok": False, "error": None,
           "registers": None, "local_bytes": None, "smem_bytes": None}
    t0 = time.time()
    try:
        ck = kernel.warmup(*args, grid=(1,), **kwargs)
        row["ok"] = True
        row["smem_bytes"] = getattr(ck.metadata, "shared", None)
        if cuobjdump and "cubin" in ck.asm:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as fh:
                fh.write(ck.asm["cubin"])
            res = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res)
            if m:
                row["registers"], row["local_bytes"] = int(m.group(1)), int(m.group(2))
    except Exception as exc:  # noqa: BLE001 - a compile error is the finding
        failed += 1
        row["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    row["seconds"] = round(time.time() - t0, 2)
    rows.append(row)
    if row["ok"]:
        print(f"  {label:36} {row['kernel']:20} {row['registers']!s:>4} {row['local_bytes']!s:>5} "
              f"{row['smem_bytes']!s:>6} {row['seconds']:5.1f}")
    else:
        print(f"  {label:36} FAILED TO COMPILE: {row['error']}")
json.dump({"triton": triton.__version__, "target": "sm_90a", "variants": rows}, open(out_json, "w"), indent=2)
try:
    driver.reset_active()  # raises where no real driver exists (no GPU); nothing runs after this
except Exception:  # noqa: BLE001
    pass
spilled = [r["variant"] for r in rows if r["local_bytes"]]
print(f"  {len(rows) - failed}/{len(rows)} compiled" + (f"; local memory (spills) in: {', '.join(spilled)}" if spilled else ""))
sys.exit(1 if failed else 0)
PY

cat >"$RUN_DIR/bench_driver.py" <<'PY'
"""`pycomm-bench kernels` plus one more onebit peer: the unfused torch
pipeline with its packbits/unpackbits done by CuPy (on CPU: numpy, so that
the dry run exercises the same code), arrays shared through DLPack and CuPy
enqueued on torch's current stream. Arguments: those of `pycomm-bench
kernels`; --impls defaults to the compiled implementations (cuda and triton,
or cpu), leaving the slow pure-torch reference out."""
import contextlib, json, os, sys

sys.path.insert(0, os.environ["ROOT"])  # an editable install, if any, still wins
import torch

import pycomm
import pycomm.bench.kernels as K
from pycomm.bench import cli, write_json

argv = sys.argv[1:]
device = torch.device(argv[argv.index("--device") + 1]) if "--device" in argv else torch.device("cpu")
json_path = argv[argv.index("--json") + 1]
if "--impls" not in argv:
    wanted = ["cuda", "triton"] if device.type == "cuda" else ["cpu"]
    have = set(K.benchmarkable_impls("onebit", device)) | set(K.benchmarkable_impls("topk", device))
    impls = [i for i in wanted if i in have]
    missing = [i for i in wanted if i not in have]
    if missing:
        print(f"bench: NOT AVAILABLE here: {', '.join(missing)} (pycomm.available_impls says "
              f"{pycomm.available_impls('onebit', device=device)})")
    if impls:
        argv += ["--impls", *impls]

xp, xp_error = None, None
if device.type == "cuda":
    try:
        import cupy as xp
    except Exception as exc:  # noqa: BLE001
        xp_error = f"{type(exc).__name__}: {exc}"
else:
    import numpy as xp
PEER_XP = f"unfused-{xp.__name__}" if xp is not None else None

def stream_ctx():
    if xp is not None and xp.__name__ == "cupy":
        return xp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
    return contextlib.nullcontext()

def packbits_xp(signs):
    """bool [n] -> int32 words, bit i of word w = element 32w + i (as K._packbits)."""
    with stream_ctx():
        packed = xp.packbits(xp.from_dlpack(signs.contiguous().view(torch.uint8)), bitorder="little")
        pad = (-packed.size) % 4
        if pad:
            packed = xp.concatenate([packed, xp.zeros(pad, dtype=xp.uint8)])
        words = torch.from_dlpack(packed)
    return words.view(torch.int32)

def unpackbits_xp(bits, numel):
    with stream_ctx():
        flags = xp.unpackbits(xp.from_dlpack(bits.contiguous().view(torch.uint8)), bitorder="little")[:numel]
        out = torch.from_dlpack(flags)
    return out.view(torch.bool)

def swapped(name, repl, call):
    """Run call() with K.<name> replaced: the peer is K's unfused pipeline
    with only its bit packing done by xp."""
    saved = getattr(K, name)
    setattr(K, name, repl)
    try:
        return call()
    finally:
        setattr(K, name, saved)

if PEER_XP is not None:
    for name in ("_packbits", "_unpackbits", "onebit_runners", "FAMILY_CONTENDERS",
                 "unfused_onebit_compress", "unfused_onebit_decompress"):
        assert hasattr(K, name), f"pycomm.bench.kernels.{name} is gone: update bench_driver.py in {__file__}"
    orig_runners = K.onebit_runners
    orig_contenders = K.FAMILY_CONTENDERS["onebit"]

    def onebit_runners(impl, block):
        if impl != PEER_XP:
            return orig_runners(impl, block)
        return (
            lambda g, r: swapped("_packbits", packbits_xp, lambda: K.unfused_onebit_compress(g, r, block)),
            lambda bits, scales, out, acc: swapped(
                "_unpackbits", unpackbits_xp, lambda: K.unfused_onebit_decompress(bits, scales, block, out, acc)),
        )

    def onebit_contenders(ctx, case, op, impls):
        out = orig_contenders(ctx, case, op, list(impls) + [PEER_XP])
        for c in out:
            if c.impl == PEER_XP:
                c.kind = "peer"
        return out

    K.onebit_runners = onebit_runners
    K.FAMILY_CONTENDERS["onebit"] = onebit_contenders
    print(f"bench: extra onebit peer {PEER_XP!r} ({xp.__name__} {xp.__version__} packbits, via DLPack)")
else:
    print(f"bench: CuPy is not importable ({xp_error}): the CuPy packbits peer is left out")

print("bench: python -m pycomm.bench kernels " + " ".join(argv), flush=True)
rc = cli.main(["kernels", *argv])
try:
    doc = json.load(open(json_path))
    bad = K.failed_rows(doc)
    if rc == 1 and bad and all(r["impl"] == PEER_XP for r in bad):
        print(f"bench: WARNING: only the extra {PEER_XP} peer failed ({bad[0]['error']}); not a failure of the check")
        rc = 0
    doc["gpu_check"] = {"xp_peer": PEER_XP, "xp_peer_module": getattr(xp, "__name__", None),
                        "xp_version": getattr(xp, "__version__", None), "xp_peer_error": xp_error,
                        "argv": argv}
    write_json(json_path, doc)
except FileNotFoundError:
    print(f"bench: no JSON was written to {json_path}")
    rc = rc or 1
sys.exit(rc)
PY

cat >"$RUN_DIR/report.py" <<'PY'
"""summary.json and the closing table (standard library only)."""
import glob, json, os, sys
import xml.etree.ElementTree as ET

out, mode, start_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
import time
def load(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default
steps = []
with open(os.path.join(out, "steps.tsv")) as fh:
    header = fh.readline().rstrip("\n").split("\t")
    for line in fh:
        steps.append(dict(zip(header, line.rstrip("\n").split("\t"))))
env = load(os.path.join(out, "env.json"), {})
ptx = load(os.path.join(out, "ptxas-sm_90a.json"), [])
tri = load(os.path.join(out, "triton-aot-sm_90a.json"), {})
tests = {}
for path in sorted(glob.glob(os.path.join(out, "tests-*.xml"))):
    try:
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        a = suite.attrib
        total, fail, err, skip = (int(a.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        tests[os.path.basename(path)] = dict(tests=total, passed=total - fail - err - skip, failed=fail,
                                             errors=err, skipped=skip, seconds=float(a.get("time", 0)))
    except (OSError, ET.ParseError, AttributeError) as exc:
        tests[os.path.basename(path)] = {"error": str(exc)}
bench_path = next(iter(sorted(glob.glob(os.path.join(out, "kernels-*.json")))), None)
bench = load(bench_path, None) if bench_path else None
smi = None
try:
    smi = open(os.path.join(out, "nvidia-smi.txt")).read()
except OSError:
    pass
bad = [s["step"] for s in steps if s["status"] not in ("ok", "warn", "not run")]
skipped_dry = [
    "building the extension with CUDA (pip install --no-build-isolation -e . with PYCOMM_CUDA=ON): "
    "only pip --dry-run and a CMake configure of the CUDA branch ran",
    "the CUDA and Triton tests on a GPU (tests/test_onebit.py tests/test_topk.py -m gpu, tests/test_triton.py): "
    "only the CPU half of tests/test_onebit.py ran",
    f"the benchmark on cuda at 256M elements with CUDA events: it ran on cpu with --quick (numel {os.environ.get('NUMEL')})",
    "the CuPy packbits peer (numpy stood in for CuPy, through the same DLPack code)",
    "nvidia-smi and the device checks (no GPU here)",
]
summary = {
    "mode": "dry-run" if mode == "dry" else "gpu",
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_s)),
    "seconds": int(time.time()) - start_s,
    "ok": not bad,
    "failed_steps": bad,
    "steps": steps,
    "device": env.get("device_name"),
    "env": env,
    "nvidia_smi": smi,
    "ptxas_sm_90a": ptx,
    "triton_aot_sm_90a": tri,
    "tests": tests,
    "bench_json": os.path.basename(bench_path) if bench_path else None,
    "bench_copy_gbps": bench.get("copy_gbps") if bench else None,
    "skipped_in_dry_run": skipped_dry if mode == "dry" else [],
    "log": "gpu_check.log",
}
with open(os.path.join(out, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=2)
    fh.write("\n")

def fmt(x, d=3):
    if x is None:
        return "-"
    if x == 0:
        return "0"
    import math
    mag = math.floor(math.log10(abs(x)))
    return f"{x:.{max(0, d - 1 - mag)}f}"
print()
print("=" * 100)
title = "DRY RUN (no GPU)" if mode == "dry" else (env.get("device_name") or "GPU ?")
print(f"pycomm GPU check: {title}, {summary['date']}, {summary['seconds']} s, torch {env.get('torch')} "
      f"(CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, cupy {env.get('cupy')}")
print(f"{'step':13} {'status':9} {'s':>5} {'limit':>5}  note")
for s in steps:
    print(f"{s['step']:13} {s['status']:9} {s['seconds']:>5} {s['limit_s']:>5}  {s['note']}")
if ptx:
    spills = sum(1 for r in ptx if (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0))
    print(f"nvcc sm_90a: {len(ptx)} kernels, max {max((r.get('registers') or 0) for r in ptx)} registers, "
          f"{spills} spilling (ptxas-sm_90a.txt)")
if tri.get("variants"):
    v = tri["variants"]
    print(f"triton sm_90a: {sum(r['ok'] for r in v)}/{len(v)} compiled, max "
          f"{max((r.get('registers') or 0) for r in v)} registers, "
          f"{sum(1 for r in v if r.get('local_bytes'))} with local memory")
for name, t in tests.items():
    if "error" in t:
        print(f"{name}: unreadable ({t['error']})")
    else:
        print(f"{name}: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped in {t['seconds']:.0f} s")
if bench:
    print(f"kernels: {bench['numel']} float32 on {bench['device']}"
          f"{' (' + bench['machine'].get('gpu') + ')' if bench['machine'].get('gpu') else ''}, "
          f"median of {bench['repeats']} after {bench['warmup']} warm-up; copy {fmt(bench.get('copy_gbps'))} GB/s")
    print(f"  {'compressor':20} {'op':15} {'impl':14} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'x unf':>6} {'x topk':>6}  status")
    for r in bench["rows"]:
        ms = None if r.get("median_s") is None else 1e3 * r["median_s"]
        print(f"  {r['compressor']:20} {r['op']:15} {r['impl']:14} {fmt(ms):>8} {fmt(r.get('gbps')):>7} "
              f"{fmt(r.get('pct_copy'), 2):>6} {fmt(r.get('speedup_vs_unfused')):>6} "
              f"{fmt(r.get('speedup_vs_torch_topk')):>6}  {r['status'] if r['status'] != 'ok' else ''}"
              f"{(' ' + str(r.get('error'))[:60]) if r.get('error') else ''}")
if mode == "dry":
    print("SKIPPED in this dry run (they need a GPU):")
    for s in skipped_dry:
        print(f"  - {s}")
print(f"results: {out}")
print("RESULT: " + ("PASS" if not bad else "FAIL (" + ", ".join(bad) + ")"))
PY

# ----------------------------------------------------------------- steps ---
say() { echo "[gpu_check] $*"; }
warn() { echo "[gpu_check] WARNING: $*"; }
problem() { echo "[gpu_check] PROBLEM: $*"; }

# Python tools each step needs: module -> pip name
tools_missing() {  # tools_missing PY MODULE... -> prints missing pip names
  local py=$1; shift
  "$py" - "$@" <<'PY' 2>/dev/null || echo "$*"
import importlib.util, sys
names = {"scikit_build_core": "scikit-build-core", "pytest_timeout": "pytest-timeout"}
print(" ".join(names.get(m, m) for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

step_env() {
  local fail=0 miss v
  cd "$ROOT"
  echo "--- machine"
  uname -a
  free -g 2>/dev/null | head -2 || true
  echo "--- nvidia-smi"
  if command -v nvidia-smi >/dev/null 2>&1; then
    { date -u '+%Y-%m-%d %H:%M:%S UTC'; nvidia-smi; echo
      nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit,pcie.link.gen.max \
        --format=csv; } >"$OUT/nvidia-smi.txt" 2>&1 || fail=1
    cat "$OUT/nvidia-smi.txt"
  elif [ "$MODE" = dry ]; then
    echo "nvidia-smi not found (dry run: no GPU expected)" | tee "$OUT/nvidia-smi.txt"
  else
    problem "nvidia-smi not found: is this the GPU machine? (use --dry-run on a CPU machine)"
    echo "nvidia-smi not found" >"$OUT/nvidia-smi.txt"
    fail=1
  fi
  echo "--- toolchain"
  if [ -n "$NVCC" ]; then echo "nvcc: $NVCC (toolkit ${CUDA_ROOT:-?})"; "$NVCC" --version | tail -2; else problem "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda*): the CUDA kernels cannot be compiled"; fail=1; fi
  for t in cmake ninja make g++ c++filt timeout; do
    if command -v "$t" >/dev/null 2>&1; then echo "$t: $(command -v "$t") $("$t" --version 2>/dev/null | head -1)"; else echo "$t: not found"; fi
  done
  echo "--- python: $BASE_PY"
  if ! "$BASE_PY" "$RUN_DIR/env_probe.py" "$OUT/env.json"; then
    problem "$BASE_PY does not run"; return 1
  fi
  if [ "$MODE" = gpu ]; then
    "$BASE_PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' 2>/dev/null \
      || { problem "$BASE_PY has no CUDA torch with a visible GPU (set PYCOMM_PYTHON to the interpreter that has one)"; fail=1; }
    "$BASE_PY" - <<'PY' || true
import json, os, re, subprocess
env = json.load(open(os.path.join(os.environ["OUT"], "env.json")))
warn = lambda m: print("[gpu_check] WARNING: " + m)
cap = env.get("capability")
if cap and cap != [9, 0]:
    warn(f"compute capability {cap}: the sm_90a kernels run on 9.0 only (the compute_90 PTX JITs on >= 9.0)")
nvcc = os.environ.get("NVCC")
tcuda = env.get("torch_cuda")
if nvcc and tcuda:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m and m.group(1) != tcuda.split(".")[0]:
        warn(f"nvcc is CUDA {m.group(1)}.{m.group(2)} but torch was built with CUDA {tcuda}: the extension "
             "links the toolkit's libcudart next to torch's; the driver must support the newer one")
    try:
        smi = open(os.path.join(os.environ["OUT"], "nvidia-smi.txt")).read()
        d = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi)
        if m and d and (int(m.group(1)), int(m.group(2))) > (int(d.group(1)), int(d.group(2))):
            warn(f"nvcc is CUDA {m.group(1)}.{m.group(2)} but the driver supports CUDA {d.group(1)}.{d.group(2)}: "
                 "kernels built by this nvcc may fail to load (cudaErrorInsufficientDriver / unsupported toolchain)")
    except OSError:
        pass
PY
    if [ "$VENV" != - ]; then
      if [ -x "$VENV/bin/python" ]; then
        say "reusing the venv $VENV"
      else
        say "creating the venv $VENV (--system-site-packages: the system's CUDA torch, Triton, CuPy)"
        "$BASE_PY" -m venv --system-site-packages "$VENV" ||
          { warn "venv with pip failed; trying --without-pip (pip then comes from the system site)"
            rm -rf "$VENV"; "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV"; } ||
          { problem "cannot create a venv with $BASE_PY -m venv (python3-venv missing?); PYCOMM_GPU_VENV=- installs into $BASE_PY itself"; return 1; }
      fi
      "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
        { problem "the venv $VENV does not see a CUDA torch: is $BASE_PY itself a venv? (PYCOMM_GPU_VENV=- uses it directly)"; fail=1; }
    fi
    "$PY" -m pip --version || { problem "no pip for $PY"; fail=1; }
  fi
  echo "--- build and test tools for $PY"
  miss=$(tools_missing "$PY" scikit_build_core pytest hypothesis tabulate tqdm numpy)
  if [ -n "$miss" ] && [ "$MODE" = gpu ] && [ -n "$WHEELHOUSE" ]; then
    say "installing from the wheelhouse $WHEELHOUSE: $miss"
    # shellcheck disable=SC2086
    "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" $miss || true
    miss=$(tools_missing "$PY" scikit_build_core pytest hypothesis tabulate tqdm numpy)
  fi
  if [ -n "$miss" ]; then
    problem "missing Python packages for $PY: $miss. There is no network: install them from wheels" \
      "(pip install --no-index --find-links DIR $miss, or pass --wheelhouse DIR)." \
      "Without scikit-build-core nothing builds; without pytest/hypothesis no test runs; without tabulate/tqdm no benchmark."
    fail=1
  fi
  if [ -n "$(tools_missing "$PY" pytest_timeout)" ]; then warn "pytest-timeout missing: single tests are not time-limited (the step still is)"; fi
  v=$( (cmake --version 2>/dev/null || "$PY" -m cmake --version 2>/dev/null) | head -1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' || true)
  if [ -z "$v" ]; then problem "CMake not found (need >= 3.25: a system cmake or the 'cmake' wheel)"; fail=1
  elif ! version_ge "$v" 3.25; then problem "CMake $v is older than the 3.25 CMakeLists.txt needs"; fail=1
  else echo "cmake $v: ok"; fi
  if command -v ninja >/dev/null 2>&1 || [ -z "$(tools_missing "$PY" ninja)" ]; then echo "ninja: ok"
  elif command -v make >/dev/null 2>&1; then warn "ninja missing: scikit-build-core falls back to make (slower)"
  else problem "neither ninja nor make: CMake has no generator"; fail=1; fi
  command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || { problem "no C++ compiler (g++)"; fail=1; }
  return "$fail"
}

# The register/spill report: every kernels/cuda/*.cu for sm_90a (+ compute_90
# PTX, as the build), flags as in CMakeLists.txt. Runs in the background.
nvcc_report() {
  local dir=$RUN_DIR/nvcc src name pids=() rc=0 i=0
  mkdir -p "$dir"
  : >"$OUT/ptxas-sm_90a.txt"
  local srcs=("$ROOT"/kernels/cuda/*.cu)
  for src in "${srcs[@]}"; do
    name=$(basename "$src" .cu)
    echo "\$ nvcc -c -std=c++17 -O3 -I kernels/include -I kernels/cuda -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90 -Xptxas -v kernels/cuda/$name.cu" >"$dir/$name.txt"
    "$NVCC" -c -std=c++17 -O3 -I "$ROOT/kernels/include" -I "$ROOT/kernels/cuda" \
      -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90 \
      -Xptxas -v "$src" -o "$dir/$name.o" >>"$dir/$name.txt" 2>&1 &
    pids+=($!)
  done
  for src in "${srcs[@]}"; do
    name=$(basename "$src" .cu)
    if wait "${pids[$i]}"; then status=ok; else status="FAILED (exit $?)"; rc=1; fi
    i=$((i + 1))
    { echo "### kernels/cuda/$name.cu: nvcc $status"; cat "$dir/$name.txt"; } >>"$OUT/ptxas-sm_90a.txt"
  done
  return "$rc"
}

step_build() {
  local fail=0 nvcc_pid="" rc
  cd "$ROOT"
  if [ -z "$NVCC" ]; then
    problem "nvcc not found: no register report, and the CUDA build cannot run"; fail=1
  else
    say "nvcc -Xptxas -v report for sm_90a (in the background)"
    nvcc_report &
    nvcc_pid=$!
  fi
  say "Triton kernels compiled ahead of time for sm_90a (in the background)"
  env -u TRITON_INTERPRET "$PY" "$RUN_DIR/triton_aot.py" "$OUT/triton-aot-sm_90a.json" >"$RUN_DIR/triton_aot.txt" 2>&1 &
  local triton_pid=$!
  local defs=(--config-settings=cmake.define.PYCOMM_CUDA=ON "--config-settings=cmake.define.PYCOMM_CUDA_ARCHS=$ARCHS"
    "--config-settings=build-dir=$BUILD_DIR" --config-settings=build.verbose=true)
  if [ "$MODE" = dry ]; then
    say "pip's check of the build command (--dry-run: nothing built or installed)"
    (cd "$ROOT" && "$PY" -m pip install --dry-run --no-build-isolation --no-deps --no-index -e . "${defs[@]}") ||
      { problem "pip rejects the build command"; fail=1; }
    say "CMake configure of the CUDA branch (PYCOMM_CUDA=ON, archs $ARCHS) against this torch; no build"
    local gen=() cdir=$RUN_DIR/cmake-cuda
    command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
    if cmake -S "$ROOT" -B "$cdir" "${gen[@]}" -DPython_EXECUTABLE="$PY" -DPYCOMM_CUDA=ON \
      "-DPYCOMM_CUDA_ARCHS=$ARCHS" -DCMAKE_BUILD_TYPE=Release >"$RUN_DIR/cmake.log" 2>&1; then
      grep -E "pycomm:|CUDA compiler identification|Configuring done" "$RUN_DIR/cmake.log" || true
      if [ ${#gen[@]} -gt 0 ]; then
        echo "nvcc command lines of the build:"
        ninja -C "$cdir" -t commands pycomm_cuda_kernels 2>/dev/null | grep -E "nvcc|\.cu" | sed "s|$ROOT/||g" || true
      fi
    else
      tail -40 "$RUN_DIR/cmake.log"; problem "CMake configure of the CUDA branch failed"; fail=1
    fi
  else
    say "pip install --no-build-isolation --no-deps --no-index -e . (PYCOMM_CUDA=ON, archs $ARCHS, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, build dir $BUILD_DIR); verbose log: build.log"
    local t0=$SECONDS
    if (cd "$ROOT" && "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e . "${defs[@]}") >"$OUT/build.log" 2>&1; then
      say "built in $((SECONDS - t0)) s; $(grep -c 'ptxas info' "$OUT/build.log" || true) ptxas lines in build.log"
      grep -E "pycomm: torch CUDA|CUDA compiler identification|Added CUDA NVCC flags|WARNING" "$OUT/build.log" | head -20 || true
      if [ -f "$BUILD_DIR/build.ninja" ]; then
        echo "nvcc command lines of the build:"
        ninja -C "$BUILD_DIR" -t commands pycomm_cuda_kernels 2>/dev/null | grep -E "\.cu" | sed "s|$ROOT/||g" || true
      fi
    else
      echo "--- errors in build.log"; grep -nE "error|FAILED|Error|CMake Error|not found" "$OUT/build.log" | grep -v "ptxas info" | head -40 || true
      echo "--- last 30 lines of build.log"; tail -30 "$OUT/build.log"
      problem "the CUDA build failed after $((SECONDS - t0)) s (full log: $OUT/build.log)"; fail=1
    fi
    "$PY" -c 'import sys, pycomm; from pycomm import _ext; i = pycomm.available_impls("onebit", device="cuda"); print("available on cuda:", i); sys.exit(0 if "cuda" in i else "impl=cuda unavailable: %s" % _ext.why_no_cuda_ops())' ||
      { problem "pycomm does not offer impl='cuda' after the build"; fail=1; }
  fi
  rc=0
  wait "$triton_pid" || rc=$?
  echo "--- Triton kernels, sm_90a (triton-aot-sm_90a.json)"
  grep -v "FP_FUSION\|warn_once" "$RUN_DIR/triton_aot.txt" || true
  if [ "$rc" = 1 ]; then problem "a Triton kernel does not compile for sm_90a (above)"; fail=1
  elif [ "$rc" != 0 ]; then
    if [ "$MODE" = dry ]; then problem "Triton ahead-of-time compile failed (exit $rc)"; fail=1
    else warn "no Triton ahead-of-time report with this Triton (exit $rc); the tests compile it anyway"; fi
  fi
  if [ -n "$nvcc_pid" ]; then
    if wait "$nvcc_pid"; then say "nvcc sm_90a: all kernels compiled"; else problem "nvcc failed on a kernel (below)"; fail=1; fi
    echo "--- ptxas -v, sm_90a (ptxas-sm_90a.txt)"
    cat "$OUT/ptxas-sm_90a.txt"
    echo "--- register report, sm_90a"
    "$PY" "$RUN_DIR/ptxas_table.py" "$OUT/ptxas-sm_90a.txt" "$OUT/ptxas-sm_90a.json" ||
      { problem "no register report parsed from ptxas"; fail=1; }
  fi
  return "$fail"
}

pytest_args() {  # common pytest arguments; $1 = junit name
  local a=(-q -p no:cacheprovider -rfE --durations=5 "--junitxml=$OUT/tests-$1.xml")
  [ -z "$(tools_missing "$PY" pytest_timeout)" ] && a+=(--timeout=120)
  printf '%s\n' "${a[@]}"
}

step_tests_cuda() {
  cd "$ROOT"
  mapfile -t args < <(pytest_args cuda)
  say "pytest tests/test_onebit.py tests/test_topk.py -m gpu (the impl='cuda' cases)"
  "$PY" -m pytest tests/test_onebit.py tests/test_topk.py -m gpu --maxfail=50 "${args[@]}"
}

step_tests_triton() {
  cd "$ROOT"
  mapfile -t args < <(pytest_args triton)
  say "pytest tests/test_triton.py (Triton compiled for the GPU)"
  "$PY" -m pytest tests/test_triton.py --maxfail=50 "${args[@]}"
}

step_tests() {  # dry run: the CPU half, quickly
  cd "$ROOT"
  mapfile -t args < <(pytest_args cpu)
  say "pytest tests/test_onebit.py -x -m 'not gpu' --strict-markers (the CPU half; the GPU half needs a device)"
  "$PY" -m pytest tests/test_onebit.py -x -m "not gpu" --strict-markers "${args[@]}"
}

step_bench() {
  cd "$ROOT"
  if [ "$MODE" = dry ]; then
    say "benchmark on cpu, --quick, numel $NUMEL (the 256M cuda run needs a GPU)"
    "$PY" "$RUN_DIR/bench_driver.py" --device cpu --quick --numel "$NUMEL" --repeats 3 --warmup 1 \
      --no-progress --json "$OUT/kernels-cpu-dryrun.json"
  else
    say "benchmark on cuda, numel $NUMEL, 15 repeats after 3 warm-ups, CUDA events"
    "$PY" "$RUN_DIR/bench_driver.py" --device cuda --numel "$NUMEL" --repeats 15 --warmup 3 \
      --no-progress --json "$OUT/kernels-cuda-$DATE.json"
  fi
}

export -f say warn problem tools_missing version_ge step_env nvcc_report step_build pytest_args \
  step_tests_cuda step_tests_triton step_tests step_bench

# ------------------------------------------------------------ the runner ---
# name:cap:min  -- cap = most seconds the step may take; min = seconds kept
# for it while earlier steps run (the budget is shared, first come first
# served, but never eats the minimum of a later step or of the report).
REPORT_RESERVE=15
if [ "$MODE" = dry ]; then
  PLAN="env:30:5 build:100:30 tests:90:30 bench:60:20"
else
  PLAN="env:90:20 build:240:60 tests_cuda:150:40 bench:200:60 tests_triton:180:50"
fi
selected() {
  case "$1" in
    build) [ "$SEL_BUILD" = 1 ] ;;
    tests | tests_cuda | tests_triton) [ "$SEL_TESTS" = 1 ] ;;
    bench) [ "$SEL_BENCH" = 1 ] ;;
    *) return 0 ;;
  esac
}
record() {  # record step status rc seconds limit note
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STEPS_TSV"
}
notes_for() {
  case "$1" in
    env) [ -f "$OUT/env.json" ] && "$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])); print(e.get("device_name") or "no GPU", "| torch", e.get("torch"), "| triton", e.get("triton"), "| cupy", e.get("cupy"))' "$OUT/env.json" 2>/dev/null || true ;;
    build) "$PY" - "$OUT" <<'PY' 2>/dev/null || true
import json, os, sys
notes = []
try:
    r = json.load(open(os.path.join(sys.argv[1], "ptxas-sm_90a.json")))
    notes.append("nvcc: %d kernels, max %d regs, %d spilling" % (
        len(r), max([x["registers"] or 0 for x in r] or [0]),
        sum(1 for x in r if (x["spill_stores"] or 0) + (x["spill_loads"] or 0))))
except (OSError, ValueError):
    pass
try:
    v = json.load(open(os.path.join(sys.argv[1], "triton-aot-sm_90a.json")))["variants"]
    notes.append("triton: %d/%d compiled" % (sum(x["ok"] for x in v), len(v)))
except (OSError, ValueError, KeyError):
    pass
print("; ".join(notes))
PY
      ;;
    tests*) local x="$OUT/tests-${1#tests_}.xml"; [ "$1" = tests ] && x="$OUT/tests-cpu.xml"
      [ -f "$x" ] && "$PY" -c 'import sys,xml.etree.ElementTree as E; r=E.parse(sys.argv[1]).getroot(); s=r if r.tag=="testsuite" else r.find("testsuite"); a=s.attrib; print(a.get("tests"),"tests,",a.get("failures"),"failed,",a.get("errors"),"errors,",a.get("skipped"),"skipped")' "$x" 2>/dev/null || true ;;
    bench) local j; j=$(ls "$OUT"/kernels-*.json 2>/dev/null | head -1); [ -n "$j" ] && "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); bad=[r for r in d["rows"] if r["status"]!="ok"]; print(len(d["rows"]),"rows,",len(bad),"not ok; copy",round(d["copy_gbps"] or 0,1),"GB/s")' "$j" 2>/dev/null || true ;;
  esac
}
run_step() {  # run_step NAME CAP MIN
  local name=$1 cap=$2 own_min=$3 reserve=0 after=0 item n c m
  for item in $PLAN; do
    IFS=: read -r n c m <<<"$item"
    if [ "$after" = 1 ] && selected "$n"; then reserve=$((reserve + m)); fi
    [ "$n" = "$name" ] && after=1
  done
  # Up to CAP, leaving the later steps their minimum; when the budget cannot
  # hold all minimums, the earlier step keeps its own (order is priority).
  local total_left=$((DEADLINE - REPORT_RESERVE - $(date +%s)))
  local left=$((total_left - reserve))
  [ "$left" -ge "$own_min" ] || left=$((own_min < total_left ? own_min : total_left))
  local limit=$((cap < left ? cap : left))
  echo
  echo "################ step $name (limit ${limit}s) ################"
  if [ "$limit" -lt 5 ]; then
    problem "no time left for step $name (budget ${BUDGET}s)"
    record "$name" skipped - 0 "$limit" "no time left in the ${BUDGET}s budget"
    return 0
  fi
  local t0 rc=0 status
  t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "set -uo pipefail; step_$name" || rc=$?
  local dt=$(($(date +%s) - t0))
  case "$rc" in
    0) status=ok ;;
    124 | 137) status=timeout; problem "step $name ran out of its ${limit}s" ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$rc" "$dt" "$limit" "$(notes_for "$name" | head -1)"
  say "step $name: $status (exit $rc) in ${dt}s"
}

for item in $PLAN; do
  IFS=: read -r n c m <<<"$item"
  if selected "$n"; then
    run_step "$n" "$c" "$m"
  else
    record "$n" "not run" - 0 - "not in --only $ONLY"
  fi
done

echo
echo "################ report ################"
report_rc=0
REPORT_PY=$PY
"$REPORT_PY" -c 'import json' 2>/dev/null || REPORT_PY=$(command -v python3 || echo python3)
timeout -k 5 30 "$REPORT_PY" "$RUN_DIR/report.py" "$OUT" "$MODE" "$START_S" || report_rc=$?
if [ "$report_rc" != 0 ]; then
  problem "the report failed (exit $report_rc)"
fi
failed=$(awk -F'\t' 'NR > 1 && $2 != "ok" && $2 != "not run" {print $1}' "$STEPS_TSV" | tr '\n' ' ')
if [ -n "$failed" ] || [ "$report_rc" != 0 ]; then
  exit 1
fi
exit 0
