"""``pycomm-bench fsdp``: argument checks by name, ratios and the table from
records, and one tiny end-to-end run (2 ranks on loopback, the tiny GPT)
whose JSON must hold every field the records promise. No timing
assertions: the machine is shared."""

import json
import math
import subprocess
import sys

import pytest
from _dist import subprocess_env

from pycomm_bench import fsdp
from pycomm_bench.cli import build_parser

RECORD_KEYS = (
    "method", "ranks", "bandwidth", "link_busbw_measured", "emulated", "steps", "timed_from", "timed_steps",
    "step_time_median_s", "step_time_p10_s", "step_time_p90_s", "step_time_vs_plain", "step_time_vs_bf16",
    "speedup_vs_plain", "bytes_sent_per_rank_per_step", "bytes_sent_per_rank_per_step_all_steps",
    "peak_rss_bytes", "peak_rss_increase_bytes", "memory_measure", "final_loss", "final_loss_std",
    "final_loss_per_seed", "final_loss_vs_plain_per_seed", "final_loss_vs_plain_mean", "train_loss_last",
    "seeds", "per_seed", "loss_per_step", "step_times_s", "tokens_per_s", "compressor", "weights",
    "reduce_dtype", "error_feedback", "parameters", "optimizer", "lr", "lr_schedule",
    "residual_bytes",
)


def _args(*argv):
    return fsdp.resolve_args(build_parser().parse_args(["fsdp", *argv]))


def test_defaults():
    a = _args()
    assert a.methods == ["plain", "bf16", "int8", "int4", "int8-weights"] and a.ranks == 4
    assert a.bandwidth == ["1gbit"] and a.rates == [1e9] and a.steps == fsdp.DEFAULT_STEPS
    q = _args("--quick")
    assert q.steps < a.steps and q.json.endswith("-quick.json") and q.json.endswith("fsdp/cpu-4ranks-quick.json")
    assert _args("--methods", "int4").methods == ["plain", "int4"]  # the baseline always runs


@pytest.mark.parametrize("argv, words", [
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--bandwidth", "1gbit,1G"], "repeated"),
    (["--methods", "int8,zstd"], "--methods"),
    (["--methods", "int8,int8"], "repeated"),
    (["--ranks", "1"], "--ranks"),
    (["--no-netns", "--bandwidth", "1gbit"], "--no-netns"),
    (["--repeats", "3"], "--repeats"),
    (["--steps", "3", "--warmup", "2"], "--steps"),
    # ddp's suffix, which restates pycomm.fsdp's default: refused, saying what to write
    (["--methods", "int4-noef"], "error feedback is off by default in pycomm-bench fsdp: write 'int4' (-ef turns it on)"),
])
def test_bad_arguments_are_named(argv, words):
    with pytest.raises(ValueError) as e:
        _args(*argv)
    assert words in str(e.value)


def test_cli_refuses_bad_argument_by_name(capsys):
    from pycomm_bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["fsdp", "--methods", "int16", "--json", "/nonexistent/never.json"])
    assert e.value.code == 2 and "--methods" in capsys.readouterr().err


def test_ratios_and_table():
    def rec(method, t, losses):
        r = dict(method=method, bandwidth=1e9, seed=0, timed_from=1, step_times_s=[9.0, t, t],
                 loss_per_step=[3.0, 2.0, 1.0], train_loss_last=1.0, bytes_sent_per_rank_per_step=1e6,
                 bytes_sent_per_rank_per_step_all_steps=1e6, peak_rss_bytes=2**30, peak_rss_increase_bytes=2**20,
                 memory_measure="VmHWM")
        return fsdp.combine_seeds([dict(r, seed=s, final_loss=l) for s, l in enumerate(losses)])

    recs = [rec("plain", 0.4, [2.0, 3.0]), rec("bf16", 0.2, [2.0, 3.0]), rec("int8", 0.1, [2.2, 3.0])]
    fsdp.add_ratios(recs)
    int8 = recs[2]
    assert int8["seeds"] == [0, 1] and int8["timed_steps"] == 4 and int8["step_time_median_s"] == 0.1
    assert int8["step_time_vs_plain"] == pytest.approx(0.25) and int8["step_time_vs_bf16"] == pytest.approx(0.5)
    assert int8["speedup_vs_plain"] == pytest.approx(4.0)
    assert int8["final_loss_vs_plain_per_seed"] == pytest.approx([1.1, 1.0])
    assert int8["final_loss"] == pytest.approx(2.6) and int8["final_loss_std"] > 0
    lines = {line.split("|")[1].strip(): line for line in fsdp.format_table(recs).splitlines()
             if line.startswith("| ")}
    assert "0.25" in lines["int8"] and "0.50" in lines["int8"] and "(1.050)" in lines["int8"]
    assert "1024 (+1)" in lines["int8"]


def test_end_to_end_tiny_run(tmp_path):
    out = tmp_path / "r" / "f.json"
    methods = "plain,bf16,int8-weights,int4-ef"
    cmd = [sys.executable, "-m", "pycomm_bench", "fsdp", "--ranks", "2", "--model", "tiny", "--bandwidth", "none",
           "--no-netns", "--no-progress", "--methods", methods, "--steps", "4", "--warmup", "1",
           "--eval-batches", "2", "--min-compress-numel", "1", "--lr-schedule", "cosine", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [r["method"] for r in recs] == methods.split(",")
    for r in recs:
        for k in RECORD_KEYS:
            assert k in r, (r["method"], k)
        assert r["ranks"] == 2 and r["bandwidth"] is None and r["emulated"] is False and r["seeds"] == [0]
        assert r["steps"] == 4 and r["timed_steps"] == 3 and len(r["loss_per_step"]) == 4
        assert 0 < r["step_time_p10_s"] <= r["step_time_median_s"] <= r["step_time_p90_s"]
        assert math.isfinite(r["final_loss"]) and r["final_loss"] > 0
        assert r["bytes_sent_per_rank_per_step"] > 0 and r["peak_rss_bytes"] > 0
        # the whole (unsharded) model: the tiny GPT with --seq-len's 64 positions instead of its 32
        assert r["optimizer"] == "adamw" and r["parameters"] == 42880 + 32 * (64 - 32)
        assert r["lr_schedule"] == "cosine"
    by = {r["method"]: r for r in recs}
    assert by["plain"]["step_time_vs_plain"] == 1.0 and by["bf16"]["step_time_vs_bf16"] == 1.0
    assert by["plain"]["final_loss_vs_plain_per_seed"] == [1.0]
    assert by["bf16"]["reduce_dtype"] == "bfloat16" and by["plain"]["compressor"] is None
    w = by["int8-weights"]
    assert (w["compressor"], w["weights"], w["error_feedback"]) == ("int8", "int8", False)
    # Error feedback: a float32 residual and its rollback buffer of each module's
    # unsharded gradient (padded to the ranks), nothing for the others.
    p = by["int4-ef"]["parameters"]
    assert 8 * p <= by["int4-ef"]["residual_bytes"] <= 8.1 * p and by["int4-ef"]["error_feedback"] is True
    assert by["plain"]["residual_bytes"] == by["int8-weights"]["residual_bytes"] == 0
    # int8 gradients and weights (every buffer compressed here) send far less than float32.
    assert w["bytes_sent_per_rank_per_step"] < 0.6 * by["plain"]["bytes_sent_per_rank_per_step"]
    assert "x plain" in proc.stdout and "int8-weights" in proc.stdout
    for kind in ("step-time", "loss-vs-steps", "loss-vs-seconds"):
        assert (tmp_path / "r" / f"f-{kind}.png").stat().st_size > 0, kind
