"""Runs each ERROR_CASES case of tests/test_triton.py against the C++ op, each
in a fresh subprocess (a segfault is reported, not fatal), and prints per
case: raised-correctly, wrong-message (or exception, or none) or crashed.

Why: on a CUDA build (torch 2.11+cu130) some cases segfaulted inside the C++
op (seemingly those whose TORCH_CHECK message streams an integer); the CPU
build (torch 2.13) raised in all. Modes, each case once per mode:

  cpp     the C++ op alone: only torch and the extension's .so are loaded
          (not the pycomm package, not Triton);
  triton  the Triton op first, as test_op_errors_match_cpp does, then the C++ op.

Case -1 is a control: torch raises a message with an integer, formatted in
libtorch, not in the extension. The header lists the libstdc++ copies mapped.
Exit status 0 when every case raised correctly in every mode. After a build:

    .venv/bin/python benchmarks/op_error_probe.py [--modes cpp]
"""

import argparse
import ast
import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys

TEST = pathlib.Path(__file__).resolve().parent.parent / "tests" / "test_triton.py"

CHILD = r"""
import faulthandler, glob, importlib.util, os, re, sys
faulthandler.enable()
import torch
idx, mode = int(sys.argv[1]), sys.argv[2]
if mode == "triton":
    import pycomm.triton.onebit, pycomm.triton.topk  # the package (it loads the extension), the Triton ops
else:  # the extension's .so alone: its static initializers register torch.ops.pycomm.*
    dirs = importlib.util.find_spec("pycomm").submodule_search_locations
    so = next(p for d in dirs for p in sorted(glob.glob(os.path.join(d, "_C*.so"))))
    spec = importlib.util.spec_from_file_location("pycomm._C", so)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
if mode == "info":
    maps = {l.split()[-1] for l in open("/proc/self/maps") if re.search(r"libstdc\+\+|libgcc_s", l)}
    print(f"torch {torch.__version__} cuda {torch.version.cuda} cxx11_abi {torch._C._GLIBCXX_USE_CXX11_ABI}"
          f" | extension {so} | triton loaded: {'triton' in sys.modules}")
    print("libstdc++/libgcc_s mapped: " + ", ".join(sorted(maps)))
    sys.exit(0)
ns = {"torch": torch}
exec(os.environ["PROBE_CASES"], ns)
if idx < 0:
    call, message = (lambda: torch.ones(3).view(4)), r"shape '\[4\]' is invalid for input of size 3"
else:
    name, args, message = ns["ERROR_CASES"][idx]
    try:
        if mode == "triton": getattr(torch.ops.pycomm, name + "_triton")(*args())
    except Exception:
        pass
    call = lambda: getattr(torch.ops.pycomm, name)(*args())
sys.stdout.flush()
try:
    call()
except RuntimeError as e:
    ok = re.search(message, str(e))
    print("raised-correctly" if ok else "wrong-message: " + str(e).splitlines()[0][:160])
    sys.exit(0 if ok else 3)
except Exception as e:
    print(f"wrong-message: {type(e).__name__}: {str(e)[:160]}")
    sys.exit(3)
print("wrong-message: nothing raised")
sys.exit(3)
"""


def case_source() -> tuple[str, list[str]]:
    """ERROR_CASES and the top-level names it uses, cut out of the test file
    (importing the file would import pytest and Triton); and the case names."""
    text = TEST.read_text()
    body = ast.parse(text).body
    cases = next(n for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ERROR_CASES")
    used = {n.id for n in ast.walk(cases) if isinstance(n, ast.Name)}
    keep = [n for n in body if (isinstance(n, ast.FunctionDef) and n.name in used)
            or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in used)]
    names = [ast.literal_eval(elt.elts[0]) for elt in cases.value.elts]
    return "\n\n".join(ast.get_source_segment(text, n) for n in keep + [cases]), names


def run(idx: int, mode: str, source: str) -> str:
    cmd, env = [sys.executable, "-c", CHILD, str(idx), mode], dict(os.environ, PROBE_CASES=source)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "timeout (300 s)"
    if p.returncode < 0:
        frames = [line.strip() for line in p.stderr.splitlines() if line.strip().startswith("File ")]
        return f"crashed ({signal.Signals(-p.returncode).name}) at " + " <- ".join(frames[:2])[:300]
    ok = p.returncode in (0, 3)
    return p.stdout.strip().splitlines()[-1] if ok else f"failed (rc {p.returncode}): {p.stderr.strip()[-300:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="cpp,triton", help="comma-separated: cpp, triton")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    opts = ap.parse_args()
    source, names = case_source()
    info = subprocess.run([sys.executable, "-c", CHILD, "0", "info"], capture_output=True, text=True)
    print(info.stdout.strip() or "info failed: " + info.stderr.strip()[-300:])
    jobs = [(mode, idx) for mode in opts.modes.split(",") for idx in range(-1, len(names))]
    with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        verdicts = list(pool.map(lambda job: run(job[1], job[0], source), jobs))
    for (mode, idx), verdict in zip(jobs, verdicts):
        print(f"{mode:7} {idx:>3} {'control: aten view' if idx < 0 else names[idx]:22} {verdict}")
    return 0 if all(v == "raised-correctly" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
