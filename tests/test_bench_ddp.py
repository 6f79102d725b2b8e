"""``pycomm-bench ddp``: method names, argument checks by name, break-even
interpolation, the table and plots from records, and a small end-to-end run
(2 ranks, the tiny language model, an emulated 100 Mbit/s link where this
machine can build one, else loopback) whose JSON must hold every field the
records promise. No timing assertions: the machine is shared."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import subprocess_env

from pycomm.bench import ddp
from pycomm.bench.cli import build_parser
from pycomm.bench.ddp import Method, break_even, format_table, parse_method
from pycomm.bench.netem import emulation_available

RECORD_KEYS = (
    "method", "bandwidth", "link_busbw_measured", "ranks", "steps", "step_time_median_s", "step_time_p10_s",
    "step_time_p90_s", "bytes_sent_per_rank_per_step", "final_loss", "emulated", "tokens_per_s",
    "compress_time_share", "params_identical", "speedup_vs_allreduce", "compute_time_s", "nocomm_step_time_s",
)




def _args(*argv):
    args = build_parser().parse_args(["ddp", *argv])
    return ddp.resolve_args(args)


@pytest.mark.parametrize("name, want", [
    ("allreduce", Method("allreduce", "ddp", "none")),
    ("fp16", Method("fp16", "torch", "fp16")),
    ("powersgd-4", Method("powersgd-4", "torch", "powersgd", True, rank=4)),
    ("onebit", Method("onebit", "hook", "onebit", True)),
    ("onebit-noef-backend", Method("onebit-noef-backend", "backend", "onebit", False)),
    ("topk-0.001-backend", Method("topk-0.001-backend", "backend", "topk", True, density=0.001)),
    ("topk-0.01-noef", Method("topk-0.01-noef", "hook", "topk", False, density=0.01)),
])
def test_parse_method(name, want):
    assert parse_method(name) == want


@pytest.mark.parametrize("name, words", [
    ("sgd", "unknown method"), ("fp16-noef", "onebit and topk only"), ("powersgd-0", "rank must be >= 1"),
    ("topk-2", "density must be in (0, 1]"), ("allreduce-backend", "onebit and topk only"),
])
def test_parse_method_refuses(name, words):
    with pytest.raises(ValueError, match=None) as e:
        parse_method(name)
    assert words in str(e.value)


def test_defaults_cover_the_comparison():
    a = _args()
    assert a.bandwidth == ["100mbit", "1gbit", "2.5gbit", "none"] and a.rates == [1e8, 1e9, 2.5e9, None]
    assert a.train_rate == 1e9 and a.ranks == 4 and a.methods[0] == "allreduce"
    names = set(a.methods)
    assert {"fp16", "powersgd-1", "powersgd-4", "onebit", "onebit-noef", "topk-0.01", "topk-0.001"} <= names
    for m in ("onebit", "topk-0.01", "topk-0.001"):  # with and without EF, hook and backend
        assert {m, f"{m}-noef", f"{m}-backend", f"{m}-noef-backend"} <= names
    q = _args("--quick")
    assert q.steps < a.steps and len(q.methods) < len(a.methods) and q.json.endswith("-quick.json")
    assert _args("--methods", "onebit").methods == ["allreduce", "onebit"]  # the baseline always runs


@pytest.mark.parametrize("argv, words", [
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--bandwidth", "1gbit,1G"], "repeated"),
    (["--methods", "onebit,zstd"], "--methods"),
    (["--train-bandwidth", "10mbit"], "--train-bandwidth"),
    (["--steps", "5", "--start-iter", "4"], "--steps"),
    (["--start-iter", "1"], "--start-iter"),
    (["--ranks", "1"], "--ranks"),
    (["--no-netns", "--bandwidth", "1gbit,none"], "--no-netns"),
    (["--repeats", "3"], "--repeats"),
])
def test_bad_arguments_are_named(argv, words):
    with pytest.raises(ValueError) as e:
        _args(*argv)
    assert words in str(e.value)


def _rec(method, bw, t, **kw):
    r = dict(method=method, bandwidth=bw, link_busbw_measured=bw or 4e9, step_time_median_s=t,
             ranks=4, params_identical=True, training_run=bw == 1e9, bytes_sent_per_rank_per_step=1e6,
             compress_time_share=0.1, final_loss=2.0, loss_per_step=[3.0, 2.5, 2.0], step_times_s=[t] * 3)
    r.update(kw)
    return r


def _sweep():
    recs = []
    for bw, plain, fast, slow in [(1e8, 2.0, 0.5, 2.5), (1e9, 0.4, 0.2, 0.8), (None, 0.1, 0.2, 0.3)]:
        recs += [_rec("allreduce", bw, plain), _rec("onebit", bw, fast), _rec("powersgd-4", bw, slow)]
    ddp.add_speedups(recs)
    return recs


def test_break_even_interpolates_in_log_bandwidth():
    be = break_even(_sweep())
    # onebit: speedup 2 at 1 Gbit/s, 0.5 at 4 Gbit/s (the unshaped link's measured rate):
    # log-linear crossing halfway, at 2 Gbit/s.
    assert be["onebit"]["bits_per_s"] == pytest.approx(2e9, rel=1e-9)
    assert be["powersgd-4"]["bits_per_s"] is None and "slower at every" in be["powersgd-4"]["note"]
    always = [_rec("allreduce", 1e8, 1.0), _rec("x", 1e8, 0.5)]
    ddp.add_speedups(always)
    assert "faster at every" in break_even(always)["x"]["note"]


def test_table_shows_speedups_loss_and_broken_ranks():
    recs = _sweep()
    recs[-1]["params_identical"] = False
    table = format_table(recs)
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "(4.00x)" in lines["onebit"] and "2 Gbit/s" in lines["onebit"]
    assert "NO" in lines["powersgd-4"] and "yes" in lines["onebit"]
    assert "2.000 (1.000)" in lines["allreduce"]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    paths = ddp.plot(_sweep(), str(tmp_path / "d"))
    assert [os.path.basename(p) for p in paths] == ["d-step-time.png", "d-loss-vs-steps.png", "d-loss-vs-seconds.png"]
    for p in paths:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_end_to_end_small_run(tmp_path):
    emulated = emulation_available()[0]
    bws = "100mbit,none" if emulated else "none"
    out = tmp_path / "r" / "d.json"
    methods = "fp16,powersgd-1,onebit,onebit-backend,topk-0.01-noef,topk-0.01-noef-backend,auto"
    cmd = [sys.executable, "-m", "pycomm.bench", "ddp", "--ranks", "2", "--model", "tiny", "--bandwidth", bws,
           "--methods", methods, "--steps", "10", "--start-iter", "4", "--time-steps", "3", "--json", str(out),
           "--netns-prefix", "pycommtest-ddp", "--no-progress", "--train-all"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads(out.read_text())
    names = ["allreduce"] + methods.split(",")
    rates = [1e8, None] if emulated else [None]
    assert sorted((r["method"], str(r["bandwidth"])) for r in recs) == sorted(
        (m, str(b)) for m in names for b in rates)
    for r in recs:
        for k in RECORD_KEYS:
            assert k in r, k
        assert r["emulated"] is emulated and r["ranks"] == 2
        assert r["params_identical"] is True, r["method"]
        assert r["link_busbw_measured"] > 0 and math.isfinite(r["final_loss"])
        assert r["nocomm_step_time_s"] > 0 and r["compute_time_s"] > 0
        assert 0 < r["step_time_p10_s"] <= r["step_time_median_s"] <= r["step_time_p90_s"]
        assert r["steps"] == (10 if r["training_run"] else 2 + 3)
        assert r["bytes_sent_per_rank_per_step"] > 0
        if r["method"] == "auto":  # the calibration and each bucket's method are recorded
            assert set(r["auto_bucket_methods"].values()) <= {"none", "fp16", "onebit", "topk"}
            assert r["auto_calibration"]["world_size"] == 2
        if r["bandwidth"] == 1e8:  # namespaces: counted on the rank's own interface
            assert abs(r["link_busbw_measured"] / 1e8 - 1) < 0.5
    train = {r["method"]: r for r in recs if r["training_run"]}
    assert len(train) == len(names) and all(len(r["loss_per_step"]) == 10 for r in train.values())
    # The same algorithm in C++ (backend) and Python (hook over Gloo), the same kernels: the same training.
    assert train["onebit"]["loss_per_step"] == train["onebit-backend"]["loss_per_step"]
    assert train["topk-0.01-noef"]["loss_per_step"] == train["topk-0.01-noef-backend"]["loss_per_step"]
    # Compressed methods send far less than the float32 all-reduce.
    plain = train["allreduce"]["bytes_sent_per_rank_per_step"]
    assert train["onebit"]["bytes_sent_per_rank_per_step"] < plain / 4
    assert train["fp16"]["bytes_sent_per_rank_per_step"] < plain * 0.75
    assert (tmp_path / "r" / "d-step-time.png").exists() and "break-even" in proc.stdout


def test_backend_twins_are_timed_not_retrained():
    a = _args("--methods", "onebit,onebit-backend,topk-0.01-backend", "--steps", "50", "--time-steps", "4")
    plan = {r["method"]: r for r in ddp.run_plan(a, training=True)}
    assert plan["onebit"]["steps"] == 50 and plan["onebit"]["training"]
    assert plan["onebit-backend"] == dict(method="onebit-backend", steps=6, start_iter=2, timed_from=3,
                                          training=False, loss_from="onebit")
    assert plan["topk-0.01-backend"]["training"]  # no hook twin in the run: trained
    assert all(not r["training"] for r in ddp.run_plan(a, training=False))
    a.train_all = True
    assert all(r["training"] for r in ddp.run_plan(a, training=True))


def test_small_tensor_workload_runs(tmp_path):
    out = tmp_path / "m.json"
    cmd = [sys.executable, "-m", "pycomm.bench", "ddp", "--workload", "mlp", "--ranks", "2", "--bandwidth", "none",
           "--methods", "onebit", "--steps", "6", "--start-iter", "2", "--json", str(out), "--no-plots",
           "--no-netns", "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [r["method"] for r in recs] == ["allreduce", "onebit"]
    assert all(r["workload"] == "mlp" and r["tokens_per_s"] is None and r["samples_per_s"] > 0 for r in recs)
    # loopback (--no-netns): labelled, bytes counted on the shared lo and divided among the ranks
    assert all(r["emulated"] is False and "loopback" in r["link"] for r in recs)
    assert recs[1]["bytes_sent_per_rank_per_step"] < recs[0]["bytes_sent_per_rank_per_step"]


def test_all_runs_each_benchmark_with_valid_arguments():
    from pycomm.bench import all as bench_all

    parser = build_parser()
    for _, argv in bench_all.PARTS:
        args = parser.parse_args(argv + ["--quick"])
        args._module.resolve_args(args)  # every part's own checks accept it
    with pytest.raises(ValueError, match="--json"):
        bench_all.resolve_args(parser.parse_args(["all", "--json", "x.json"]))
