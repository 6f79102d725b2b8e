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

from pycomm.distributed import spec
from pycomm_bench import ddp
from pycomm_bench.cli import build_parser
from pycomm_bench.ddp import Method, break_even, format_table, parse_method
from pycomm_bench.netem import emulation_available

RECORD_KEYS = (
    "method", "bandwidth", "link_busbw_measured", "ranks", "steps", "step_time_median_s", "step_time_p10_s",
    "step_time_p90_s", "bytes_sent_per_rank_per_step", "final_loss", "emulated", "tokens_per_s",
    "compress_time_share", "params_identical", "speedup_vs_allreduce", "compute_time_s", "nocomm_step_time_s",
)
#: Added by --seeds (present with one seed too).
SEED_KEYS = (
    "seeds", "per_seed", "final_loss_std", "final_loss_min", "final_loss_max", "final_loss_per_seed",
    "final_loss_vs_allreduce_per_seed", "final_loss_vs_allreduce_mean", "final_loss_vs_allreduce_min",
    "final_loss_vs_allreduce_max", "optimizer", "optimizer_class", "eval_loss_curve",
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
    ("int8", Method("int8", "hook", "int8", True)),
    ("int4-noef", Method("int4-noef", "hook", "int4", False)),
    ("int4-noef-backend", Method("int4-noef-backend", "backend", "int4", False)),
    ("optim-onebit", Method("optim-onebit", "optim", "onebit", True)),
    ("optim-int4", Method("optim-int4", "optim", "int4", True)),
    ("int4-sr-noef", Method("int4-sr-noef", "hook", "int4", False, rounding="stochastic")),
    ("int8-sr-backend", Method("int8-sr-backend", "backend", "int8", True, rounding="stochastic")),
    ("optim-int4-overlap-sr", Method("optim-int4-overlap-sr", "optim", "int4", True, overlap=True,
                                     rounding="stochastic")),
    ("optim-onebit-v40", Method("optim-onebit-v40", "optim", "onebit", True, variance_every=40)),
    ("optim-int8-overlap-v0", Method("optim-int8-overlap-v0", "optim", "int8", True, overlap=True, variance_every=0)),
    # DiLoCo: exact by default; error feedback on for a codec that keeps residuals, as for the hook.
    ("diloco-H16", Method("diloco-H16", "diloco", "none", False, sync_every=16, fragments=1, delay=0)),
    ("diloco-H16-int4", Method("diloco-H16-int4", "diloco", "int4", True, sync_every=16, fragments=1, delay=0)),
    ("diloco-H32-F4-d1-int4", Method("diloco-H32-F4-d1-int4", "diloco", "int4", True, sync_every=32, fragments=4,
                                     delay=1)),
    ("diloco-H8-d3-int8-sr-noef", Method("diloco-H8-d3-int8-sr-noef", "diloco", "int8", False,
                                         rounding="stochastic", sync_every=8, fragments=1, delay=3)),
    ("diloco-H4-F2-fp16", Method("diloco-H4-F2-fp16", "diloco", "fp16", False, sync_every=4, fragments=2, delay=0)),
    ("diloco-H1-onebit-noef", Method("diloco-H1-onebit-noef", "diloco", "onebit", False, sync_every=1, fragments=1,
                                     delay=0)),
])
def test_parse_method(name, want):
    assert parse_method(name) == want


#: The -sr refusal names the methods that round, from the table.
ROUNDING_ONLY = f"applies to {', '.join(spec.ROUNDING_METHODS[:-1])} or {spec.ROUNDING_METHODS[-1]} only"


@pytest.mark.parametrize("name, words", [
    ("sgd", "unknown method"), ("fp16-noef", "apply to onebit, topk, int8, int4"), ("powersgd-0", "rank must be >= 1"),
    ("topk-2", "density must be in (0, 1]"), ("allreduce-backend", "apply to onebit, topk"),
    ("int16", "unknown method"), ("optim-topk", "must be one of onebit, int8, int4"),
    ("optim-onebit-noef", "apply to onebit, topk"), ("optim-int4-backend", "apply to onebit, topk"),
    ("onebit-sr", ROUNDING_ONLY), ("optim-onebit-sr", ROUNDING_ONLY), ("fp16-sr", ROUNDING_ONLY),
    ("onebit-v40", "unknown method"), ("optim-onebit-v", "unknown method"),
    ("diloco", "unknown method"), ("diloco-16", "unknown method"), ("diloco-H0", "H and F must be >= 1"),
    ("diloco-H16-F3", "F=3 must divide H=16"), ("diloco-H16-F4-d4", "d=4 must be less than H/F = 4"),
    ("diloco-H16-lz4", "must be one of onebit, int8, int4, "), ("diloco-H16-lz4", "(or none, for the exact "
                                                                                  "average), got 'lz4'"),
    ("diloco-H16-topk", "topk needs a density: topk-<density>"), ("diloco-H16-int4-0.1", "only topk takes a density"),
    ("diloco-H16-topk-0", "density must be in (0, 1]"),
    ("diloco-H16-int3", "got 'int3'"), ("diloco-H16-noef", "-noef applies to a codec that keeps residuals"),
    ("diloco-H16-bf16-noef", "(onebit, int8, int4"), ("diloco-H16-onebit-sr", ROUNDING_ONLY),
    ("diloco-H16-int4-backend", "-backend does not apply to diloco"),
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
    assert {"fp16", "powersgd-1", "powersgd-4", "onebit", "onebit-noef", "topk-0.01", "topk-0.001", "int8", "int4",
            "optim-onebit"} <= names
    for m in ("onebit", "topk-0.01", "topk-0.001"):  # with and without EF, hook and backend
        assert {m, f"{m}-noef", f"{m}-backend", f"{m}-noef-backend"} <= names
    q = _args("--quick")
    assert q.steps < a.steps and len(q.methods) < len(a.methods) and q.json.endswith("-quick.json")
    assert _args("--methods", "onebit").methods == ["allreduce", "onebit"]  # the baseline runs
    assert _args("--methods", "onebit", "--no-baseline").methods == ["onebit"]  # unless left to a merge
    # The optimizer methods' warm-up: 20% of the steps, at least --start-iter; one seed unless asked.
    assert _args("--steps", "400").optim_warmup == 80 and _args("--steps", "40").optim_warmup == 10
    assert _args("--optim-warmup", "30").optim_warmup == 30 and a.seeds == 1 and a.lr_schedule == "constant"


@pytest.mark.parametrize("argv, words", [
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--bandwidth", "1gbit,1G"], "repeated"),
    (["--methods", "onebit,zstd"], "--methods"),
    (["--train-bandwidth", "10mbit"], "--train-bandwidth"),
    (["--steps", "5", "--start-iter", "4"], "--steps"),
    (["--start-iter", "1"], "--start-iter"),
    (["--no-netns", "--bandwidth", "1gbit,none"], "--no-netns"),
    (["--repeats", "3"], "--repeats"),
    (["--optim-warmup", "1"], "--optim-warmup"),
    (["--methods", "optim-onebit", "--steps", "20", "--optim-warmup", "18"], "--optim-warmup"),
    (["--steps", "20", "--eval-every", "20"], "--eval-every"),
    (["--optimizer", "sgd", "--methods", "optim-onebit-v10"], "OneBitAdam's variance"),
    (["--optimizer", "sgd", "--methods", "diloco-H16"], "diloco-H16: DiLoCo's outer step"),
    (["--outer-lr", "0"], "--outer-lr must be > 0"), (["--outer-momentum", "1"], "--outer-momentum must be in [0, 1)"),
    # fsdp's suffix, which restates the hook's default: refused, saying what to write
    (["--methods", "int8-ef"], "error feedback is on by default in pycomm-bench ddp: write 'int8'"),
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


def _seed_rec(method, seed, loss, **kw):
    r = dict(method=method, seed=seed, bandwidth=None, link_busbw_measured=4e9, ranks=2, training_run=True,
             final_loss=loss, train_loss_last=loss,
             bytes_sent_per_rank_per_step=1e6, params_identical=True, timed_from=1, compress_time_s=None,
             loss_per_step=[5.0, 4.0, loss], step_times_s=[1.0, 0.1, 0.3], steps=3, start_iter=1,
             eval_loss_curve=[[2, 4.5], [3, loss]])
    r.update(kw)
    return r


def test_seeds_are_combined_and_compared_seed_by_seed():
    plain = ddp.combine_seeds([_seed_rec("allreduce", s, l) for s, l in ((0, 2.0), (1, 3.0), (2, 2.5))])
    # Given in any order; seed 1 of "x" is 10% worse than plain's seed 1, seed 0 equal.
    x = ddp.combine_seeds([_seed_rec("x", 1, 3.3, params_identical=False), _seed_rec("x", 0, 2.0),
                           _seed_rec("x", 2, 2.5, step_times_s=[1.0, 0.2, 0.2])])
    recs = [plain, x]
    ddp.finish_records(recs)
    assert x["seeds"] == [0, 1, 2] and [p["seed"] for p in x["per_seed"]] == [0, 1, 2]
    assert x["final_loss_per_seed"] == [2.0, 3.3, 2.5] and x["final_loss"] == pytest.approx(7.8 / 3)
    assert x["final_loss_min"] == 2.0 and x["final_loss_max"] == 3.3
    assert x["final_loss_std"] == pytest.approx(math.sqrt(((2.0 - 2.6) ** 2 + 0.7 ** 2 + 0.1 ** 2) / 2))
    assert x["final_loss_vs_allreduce_per_seed"] == pytest.approx([1.0, 1.1, 1.0])
    assert x["final_loss_vs_allreduce_mean"] == pytest.approx(3.1 / 3)
    assert (x["final_loss_vs_allreduce_min"], x["final_loss_vs_allreduce_max"]) == pytest.approx((1.0, 1.1))
    assert plain["final_loss_vs_allreduce_per_seed"] == [1.0, 1.0, 1.0]
    # Step times pooled over the seeds' timed steps (from timed_from on); curves averaged step by step.
    assert x["timed_steps"] == 6 and x["step_time_median_s"] == pytest.approx(0.2)
    assert x["loss_per_step"] == pytest.approx([5.0, 4.0, 7.8 / 3])
    assert [s for s, _ in x["eval_loss_curve"]] == [2, 3]
    assert [v for _, v in x["eval_loss_curve"]] == pytest.approx([4.5, 7.8 / 3])
    assert plain["eval_loss_change_last_quarter"] == pytest.approx(2.5 / 4.5 - 1)
    assert x["params_identical"] is False  # one seed that broke is enough
    with pytest.raises(ValueError, match="seed repeated"):
        ddp.combine_seeds([_seed_rec("x", 0, 2.0), _seed_rec("x", 0, 2.1)])
    with pytest.raises(ValueError, match="differ in 'steps'"):
        ddp.combine_seeds([_seed_rec("x", 0, 2.0), _seed_rec("x", 1, 2.1, steps=4)])
    # The table shows mean +-std and the per-seed ratios' mean and range.
    lines = {line.split("|")[1].strip(): line for line in format_table(recs).splitlines() if line.startswith("| ")}
    assert "2.600 ±0.656 (1.033, 1.000-1.100)" in lines["x"] and "min-max over seeds" in format_table(recs)


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
    cmd = [sys.executable, "-m", "pycomm_bench", "ddp", "--ranks", "2", "--model", "tiny", "--bandwidth", bws,
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
        for k in RECORD_KEYS + SEED_KEYS:
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


def _run_bench(tmp_path, *argv, timeout=600):
    cmd = [sys.executable, "-m", "pycomm_bench", "ddp", "--ranks", "2", "--model", "tiny", "--bandwidth", "none",
           "--no-netns", "--no-progress", "--no-plots", *argv]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_seeds_quantized_methods_and_optimizer_end_to_end(tmp_path):
    out = tmp_path / "s.json"
    methods = "int8,int4-noef,optim-onebit"
    proc = _run_bench(tmp_path, "--methods", methods, "--steps", "9", "--start-iter", "3", "--optim-warmup", "4",
                      "--seeds", "2", "--seed", "5", "--eval-every", "3", "--eval-batches", "4",
                      "--lr-schedule", "cosine", "--json", str(out))
    recs = json.loads(out.read_text())
    assert [r["method"] for r in recs] == ["allreduce", *methods.split(",")]
    for r in recs:
        for k in RECORD_KEYS + SEED_KEYS:
            assert k in r, (r["method"], k)
        assert r["seeds"] == [5, 6] and [p["seed"] for p in r["per_seed"]] == [5, 6]
        assert r["params_identical"] is True and all(p["params_identical"] for p in r["per_seed"])
        assert r["final_loss"] == pytest.approx(sum(r["final_loss_per_seed"]) / 2)
        assert r["final_loss_min"] <= r["final_loss"] <= r["final_loss_max"]
        assert len(r["final_loss_vs_allreduce_per_seed"]) == 2
        assert all(len(p["loss_per_step"]) == 9 for p in r["per_seed"]) and len(r["loss_per_step"]) == 9
        assert [s for s, _ in r["eval_loss_curve"]] == [3, 6, 9]
        assert r["optimizer"] == "adamw" and r["lr_schedule"] == "cosine" and r["eval_batches"] == 4
        assert r["bytes_sent_per_rank_per_step"] > 0 and r["bytes_sent_per_rank_per_step_all_steps"] > 0
    by = {r["method"]: r for r in recs}
    assert by["allreduce"]["final_loss_vs_allreduce_per_seed"] == [1.0, 1.0]
    # Different seeds: different model and data (the runs are not copies of each other).
    assert len(set(by["allreduce"]["final_loss_per_seed"])) == 2
    opt = by["optim-onebit"]
    assert opt["entry"] == "optim" and opt["optimizer_class"] == "OneBitAdam"
    assert opt["start_iter"] == 4 and opt["timed_from"] == 5 and opt["timed_steps"] == 2 * (9 - 5)
    assert 0 < opt["optim_bytes_per_step"]["compressed"] < opt["optim_bytes_per_step"]["exact"]
    assert by["int8"]["start_iter"] == 3 and by["int8"]["error_feedback"] is True
    assert by["int4-noef"]["compressor"] == "int4" and by["int4-noef"]["error_feedback"] is False
    assert "change from step" in proc.stdout and "min-max over seeds" in proc.stdout

    # --merge: the two seeds written as two files come back as the one run.
    for i in range(2):
        part = [dict(r, per_seed=r["per_seed"][i:i + 1]) for r in recs]
        (tmp_path / f"p{i}.json").write_text(json.dumps(part))
    merged_path = tmp_path / "m.json"
    _run_bench(tmp_path, "--merge", str(tmp_path / "p1.json"), str(tmp_path / "p0.json"), "--json",
               str(merged_path))
    merged = json.loads(merged_path.read_text())
    for a, b in zip(recs, merged):
        for k in ("method", "seeds", "final_loss", "final_loss_std", "final_loss_vs_allreduce_per_seed",
                  "step_time_median_s", "bytes_sent_per_rank_per_step", "loss_per_step", "eval_loss_curve"):
            assert a[k] == b[k], k
    # A seed found twice is kept once if it trained the same (a rerun), refused if not.
    assert ddp.merge_files([str(tmp_path / "p0.json"), str(tmp_path / "p0.json")])[0]["seeds"] == [5]
    part = json.loads((tmp_path / "p0.json").read_text())
    part[1]["per_seed"][0]["final_loss"] += 0.5
    (tmp_path / "p2.json").write_text(json.dumps(part))
    bad = subprocess.run([sys.executable, "-m", "pycomm_bench", "ddp", "--merge", str(tmp_path / "p0.json"),
                          str(tmp_path / "p2.json"), "--json", str(tmp_path / "x.json")],
                         cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "seed repeated" in bad.stderr and "int8" in bad.stderr


def test_momentum_sgd_optimizer_method_runs(tmp_path):
    out = tmp_path / "g.json"
    _run_bench(tmp_path, "--optimizer", "sgd", "--methods", "int4,optim-int4", "--steps", "7", "--start-iter", "3",
               "--json", str(out))
    recs = {r["method"]: r for r in json.loads(out.read_text())}
    assert recs["optim-int4"]["optimizer_class"] == "OneBitSGD" and recs["allreduce"]["optimizer_class"] == "SGD"
    assert all(r["optimizer"] == "sgd" and r["params_identical"] and r["seeds"] == [0] for r in recs.values())
    assert all(math.isfinite(r["final_loss"]) and r["final_loss_std"] == 0.0 for r in recs.values())


def test_backend_twins_are_timed_not_retrained():
    a = _args("--methods", "onebit,onebit-backend,topk-0.01-backend", "--steps", "50", "--time-steps", "4")
    plan = {r["method"]: r for r in ddp.run_plan(a, training=True)}
    assert plan["onebit"]["steps"] == 50 and plan["onebit"]["training"] and a.optim_warmup == a.start_iter
    assert plan["onebit-backend"] == dict(method="onebit-backend", steps=6, start_iter=2, timed_from=3,
                                          training=False, loss_from="onebit")
    assert plan["topk-0.01-backend"]["training"]  # no hook twin in the run: trained
    assert all(not r["training"] for r in ddp.run_plan(a, training=False))
    a.train_all = True
    assert all(r["training"] for r in ddp.run_plan(a, training=True))


def test_diloco_is_timed_over_whole_sync_periods():
    a = _args("--methods", "diloco-H16-int4,diloco-H8-F4-d1", "--steps", "50", "--time-steps", "10")
    timing = {r["method"]: r for r in ddp.run_plan(a, training=False)}
    # 10 timed steps rounded up to one period of H: exactly one sync of every fragment timed.
    assert timing["diloco-H16-int4"] == dict(method="diloco-H16-int4", steps=3 + 16, start_iter=2, timed_from=3,
                                             training=False)
    assert timing["diloco-H8-F4-d1"]["steps"] == 3 + 16 and timing["allreduce"]["steps"] == 2 + 10
    train = {r["method"]: r for r in ddp.run_plan(a, training=True)}
    assert train["diloco-H16-int4"]["steps"] == 50 and train["diloco-H16-int4"]["start_iter"] == a.start_iter


class _Bucket:
    def __init__(self, last):
        self.last = last

    def is_last(self):
        return self.last


def test_cast_hooks_wait_for_the_plain_warm_up(monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []
    monkeypatch.setattr(default_hooks, "allreduce_hook", lambda group, bucket: calls.append("plain") or "p")
    state = ddp._AfterWarmup(2, lambda group, bucket: calls.append("fp16") or "c")
    # Two buckets per step: a step counts once, at its last bucket.
    futs = [ddp._AfterWarmup.hook(state, _Bucket(last)) for _ in range(3) for last in (False, True)]
    assert calls == ["plain"] * 4 + ["fp16"] * 2 and futs == ["p"] * 4 + ["c"] * 2 and state.iter == 3


def test_quick_runs_say_their_loss_is_no_verdict(tmp_path, capsys):
    recs = [ddp.combine_seeds([_seed_rec(m, 0, loss)]) for m, loss in (("allreduce", 2.0), ("x", 2.1))]
    ddp.finish_records(recs)
    (tmp_path / "q.json").write_text(json.dumps(recs))
    for quick in (True, False):
        args = _args("--merge", str(tmp_path / "q.json"), "--json", str(tmp_path / "o.json"), "--no-plots",
                     *(["--quick"] if quick else []))
        assert ddp.run(args) == 0
        out = capsys.readouterr().out
        assert ("no verdict on quality" in out) is quick and "2.100 (1.050)" in out


def test_diloco_end_to_end(tmp_path):
    out = tmp_path / "d.json"
    methods = "fp16,diloco-H4-int4,diloco-H4-F2-d1,diloco-H4-topk-0.05"
    proc = _run_bench(tmp_path, "--methods", methods, "--steps", "12", "--start-iter", "3", "--eval-every", "4",
                      "--eval-batches", "4", "--outer-lr", "0.5", "--json", str(out))
    recs = {r["method"]: r for r in json.loads(out.read_text())}
    plain, fp16 = recs["allreduce"], recs["fp16"]
    # fp16 trains plainly through the same warm-up: the same losses until its first compressed step counts.
    assert fp16["loss_per_step"][:4] == plain["loss_per_step"][:4]
    for name in ("diloco-H4-int4", "diloco-H4-F2-d1", "diloco-H4-topk-0.05"):
        r = recs[name]
        for k in RECORD_KEYS + SEED_KEYS:
            assert k in r, (name, k)
        assert r["entry"] == "diloco" and r["optimizer_class"] == "DiLoCo(AdamW)"
        assert (r["diloco_outer_lr"], r["diloco_outer_momentum"]) == (0.5, 0.9)
        assert r["params_identical"] is True  # every rank holds the same anchor
        assert [s for s, _ in r["eval_loss_curve"]] == [4, 8, 12] and math.isfinite(r["final_loss"])
        assert r["step_time_mean_s"] > 0 and r["diloco_memory_bytes"] > 0
        assert 0 < r["diloco_bytes_per_step"] < plain["bytes_sent_per_rank_per_step"]
    # 9 DiLoCo steps after the 3 warm-up ones: syncs at its steps 4 and 8 (H=4); F=2: a fragment every 2 steps.
    assert recs["diloco-H4-int4"]["per_seed"][0]["diloco_syncs"] == 2
    assert recs["diloco-H4-F2-d1"]["per_seed"][0]["diloco_syncs"] == 4
    # int4 sends about an eighth of the exact average's bytes per sync (float32 -> 4 bits and scales).
    exact_sync = recs["diloco-H4-F2-d1"]["diloco_bytes_per_sync"]
    assert recs["diloco-H4-int4"]["diloco_bytes_per_sync"] < exact_sync / 6
    # top-k at 5%: int32 index + float32 value per kept entry, gathered from both ranks.
    assert recs["diloco-H4-topk-0.05"]["diloco_bytes_per_sync"] < exact_sync / 4
    assert recs["diloco-H4-topk-0.05"]["per_seed"][0]["diloco_syncs"] == 2
    assert "MB/step measured (" in proc.stdout and "MB by DiLoCo.bytes_per_step" in proc.stdout
    assert "no verdict" not in proc.stdout
    # One step time per row: a DiLoCo row's is its mean, and its speedup is against plain's mean.
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| diloco-H4-int4 "))
    mean_ms = recs["diloco-H4-int4"]["step_time_mean_s"] * 1e3
    assert f"| {mean_ms:.0f} mean (" in row, row
    assert recs["diloco-H4-int4"]["speedup_vs_allreduce"] == pytest.approx(
        plain["step_time_mean_s"] / recs["diloco-H4-int4"]["step_time_mean_s"])
    assert "mean step" not in proc.stdout  # no second step time in the DiLoCo lines
    # The harness's diloco-*-int4 keeps residuals (its names: on unless -noef), where DiLoCo() defaults off.
    assert "diloco-H4-int4 (unshaped, error feedback on)" in proc.stdout


def test_time_only_trains_nothing(tmp_path):
    out = tmp_path / "t.json"
    _run_bench(tmp_path, "--methods", "int8", "--time-only", "--time-steps", "3", "--json", str(out))
    recs = json.loads(out.read_text())
    assert [r["method"] for r in recs] == ["allreduce", "int8"]
    assert all(not r["training_run"] and r["steps"] == 2 + 3 and "loss_per_step" not in r for r in recs)
    assert all(r["step_time_mean_s"] > 0 for r in recs)


def test_small_tensor_workload_runs(tmp_path):
    out = tmp_path / "m.json"
    cmd = [sys.executable, "-m", "pycomm_bench", "ddp", "--workload", "mlp", "--ranks", "2", "--bandwidth", "none",
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
    from pycomm_bench import all as bench_all

    parser = build_parser()
    for _, argv in bench_all.PARTS:
        args = parser.parse_args(argv + ["--quick"])
        args._module.resolve_args(args)  # every part's own checks accept it
    with pytest.raises(ValueError, match="--json"):
        bench_all.resolve_args(parser.parse_args(["all", "--json", "x.json"]))
