"""pycomm's GPU check: build with CUDA, run the GPU tests, benchmark, report.

On the GPU machine (one H200; CUDA torch, Triton and CuPy installed
system-wide; no network), in under 8 minutes:

* env: what the machine is (nvidia-smi, versions), a venv with
  --system-site-packages (the system's CUDA torch/Triton/CuPy), checks that
  the build and test tools are there;
* build: nvcc -Xptxas -v of every kernels/cuda/*.cu for sm_90a + PTX (the
  register/spill report), Triton kernels compiled ahead of time for sm_90a
  (their registers/spills), and pip install --no-build-isolation --no-deps
  --no-index -e . with PYCOMM_CUDA=ON (verbose log in build.log);
* tests_product: pytest tests/test_gpu_product.py -m gpu (the product on the
  GPU: the engine over NCCL against the simulation, Gloo with CUDA tensors,
  the DDP hook, OneBitAdam/OneBitSGD, pycomm.fsdp, no host sync under
  ``torch.cuda.set_sync_debug_mode``);
* bench_engine: ``pycomm-bench allreduce --device cuda --json engine.json``
  (the engine's GB/s beside the bare kernels' and plain NCCL's; per method
  engine_over_kernels);
* op_errors: benchmarks/op_error_probe.py (each of tests/test_triton.py's
  ERROR_CASES in a subprocess of its own: raised, wrong message or crashed)
  and pytest tests/test_triton.py -k test_op_errors_match_cpp: hostile input
  to the CUDA build's C++ ops;
* tests_cuda: pytest tests/test_onebit.py tests/test_topk.py tests/test_quant.py -m gpu (the
  impl="cuda" cases against the reference);
* bench: ``pycomm-bench kernels --device cuda --numel 256M`` (CUDA, Triton,
  unfused torch, torch.topk, plus an unfused peer whose packbits is CuPy's),
  CUDA events, medians, GB/s against a device-to-device copy timed in the
  same run;
* tests_triton: pytest tests/test_triton.py (on the GPU: Triton compiled;
  last, as the longest);
* report: summary.json and a short table, printed last.

The steps run in that order, which is their priority: when the budget runs
short, the last ones are cut (each step's minimum, in PLANS, is kept for it
while earlier steps run). Every step runs in its own process group under a
time limit taken from one overall budget (default 450 s: with the report and
the kill grace, all ends within 8 minutes); a step that fails does not stop
the next; the exit status is 1 if any failed. tests/test_backend.py and the
other multi-process tests on CPU tensors are not run here: the CPU test
suite already covers them.

``--dry-run`` (CPU machines, no GPU): everything that runs without one: the
argument handling, the environment checks (of the interpreter at hand; no
venv is made), nvcc compiling every kernel for sm_90a with the register
report, the Triton kernels compiled for sm_90a, a CMake configure of the
CUDA branch, pip's own check of the build command (pip --dry-run), the CPU
half of tests/test_onebit.py, the benchmark on cpu with --quick (numpy
standing in for CuPy in the extra peer), the result files. It says what it
skipped.

A repository tool, not part of any package: a file of the source tree,
run as ``python tools/gpu_check.py`` (or ``pycomm-bench gpu-check``, or
``bash benchmarks/gpu_check.sh``). Only the standard library is imported
here, so the check also runs where pycomm cannot be imported yet; the parts
that need torch run in the interpreter under test, as subprocesses, with
the benchmark harness (``bench/``, the package pycomm_bench) on their
PYTHONPATH, so that the venv it makes needs only pycomm installed.

Example::

    $ python tools/gpu_check.py --dry-run       # or: pycomm-bench gpu-check --dry-run
    $ python tools/gpu_check.py --only build,tests /tmp/gpu-out
    $ python tools/gpu_check.py --only build,bench_engine,op_errors /tmp/gpu-out
"""

from __future__ import annotations

import datetime as _dt
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Sequence, Tuple

HELP = "the GPU check: CUDA build, GPU tests, kernel benchmark and report (--dry-run on a CPU machine)"
SELF = os.path.abspath(__file__)
HERE = os.path.dirname(SELF)
ROOT = os.path.dirname(HERE)
#: The benchmark harness's folder (the package pycomm_bench is in it).
BENCH = os.path.join(ROOT, "bench")
PROG = "python tools/gpu_check.py"


def _load_report():
    """The harness's report module (standard library only), loaded by its
    path: this file runs before pycomm or pycomm_bench can be imported."""
    import importlib.util as _util

    spec = _util.spec_from_file_location("_pycomm_bench_report", os.path.join(BENCH, "pycomm_bench", "report.py"))
    module = _util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fmt_number = _load_report().fmt_number

USAGE = """\
usage: {prog} [--dry-run] [--only STEPS] [--budget SECONDS] [--numel N]
       {pad} [--wheelhouse DIR] [-h|--help] [OUT_DIR]

  OUT_DIR            where the results go (default: $PYCOMM_GPU_OUT, else
                     benchmarks/results/gpu/<gpu name>/, the device's current
                     record, or build/gpu-dryrun/ for a dry run, which
                     measures no GPU
                     with --dry-run)
  --dry-run          CPU machine: run all that needs no GPU, skip the rest
  --only STEPS       comma-separated steps: build, tests_product,
                     bench_engine, op_errors, tests_cuda, bench, tests_triton;
                     "tests" is every test step (tests_*, op_errors). With
                     --dry-run: build, tests, bench. env and report always
                     run; without build, the venv and the build of an
                     earlier run are reused
  --budget SECONDS   time for the steps (default 450; 170 with --dry-run)
  --numel N          benchmark size (default 256M; 64k with --dry-run)
  --wheelhouse DIR   install missing build/test tools from wheels in DIR
                     (pip --no-index --find-links DIR, into the venv only)
  -h, --help         this text

environment: PYCOMM_PYTHON (interpreter with CUDA torch; default python3, or
.venv/bin/python with --dry-run), PYCOMM_GPU_VENV (venv to create or reuse;
default ${{TMPDIR:-/tmp}}/pycomm-gpu-venv; "-" installs into PYCOMM_PYTHON),
PYCOMM_GPU_WORK (build dir, caches; default ${{TMPDIR:-/tmp}}/pycomm-gpu-check),
PYCOMM_GPU_ARCHS (default "90a-real;90-virtual"), PYCOMM_GPU_OUT, CUDA_HOME.
"""

#: name:cap:min -- cap = most seconds the step may take; min = seconds kept
#: for it while earlier steps run (the budget is shared, first come first
#: served, but never eats the minimum of a later step or of the report).
#: The order is the priority: what is cut when time runs short comes last.
#: GPU: the minimums (420 s) fit the default budget (450 s, less the report's
#: 15 s); bench_engine's ~150 s is its cap, two thirds of it kept for it.
PLANS = {
    "dry": [("env", 30, 5), ("build", 100, 30), ("tests", 90, 30), ("bench", 60, 20)],
    "gpu": [("env", 60, 20), ("build", 180, 60), ("tests_product", 150, 60), ("bench_engine", 150, 120),
            ("op_errors", 120, 60), ("tests_cuda", 120, 30), ("bench", 150, 40), ("tests_triton", 150, 30)],
}
#: --only names that stand for several steps.
STEP_GROUPS = {"tests": ("tests", "tests_product", "op_errors", "tests_cuda", "tests_triton")}
REPORT_RESERVE = 15
#: Seconds between SIGTERM and SIGKILL of a step that ran out of time.
KILL_GRACE = 5
STEP_FIELDS = ("step", "status", "rc", "seconds", "limit_s", "note")


class UsageError(Exception):
    """A bad command line: exit status 2, the message and the usage on stderr."""


# ------------------------------------------------------------- arguments ---
def parse_args(argv: Sequence[str]) -> Dict[str, object]:
    """The options, checked; raises :class:`UsageError`. ``help`` True: print
    the usage and stop.

    >>> parse_args(["--dry-run", "/tmp/o"])["numel"]
    '64k'
    """
    mode = "gpu"
    values = {"--only": "", "--budget": "", "--numel": "", "--wheelhouse": os.environ.get("PYCOMM_WHEELHOUSE", "")}
    positional: List[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--dry-run":
            mode = "dry"
        elif a in ("-h", "--help"):
            return {"help": True}
        elif a in values:
            if i + 1 >= len(args):
                raise UsageError(f"option {a} needs a value")
            i += 1
            values[a] = args[i]
        elif "=" in a and a.split("=", 1)[0] in values:
            name, value = a.split("=", 1)
            values[name] = value
        elif a == "--":
            positional += args[i + 1:]
            break
        elif a.startswith("-"):
            raise UsageError(f"unknown option: {a}")
        else:
            positional.append(a)
        i += 1
    if len(positional) > 1:
        raise UsageError(f"at most one OUT_DIR, got: {' '.join(positional)}")
    only, budget, numel, wheelhouse = (values[k] for k in ("--only", "--budget", "--numel", "--wheelhouse"))
    budget = budget or ("170" if mode == "dry" else "450")
    numel = numel or ("64k" if mode == "dry" else "256M")
    if not re.fullmatch(r"[0-9]+", budget) or int(budget) < 30:
        raise UsageError(f"--budget: an integer >= 30 seconds, got '{budget}'")
    if not re.fullmatch(r"[0-9]+[kKmMgG]?", numel):
        raise UsageError(f"--numel: a positive integer with an optional k/M/G suffix, got '{numel}'")
    choices = list(dict.fromkeys([n for n, _, _ in PLANS[mode] if n != "env"] + list(STEP_GROUPS)))
    selected = set(choices)
    if only:
        parts = only.split(",")
        if parts and parts[-1] == "":
            parts.pop()  # "build," is "build"
        for s in parts:
            if s not in choices:
                gpu_only = " (a GPU step: not in --dry-run)" if any(n == s for n, _, _ in PLANS["gpu"]) else ""
                raise UsageError(f"--only: unknown step '{s}'{gpu_only} (choose from {','.join(choices)})")
        selected = set(parts)
    if wheelhouse:
        if not os.path.isdir(wheelhouse):
            raise UsageError(f"--wheelhouse: no such folder: {wheelhouse}")
        wheelhouse = os.path.abspath(wheelhouse)
    return {"help": False, "mode": mode, "only": only, "budget": int(budget), "numel": numel,
            "wheelhouse": wheelhouse, "selected": sorted(selected), "out_arg": positional[0] if positional else ""}


def _usage(prog: str) -> str:
    return USAGE.format(prog=prog, pad=" " * len(prog))


# ------------------------------------------------------------------ logging ---
class _Tee:
    """Writes to the terminal and to the log: everything after the output
    folder exists is in gpu_check.log too (stderr merged into stdout)."""

    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.stream.write(text)
            self.stream.flush()
            self.log.write(text)
            self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()


def say(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"[gpu_check] WARNING: {msg}", flush=True)


def problem(msg: str) -> None:
    print(f"[gpu_check] PROBLEM: {msg}", flush=True)


def _sh(argv: Sequence[str], **kw) -> int:
    """Run a command with its output on ours; its exit status (127: not found)."""
    sys.stdout.flush()
    try:
        return subprocess.run(list(argv), **kw).returncode
    except OSError as exc:
        print(f"{argv[0]}: {exc}", flush=True)
        return 127


def _out(argv: Sequence[str], **kw) -> Tuple[int, str]:
    """(exit status, stdout + stderr) of a command; 127 if it cannot start."""
    try:
        p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", **kw)
        return p.returncode, p.stdout
    except OSError as exc:
        return 127, str(exc)


def _grep(pattern: str, text: str, invert: str = "") -> List[str]:
    return [ln for ln in text.splitlines() if re.search(pattern, ln) and not (invert and re.search(invert, ln))]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _load(path: str, default=None):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


# ------------------------------------------------------------ configuration ---
def find_nvcc() -> Optional[str]:
    """CUDA_HOME first (the user's choice), then PATH, then /usr/local/cuda*."""
    for d in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if d and os.access(os.path.join(d, "bin", "nvcc"), os.X_OK):
            return os.path.join(d, "bin", "nvcc")
    if shutil.which("nvcc"):
        return shutil.which("nvcc")

    def version_key(path: str) -> List[object]:
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path)]

    for d in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), key=version_key, reverse=True):
        if os.access(os.path.join(d, "bin", "nvcc"), os.X_OK):
            return os.path.join(d, "bin", "nvcc")
    return None


def configure(opts: Dict[str, object], out: str, work: str, run_dir: str, date: str) -> Dict[str, object]:
    """The state every step reads (written to RUN_DIR/state.json), and the
    environment the steps inherit (set in ``os.environ``)."""
    mode = opts["mode"]
    if mode == "dry":
        if os.environ.get("PYCOMM_PYTHON"):
            py = os.environ["PYCOMM_PYTHON"]
        elif os.access(os.path.join(ROOT, ".venv", "bin", "python"), os.X_OK):
            py = os.path.join(ROOT, ".venv", "bin", "python")
        else:
            py = shutil.which("python3") or "python3"
        base_py, venv = py, ""
    else:
        base_py = os.environ.get("PYCOMM_PYTHON") or shutil.which("python3") or "python3"
        venv = os.environ.get("PYCOMM_GPU_VENV") or os.path.join(tempfile.gettempdir(), "pycomm-gpu-venv")
        py = base_py if venv == "-" else os.path.join(venv, "bin", "python")
    env = os.environ
    env.setdefault("TRITON_CACHE_DIR", os.path.join(work, "triton-cache"))
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1")
    # The benchmark harness (pycomm_bench) from the source tree, for every step
    # and the processes they start: the venv made here installs pycomm alone.
    if BENCH not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, env.get("PYTHONPATH", "")) if p)
    if mode == "gpu":
        env.pop("TRITON_INTERPRET", None)  # on the GPU, Triton must compile, not interpret
        # torch's CMake config adds nvcc -gencode flags of its own (detected from
        # the GPU unless this is set): keep them to the one target of this check.
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    nvcc, cuda_root = find_nvcc(), ""
    if nvcc:
        # nvcc may be a wrapper script: ask it where its toolkit is, and point every
        # finder (CMake's CUDA language, torch's FindCUDA, FindCUDAToolkit) at that
        # one toolkit, or torch's CMake config stops on "two conflicting CUDA versions".
        _, text = _out([nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"])
        top = next((ln[len("#$ TOP="):] for ln in text.splitlines() if ln.startswith("#$ TOP=")), "")
        if top and os.access(os.path.join(top, "bin", "nvcc"), os.X_OK):
            cuda_root = os.path.realpath(top)
            nvcc = os.path.join(cuda_root, "bin", "nvcc")
            if mode == "gpu":
                env.update(CUDA_HOME=cuda_root, CUDA_PATH=cuda_root, CUDAToolkit_ROOT=cuda_root)
        nvcc_dir = os.path.dirname(nvcc)
        if nvcc_dir not in env.get("PATH", "").split(":"):
            env["PATH"] = f"{nvcc_dir}:{env.get('PATH', '')}"
        env["CUDACXX"] = nvcc
    state = {"root": ROOT, "out": out, "work": work, "run_dir": run_dir, "mode": mode, "py": py,
             "base_py": base_py, "venv": venv, "nvcc": nvcc or "", "cuda_root": cuda_root,
             "archs": env.get("PYCOMM_GPU_ARCHS", "90a-real;90-virtual"), "build_dir": os.path.join(work, "build"),
             "numel": opts["numel"], "wheelhouse": opts["wheelhouse"], "date": date}
    with open(os.path.join(run_dir, "state.json"), "w", encoding="utf-8") as fh:
        json.dump(state, fh)
    return state


# --------------------------------------------------------------------- steps ---
_TOOL_NAMES = {"scikit_build_core": "scikit-build-core", "pytest_timeout": "pytest-timeout"}


def tools_missing(py: str, *modules: str) -> str:
    """The pip names of ``modules`` that ``py`` cannot import ("" if none;
    all of them if ``py`` does not run)."""
    code = ("import importlib.util, sys\n"
            f"names = {_TOOL_NAMES!r}\n"
            "print(' '.join(names.get(m, m) for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    try:
        p = subprocess.run([py, "-c", code, *modules], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return " ".join(modules)
    return p.stdout.strip() if p.returncode == 0 else " ".join(modules)


def version_ge(a: str, b: str) -> bool:
    """``a >= b`` for dotted versions.

    >>> version_ge("3.25.1", "3.25"), version_ge("3.9", "3.25")
    (True, False)
    """
    def key(v: str) -> List[int]:
        return [int(x) for x in re.findall(r"\d+", v)]

    return key(a) >= key(b)


def _first_line(argv: Sequence[str]) -> str:
    rc, text = _out(argv)
    return text.splitlines()[0] if text.strip() else ""


def step_env(st: Dict[str, object]) -> int:
    fail = 0
    out, py, base_py, mode = st["out"], st["py"], st["base_py"], st["mode"]
    print("--- machine", flush=True)
    _sh(["uname", "-a"])
    rc, text = _out(["free", "-g"])
    if rc == 0:
        print("\n".join(text.splitlines()[:2]))
    print("--- nvidia-smi", flush=True)
    smi_path = os.path.join(out, "nvidia-smi.txt")
    if shutil.which("nvidia-smi"):
        with open(smi_path, "w", encoding="utf-8") as fh:
            fh.write(time.strftime("%Y-%m-%d %H:%M:%S UTC\n", time.gmtime()))
            fh.flush()
            subprocess.run(["nvidia-smi"], stdout=fh, stderr=subprocess.STDOUT)
            fh.write("\n")
            fh.flush()
            query = ("index,name,uuid,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit,"
                     "pcie.link.gen.max")
            if subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], stdout=fh,
                              stderr=subprocess.STDOUT).returncode != 0:
                fail = 1
        print(_read(smi_path), end="")
    elif mode == "dry":
        line = "nvidia-smi not found (dry run: no GPU expected)"
        print(line)
        with open(smi_path, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    else:
        problem("nvidia-smi not found: is this the GPU machine? (use --dry-run on a CPU machine)")
        with open(smi_path, "w", encoding="utf-8") as fh:
            fh.write("nvidia-smi not found\n")
        fail = 1
    print("--- toolchain", flush=True)
    if st["nvcc"]:
        print(f"nvcc: {st['nvcc']} (toolkit {st['cuda_root'] or '?'})")
        print("\n".join(_out([st["nvcc"], "--version"])[1].splitlines()[-2:]))
    else:
        problem("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda*): the CUDA kernels cannot be compiled")
        fail = 1
    for tool in ("cmake", "ninja", "make", "g++", "c++filt"):
        path = shutil.which(tool)
        print(f"{tool}: {path} {_first_line([tool, '--version'])}" if path else f"{tool}: not found")
    print(f"--- python: {base_py}", flush=True)
    if _sh([base_py, SELF, "--internal-helper", "env-probe", os.path.join(out, "env.json")]) != 0:
        problem(f"{base_py} does not run")
        return 1
    if mode == "gpu":
        code = "import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)"
        if _out([base_py, "-c", code])[0] != 0:
            problem(f"{base_py} has no CUDA torch with a visible GPU "
                    "(set PYCOMM_PYTHON to the interpreter that has one)")
            fail = 1
        _gpu_warnings(st)
        venv = st["venv"]
        if venv != "-":
            if os.access(os.path.join(venv, "bin", "python"), os.X_OK):
                say(f"reusing the venv {venv}")
            else:
                say(f"creating the venv {venv} (--system-site-packages: the system's CUDA torch, Triton, CuPy)")
                if _sh([base_py, "-m", "venv", "--system-site-packages", venv]) != 0:
                    warn("venv with pip failed; trying --without-pip (pip then comes from the system site)")
                    shutil.rmtree(venv, ignore_errors=True)
                    if _sh([base_py, "-m", "venv", "--system-site-packages", "--without-pip", venv]) != 0:
                        problem(f"cannot create a venv with {base_py} -m venv (python3-venv missing?); "
                                f"PYCOMM_GPU_VENV=- installs into {base_py} itself")
                        return 1
            if _sh([py, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"]) != 0:
                problem(f"the venv {venv} does not see a CUDA torch: is {base_py} itself a venv? "
                        "(PYCOMM_GPU_VENV=- uses it directly)")
                fail = 1
        if _sh([py, "-m", "pip", "--version"]) != 0:
            problem(f"no pip for {py}")
            fail = 1
    print(f"--- build and test tools for {py}", flush=True)
    needed = ("scikit_build_core", "pytest", "hypothesis", "tabulate", "tqdm", "numpy")
    miss = tools_missing(py, *needed)
    if miss and mode == "gpu" and st["wheelhouse"]:
        say(f"installing from the wheelhouse {st['wheelhouse']}: {miss}")
        _sh([py, "-m", "pip", "install", "--no-index", "--find-links", st["wheelhouse"], *miss.split()])
        miss = tools_missing(py, *needed)
    if miss:
        problem(f"missing Python packages for {py}: {miss}. There is no network: install them from wheels "
                f"(pip install --no-index --find-links DIR {miss}, or pass --wheelhouse DIR). "
                "Without scikit-build-core nothing builds; without pytest/hypothesis no test runs; "
                "without tabulate/tqdm no benchmark.")
        fail = 1
    if tools_missing(py, "pytest_timeout"):
        warn("pytest-timeout missing: single tests are not time-limited (the step still is)")
    cmake_line = _first_line(["cmake", "--version"]) if shutil.which("cmake") else ""
    if not cmake_line:
        cmake_line = _first_line([py, "-m", "cmake", "--version"])
    m = re.search(r"[0-9]+\.[0-9]+(\.[0-9]+)?", cmake_line)
    if m is None:
        problem("CMake not found (need >= 3.25: a system cmake or the 'cmake' wheel)")
        fail = 1
    elif not version_ge(m.group(0), "3.25"):
        problem(f"CMake {m.group(0)} is older than the 3.25 CMakeLists.txt needs")
        fail = 1
    else:
        print(f"cmake {m.group(0)}: ok")
    if shutil.which("ninja") or not tools_missing(py, "ninja"):
        print("ninja: ok")
    elif shutil.which("make"):
        warn("ninja missing: scikit-build-core falls back to make (slower)")
    else:
        problem("neither ninja nor make: CMake has no generator")
        fail = 1
    if not (shutil.which("g++") or shutil.which("c++")):
        problem("no C++ compiler (g++)")
        fail = 1
    sys.stdout.flush()
    return fail


def _gpu_warnings(st: Dict[str, object]) -> None:
    """Mismatches that may break the build or the kernels' loading, as warnings."""
    env = _load(os.path.join(st["out"], "env.json"), {})
    cap = env.get("capability")
    if cap and cap != [9, 0]:
        warn(f"compute capability {cap}: the sm_90a kernels run on 9.0 only (the compute_90 PTX JITs on >= 9.0)")
    tcuda = env.get("torch_cuda")
    if not (st["nvcc"] and tcuda):
        return
    m = re.search(r"release (\d+)\.(\d+)", _out([st["nvcc"], "--version"])[1])
    if m and m.group(1) != tcuda.split(".")[0]:
        warn(f"nvcc is CUDA {m.group(1)}.{m.group(2)} but torch was built with CUDA {tcuda}: the extension "
             "links the toolkit's libcudart next to torch's; the driver must support the newer one")
    d = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", _read(os.path.join(st["out"], "nvidia-smi.txt")))
    if m and d and (int(m.group(1)), int(m.group(2))) > (int(d.group(1)), int(d.group(2))):
        warn(f"nvcc is CUDA {m.group(1)}.{m.group(2)} but the driver supports CUDA {d.group(1)}.{d.group(2)}: "
             "kernels built by this nvcc may fail to load (cudaErrorInsufficientDriver / unsupported toolchain)")


def nvcc_report(st: Dict[str, object]) -> int:
    """The register/spill report: every kernels/cuda/*.cu for sm_90a (+
    compute_90 PTX, as the build), flags as in CMakeLists.txt, compiled in
    parallel into ptxas-sm_90a.txt. 0 if all compiled."""
    root, nvcc = st["root"], st["nvcc"]
    folder = os.path.join(st["run_dir"], "nvcc")
    os.makedirs(folder, exist_ok=True)
    jobs = []
    for src in sorted(glob.glob(os.path.join(root, "kernels", "cuda", "*.cu"))):
        name = os.path.basename(src)[:-len(".cu")]
        log = open(os.path.join(folder, f"{name}.txt"), "w+", encoding="utf-8", errors="replace")
        log.write("$ nvcc -c -std=c++17 -O3 -I kernels/include -I kernels/cuda -gencode arch=compute_90a,code=sm_90a "
                  f"-gencode arch=compute_90,code=compute_90 -Xptxas -v kernels/cuda/{name}.cu\n")
        log.flush()
        p = subprocess.Popen([nvcc, "-c", "-std=c++17", "-O3", "-I", os.path.join(root, "kernels", "include"),
                              "-I", os.path.join(root, "kernels", "cuda"), "-gencode", "arch=compute_90a,code=sm_90a",
                              "-gencode", "arch=compute_90,code=compute_90", "-Xptxas", "-v", src,
                              "-o", os.path.join(folder, f"{name}.o")], stdout=log, stderr=subprocess.STDOUT)
        jobs.append((name, p, log))
    rc = 0
    with open(os.path.join(st["out"], "ptxas-sm_90a.txt"), "w", encoding="utf-8") as report:
        for name, p, log in jobs:
            code = p.wait()
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            rc = rc or int(code != 0)
            log.seek(0)
            report.write(f"### kernels/cuda/{name}.cu: nvcc {status}\n{log.read()}")
            log.close()
    return rc


def ptxas_table(text: str, json_path: str) -> int:
    """Parse ``ptxas -v`` output into JSON and print a table; 1 if no kernel was found."""
    rows: List[Dict[str, object]] = []
    cur: Optional[Dict[str, object]] = None
    source = None
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
        demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                                   text=True).stdout.splitlines()
        if len(demangled) == len(names):
            for r, d in zip(rows, demangled):
                r["demangled"] = d

    def short(r: Dict[str, object]) -> str:
        d = str(r.get("demangled", r["mangled"])).replace("(anonymous namespace)::", "")
        d = re.sub(r"^void ", "", d).split("(")[0]
        if d.startswith("cub::"):  # cub::CUB_300001_SM_900::detail::scan::DeviceScanKernel<...long...>
            d = "cub::" + d.split("<")[0].split("::")[-1] + ("<...>" if "<" in d else "")
        return d.replace("pycomm::cuda::", "")

    for r in rows:
        r["kernel"] = short(r)
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=2)
    print(f"  {'kernel':58} {'arch':7} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}")
    for r in rows:
        regs = r["registers"] if r["registers"] is not None else "?"
        print(f"  {str(r['kernel'])[:58]:58} {r['arch']:7} {regs:>4} "
              f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>11} {r['stack_bytes']!s:>5} {r['smem_bytes']:>6}")
    spills = [r for r in rows if (r["spill_stores"] or 0) + (r["spill_loads"] or 0) > 0]
    print(f"  {len(rows)} kernels, max {max([r['registers'] or 0 for r in rows], default=0)} registers, "
          f"{len(spills)} with spills" + (": " + ", ".join(str(r["kernel"]) for r in spills) if spills else ""))
    return 0 if rows else 1


def step_build(st: Dict[str, object]) -> int:
    fail = 0
    root, out, py, run_dir = st["root"], st["out"], st["py"], st["run_dir"]
    nvcc_result: Dict[str, int] = {}
    nvcc_thread = None
    if not st["nvcc"]:
        problem("nvcc not found: no register report, and the CUDA build cannot run")
        fail = 1
    else:
        say("nvcc -Xptxas -v report for sm_90a (in the background)")
        nvcc_thread = threading.Thread(target=lambda: nvcc_result.update(rc=nvcc_report(st)))
        nvcc_thread.start()
    say("Triton kernels compiled ahead of time for sm_90a (in the background)")
    triton_log = open(os.path.join(run_dir, "triton_aot.txt"), "w+", encoding="utf-8", errors="replace")
    triton_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    triton = subprocess.Popen([py, SELF, "--internal-helper", "triton-aot",
                               os.path.join(out, "triton-aot-sm_90a.json")],
                              stdout=triton_log, stderr=subprocess.STDOUT, env=triton_env)
    archs = st["archs"]
    defs = ["--config-settings=cmake.define.PYCOMM_CUDA=ON", f"--config-settings=cmake.define.PYCOMM_CUDA_ARCHS={archs}",
            f"--config-settings=build-dir={st['build_dir']}", "--config-settings=build.verbose=true"]
    if st["mode"] == "dry":
        say("pip's check of the build command (--dry-run: nothing built or installed)")
        if _sh([py, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--no-deps", "--no-index",
                "-e", ".", *defs], cwd=root) != 0:
            problem("pip rejects the build command")
            fail = 1
        say(f"CMake configure of the CUDA branch (PYCOMM_CUDA=ON, archs {archs}) against this torch; no build")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        cdir = os.path.join(run_dir, "cmake-cuda")
        rc, log = _out(["cmake", "-S", root, "-B", cdir, *gen, f"-DPython_EXECUTABLE={py}", "-DPYCOMM_CUDA=ON",
                        f"-DPYCOMM_CUDA_ARCHS={archs}", "-DCMAKE_BUILD_TYPE=Release"])
        with open(os.path.join(run_dir, "cmake.log"), "w", encoding="utf-8") as fh:
            fh.write(log)
        if rc == 0:
            for line in _grep(r"pycomm:|CUDA compiler identification|Configuring done", log):
                print(line)
            if gen:
                print("nvcc command lines of the build:")
                _print_build_commands(cdir, r"nvcc|\.cu", root)
        else:
            print("\n".join(log.splitlines()[-40:]))
            problem("CMake configure of the CUDA branch failed")
            fail = 1
    else:
        say("pip install --no-build-isolation --no-deps --no-index -e . (PYCOMM_CUDA=ON, archs "
            f"{archs}, TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}, build dir {st['build_dir']}); "
            "verbose log: build.log")
        t0 = time.monotonic()
        build_log = os.path.join(out, "build.log")
        with open(build_log, "w", encoding="utf-8") as fh:
            rc = subprocess.run([py, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
                                 "-e", ".", *defs], cwd=root, stdout=fh, stderr=subprocess.STDOUT,
                                env=_compiler_env()).returncode
        log = _read(build_log)
        took = int(time.monotonic() - t0)
        if rc == 0:
            say(f"built in {took} s; {len(_grep('ptxas info', log))} ptxas lines in build.log")
            for line in _grep(r"pycomm: torch CUDA|CUDA compiler identification|Added CUDA NVCC flags|WARNING",
                              log)[:20]:
                print(line)
            if os.path.isfile(os.path.join(st["build_dir"], "build.ninja")):
                print("nvcc command lines of the build:")
                _print_build_commands(st["build_dir"], r"\.cu", root)
        else:
            print("--- errors in build.log")
            errors = [f"{n}:{line}" for n, line in enumerate(log.splitlines(), 1)
                      if re.search(r"error|FAILED|Error|CMake Error|not found", line) and "ptxas info" not in line]
            print("\n".join(errors[:40]))
            print("--- last 30 lines of build.log")
            print("\n".join(log.splitlines()[-30:]))
            problem(f"the CUDA build failed after {took} s (full log: {build_log})")
            fail = 1
        check = ("import sys, pycomm; from pycomm import _ext; i = pycomm.available_impls('onebit', device='cuda'); "
                 "print('available on cuda:', i); "
                 "sys.exit(0 if 'cuda' in i else 'impl=cuda unavailable: %s' % _ext.why_no_cuda_ops())")
        if _sh([py, "-c", check]) != 0:
            problem("pycomm does not offer impl='cuda' after the build")
            fail = 1
    rc = triton.wait()
    triton_log.seek(0)
    print("--- Triton kernels, sm_90a (triton-aot-sm_90a.json)")
    for line in triton_log.read().splitlines():
        if "FP_FUSION" not in line and "warn_once" not in line:
            print(line)
    triton_log.close()
    if rc == 1:
        problem("a Triton kernel does not compile for sm_90a (above)")
        fail = 1
    elif rc != 0:
        if st["mode"] == "dry":
            problem(f"Triton ahead-of-time compile failed (exit {rc})")
            fail = 1
        else:
            warn(f"no Triton ahead-of-time report with this Triton (exit {rc}); the tests compile it anyway")
    if nvcc_thread is not None:
        nvcc_thread.join()
        if nvcc_result.get("rc") == 0:
            say("nvcc sm_90a: all kernels compiled")
        else:
            problem("nvcc failed on a kernel (below)")
            fail = 1
        txt = os.path.join(out, "ptxas-sm_90a.txt")
        print("--- ptxas -v, sm_90a (ptxas-sm_90a.txt)")
        print(_read(txt), end="")
        print("--- register report, sm_90a")
        if ptxas_table(_read(txt), os.path.join(out, "ptxas-sm_90a.json")) != 0:
            problem("no register report parsed from ptxas")
            fail = 1
    sys.stdout.flush()
    return fail


def _compiler_env() -> Dict[str, str]:
    """The build's environment. A CXX that is a wrapper script is replaced by
    the system's g++: the GPU machine's CXX (/opt/gcc/bin/g++, a script)
    links libstdc++ statically into shared libraries, which CMakeLists.txt
    refuses (an extension with its own libstdc++ beside torch's crashed
    whenever an error message held a number)."""
    env = dict(os.environ)
    cxx = env.get("CXX", "")
    try:
        with open(cxx, "rb") as fh:
            script = fh.read(2) == b"#!"
    except OSError:
        script = False
    if script and os.path.exists("/usr/bin/g++"):
        say(f"CXX={cxx} is a wrapper script: building with /usr/bin/g++ (libstdc++ linked as a shared library)")
        env.update(CXX="/usr/bin/g++", CC="/usr/bin/gcc", CUDAHOSTCXX="/usr/bin/g++")
    return env


def _print_build_commands(build_dir: str, pattern: str, root: str) -> None:
    """The nvcc command lines ninja would run for the CUDA kernels, relative to the repository."""
    rc, text = _out(["ninja", "-C", build_dir, "-t", "commands", "pycomm_cuda_kernels"])
    if rc == 0:
        for line in _grep(pattern, text):
            print(line.replace(f"{root}/", ""))


def _pytest(st: Dict[str, object], junit: str, *args: str) -> int:
    extra = [] if tools_missing(st["py"], "pytest_timeout") else ["--timeout=120"]
    return _sh([st["py"], "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", "-rfE", "--durations=5",
                f"--junitxml={os.path.join(st['out'], f'tests-{junit}.xml')}", *extra], cwd=st["root"])


def step_tests_cuda(st: Dict[str, object]) -> int:
    say("pytest tests/test_onebit.py tests/test_topk.py tests/test_quant.py -m gpu (the impl='cuda' cases)")
    return _pytest(st, "cuda", "tests/test_onebit.py", "tests/test_topk.py", "tests/test_quant.py", "-m", "gpu",
                   "--maxfail=50")


def step_tests_triton(st: Dict[str, object]) -> int:
    say("pytest tests/test_triton.py (Triton compiled for the GPU)")
    return _pytest(st, "triton", "tests/test_triton.py", "--maxfail=50")


def step_tests_product(st: Dict[str, object]) -> int:
    path = "tests/test_gpu_product.py"
    say(f"pytest {path} -m gpu (engine over NCCL vs the simulation, Gloo with CUDA tensors, the DDP hook, "
        "OneBitAdam/OneBitSGD, pycomm.fsdp, no host sync under set_sync_debug_mode)")
    if not os.path.isfile(os.path.join(st["root"], path)):
        problem(f"{path} not found")
        return 1
    return _pytest(st, "product", path, "-m", "gpu", "--maxfail=50")


def step_bench_engine(st: Dict[str, object]) -> int:
    path = os.path.join(st["out"], "engine.json")
    say("pycomm-bench allreduce --device cuda --json engine.json (the engine's GB/s beside the kernels' and "
        "plain NCCL's)")
    return _sh([st["py"], "-m", "pycomm_bench", "allreduce", "--device", "cuda", "--no-progress", "--json", path],
               cwd=st["root"])


def step_op_errors(st: Dict[str, object]) -> int:
    """Hostile input to the CUDA build's ops: the probe runs each case in a
    process of its own (a segfault is a finding, not the end of the step),
    then the test itself, whose one crash would end it."""
    fail = 0
    probe = os.path.join(st["root"], "benchmarks", "op_error_probe.py")
    say("benchmarks/op_error_probe.py (each ERROR_CASES case in a subprocess: raised / wrong message / crashed)")
    if not os.path.isfile(probe):
        problem("benchmarks/op_error_probe.py not found")
        fail = 1
    else:
        args = [st["py"], probe]
        if '"--json"' in _read(probe):  # the probe writes JSON: keep it with the results
            args += ["--json", os.path.join(st["out"], "op_errors.json")]
        rc = _sh(args, cwd=st["root"])
        if rc != 0:
            problem(f"the op error probe exited {rc}: a case crashed or raised the wrong error (above)")
            fail = 1
    say("pytest tests/test_triton.py -k test_op_errors_match_cpp (the Triton and the C++ ops, same errors)")
    if _pytest(st, "op_errors", "tests/test_triton.py", "-k", "test_op_errors_match_cpp") != 0:
        fail = 1
    return fail


def step_tests(st: Dict[str, object]) -> int:
    """The dry run's: the CPU half, quickly."""
    say("pytest tests/test_onebit.py -x -m 'not gpu' --strict-markers (the CPU half; the GPU half needs a device)")
    return _pytest(st, "cpu", "tests/test_onebit.py", "-x", "-m", "not gpu", "--strict-markers")


def step_bench(st: Dict[str, object]) -> int:
    helper = [st["py"], SELF, "--internal-helper", "bench"]
    if st["mode"] == "dry":
        say(f"benchmark on cpu, --quick, numel {st['numel']} (the 256M cuda run needs a GPU)")
        return _sh([*helper, "--device", "cpu", "--quick", "--numel", st["numel"], "--repeats", "3", "--warmup", "1",
                    "--no-progress", "--json", os.path.join(st["out"], "kernels-cpu-dryrun.json")], cwd=st["root"])
    say(f"benchmark on cuda, numel {st['numel']}, 15 repeats after 3 warm-ups, CUDA events")
    return _sh([*helper, "--device", "cuda", "--numel", st["numel"], "--repeats", "15", "--warmup", "3",
                "--no-progress", "--json", os.path.join(st["out"], "kernels-cuda.json")], cwd=st["root"])


STEPS = {"env": step_env, "build": step_build, "tests": step_tests, "tests_product": step_tests_product,
         "bench_engine": step_bench_engine, "op_errors": step_op_errors, "tests_cuda": step_tests_cuda,
         "tests_triton": step_tests_triton, "bench": step_bench}


# ------------------------------------------------- helpers (other interpreters) ---
def helper_env_probe(out_json: str) -> int:
    """Versions and devices of this interpreter, as JSON; a missing module is a None."""
    import importlib
    import platform

    info: Dict[str, object] = {"python": platform.python_version(), "executable": sys.executable,
                               "prefix": sys.prefix}
    errors: Dict[str, str] = {}
    for key, mod in [("torch", "torch"), ("triton", "triton"), ("cupy", "cupy"), ("numpy", "numpy"),
                     ("scikit_build_core", "scikit_build_core"), ("pytest", "pytest"),
                     ("hypothesis", "hypothesis"), ("pytest_timeout", "pytest_timeout"),
                     ("tabulate", "tabulate"), ("tqdm", "tqdm"), ("ninja_py", "ninja"), ("cmake_py", "cmake"),
                     ("pip", "pip")]:
        try:
            info[key] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - report any import failure
            info[key] = None
            errors[key] = f"{type(exc).__name__}: {exc}"[:300]
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
    with open(out_json, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=2)
    for k, v in info.items():
        if k != "import_errors":
            print(f"  {k:18} {v}")
    for k, v in errors.items():
        print(f"  {k:18} not importable ({v})")
    return 0


def helper_triton_aot(out_json: str) -> int:
    """Compile pycomm's Triton kernels for sm_90a ahead of time, without a GPU.

    A stand-in Triton driver names the target (cuda, capability 90, warp 32);
    JITFunction.warmup compiles exactly what a launch with these argument
    types and constexprs would compile (the call sites in pycomm/triton/*.py),
    and launches nothing. Registers and local memory come from cuobjdump on
    the cubin. Exit 1: a kernel failed to compile; 3: this Triton has no API
    for it.
    """
    try:
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
    except Exception as exc:  # noqa: BLE001
        print(f"  Triton ahead-of-time compile not possible here: {type(exc).__name__}: {exc}")
        return 3

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
        return 3

    f32, f16, bf16, i32, i64 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64
    n = 1 << 20  # divisible by 16, as large tensors are (Triton specializes on it)
    words = tob.MAX_TILE // 32
    tk = dict(BLOCK=ttk.TILE, num_warps=ttk.NUM_WARPS)
    variants = [
        # (kernel, label, args, kwargs): mirrors the launches in pycomm/triton/*.py
        (tob._compress_kernel, "onebit compress f32 EF b=2048", (f32, f32, i32, f32, n, 2048),
         dict(HAS_RES=True, WORDS=words, ONE_TILE=True, num_warps=8)),
        (tob._compress_kernel, "onebit compress f32 noEF b=2048", (f32, f32, i32, f32, n, 2048),
         dict(HAS_RES=False, WORDS=words, ONE_TILE=True, num_warps=8)),
        (tob._compress_kernel, "onebit compress bf16 EF b=2048", (bf16, f32, i32, f32, n, 2048),
         dict(HAS_RES=True, WORDS=words, ONE_TILE=True, num_warps=8)),
        (tob._compress_kernel, "onebit compress f16 EF b=2048", (f16, f32, i32, f32, n, 2048),
         dict(HAS_RES=True, WORDS=words, ONE_TILE=True, num_warps=8)),
        (tob._compress_kernel, "onebit compress f32 EF b=32", (f32, f32, i32, f32, n, 32),
         dict(HAS_RES=True, WORDS=1, ONE_TILE=True, num_warps=1)),
        (tob._compress_kernel, "onebit compress f32 EF b=65536", (f32, f32, i32, f32, n, 65536),
         dict(HAS_RES=True, WORDS=words, ONE_TILE=False, num_warps=8)),
        (tob._decompress_kernel, "onebit decompress", (i32, f32, f32, n, 2048),
         dict(ACCUMULATE=False, WORDS=tob.DECOMPRESS_TILE // 32, num_warps=8)),
        (tob._decompress_kernel, "onebit decompress acc", (i32, f32, f32, n, 2048),
         dict(ACCUMULATE=True, WORDS=tob.DECOMPRESS_TILE // 32, num_warps=8)),
        (ttk._radix_hist_kernel, "topk radix_hist f32 EF shift=24", (f32, f32, n, i32, i32),
         dict(SHIFT=24, HAS_RES=True, **tk)),
        (ttk._radix_hist_kernel, "topk radix_hist f32 EF shift=16", (f32, f32, n, i32, i32),
         dict(SHIFT=16, HAS_RES=True, **tk)),
        (ttk._radix_hist_kernel, "topk radix_hist bf16 noEF shift=0", (bf16, bf16, n, i32, i32),
         dict(SHIFT=0, HAS_RES=False, **tk)),
        (ttk._radix_pick_kernel, "topk radix_pick shift=24", (i32, i32), dict(SHIFT=24, num_warps=1)),
        (ttk._radix_pick_kernel, "topk radix_pick shift=0", (i32, i32), dict(SHIFT=0, num_warps=1)),
        (ttk._count_kernel, "topk count f32 EF", (f32, f32, n, i32, i32, i32), dict(HAS_RES=True, **tk)),
        (ttk._compact_kernel, "topk compact f32 EF", (f32, f32, n, i32, i64, i64, i64, i32, f32),
         dict(HAS_RES=True, LIMIT_EQ=False, **tk)),
        (ttk._compact_kernel, "topk compact f32 EF limit_eq", (f32, f32, n, i32, i64, i64, i64, i32, f32),
         dict(HAS_RES=True, LIMIT_EQ=True, **tk)),
        (ttk._scatter_kernel, "topk scatter", (i32, f32, f32, 4096),
         dict(ACCUMULATE=False, BLOCK=ttk.SCATTER_TILE, num_warps=4)),
        (ttk._scatter_kernel, "topk scatter acc", (i32, f32, f32, 4096),
         dict(ACCUMULATE=True, BLOCK=ttk.SCATTER_TILE, num_warps=4)),
    ]
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = next((p for p in [os.path.join(bindir, "cuobjdump"), shutil.which("cuobjdump")]
                      if p and os.access(p, os.X_OK)), None)
    rows, failed = [], 0
    tmp = tempfile.mkdtemp()
    print(f"  triton {triton.__version__}, target sm_90a (cuda 90, warp 32), cache "
          f"{os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')}")
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
                res = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                                     text=True).stdout
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
    with open(out_json, "w", encoding="utf-8") as fh:
        json.dump({"triton": triton.__version__, "target": "sm_90a", "variants": rows}, fh, indent=2)
    try:
        driver.reset_active()  # raises where no real driver exists (no GPU); nothing runs after this
    except Exception:  # noqa: BLE001
        pass
    spilled = [r["variant"] for r in rows if r["local_bytes"]]
    print(f"  {len(rows) - failed}/{len(rows)} compiled"
          + (f"; local memory (spills) in: {', '.join(spilled)}" if spilled else ""))
    return 1 if failed else 0


def helper_bench(argv: List[str]) -> int:
    """``pycomm-bench kernels`` plus one more onebit peer: the unfused torch
    pipeline with its packbits/unpackbits done by CuPy (on CPU: numpy, so
    that the dry run exercises the same code), arrays shared through DLPack
    and CuPy enqueued on torch's current stream. Arguments: those of
    ``pycomm-bench kernels``; --impls defaults to the compiled
    implementations (cuda and triton, or cpu), leaving the slow pure-torch
    reference out."""
    import contextlib

    import torch

    import pycomm
    import pycomm_bench.kernels as K
    from pycomm_bench import cli, write_json

    device = torch.device(argv[argv.index("--device") + 1]) if "--device" in argv else torch.device("cpu")
    json_path = argv[argv.index("--json") + 1]
    if "--impls" not in argv:
        wanted = ["cuda", "triton"] if device.type == "cuda" else ["cpu"]
        have = {i for case in K.CASES for i in K.benchmarkable_impls(case.family, device)}
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
    peer_xp = f"unfused-{xp.__name__}" if xp is not None else None

    def stream_ctx():
        if xp is not None and xp.__name__ == "cupy":
            return xp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        return contextlib.nullcontext()

    def packbits_xp(signs):
        """bool [n] -> int32 words, bit i of word w = element 32w + i (as numpy.packbits in K)."""
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

    if peer_xp is not None:
        # The unfused onebit pipeline with only its bit packing done by xp.
        K.register_peer(K.ONEBIT, peer_xp, lambda block: (
            lambda g, r: K.unfused_onebit_compress(g, r, block, pack=packbits_xp),
            lambda bits, scales, out, acc: K.unfused_onebit_decompress(bits, scales, block, out, acc,
                                                                       unpack=unpackbits_xp),
        ))
        print(f"bench: extra onebit peer {peer_xp!r} ({xp.__name__} {xp.__version__} packbits, via DLPack)")
    else:
        print(f"bench: CuPy is not importable ({xp_error}): the CuPy packbits peer is left out")

    print("bench: python -m pycomm_bench kernels " + " ".join(argv), flush=True)
    rc = cli.main(["kernels", *argv])
    doc = _load(json_path)
    if doc is None:
        print(f"bench: no JSON was written to {json_path}")
        return rc or 1
    bad = K.failed_rows(doc)
    if rc == 1 and bad and all(r["impl"] == peer_xp for r in bad):
        print(f"bench: WARNING: only the extra {peer_xp} peer failed ({bad[0]['error']}); not a failure of the check")
        rc = 0
    doc["gpu_check"] = {"xp_peer": peer_xp, "xp_peer_module": getattr(xp, "__name__", None),
                        "xp_version": getattr(xp, "__version__", None), "xp_peer_error": xp_error, "argv": argv}
    write_json(json_path, doc)
    return rc


def run_helper(name: str, args: List[str]) -> int:
    """``--internal-helper NAME ARGS``: a part that runs in the interpreter under test."""
    if sys.path and os.path.abspath(sys.path[0]) == HERE:
        sys.path.pop(0)  # this file's folder (tools/): nothing there is to be imported
    if name in ("bench", "triton-aot"):
        sys.path.insert(0, ROOT)  # pycomm from the source tree (an editable install still wins)
    if name == "bench" and BENCH not in sys.path:
        sys.path.insert(1, BENCH)  # pycomm_bench, the same way (PYTHONPATH has it too)
    if name == "env-probe":
        return helper_env_probe(args[0])
    if name == "triton-aot":
        return helper_triton_aot(args[0])
    return helper_bench(args)


# -------------------------------------------------------------------- runner ---
def notes_for(name: str, out: str) -> str:
    """One line on what a step produced, for steps.tsv and the report."""
    try:
        if name == "env":
            e = _load(os.path.join(out, "env.json"))
            if e is None:
                return ""
            return (f"{e.get('device_name') or 'no GPU'} | torch {e.get('torch')} | triton {e.get('triton')} "
                    f"| cupy {e.get('cupy')}")
        if name == "build":
            notes = []
            r = _load(os.path.join(out, "ptxas-sm_90a.json"))
            if r is not None:
                notes.append("nvcc: %d kernels, max %d regs, %d spilling" % (
                    len(r), max([x["registers"] or 0 for x in r] or [0]),
                    sum(1 for x in r if (x["spill_stores"] or 0) + (x["spill_loads"] or 0))))
            v = (_load(os.path.join(out, "triton-aot-sm_90a.json")) or {}).get("variants")
            if v is not None:
                notes.append("triton: %d/%d compiled" % (sum(x["ok"] for x in v), len(v)))
            return "; ".join(notes)
        if name.startswith("tests"):
            xml = os.path.join(out, "tests-cpu.xml" if name == "tests" else f"tests-{name[len('tests_'):]}.xml")
            return _xml_note(xml)
        if name == "op_errors":
            notes = []
            counts = _op_error_outcomes(_load(os.path.join(out, "op_errors.json")))
            if counts:
                notes.append("probe: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
            notes.append(_xml_note(os.path.join(out, "tests-op_errors.xml")))
            return "; ".join(n for n in notes if n)
        if name == "bench_engine":
            d = _load(os.path.join(out, "engine.json"))
            if d is None:
                return ""
            ratios = _engine_ratios(d)
            bad = [r for r in d.get("records", []) if isinstance(r, dict) and r.get("status", "ok") != "ok"]
            return (f"{len(d.get('records', []))} records, {len(bad)} not ok; engine/kernels "
                    + (", ".join(f"{m} {_fmt_any(v)}" for m, v in ratios.items()) or "?"))
        if name == "bench":
            found = sorted(glob.glob(os.path.join(out, "kernels-*.json")))
            d = _load(found[0]) if found else None
            if d is None:
                return ""
            bad = [r for r in d["rows"] if r["status"] != "ok"]
            return f"{len(d['rows'])} rows, {len(bad)} not ok; copy {round(d['copy_gbps'] or 0, 1)} GB/s"
    except (KeyError, TypeError, ValueError, AttributeError, ET.ParseError):
        pass
    return ""


def _xml_note(xml: str) -> str:
    if not os.path.isfile(xml):
        return ""
    a = _suite(xml).attrib
    return f"{a.get('tests')} tests, {a.get('failures')} failed, {a.get('errors')} errors, {a.get('skipped')} skipped"


def _engine_ratios(doc: object) -> Dict[str, object]:
    """Method -> engine_over_kernels (engine GB/s over the bare kernels'),
    wherever engine.json keeps it: a map per method, or a field of records
    that name their method (and size).

    >>> _engine_ratios({"records": [{"method": "onebit", "numel": 64, "engine_over_kernels": 0.5}]})
    {'onebit n=64': 0.5}
    """
    found: Dict[str, object] = {}

    def walk(x: object, key: Optional[str]) -> None:
        if isinstance(x, dict):
            v = x.get("engine_over_kernels")
            name = x.get("method", key)  # a record's method, or the key it is filed under
            if isinstance(v, dict):
                found.update((str(k), val) for k, val in v.items())
            elif v is not None and name is not None:
                found[str(name) + (f" n={x['numel']}" if "numel" in x else "")] = v
            for k, val in x.items():
                if k != "engine_over_kernels":
                    walk(val, str(k))
        elif isinstance(x, list):
            for val in x:
                walk(val, None)

    walk(doc, None)
    return found


def _fmt_any(v: object) -> str:
    """A number to 2 significant digits; anything else as text (cut short)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return fmt_number(float(v), 2)
    return str(v)[:40]


def _op_error_outcomes(doc: object) -> Dict[str, int]:
    """Outcome -> number of cases in op_error_probe's JSON (a list of cases,
    or {"cases": [...]}, each with an "outcome" or a "status")."""
    cases = doc.get("cases") if isinstance(doc, dict) else doc
    counts: Dict[str, int] = {}
    for c in cases if isinstance(cases, list) else []:
        if isinstance(c, dict):
            key = str(c.get("outcome", c.get("status", "?")))
            counts[key] = counts.get(key, 0) + 1
    return counts


def _suite(xml_path: str):
    root = ET.parse(xml_path).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def run_step(name: str, cap: int, own_min: int, plan: List[Tuple[str, int, int]], selected, ctx) -> None:
    """Run one step in its own process group, under its share of the budget;
    a line of steps.tsv either way."""
    reserve, after = 0, False
    for n, _c, m in plan:
        if after and selected(n):
            reserve += m
        if n == name:
            after = True
    # Up to CAP, leaving the later steps their minimum; when the budget cannot
    # hold all minimums, the earlier step keeps its own (order is priority).
    total_left = ctx["deadline"] - REPORT_RESERVE - int(time.time())
    left = total_left - reserve
    if left < own_min:
        left = min(own_min, total_left)
    limit = min(cap, left)
    print()
    print(f"################ step {name} (limit {limit}s) ################", flush=True)
    if limit < 5:
        problem(f"no time left for step {name} (budget {ctx['budget']}s)")
        _record(ctx["steps_tsv"], name, "skipped", "-", 0, limit, f"no time left in the {ctx['budget']}s budget")
        return
    t0 = int(time.time())
    rc = _run_limited([sys.executable, SELF, "--internal-step", name, ctx["state_path"]], limit)
    dt = int(time.time()) - t0
    if rc == 0:
        status = "ok"
    elif rc in (124, 137):
        status = "timeout"
        problem(f"step {name} ran out of its {limit}s")
    else:
        status = "failed"
    _record(ctx["steps_tsv"], name, status, rc, dt, limit, notes_for(name, ctx["out"]).split("\n")[0])
    say(f"step {name}: {status} (exit {rc}) in {dt}s")


def _run_limited(argv: List[str], limit: int) -> int:
    """Run ``argv`` in a new process group, its output through ours; past
    ``limit`` seconds SIGTERM to the group, SIGKILL 5 s later: exit 124 (137
    if it had to be killed), as coreutils' timeout -k 5."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def pump() -> None:
        for chunk in iter(lambda: p.stdout.read1(65536), b""):  # type: ignore[union-attr]
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc = None
    try:
        rc = p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGTERM)
        try:
            p.wait(timeout=KILL_GRACE)
            rc = 124
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
            rc = 137
    finally:
        if rc is None:  # interrupted: leave nothing running
            _signal_group(p, signal.SIGKILL)
            p.wait()
        _signal_group(p, signal.SIGKILL)  # what the step left behind in its group
        reader.join(timeout=5)
    return rc


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _record(path: str, *fields: object) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\t".join(str(f) for f in fields) + "\n")


# -------------------------------------------------------------------- report ---
def report(out: str, mode: str, start_s: int, numel: str) -> bool:
    """summary.json and the closing table; True if every step passed."""
    with open(os.path.join(out, "steps.tsv"), encoding="utf-8") as fh:
        header = fh.readline().rstrip("\n").split("\t")
        steps = [dict(zip(header, line.rstrip("\n").split("\t"))) for line in fh]
    env = _load(os.path.join(out, "env.json"), {})
    ptx = _load(os.path.join(out, "ptxas-sm_90a.json"), [])
    tri = _load(os.path.join(out, "triton-aot-sm_90a.json"), {})
    tests: Dict[str, Dict[str, object]] = {}
    for path in sorted(glob.glob(os.path.join(out, "tests-*.xml"))):
        try:
            a = _suite(path).attrib
            total, fail, err, skip = (int(a.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
            tests[os.path.basename(path)] = dict(tests=total, passed=total - fail - err - skip, failed=fail,
                                                 errors=err, skipped=skip, seconds=float(a.get("time", 0)))
        except (OSError, ET.ParseError, AttributeError) as exc:
            tests[os.path.basename(path)] = {"error": str(exc)}
    bench_path = next(iter(sorted(glob.glob(os.path.join(out, "kernels-*.json")))), None)
    bench = _load(bench_path) if bench_path else None
    engine = _load(os.path.join(out, "engine.json"))
    engine_ratios = _engine_ratios(engine) if engine is not None else {}
    op_errors = _op_error_outcomes(_load(os.path.join(out, "op_errors.json")))
    smi = _read(os.path.join(out, "nvidia-smi.txt")) or None
    bad = [s["step"] for s in steps if s["status"] not in ("ok", "warn", "not run")]
    skipped_dry = [
        "building the extension with CUDA (pip install --no-build-isolation -e . with PYCOMM_CUDA=ON): "
        "only pip --dry-run and a CMake configure of the CUDA branch ran",
        "the CUDA and Triton tests on a GPU (tests/test_onebit.py tests/test_topk.py -m gpu, tests/test_triton.py): "
        "only the CPU half of tests/test_onebit.py ran",
        f"the benchmark on cuda at 256M elements with CUDA events: it ran on cpu with --quick (numel {numel})",
        "tests_product (tests/test_gpu_product.py -m gpu), bench_engine (pycomm-bench allreduce --device cuda) "
        "and op_errors (benchmarks/op_error_probe.py and test_op_errors_match_cpp on the CUDA build)",
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
        "engine_json": "engine.json" if engine is not None else None,
        "engine_over_kernels": engine_ratios,
        "op_error_probe": op_errors,
        "skipped_in_dry_run": skipped_dry if mode == "dry" else [],
        "log": "gpu_check.log",
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")

    fmt = fmt_number
    print()
    print("=" * 100)
    title = "DRY RUN (no GPU)" if mode == "dry" else (env.get("device_name") or "GPU ?")
    print(f"pycomm GPU check: {title}, {summary['date']}, {summary['seconds']} s, torch {env.get('torch')} "
          f"(CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, cupy {env.get('cupy')}")
    print(f"{'step':14} {'status':9} {'s':>5} {'limit':>5}  note")
    for s in steps:
        print(f"{s['step']:14} {s['status']:9} {s['seconds']:>5} {s['limit_s']:>5}  {s['note']}")
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
        gpu = bench["machine"].get("gpu")
        print(f"kernels: {bench['numel']} float32 on {bench['device']}{' (' + gpu + ')' if gpu else ''}, "
              f"median of {bench['repeats']} after {bench['warmup']} warm-up; copy {fmt(bench.get('copy_gbps'))} GB/s")
        print(f"  {'compressor':20} {'op':15} {'impl':14} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'x unf':>6} "
              f"{'x topk':>6}  status")
        for r in bench["rows"]:
            ms = None if r.get("median_s") is None else 1e3 * r["median_s"]
            print(f"  {r['compressor']:20} {r['op']:15} {r['impl']:14} {fmt(ms):>8} {fmt(r.get('gbps')):>7} "
                  f"{fmt(r.get('pct_copy'), 2):>6} {fmt(r.get('speedup_vs_unfused')):>6} "
                  f"{fmt(r.get('speedup_vs_torch_topk')):>6}  {r['status'] if r['status'] != 'ok' else ''}"
                  f"{(' ' + str(r.get('error'))[:60]) if r.get('error') else ''}")
    if engine_ratios:
        print("engine over the bare kernels (engine.json, GB/s over GB/s): "
              + ", ".join(f"{m} {_fmt_any(v)}" for m, v in engine_ratios.items()))
    if op_errors:
        print("op error probe: " + ", ".join(f"{n} {k}" for k, n in sorted(op_errors.items())))
    if mode == "dry":
        print("SKIPPED in this dry run (they need a GPU):")
        for s in skipped_dry:
            print(f"  - {s}")
    print(f"results: {out}")
    print("RESULT: " + ("PASS" if not bad else "FAIL (" + ", ".join(bad) + ")"), flush=True)
    return not bad


# ---------------------------------------------------------------------- main ---
def _git(*args: str) -> str:
    rc, text = _out(["git", "-C", ROOT, *args])
    return text.strip() if rc == 0 else ""


def _gpu_slug() -> str:
    """The first GPU's name as a folder name (``nvidia-h200``), from
    nvidia-smi; ``gpu`` where it cannot say."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "gpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """The GPU check (see the module docstring); the exit status: 0 if every
    step passed, 1 if one failed, 2 on a bad command line.

    >>> main(["--dry-run", "/tmp/gpu-dry"])   # doctest: +SKIP
    0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--internal-step"]:
        with open(argv[2], encoding="utf-8") as fh:
            st = json.load(fh)
        os.chdir(st["root"])
        return int(STEPS[argv[1]](st))
    if argv[:1] == ["--internal-helper"]:
        return run_helper(argv[1], argv[2:])
    try:
        opts = parse_args(argv)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        print(_usage(prog), file=sys.stderr, end="")
        return 2
    if opts["help"]:
        print(_usage(prog), end="")
        return 0
    mode = str(opts["mode"])
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    out = str(opts["out_arg"] or os.environ.get("PYCOMM_GPU_OUT") or (
        os.path.join(ROOT, "build", "gpu-dryrun") if mode == "dry"
        else os.path.join(ROOT, "benchmarks", "results", "gpu", _gpu_slug())))
    try:
        os.makedirs(out, exist_ok=True)
    except OSError:
        print(f"{prog}: cannot create the output folder {out}", file=sys.stderr)
        return 2
    out = os.path.abspath(out)

    log = open(os.path.join(out, "gpu_check.log"), "w", encoding="utf-8")
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = _Tee(real_out, log)  # type: ignore[assignment]
    work = os.environ.get("PYCOMM_GPU_WORK") or os.path.join(tempfile.gettempdir(), "pycomm-gpu-check")
    os.makedirs(work, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="run.", dir=work)
    try:
        return _check(opts, out, work, run_dir, date)
    finally:
        if os.environ.get("PYCOMM_GPU_KEEP_WORK", "0") != "1":
            shutil.rmtree(run_dir, ignore_errors=True)
        sys.stdout.flush()
        sys.stdout, sys.stderr = real_out, real_err
        log.close()


def _check(opts: Dict[str, object], out: str, work: str, run_dir: str, date: str) -> int:
    mode, budget = str(opts["mode"]), int(opts["budget"])  # type: ignore[arg-type]
    start_s = int(time.time())
    steps_tsv = os.path.join(out, "steps.tsv")
    with open(steps_tsv, "w", encoding="utf-8") as fh:
        fh.write("\t".join(STEP_FIELDS) + "\n")
    head = _git("rev-parse", "--short", "HEAD") or "?"
    dirty = " (uncommitted changes)" if _git("status", "--porcelain") else ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"== pycomm GPU check ({'DRY RUN, no GPU' if mode == 'dry' else 'GPU'}) ==")
    print(f"date:    {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"host:    {os.uname().nodename}  ({cpus} CPUs)")
    print(f"repo:    {ROOT} @ {head}{dirty}")
    print(f"out:     {out}")
    print(f"budget:  {budget}s; benchmark numel {opts['numel']}", flush=True)
    state = configure(opts, out, work, run_dir, date)
    chosen = set(opts["selected"])  # type: ignore[arg-type]

    def selected(step: str) -> bool:
        return step == "env" or step in chosen or any(step in STEP_GROUPS.get(g, ()) for g in chosen)

    ctx = {"deadline": start_s + budget, "budget": budget, "steps_tsv": steps_tsv, "out": out,
           "state_path": os.path.join(run_dir, "state.json")}
    plan = PLANS[mode]
    for name, cap, own_min in plan:
        if selected(name):
            run_step(name, cap, own_min, plan, selected, ctx)
        else:
            _record(steps_tsv, name, "not run", "-", 0, "-", f"not in --only {opts['only']}")
    print()
    print("################ report ################", flush=True)
    try:
        report(out, mode, start_s, str(state["numel"]))
        report_ok = True
    except Exception as exc:  # noqa: BLE001 - the report's own failure is a finding too
        problem(f"the report failed ({type(exc).__name__}: {exc})")
        report_ok = False
    with open(steps_tsv, encoding="utf-8") as fh:
        failed = [line.split("\t")[0] for line in list(fh)[1:] if line.split("\t")[1] not in ("ok", "not run")]
    return 1 if failed or not report_ok else 0


if __name__ == "__main__":
    sys.exit(main())
