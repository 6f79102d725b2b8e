"""Smoke tests of ``pycomm-bench allreduce``: it runs on 2 local ranks, writes
complete JSON, verifies before timing, counts bytes as docs/allreduce.md
says, and refuses bad arguments by name. No timing assertions: the machine is
shared, only the presence and sanity of numbers is checked."""

import json
import math
import subprocess
import sys

import pytest
from _dist import subprocess_env

from pycomm_bench import allreduce
from pycomm_bench.allreduce import bytes_sent, parse_method
from pycomm_bench.cli import main





def _positive_finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_allreduce_quick_runs_and_writes_json(tmp_path):
    out = tmp_path / "results" / "a.json"  # the folder does not exist yet
    cmd = [sys.executable, "-m", "pycomm_bench", "allreduce", "--quick", "--ranks", "2", "--sizes", "64k",
           "--repeats", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads(out.read_text())
    assert doc["ranks"] == [2] and doc["sizes"] == [65536] and doc["repeats"] == 2 and doc["quick"]
    assert doc["failures"] == []
    for key in ("node", "torch", "cpu_count"):
        assert key in doc["machine"]

    recs = {r["method"]: r for r in doc["records"]}
    assert len(recs) == len(doc["records"]) == len(allreduce.DEFAULT_METHODS)
    for name in allreduce.DEFAULT_METHODS:
        r = recs[name]
        assert r["status"] == "ok" and r["verified"] is True, r["error"]
        assert r["ranks"] == 2 and r["numel"] == 65536
        for key in ("median_s", "p10_s", "p90_s", "algbw_gbps", "bytes_sent", "speedup_vs_plain"):
            assert _positive_finite(r[key]), (name, key, r[key])
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert len(r["times_s"]) == 2
        if name == "plain":
            assert r["compress_median_s"] is None and r["wire_median_s"] is None
            continue
        assert r["bytes_sent"] < recs["plain"]["bytes_sent"], name
        assert r["chunk_numel"] > 0  # the backend's default, as it reports it
        for key in ("compress_median_s", "wire_median_s", "max_compress_wire_s", "sum_compress_wire_s",
                    "measured_vs_max"):
            assert _positive_finite(r[key]), (name, key, r[key])
        assert r["max_compress_wire_s"] <= r["sum_compress_wire_s"]

    # The table went to stdout, the progress bar to stderr; nothing under cwd
    # but what --json named.
    for word in ("meas/max", "compress ms", "wire ms", *allreduce.DEFAULT_METHODS):
        assert word in proc.stdout
    assert str(out) in proc.stdout
    assert not (tmp_path / "benchmarks").exists()


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "1"], "--ranks"),
        (["--ranks", "two"], "--ranks"),
        (["--methods", "bogus"], "--methods"),
        (["--methods", "topk-0"], "--methods"),
        (["--sizes", "0"], "--sizes"),
        (["--chunk-numel", "0"], "--chunk-numel"),
        (["--timeout", "-1"], "--timeout"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_argument_is_named(argv, name, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["allreduce", *argv, "--json", str(tmp_path / "never.json")])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert name in err, err
    assert not (tmp_path / "never.json").exists()


def test_bad_argument_from_the_command_line(tmp_path):
    # The same through the real entry point: exit status and message on stderr.
    cmd = [sys.executable, "-m", "pycomm_bench", "allreduce", "--methods", "bogus"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--methods" in proc.stderr and "bogus" in proc.stderr


def test_bytes_follow_the_algorithms():
    n, mi = 1 << 22, 1 << 20
    for w in (2, 3, 4, 8):
        plain = bytes_sent(parse_method("plain"), n, w, mi)
        assert plain == 2 * (w - 1) * 4 * n // w  # ring all-reduce of float32
        assert bytes_sent(parse_method("fp16"), n, w, mi) == plain // 2
        # onebit: about 2 n / 8 bytes (signs twice) plus the scales, for any W.
        onebit = bytes_sent(parse_method("onebit"), n, w, mi)
        signs = 2 * (w - 1) * n // (8 * w)
        assert signs < onebit < 1.1 * (2 * n / 8)
        # topk: the padded 1 + 2 cap int32 buffer and the 2-word call tag of
        # each chunk to each of W-1 peers.
        k = math.ceil(0.01 * mi)
        per_chunk = 1 + 2 * (k + k // 4) + 2
        assert bytes_sent(parse_method("topk-0.01"), n, w, mi) == 4 * (n // mi) * (w - 1) * per_chunk
    # 2 (W-1) segment payloads of 8192 words + 128 scales, 4 bytes each, and
    # W-1 call tags of 2 words with the all-gathered server payloads.
    assert bytes_sent(parse_method("onebit"), 1 << 20, 4, 1 << 20) == (2 * 3 * (8192 + 128) + 3 * 2) * 4


def test_per_call_section_runs_one_rank_and_writes_json(tmp_path):
    # The engine's cost per call beside plain Gloo's: one rank allowed,
    # every method keyed, plus its ":queued" (async) variant.
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "pycomm_bench", "allreduce", "--per-call", "--ranks", "1", "--sizes", "1k",
           "--methods", "plain,onebit,topk-0.01", "--repeats", "2", "--calls", "5", "--warmup", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "allreduce-per-call" and doc["ranks"] == [1] and doc["failures"] == []
    recs = {r["method"]: r for r in doc["records"]}
    assert sorted(recs) == ["onebit", "onebit:queued", "plain", "topk-0.01", "topk-0.01:queued"]
    for name, r in recs.items():
        assert r["numel"] == 1024 and r["calls"] == 5 and len(r["per_call_s"]) == 2
        assert _positive_finite(r["median_s"]) and _positive_finite(r["vs_plain"]), (name, r)
    assert recs["plain"]["vs_plain"] == 1.0
    assert "us/call" in proc.stdout and "onebit:queued" in proc.stdout


def test_per_call_defaults_and_refusals(tmp_path):
    args = allreduce.make_args(per_call=True)
    assert args.ranks == [1] and args.sizes == [1024, 65536, 25 * 2 ** 20 // 4] and args.calls == 200
    assert "plain" in args.methods and args.json.endswith("per-call/cpu-1rank.json")
    with pytest.raises(ValueError, match="between 2 and"):
        allreduce.make_args(ranks="1")  # one rank only for the per-call section
    with pytest.raises(ValueError, match="calls"):
        allreduce.make_args(per_call=True, calls=0)


def test_defaults_and_quick():
    args = allreduce.make_args()
    assert args.ranks == [2, 4] and args.sizes == [1 << 20, 1 << 22, 1 << 24, 1 << 26]
    assert args.methods == list(allreduce.DEFAULT_METHODS) and args.chunk_numel is None
    quick = allreduce.make_args(quick=True)
    assert quick.ranks == [2] and quick.sizes == [1 << 20, 1 << 22]
    assert quick.repeats < args.repeats and quick.json.endswith("-quick.json")
    assert allreduce.make_args(ranks="2, 4", sizes=["64k", "1M"]).sizes == [65536, 1 << 20]


# Runs in the rank processes (so module level): rank 1's onebit result is
# off by one element, which only the cross-rank check can catch.
def _rank_with_wrong_onebit(rank):
    import pycomm.distributed as pd

    real = pd.all_reduce

    def wrong(tensor, key=None, group=None, op="sum", async_op=False):
        real(tensor, key=key, group=group, op=op, async_op=async_op)
        if rank.rank == 1 and pd.options_of(group)["method"] == "onebit":
            tensor[7] += 1.0

    pd.all_reduce = wrong
    allreduce._rank_main(rank)


def test_failed_verification_is_reported_not_timed(monkeypatch):
    monkeypatch.setattr(allreduce, "_rank_main", _rank_with_wrong_onebit)
    doc = allreduce.run_allreduce(allreduce.make_args(ranks="2", sizes="64k", methods="plain,onebit",
                                                      repeats=1, warmup=0, timeout=30))
    by = {r["method"]: r for r in doc["records"]}
    assert by["onebit"]["status"] == "verify_failed" and by["onebit"]["verified"] is False
    assert "differ between ranks" in by["onebit"]["error"]
    assert by["onebit"]["median_s"] is None and by["onebit"]["compress_median_s"] is None
    assert by["plain"]["status"] == "ok" and by["plain"]["median_s"] > 0
    assert allreduce.failed(doc) and "VERIFY FAILED" in allreduce.format_table(doc)


def test_the_engine_benchmark_ships_its_result_with_the_package(tmp_path, monkeypatch):
    # pycomm plan reads the shipped copy where no benchmarks/results exists
    # (an installed wheel): the run replaces the older file of its device.
    import json

    import pycomm.plan
    from pycomm_bench import engine_cuda

    shipped = tmp_path / "pycomm" / "measurements"
    shipped.mkdir(parents=True)
    (shipped / "allreduce-cuda-gpu9-2026-01-01.json").write_text("{}")
    (shipped / "allreduce-cpu-x-2026-01-01.json").write_text("{}")
    monkeypatch.setattr(pycomm.plan, "MEASUREMENTS_DIR", str(shipped))
    assert engine_cuda.ship({"a": 1}, "benchmarks/results/allreduce-cuda-gpu9-2026-12-04.json") is None  # no tree
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    out = engine_cuda.ship({"a": 1}, "benchmarks/results/allreduce-cuda-gpu9-2026-12-04.json")
    assert sorted(p.name for p in shipped.iterdir()) == ["allreduce-cpu-x-2026-01-01.json",
                                                          "allreduce-cuda-gpu9-2026-12-04.json"]
    assert json.loads(open(out).read()) == {"a": 1}
    # a record under its stable name ships under the device's name
    out = engine_cuda.ship({"b": 2}, "benchmarks/results/allreduce/cuda-gpu9.json")
    assert sorted(p.name for p in shipped.iterdir()) == ["allreduce-cpu-x-2026-01-01.json", "allreduce-cuda-gpu9.json"]
    assert json.loads(open(out).read()) == {"b": 2}
    # the GPU check's engine.json ships under its GPU's name
    out = engine_cuda.ship({"gpu": "GPU 9"}, "/tmp/out/engine.json")
    assert sorted(p.name for p in shipped.iterdir()) == ["allreduce-cpu-x-2026-01-01.json", "allreduce-cuda-gpu-9.json"]
