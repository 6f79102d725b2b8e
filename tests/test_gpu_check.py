"""tools/gpu_check.py, the GPU check, dry-run on a machine without a GPU.

``--dry-run`` does all that needs no GPU: argument handling, environment
checks, nvcc compiling every CUDA kernel for sm_90a with the ptxas register
report, the Triton kernels compiled for sm_90a, the CPU half of the onebit
tests, the benchmark on cpu, the result files. So the check that will run on
the GPU machine (where device time is short) is exercised here first.
Skipped without nvcc: the dry run compiles the CUDA kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
#: A repository tool: a file of the source tree, not a module of a package.
GPU_CHECK = ROOT / "tools" / "gpu_check.py"
MODULE = [sys.executable, str(GPU_CHECK)]
PROG = "python tools/gpu_check.py"
DRY_RUN_TIMEOUT_S = 180  # the check's own budget in a dry run is 170 s


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def _gpu_check():
    """tools/gpu_check.py, imported from its path (under the name
    ``pycomm-bench gpu-check`` loads it with, so both share one module)."""
    name = "_pycomm_tool_gpu_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GPU_CHECK)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _run(args, timeout, env=None, command=MODULE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the dry run compiles the CUDA kernels")
def test_dry_run_writes_results_and_register_report(tmp_path: Path):
    out = tmp_path / "out"
    # The interpreter running this test has torch and pycomm: the dry run uses it.
    env = dict(os.environ, PYCOMM_PYTHON=sys.executable, PYCOMM_GPU_WORK=str(tmp_path / "work"))
    env.pop("PYCOMM_GPU_OUT", None)
    proc = _run(["--dry-run", str(out)], DRY_RUN_TIMEOUT_S, env)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"dry run exited {proc.returncode}:\n{tail}"

    log = (out / "gpu_check.log").read_text()
    assert "RESULT: PASS" in log, tail
    # The nvcc register report of every CUDA kernel source, for sm_90a.
    for source in sorted((ROOT / "kernels" / "cuda").glob("*.cu")):
        assert f"### kernels/cuda/{source.name}: nvcc ok" in log, f"no nvcc report for {source.name}"
    assert re.search(r"ptxas info\s*: Used \d+ registers", log), "no ptxas register lines in the log"
    assert re.search(r"Compiling entry function '\S+' for 'sm_90a'", log)
    assert "onebit_compress_block_kernel<float>" in log and "radix_histogram_kernel<float>" in log
    kernels = json.loads((out / "ptxas-sm_90a.json").read_text())
    assert kernels and all(k["registers"] is not None and k["arch"] == "sm_90a" for k in kernels)
    # The Triton kernels, compiled for sm_90a without a GPU.
    triton_aot = json.loads((out / "triton-aot-sm_90a.json").read_text())
    assert triton_aot["variants"] and all(v["ok"] for v in triton_aot["variants"])
    # It says what it skipped.
    assert "SKIPPED in this dry run" in log and "nvidia-smi" in log

    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry-run" and summary["ok"] is True
    assert {s["step"]: s["status"] for s in summary["steps"]} == {
        "env": "ok", "build": "ok", "tests": "ok", "bench": "ok"
    }
    assert summary["tests"]["tests-cpu.xml"]["failed"] == 0
    assert summary["tests"]["tests-cpu.xml"]["passed"] > 0
    bench = json.loads((out / "kernels-cpu-dryrun.json").read_text())
    assert bench["copy_gbps"] > 0
    rows = {(r["compressor"], r["op"], r["impl"]): r for r in bench["rows"]}
    # The extra peer (numpy standing in for CuPy) was verified and timed next to the others.
    peer = rows[("onebit b=2048", "compress", "unfused-numpy")]
    assert peer["status"] == "ok" and peer["verified"] is True and peer["kind"] == "peer"
    assert rows[("onebit b=2048", "compress", "cpu")]["status"] == "ok"
    assert rows[("topk exact d=0.01", "compress", "torch.topk")]["status"] == "ok"
    # The table comes last.
    assert proc.stdout.rstrip().splitlines()[-1] == "RESULT: PASS"


def test_unknown_option_exits_with_usage(tmp_path: Path):
    proc = _run(["--no-such-option", str(tmp_path / "out")], timeout=30)
    assert proc.returncode != 0
    assert "unknown option: --no-such-option" in proc.stderr
    assert f"usage: {PROG}" in proc.stderr
    assert not (tmp_path / "out").exists(), "nothing may be written on a usage error"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "abc"], "--budget"),
        (["--only", "build,nope"], "--only: unknown step 'nope'"),
        (["--numel"], "option --numel needs a value"),
        (["a", "b"], "at most one OUT_DIR"),
        (["--dry-run", "--only", "op_errors"], "--only: unknown step 'op_errors' (a GPU step: not in --dry-run)"),
    ],
)
def test_bad_arguments_exit_with_usage(args, message):
    proc = _run(args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr and "usage:" in proc.stderr


def test_help():
    proc = _run(["--help"], timeout=30)
    assert proc.returncode == 0
    assert f"usage: {PROG}" in proc.stdout and "--dry-run" in proc.stdout


@pytest.mark.parametrize("command, prog", [
    ([sys.executable, "-m", "pycomm_bench", "gpu-check"], "pycomm-bench gpu-check"),
    (["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], PROG),  # runs the file, before pycomm imports
])
def test_other_entry_points(command, prog):
    # pycomm-bench finds the tool in the source tree it is part of (bench/ -> tools/).
    proc = _run(["--help"], timeout=60, command=command, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert f"usage: {prog}" in proc.stdout and "--dry-run" in proc.stdout
    proc = _run(["--budget", "abc"], timeout=60, command=command, env=subprocess_env())
    assert proc.returncode == 2 and "--budget" in proc.stderr


GPU_STEPS = ["env", "build", "tests_product", "bench_engine", "op_errors", "tests_cuda", "bench", "tests_triton"]


def test_gpu_plan_is_in_priority_order_and_fits_the_budget():
    G = _gpu_check()

    plan = G.PLANS["gpu"]
    assert [name for name, _, _ in plan] == GPU_STEPS
    assert all(name in G.STEPS for name in GPU_STEPS)
    # Every step's minimum is kept within the default budget (450 s, as parse_args says).
    budget = G.parse_args(["/tmp/x"])["budget"]
    assert budget == 450 and sum(m for _, _, m in plan) + G.REPORT_RESERVE <= budget
    assert dict((n, c) for n, c, _ in plan)["bench_engine"] == 150


def test_only_takes_the_gpu_steps():
    G = _gpu_check()

    opts = G.parse_args(["--only", "build,tests_product,bench_engine,op_errors", "/tmp/x"])
    assert opts["selected"] == ["bench_engine", "build", "op_errors", "tests_product"]
    assert set(G.parse_args(["/tmp/x"])["selected"]) >= set(GPU_STEPS[1:])
    assert G.parse_args(["--dry-run", "--only", "tests", "/tmp/x"])["selected"] == ["tests"]
    # "tests" stands for every test step, op_errors included.
    assert set(G.STEP_GROUPS["tests"]) >= {"tests_product", "op_errors", "tests_cuda", "tests_triton"}


def _junit(path: Path, tests: int, failures: int) -> None:
    path.write_text(f'<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="0" '
                    f'tests="{tests}" time="2.0"></testsuite></testsuites>')


def test_report_lists_the_new_steps(tmp_path: Path, capsys):
    """summary.json and the printed table of a GPU run hold the new steps
    and what they produced (results made up here: no GPU)."""
    import time

    G = _gpu_check()

    out = tmp_path
    with open(out / "steps.tsv", "w") as fh:
        fh.write("\t".join(G.STEP_FIELDS) + "\n")
        for name in GPU_STEPS:
            status = "failed" if name == "op_errors" else "ok"
            fh.write("\t".join([name, status, "0", "10", "60", G.notes_for(name, str(out))]) + "\n")
    (out / "engine.json").write_text(json.dumps({"records": [
        {"method": "onebit", "numel": 1 << 26, "status": "ok", "engine_over_kernels": 0.31},
        {"method": "int8", "numel": 1 << 26, "status": "ok", "engine_over_kernels": 0.42}]}))
    (out / "op_errors.json").write_text(json.dumps({"cases": [{"outcome": "raised"}] * 6 + [{"outcome": "crashed"}]}))
    _junit(out / "tests-product.xml", 12, 0)
    _junit(out / "tests-op_errors.xml", 13, 1)
    assert "12 tests, 0 failed" in G.notes_for("tests_product", str(out))
    assert "onebit n=67108864 0.31" in G.notes_for("bench_engine", str(out))
    assert "probe: 1 crashed, 6 raised" in G.notes_for("op_errors", str(out))

    assert G.report(str(out), "gpu", int(time.time()), "256M") is False  # op_errors failed
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == GPU_STEPS
    assert summary["failed_steps"] == ["op_errors"]
    assert summary["engine_over_kernels"] == {"onebit n=67108864": 0.31, "int8 n=67108864": 0.42}
    assert summary["op_error_probe"] == {"raised": 6, "crashed": 1}
    assert summary["tests"]["tests-product.xml"]["passed"] == 12
    assert summary["tests"]["tests-op_errors.xml"]["failed"] == 1
    for name in GPU_STEPS:
        assert re.search(rf"^{name} +(ok|failed) ", printed, re.M), name
    assert "engine over the bare kernels (engine.json, GB/s over GB/s): onebit n=67108864 0.31" in printed
    assert "op error probe: 1 crashed, 6 raised" in printed
    assert printed.rstrip().splitlines()[-1] == "RESULT: FAIL (op_errors)"
