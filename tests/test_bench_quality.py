"""``pycomm-bench quality``: the study's plan (grid first, DiLoCo after
plain's winner, seeds at the winner), its report, the held-out text split
and the warm-up cosine, and a miniature study end to end that resumes
without rerunning what it has."""

import json
import os
import math
import subprocess
import sys

import pytest
from _dist import subprocess_env

from pycomm_bench import models, quality
from pycomm_bench.netem import emulation_available
from pycomm_bench.quality import Arm, pending, run_id, summarize
from pycomm_bench.sweep import LR_FLOOR, lr_at

LRS = (1e-3, 2e-3)
GRID = {"adamw": LRS}
OUTER = ((0.7, 0.9), (1.0, 0.5))


def _run(arm, setting, seed, loss, sent=1000.0, curve=None):
    return run_id(arm, setting, seed), {
        "seed": seed, "final_loss": loss, "optimizer": "adamw", "steps": 10, "tokens_per_step": 64,
        "batch_size": arm.batch_size or 4,
        "tokens_per_rank_per_step": 16, "model": "tiny", "gradient_numel": 5,
        "bytes_sent_per_rank_per_step_all_steps": sent + 300.0, "bytes_sent_per_rank_per_step": sent,
        "step_time_mean_s": 0.1, "start_iter": 2,
        "eval_loss_curve": curve or [[0, 5.0], [8, 4.0], [10, loss]]}


def test_plan_runs_the_grid_then_the_winner_on_every_seed():
    plain, dil = Arm("allreduce"), Arm("diloco-H16")
    # Nothing yet: plain's grid; DiLoCo waits for plain's best lr.
    assert pending([plain, dil], {}, [0, 1, 2], GRID, OUTER) == [(plain, {"lr": lr}, 0) for lr in LRS]
    runs = dict([_run(plain, {"lr": 1e-3}, 0, 2.0), _run(plain, {"lr": 2e-3}, 0, 1.9)])
    todo = pending([plain, dil], runs, [0, 1, 2], GRID, OUTER)
    # plain's winner (lr 2e-3) on seeds 1 and 2; DiLoCo's outer grid at that lr / sqrt(4 replicas).
    assert todo == ([(plain, {"lr": 2e-3}, s) for s in (1, 2)] +
                    [(dil, {"lr": 1e-3, "outer_lr": a, "outer_momentum": m}, 0) for a, m in OUTER])


def test_report_compares_each_seed_with_plain_of_the_same_seed_and_ranks():
    plain, int8, one = Arm("allreduce"), Arm("int8"), Arm("allreduce", 1)
    sgd, sgd_int8 = Arm("allreduce", 4, "sgd"), Arm("int8", 4, "sgd")
    # One rank at the 4-rank arms' global batch: its own plain, not the 1-rank plain of the regime's batch.
    one_b16, int8_b16 = Arm("allreduce", 1, batch_size=16), Arm("int8", 1, batch_size=16)
    runs = {}
    for arm, losses in ((plain, (2.0, 1.9, 2.0, 2.2)), (int8, (2.1, 2.2, 2.1, 2.2)), (one, (3.0, 3.0, 3.0, 3.0)),
                        (sgd, (4.0, 4.0, 4.0, 4.0)), (sgd_int8, (4.4, 5.0, 4.4, 4.4)),
                        (one_b16, (2.5, 2.5, 2.5, 2.5)), (int8_b16, (2.75, 2.75, 2.75, 2.75))):
        for lr, loss in zip(LRS, losses[:2]):
            runs.update([_run(arm, {"lr": lr}, 0, loss, sent=100.0 if arm == int8 else 400.0)])
        best = {"lr": LRS[0]} if losses[0] < losses[1] else {"lr": LRS[1]}
        for seed, loss in zip((1, 2), losses[2:]):
            runs.update([_run(arm, best, seed, loss, sent=100.0 if arm == int8 else 400.0)])
    recs = {r["arm"]: r for r in summarize([plain, int8, one, sgd, sgd_int8, one_b16, int8_b16], runs, [0, 1, 2],
                                           {"adamw": LRS, "sgd": LRS}, OUTER)}
    p, q = recs["4r-allreduce"], recs["4r-int8"]
    assert p["winner"] == {"lr": 2e-3} and q["winner"] == {"lr": 1e-3}
    assert p["final_loss_per_seed"] == [1.9, 2.0, 2.2] and p["final_loss_vs_allreduce_mean"] == 1.0
    # int8's seed 0 (2.1) against plain's seed 0 (1.9), and so on: not against plain's mean.
    assert q["final_loss_vs_allreduce_per_seed"] == pytest.approx([2.1 / 1.9, 2.1 / 2.0, 2.2 / 2.2])
    # After the warm-up int8 sends a quarter; over every step the warm-up (300 each) weighs in.
    assert q["bytes_vs_allreduce"] == pytest.approx(4.0) and q["bytes_vs_allreduce_all_steps"] == pytest.approx(1.75)
    assert q["winner_at_grid_edge"]
    assert recs["1r-allreduce"]["final_loss_vs_allreduce_mean"] == 1.0  # its own ranks' plain
    assert recs["4r-int8-sgd"]["final_loss_vs_allreduce_mean"] == pytest.approx(1.1)  # against SGD's plain
    assert recs["1r-b16-int8"]["final_loss_vs_allreduce_mean"] == pytest.approx(1.1)  # against its batch's plain
    assert recs["1r-b16-int8"]["global_batch"] == recs["4r-int8"]["global_batch"] == 16
    assert p["eval_loss_change_last_quarter"] == pytest.approx((1.9 + 2.0 + 2.2) / 3 / 4.0 - 1)  # step 8 -> 10
    assert "+5.18%" in quality.format_summary(list(recs.values())[:3], 3)  # int8: mean of the per-seed ratios


def test_a_diverged_run_is_recorded_and_loses_without_breaking_the_report(tmp_path):
    # A run whose loss went non-finite is written as strict JSON (nulls), marked diverged.
    rec = quality.clean(dict(final_loss=float("nan"), eval_loss_curve=[[0, 5.0], [10, float("inf")]], ok=1.5))
    assert rec == {"final_loss": None, "eval_loss_curve": [[0, 5.0], [10, None]], "ok": 1.5}
    plain, sgd = Arm("allreduce", 4, "sgd"), Arm("onebit", 4, "sgd")
    runs = {}
    for lr, loss in zip(LRS, (2.0, 2.1)):
        runs.update([_run(plain, {"lr": lr}, 0, loss)])
    runs.update([_run(plain, {"lr": LRS[0]}, 1, 2.0)])
    runs.update([_run(sgd, {"lr": LRS[0]}, 0, None), _run(sgd, {"lr": LRS[1]}, 0, 2.5)])
    # The diverged setting loses the grid; the winner then diverges on seed 1.
    assert quality.winner(sgd, runs, [{"lr": lr} for lr in LRS], 0) == {"lr": LRS[1]}
    runs.update([_run(sgd, {"lr": LRS[1]}, 1, None)])
    recs = {r["arm"]: r for r in summarize([plain, sgd], runs, [0, 1], {"sgd": LRS}, OUTER)}
    r = recs["4r-onebit-sgd"]
    assert r["diverged_seeds"] == [1] and r["final_loss_per_seed"] == [2.5, None]
    assert r["final_loss_mean"] is None and r["final_loss_vs_allreduce_mean"] is None
    assert "diverged (seed 1)" in quality.format_summary([r], 2)
    path = tmp_path / "doc.json"
    quality.write_json(str(path), recs)  # strict JSON: no NaN anywhere
    assert json.loads(path.read_text())["4r-onebit-sgd"]["diverged_seeds"] == [1]


def test_time_to_plain_loss_on_a_link():
    # plain: 1.0 s per step at this link; a method twice as fast per step after 10 exact steps.
    plain = {"arm": "allreduce", "method": "allreduce", "ranks": 4, "optimizer": "adamw", "steps": 100, "exact_steps": 10, "final_loss_mean": 2.0,
             "eval_loss_curve": [[0, 5.0], [50, 3.0], [100, 2.0]]}
    fast = dict(plain, arm="int8", method="int8", final_loss_mean=1.9, eval_loss_curve=[[0, 5.0], [50, 2.5], [100, 1.9]])
    slow = dict(plain, arm="diloco-H16", method="diloco-H16", final_loss_mean=2.5, eval_loss_curve=[[0, 5.0], [50, 3.5], [100, 2.5]])
    # At 2 ranks, plain and int8 against 2-rank plain (timed at 0.5 s), not the 4-rank one.
    other, sgd = dict(plain, arm="2r-allreduce", ranks=2), dict(plain, arm="4r-sgd", optimizer="sgd")
    fast2 = dict(fast, arm="2r-int8", ranks=2)
    quality.add_time_to_loss([plain, fast, slow, other, fast2, sgd], {"100mbit": {
        4: {"allreduce": 1.0, "int8": 0.5, "diloco-H16": 0.1}, 2: {"allreduce": 0.5, "int8": 0.25}}})
    assert plain["links"]["100mbit"]["time_to_allreduce_final_s"] == pytest.approx(100.0)
    # int8 reaches 2.0 at step 50 + 0.5/0.6 * 50 = 91.67: 10 s of exact steps, 81.67 steps at 0.5 s.
    f = fast["links"]["100mbit"]
    assert f["time_to_allreduce_final_s"] == pytest.approx(10 + 81.666667 * 0.5)
    assert f["allreduce_time_over_method_time"] == pytest.approx(100 / (10 + 81.666667 * 0.5))
    # DiLoCo never gets to 2.0: plain reaches DiLoCo's 2.5 at step 75, 75 s, against DiLoCo's 19 s run.
    s = slow["links"]["100mbit"]
    assert "time_to_allreduce_final_s" not in s and s["allreduce_time_to_method_final_s"] == pytest.approx(75.0)
    assert s["allreduce_time_over_method_time"] == pytest.approx(75.0 / 19.0)
    assert other["links"]["100mbit"]["time_to_allreduce_final_s"] == pytest.approx(50.0)
    assert fast2["links"]["100mbit"]["allreduce_time_over_method_time"] == pytest.approx(
        f["allreduce_time_over_method_time"])  # both halved: the same ratio
    assert "links" not in sgd  # only the AdamW arms at the regime's batch are timed
    assert "2r-int8" in quality.format_links([fast2])
    assert "never reaches it" in quality.format_links([slow]) and "faster than allreduce" in quality.format_links([fast])
    assert "(the reference)" in quality.format_links([plain]) and "faster" not in quality.format_links([plain])


def test_link_timings_are_named_by_link_and_rank_count(tmp_path):
    for link, ranks, t in (("100mbit", 4, 1.0), ("100mbit", 2, 0.5), ("1gbit", 2, 0.1)):
        path = quality.links_path(str(tmp_path), link, ranks)
        with open(path, "w") as fh:
            json.dump([{"method": "allreduce", "step_time_mean_s": t}], fh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["100mbit-2ranks.json", "100mbit.json", "1gbit-2ranks.json"]
    assert quality.timed_links(str(tmp_path)) == {"100mbit": {2: {"allreduce": 0.5}, 4: {"allreduce": 1.0}},
                                                  "1gbit": {2: {"allreduce": 0.1}}}
    assert quality.link_times(str(tmp_path), "1gbit") == {}


def test_heldout_text_is_never_trained_on():
    text = models.stdlib_text(8, 200_000)
    cut = len(text) - int(0.1 * len(text))
    train = models.text_batch_fn(8, 64, 0, n_files=8, max_bytes=200_000, heldout=0.1)
    held = models.text_batch_fn(8, 64, 0, n_files=8, max_bytes=200_000, heldout=0.1, split="heldout")
    for rank in range(4):
        for x, _ in (train(rank, 3), ):
            assert all(bytes(row.tolist()) in text[:cut] for row in x)
        x, y = held(rank, 0)
        assert all(bytes(row.tolist()) in text[cut:] for row in x)
        assert all(bytes(row.tolist()) in text[cut:] for row in y)
    with pytest.raises(ValueError, match="split='heldout' needs heldout > 0"):
        models.text_batch_fn(2, 8, split="heldout")
    with pytest.raises(ValueError, match="heldout must be in"):
        models.text_batch_fn(2, 8, heldout=1.0)


def test_warmup_cosine_rises_then_falls_to_its_floor():
    lrs = [lr_at(2.0, s, 100, "warmup-cosine", warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.2) and lrs[9] == pytest.approx(2.0)
    assert lrs[10] == pytest.approx(2.0) and all(a > b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(2.0 * LR_FLOOR)


@pytest.mark.parametrize("argv, words", [
    (["--arms", "nope"], "--arms: unknown arm 'nope'"),
    (["--lrs", "0"], "--lrs"),
    (["--outer", "0.7"], "--outer"),
    (["--outer", "0.7:1"], "--outer"),
    (["--repeats", "2"], "--repeats"),
    (["--links", "none"], "--links none"),
    (["--links", "fast"], "--links fast"),
    (["--quick", "--steps", "100"], "--steps"),
])
def test_bad_arguments_are_named(argv, words):
    from pycomm_bench.cli import build_parser

    with pytest.raises(ValueError) as e:
        quality.resolve_args(build_parser().parse_args(["quality", *argv]))
    assert words in str(e.value)


def test_a_longer_study_keeps_the_regime_in_proportion_and_its_own_folder():
    from pycomm_bench.cli import build_parser

    args = quality.resolve_args(build_parser().parse_args(["quality", "--steps", "3000"]))
    r = args.regime
    assert r["steps"] == 3000 and r["lr_warmup"] == r["start_iter"] == 3 * quality.REGIME["lr_warmup"]
    assert r["eval_every"] == 3 * quality.REGIME["eval_every"]
    assert {k: v for k, v in r.items() if k not in ("steps", "lr_warmup", "start_iter", "eval_every")} == \
        {k: v for k, v in quality.REGIME.items() if k not in ("steps", "lr_warmup", "start_iter", "eval_every")}
    assert args.out.endswith(os.path.join("quality", "runs-3000steps"))
    assert args.json.endswith(os.path.join("quality", "summary-3000steps.json"))
    assert quality.resolve_args(build_parser().parse_args(["quality"])).regime == quality.REGIME


def test_miniature_study_end_to_end_and_resumes(tmp_path):
    out, doc = tmp_path / "q", tmp_path / "q.json"
    cmd = [sys.executable, "-m", "pycomm_bench", "quality", "--quick", "--arms", "1r-allreduce", "1r-diloco-H16",
           "--lrs", "1e-3", "2e-3", "--outer", "0.7:0.9", "--seeds", "2", "--out", str(out), "--json", str(doc),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    # plain: 2 lrs on seed 0, its winner on seed 1; DiLoCo: 1 outer setting on seed 0, then seed 1.
    assert len(files) == 5 and sum(f.startswith("1r-diloco-H16-") for f in files) == 2, files
    summary = json.loads(doc.read_text())
    assert summary["runs_known_left"] == 0 and summary["regime"] == quality.QUICK_REGIME
    arms = {r["arm"]: r for r in summary["arms"]}
    d = arms["1r-diloco-H16"]
    for k in ("ranks", "steps", "tokens_per_step", "seeds", "final_loss_vs_allreduce_mean", "grid", "winner",
              "eval_loss_curve"):
        assert d[k] is not None, k
    assert d["bytes_sent_per_rank_per_step"] is None  # one rank sends nothing
    assert d["ranks"] == 1 and d["seeds"] == [0, 1] and d["winner"]["lr"] == arms["1r-allreduce"]["winner"]["lr"]
    assert d["tokens_per_step"] == quality.QUICK_REGIME["batch_size"] * quality.QUICK_REGIME["seq_len"]
    rec = json.loads((out / files[0]).read_text())
    assert rec["heldout"] == 0.1 and rec["lr_schedule"] == "warmup-cosine" and rec["lr_warmup"] == 2
    # A second sitting finds every run done: nothing is trained again.
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "[quality] 1r-" not in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


@pytest.mark.skipif(not emulation_available()[0], reason="no network namespaces here (root and iproute2)")
def test_links_put_the_curves_on_an_emulated_clock(tmp_path):
    out, doc = tmp_path / "q", tmp_path / "q.json"
    base = [sys.executable, "-m", "pycomm_bench", "quality", "--quick", "--arms", "allreduce", "int8",
            "--lrs", "2e-3", "--seeds", "1", "--out", str(out), "--json", str(doc), "--no-progress"]
    proc = subprocess.run(base + ["--links", "100mbit", "--time-steps", "4"], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timed = json.loads((out / "links" / "100mbit.json").read_text())
    assert {r["method"] for r in timed} == {"allreduce", "int8"} and all(r["emulated"] for r in timed)
    arms = {r["method"]: r for r in json.loads(doc.read_text())["arms"]}
    link = arms["allreduce"]["links"]["100mbit"]
    assert link["step_time_mean_s"] > 0 and link["time_to_allreduce_final_s"] == pytest.approx(link["run_s"])
    assert "100mbit" in arms["int8"]["links"] and "to allreduce's final held-out loss" in proc.stdout
    assert (tmp_path / "q-seconds.png").exists()


def _children(pid):
    """The processes whose parent is ``pid`` (Linux /proc)."""
    import os

    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    # The parent's pid is the second field after the name, which may hold spaces.
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # ended while read
    return kids


def test_torchft_diloco_trains_in_the_quick_regime_and_leaves_nothing_behind(tmp_path):
    import importlib.metadata
    import os

    pytest.importorskip("torchft")
    from pycomm.distributed import spec

    arm = Arm("torchft-diloco-H16", 2)
    assert arm.diloco and arm in quality.ARMS and arm.name == "2r-torchft-diloco-H16"
    setting = {"lr": 2e-3, "outer_lr": 1.0, "outer_momentum": 0.5}
    before = set(_children(os.getpid()))
    rec = quality.run_one(arm, setting, 0, quality.QUICK_REGIME, str(tmp_path))
    assert set(_children(os.getpid())) <= before  # ranks gone; the lighthouse lived in rank 0
    assert (tmp_path / f"{run_id(arm, setting, 0)}.json").exists()
    curve = [v for _, v in rec["eval_loss_curve"]]
    assert all(map(math.isfinite, curve)) and curve[-1] < curve[0], curve  # it trains
    # 20 steps after the warm-up: one sync of 16, committed.
    assert rec["entry"] == "torchft" and rec["per_seed"][0]["diloco_syncs"] == 1
    # The same formula as pycomm's DiLoCo: an exact float32 all-reduce of the model every H steps.
    assert rec["diloco_bytes_per_step"] == spec.wire_bytes("none", rec["gradient_numel"], 2) / 16
    assert rec["bytes_sent_per_rank_per_step"] > 0  # measured on loopback, as every run
    assert rec["torchft_version"] == importlib.metadata.version("torchft") and rec["torchft_quantize"] is False
    assert rec["params_identical"]  # every replica holds the same anchor after the sync


def test_against_torchft_names_each_target_and_the_step_times_side_by_side():
    def arm(name, loss, sent, ms):
        return dict(arm=f"4r-{name}", method=name, ranks=4, batch_size=4, seeds=[0, 1], final_loss_per_seed=[loss, loss],
                    final_loss_mean=loss, final_loss_min=loss, final_loss_max=loss, diloco_bytes_per_step=sent,
                    bytes_sent_per_rank_per_step=sent, links={"100mbit": {"step_time_mean_s": ms / 1e3}})
    rows = quality.against_torchft([arm("torchft-diloco-H16", 2.0, 800.0, 120), arm("diloco-H16", 2.0, 800.0, 100),
                                    arm("diloco-H16-int4", 2.02, 100.0, 130)])
    assert [(c["arm"], [t["met"] for t in c["targets"]]) for c in rows] == [
        ("4r-diloco-H16", [True, True]), ("4r-diloco-H16-int4", [False, False])]  # +1% loss; a slower step
    text = quality.format_against_torchft(rows)
    assert "100mbit 100 (120)" in text and "100mbit 130 (120)" in text and "NOT met" in text
