"""Smoke tests of ``pycomm-bench kernels``: it runs, writes complete JSON,
prints its table, and refuses bad arguments by name. No timing assertions:
the machine is shared, only the presence and sanity of numbers is checked."""

import json
import math
import os
import subprocess
import sys

import pytest
from _dist import subprocess_env
import torch

from pycomm.distributed import spec
from pycomm_bench import default_json_path, kernels
from pycomm_bench.cli import main, positive_int





def _positive_finite(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_kernels_quick_runs_and_writes_json(tmp_path):
    out = tmp_path / "results" / "k.json"  # the folder does not exist yet
    cmd = [sys.executable, "-m", "pycomm_bench", "kernels", "--quick", "--numel", "65536",
           "--repeats", "2", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads(out.read_text())
    assert doc["numel"] == 65536 and doc["repeats"] == 2 and doc["warmup"] == 1
    assert _positive_finite(doc["copy_gbps"])
    for key in ("node", "torch", "threads"):
        assert key in doc["machine"]

    rows = {(r["compressor"], r["op"], r["impl"]): r for r in doc["rows"]}
    assert len(rows) == len(doc["rows"]), "one row per (compressor, op, impl)"
    for case in kernels.CASES:
        impls = kernels.benchmarkable_impls(case.family, "cpu")
        assert "triton" not in impls  # the interpreter is never benchmarked
        sparse = spec.method_spec(case.family).kind == "sparse"
        expected = impls + kernels.peers(case.family) + ([kernels.TOPK_BASELINE] if sparse else [])
        for op in case.ops:
            for impl in expected:
                r = rows.get((case.label, op, impl))
                assert r is not None, f"no row for {case.label} {op} {impl}"
                assert r["status"] == "ok", r["error"]
                assert r["verified"] is (None if impl == kernels.TOPK_BASELINE else True)
                for key in ("median_s", "p10_s", "p90_s", "gbps", "pct_copy", "copy_gbps"):
                    assert _positive_finite(r[key]), (impl, key, r[key])
                # int8/int4 have no unfused peer to be compared with
                has_peer = kernels.PEER in kernels.peers(case.family)
                assert _positive_finite(r["speedup_vs_unfused"]) if has_peer else r["speedup_vs_unfused"] is None
                assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
                assert len(r["times_s"]) == 2
                if sparse:
                    assert r["k"] <= r["count"] <= r["k"] + r["k"] // 4
                    if impl != kernels.TOPK_BASELINE:
                        assert r["recall"] == 1.0  # randn: no ties, the exact top-k is kept

    # The table went to stdout, the progress bar to stderr.
    assert "x vs unfused" in proc.stdout and "% copy" in proc.stdout
    for case in kernels.CASES:
        assert case.label in proc.stdout
    assert str(out) in proc.stdout


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--numel", "0"], "--numel"),
        (["--numel", "lots"], "--numel"),
        (["--impls", "bogus"], "--impls"),
        (["--impls", "triton"], "--impls"),  # the interpreter on CPU is not a benchmark
        (["--repeats", "0"], "--repeats"),
        (["--warmup", "-1"], "--warmup"),
        (["--device", "tpu"], "--device"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_argument_is_named(argv, name, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["kernels", *argv, "--json", str(tmp_path / "never.json")])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert name in err, err
    assert not (tmp_path / "never.json").exists()


def test_missing_subcommand_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code != 0
    assert "COMMAND" in capsys.readouterr().err


def test_failed_verification_is_reported_not_timed(monkeypatch, tmp_path, capsys):
    # A peer that gets one sign bit wrong must be caught before it is timed.
    real = kernels.unfused_onebit_compress

    def wrong(grad, residual, block_size):
        bits, scales = real(grad, residual, block_size)
        bits = bits.clone()
        bits[0] ^= 1
        return bits, scales

    monkeypatch.setattr(kernels, "unfused_onebit_compress", wrong)
    out = tmp_path / "k.json"
    status = main(["kernels", "--numel", "4096", "--repeats", "1", "--warmup", "0",
                   "--impls", "reference", "--no-progress", "--json", str(out)])
    assert status == 1
    rows = json.loads(out.read_text())["rows"]
    by = {(r["compressor"], r["op"], r["impl"]): r for r in rows}
    bad = by[("onebit b=2048", "compress", kernels.PEER)]
    assert bad["status"] == "verify_failed" and bad["verified"] is False
    assert "bits" in bad["error"] and bad["median_s"] is None
    ref = by[("onebit b=2048", "compress", "reference")]
    assert ref["status"] == "ok" and ref["median_s"] > 0
    assert ref["speedup_vs_unfused"] is None  # nothing valid to compare against
    assert by[("onebit b=2048", "decompress", kernels.PEER)]["status"] == "ok"
    assert "VERIFY FAILED" in capsys.readouterr().out


def test_helpers():
    assert positive_int("16M") == 1 << 24 and positive_int("64k") == 65536 and positive_int("7") == 7
    assert default_json_path("kernels", torch.device("cpu")) == os.path.join("benchmarks", "results", "kernels",
                                                                              "cpu.json")
    assert kernels.onebit_bytes(2048 * 8, 2048, "compress") / (2048 * 8) == pytest.approx(12.127, abs=1e-3)
    args = kernels.make_args(quick=True)
    assert (args.numel, args.repeats, args.warmup) == (
        kernels.QUICK_NUMEL, kernels.QUICK_REPEATS, kernels.QUICK_WARMUP)


@pytest.mark.parametrize("n", [1, 31, 33, 4097])
def test_peer_bit_packing_matches_reference(n):
    # The torch variants are what the peer runs on CUDA; check them here on CPU.
    from pycomm.compressors import onebit as onebit_ref

    signs = torch.randn(n, generator=torch.Generator().manual_seed(n)) >= 0
    want = onebit_ref._pack_bits_reference(signs)
    for pack in (kernels._packbits, kernels._packbits_torch):
        assert torch.equal(pack(signs), want)
    for unpack in (kernels._unpackbits, kernels._unpackbits_torch):
        assert torch.equal(unpack(want, n), signs)


@pytest.mark.parametrize("bench", ["kernels", "allreduce", "ddp", "fsdp", "hierarchy", "all"])
def test_every_benchmark_prints_its_help(bench, capsys):
    # argparse formats each help string with %: a stray "%" breaks --help.
    with pytest.raises(SystemExit) as exc:
        main([bench, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_kernels_time_every_block_codec_and_a_registered_peer(tmp_path):
    # The cases come from the method table: every block codec at its default
    # block size, so int8 and int4 are timed too.
    labels = {c.label for c in kernels.CASES}
    for m in spec.BLOCK_METHODS:
        assert f"{m} b={spec.DEFAULT_BLOCK_SIZE[m]}" in labels
    calls = []

    def runners(block):
        compress, decompress = kernels.block_runners(kernels.ONEBIT, kernels.PEER, block)
        return (lambda g, r: calls.append("c") or compress(g, r)), decompress

    kernels.register_peer(kernels.ONEBIT, "unfused-again", runners)
    try:
        assert kernels.peers(kernels.ONEBIT) == [kernels.PEER, "unfused-again"]
        doc = kernels.run_kernels(kernels.make_args(numel=4096, repeats=1, warmup=0, impls="cpu",
                                                    json=str(tmp_path / "k.json")))
    finally:
        kernels.unregister_peer(kernels.ONEBIT, "unfused-again")
    assert kernels.peers(kernels.ONEBIT) == [kernels.PEER]
    rows = {(r["compressor"], r["op"], r["impl"]): r for r in doc["rows"]}
    extra = rows[("onebit b=2048", "compress", "unfused-again")]
    assert extra["kind"] == "peer" and extra["verified"] is True and extra["status"] == "ok"
    assert calls, "the registered runners were not used"
    for m in spec.ROUNDING_METHODS:
        for op in kernels.BLOCK_OPS:
            row = rows[(f"{m} b={spec.DEFAULT_BLOCK_SIZE[m]}", op, "cpu")]
            assert row["status"] == "ok" and row["verified"] is True and row["bytes_moved"] > 0
    with pytest.raises(ValueError, match="no kernel cases"):
        kernels.register_peer("fp16", "x", runners)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_library_is_the_library():
    """The harness is a package of its own (bench/): no module of pycomm
    imports it or the repository tools, importing pycomm loads none of it,
    the pycomm wheel packs pycomm alone, and ``pycomm-bench`` is the
    harness's command."""
    import ast

    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "pycomm")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            for node in ast.walk(ast.parse(source, path)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{os.path.relpath(path, ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in ("pycomm_bench", "tools")]
            if "pycomm_bench" in source:
                found.append(f"{os.path.relpath(path, ROOT)}: names pycomm_bench")
    assert not found, found
    code = "import sys, pycomm; print(sorted(m for m in sys.modules if m.startswith('pycomm_bench')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr

    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        root = tomllib.load(fh)
    with open(os.path.join(ROOT, "bench", "pyproject.toml"), "rb") as fh:
        bench = tomllib.load(fh)
    assert root["tool"]["scikit-build"]["wheel"]["packages"] == ["pycomm"]
    assert "pycomm-bench" not in root["project"]["scripts"]
    assert bench["project"]["scripts"] == {"pycomm-bench": "pycomm_bench.cli:main"}
    assert "pycomm" in bench["project"]["dependencies"]
    assert not os.path.exists(os.path.join(ROOT, "pycomm", "bench"))
    assert not os.path.exists(os.path.join(ROOT, "pycomm", "tools"))
