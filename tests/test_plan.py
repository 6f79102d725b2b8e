"""pycomm plan: the alpha-beta formulas, the presets, the checks a user relies
on (the 70B-over-PCIe envelope), argument errors and the JSON output."""

import json
import math
import subprocess
import sys

import pytest

from pycomm import plan as P
from pycomm.distributed import spec


def test_70b_fp32_over_pcie4_envelope():
    # The classic back-of-envelope: 70e9 fp32 gradients = 280 GB; over PCIe
    # Gen4 x16 at 64 GB/s (as quoted, both directions) that is 4.375 s.
    p = P.plan(params=70e9, gpus=8, gpus_per_node=8, intra="pcie4", dtype="fp32", kernels_json=False)
    assert p["gradient_bytes"] == 280e9
    assert p["envelope"]["link"] == "pcie4"
    assert p["envelope"]["seconds"] == pytest.approx(4.375)
    # A ring moves 2(W-1)/W x the bytes each way at 32 GB/s per direction.
    flat = p["methods"][0]
    assert flat["transfer_s"] == pytest.approx(2 * 7 / 8 * 280e9 / 32e9)
    assert flat["total_s"] >= 4.375


def test_70b_pcie_case_printed(capsys):
    assert P.main(["plan", "--params", "70e9", "--gpus", "8", "--intra", "pcie4"]) == 0
    out = capsys.readouterr().out
    assert "280 GB" in out
    assert "gradient bytes / link bandwidth: 280 GB / 64 GB/s bidirectional (pcie4) = 4.38 s" in out
    assert "flat ring" in out and "hierarchical" in out


@pytest.mark.parametrize("world,nbytes,bw,alpha", [(2, 8, 1.0, 0.5), (4, 1000, 10.0, 0.01), (3, 3e6, 1e9, 1e-6)])
def test_ring_formula_exact(world, nbytes, bw, alpha):
    c = P.ring_allreduce(nbytes, world, bw, alpha)
    assert c["messages"] == 2 * (world - 1)
    assert c["latency_s"] + c["transfer_s"] == pytest.approx(2 * (world - 1) * alpha + 2 * (world - 1) / world * nbytes / bw)
    r = P.predict_allreduce_time("allreduce", int(nbytes), world, bw, alpha, dtype="fp32")
    assert r["wire_s"] == pytest.approx(2 * (world - 1) * alpha + 2 * (world - 1) / world * 4 * int(nbytes) / bw)
    assert r["compute_s"] is None and r["total_s"] == r["wire_s"]


def test_ring_small_case_by_hand():
    # W=2, 8 bytes at 1 B/s, alpha 0.5 s: 2 messages (1 s) + 8 bytes (8 s).
    c = P.ring_allreduce(8, 2, 1.0, 0.5)
    assert (c["latency_s"], c["transfer_s"]) == (1.0, 8.0)
    assert P.predict_allreduce_time("allreduce", 10, 1, 1.0, 1.0)["wire_s"] == 0


def test_hierarchical_beats_flat_when_intra_fast():
    p = P.plan(params=7e9, gpus=64, gpus_per_node=8, intra="nvlink4", inter="ib-hdr", kernels_json=False)
    flat, hier = p["methods"][0], p["methods"][1]
    assert hier["method"] == "hierarchical"
    assert hier["total_s"] <= flat["total_s"]
    assert p["topology"] == {**p["topology"], "dp": 64, "dp_ranks_per_node": 8, "dp_nodes": 8}


def test_single_node_hierarchical_is_flat():
    p = P.plan(params=1e9, gpus=8, gpus_per_node=8, kernels_json=False)
    assert p["topology"]["flat_ring_link"] == "intra"
    assert p["methods"][0]["total_s"] == p["methods"][1]["total_s"]


@pytest.mark.parametrize("method", spec.BLOCK_METHODS)
def test_block_codec_traffic_is_its_bits(method):
    # Two phases of (W-1)/W of one compressed copy: bits/32 of fp32's ring
    # bytes, plus the scales; padding and the tags (8 bytes per peer) are
    # what the old approximation left out.
    n, W, bits = 1 << 24, 8, spec.method_spec(method).bits
    block = spec.DEFAULT_BLOCK_SIZE[method]
    dense = P.predict_allreduce_time("allreduce", n, W, 1e9, 0.0)
    got = P.predict_allreduce_time(method, n, W, 1e9, 0.0)
    scales = 2 * (W - 1) / W * 4 * math.ceil(n / block)
    approx = dense["bytes_per_rank"] * bits / 32 + scales
    assert approx < got["bytes_per_rank"] <= approx + 8 * (W - 1) + 4 * 2 * (W - 1) * (1 + 32 // bits)
    assert got["bytes_per_rank"] == spec.wire_bytes(method, n, W, chunk_numel=n)
    assert got["messages"] == 2 * (W - 1)
    # Its own default block size; a given one changes the scales' bytes.
    coarse = P.predict_allreduce_time(method, n, W, 1e9, 0.0, block_size=4 * block)["bytes_per_rank"]
    assert got["bytes_per_rank"] - coarse == pytest.approx(scales * 3 / 4, abs=8 * W)
    # Worker and server compress, the server's sum, the decode: as onebit.
    r = P.predict_allreduce_time(method, n, W, 1e9, 0.0, compress_throughput=1e9)
    assert r["compute_s"] == pytest.approx((n + n / W + n + n) / 1e9)


def test_int4_sends_half_of_int8():
    n, W = 1 << 24, 8
    int8, int4 = (P.predict_allreduce_time(m, n, W, 1e9, 0.0)["bytes_per_rank"] for m in ("int8", "int4"))
    scales = 2 * (W - 1) / W * 4 * n / 256
    assert int4 - scales == pytest.approx((int8 - scales) / 2, rel=1e-4)


def test_topk_traffic_grows_with_world():
    n = 1 << 22
    sent = [P.predict_allreduce_time("topk", n, W, 1e9, 0.0, density=0.01, approx=False)["bytes_per_rank"]
            for W in (2, 4, 8, 16)]
    assert sent == sorted(sent) and sent[-1] > 7 * sent[0]
    k = math.ceil(0.01 * n)
    assert sent[1] == 3 * (4 + 8 * k + 8)  # (W-1) payloads of a count word + k (index, value) + the tag
    approx = P.predict_allreduce_time("topk", n, 4, 1e9, 0.0, density=0.01)["bytes_per_rank"]
    assert approx == 3 * (4 + 8 * (k + k // 4) + 8)  # approximate mode reserves 1.25 k


@pytest.mark.parametrize("method", P.METHODS)
@pytest.mark.parametrize("n,world,chunks", [(1000, 2, 1), (1 << 20, 4, 3), (10_000_019, 7, 5), (5, 3, 8)])
def test_bytes_are_the_spec_s(method, n, world, chunks):
    # Each of `chunks` collectives is one chunk of n/chunks elements, counted
    # by the spec's formula.
    name = spec.EXACT_METHOD if method == "allreduce" else method
    lengths = [n // chunks + (i < n % chunks) for i in range(chunks)]
    want = sum(spec.wire_bytes(name, m, world, chunk_numel=max(1, m)) for m in lengths)
    assert P.predict_allreduce_time(method, n, world, 1e9, 0.0, chunks=chunks)["bytes_per_rank"] == want


def test_every_method_is_planned():
    assert set(P.COMPRESSORS) == set(spec.METHODS)
    assert P.COMPRESSORS[0] == spec.EXACT_METHOD  # the default comes first in --help
    for m in spec.METHODS:
        if m == spec.EXACT_METHOD:
            continue
        p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor=m, kernels_json=False,
                   engine_json=False)
        row = p["methods"][2]
        assert row["method"] == m and 0 < row["bytes_per_rank"] < p["methods"][0]["bytes_per_rank"]
    p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="int8", kernels_json=False,
               engine_json=False)
    assert p["inputs"]["block_size"] == spec.DEFAULT_BLOCK_SIZE["int8"]
    assert p["methods"][2]["compute"] == "no measurement"


def test_half_precision_halves_bytes():
    fp32 = P.predict_allreduce_time("allreduce", 1000, 4, 1e9, 0.0)
    half = P.predict_allreduce_time("bf16", 1000, 4, 1e9, 0.0)
    assert half["bytes_per_rank"] == fp32["bytes_per_rank"] / 2
    assert half["compute_s"] is None and "cast" in half["compute_excluded"]


def test_compute_throughput_number_and_mapping():
    n, W = 1_000_000, 4
    r = P.predict_allreduce_time("onebit", n, W, 1e9, 0.0, compress_throughput=1e9)
    assert r["compute_s"] == pytest.approx((n + n / W + n + n) / 1e9)
    r = P.predict_allreduce_time("onebit", n, W, 1e9, 0.0, compress_throughput={"compress": 1e9})
    assert r["compute_s"] == pytest.approx((n + n / W) / 1e9)
    assert r["compute_excluded"] == ["decompress", "decompress_acc"]
    assert r["total_s"] == pytest.approx(r["wire_s"] + r["compute_s"])


def test_chunks_multiply_latency_only():
    one = P.predict_allreduce_time("onebit", 1 << 22, 4, 1e9, 1e-3)
    four = P.predict_allreduce_time("onebit", 1 << 22, 4, 1e9, 1e-3, chunks=4)
    assert four["latency_s"] == pytest.approx(4 * one["latency_s"])
    # The same bytes but each extra chunk's tag (8 bytes to each of W-1 peers):
    # 2^22 elements cut in 4 leave every segment a whole number of blocks.
    assert four["bytes_per_rank"] == one["bytes_per_rank"] + 3 * 3 * 8


def test_kernel_json_measured_and_missing(tmp_path):
    doc = {"device": "cpu", "date": "2026-12-02T14:05:23", "machine": {"cpu_model": "TestCPU"}, "rows": [
        {"family": "onebit", "params": {"block_size": 2048}, "op": op, "impl": impl, "kind": kind,
         "status": "ok", "elements_per_s": eps}
        for op in ("compress", "decompress", "decompress_acc")
        for impl, kind, eps in (("reference", "impl", 1e7), ("cpu", "impl", 1e9), ("unfused", "peer", 5e9))]}
    path = tmp_path / "kernels-cpu-2026-12-02.json"
    path.write_text(json.dumps(doc))
    p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="onebit", kernels_json=str(path))
    assert p["kernels"]["label"] == "measured on TestCPU (cpu, cpu kernels), 2026-12-02"
    assert p["kernels"]["rates"]["compress"] == 1e9  # the fastest impl, never a peer
    ob = p["methods"][2]
    assert ob["compute"] == "measured" and ob["compute_s"] > 0
    # a block size the file did not measure: no measurement, compute left out
    p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="onebit", block_size=4096,
               kernels_json=str(path))
    ob = p["methods"][2]
    assert ob["compute"] == "no measurement" and ob["compute_s"] is None
    assert ob["total_s"] == ob["wire_s"]
    assert p["kernels"]["note"].startswith("no measurement")


def test_free_rates_and_presets():
    assert P.parse_link("1gbit").bytes_per_s == 125e6
    assert P.parse_link("100mbit").bytes_per_s == 12.5e6
    assert P.parse_link("2.5gbit").bytes_per_s == 312.5e6
    assert P.parse_link("25Gbit/s").bytes_per_s == 25e9 / 8
    assert P.parse_link("40GB/s").bytes_per_s == 40e9
    assert P.LINKS["eth1"].bytes_per_s == P.parse_link("1gbit").bytes_per_s
    assert P.LINKS["nvlink4"].bytes_per_s == 450e9 and P.LINKS["nvlink4"].quoted_bytes_per_s == 900e9
    assert P.LINKS["nvlink3"].bytes_per_s == 300e9
    assert P.LINKS["ib-ndr400"].bytes_per_s == 50e9 and P.LINKS["ib-hdr"].bytes_per_s == 25e9
    for link in P.LINKS.values():
        assert link.source and ("per direction" in link.quoted or "bidirectional" in link.quoted)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(inter="warp9"), "--inter: unknown link 'warp9'; presets: nvlink3, nvlink4"),
    (dict(intra="nvlink9"), "--intra: unknown link"),
    (dict(gpus=12, tp=8), "--gpus 12 is not a multiple of --tp x --pp = 8 x 1 = 8"),
    (dict(gpus=20, gpus_per_node=8), "--gpus 20 is not a multiple of --gpus-per-node 8"),
    (dict(compressor="zip"), "--compressor must be one of none, onebit, topk, fp16, bf16, int8, int4"),
    (dict(dtype="fp8"), "--dtype must be one of fp32, bf16, fp16"),
    (dict(gpu="tpu"), "--gpu must be one of h100, h200, a100, v100"),
    (dict(mfu=1.5), "--mfu must be in"),
    (dict(density=0.0, compressor="topk"), "--density must be in"),
    (dict(gpus=0), "--gpus must be an integer >= 1"),
    (dict(block_size=0, compressor="int4"), "--block-size must be an integer >= 1"),
    (dict(params="lots"), "--params: expected a positive number"),
    (dict(tp=3, gpus=24), "--tp 3 must divide --gpus-per-node 8"),
])
def test_bad_arguments_name_the_flag(kwargs, needle):
    args = {"params": 1e9, "gpus": 16, "kernels_json": False, **kwargs}
    with pytest.raises(ValueError) as err:
        P.plan(**args)
    assert needle in str(err.value)


def test_cli_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        P.main(["--params", "1e9", "--gpus", "16", "--inter", "warp9"])
    assert e.value.code == 2
    assert "ib-ndr400" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        P.main(["--params", "1e9", "--gpus", "12", "--tp", "8"])
    assert e.value.code == 2 and "--tp x --pp" in capsys.readouterr().err
    assert P.main(["frobnicate"]) == 2


JSON_KEYS = {"inputs", "topology", "links", "gradient_elements", "gradient_bytes", "envelope", "methods",
             "alternatives", "memory", "compute", "comm_to_compute", "kernels", "best", "recommendation"}
METHOD_KEYS = {"method", "messages", "bytes_per_rank", "latency_s", "transfer_s", "wire_s", "compute_s",
               "compute_excluded", "compute", "total_s", "exposed_s", "step_s", "saving_vs_plain"}


def test_json_output_keys(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert P.main(["plan", "--params", "4.9e6", "--gpus", "4", "--gpus-per-node", "1", "--inter", "1gbit",
                   "--compressor", "topk", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == JSON_KEYS
    assert [m["method"] for m in doc["methods"]] == ["flat ring", "hierarchical", "topk", "hierarchical + topk"]
    for m in doc["methods"]:
        assert set(m) == METHOD_KEYS
    assert set(doc["envelope"]) == {"link", "quoted", "seconds", "per_direction_seconds"}
    assert doc["topology"]["dp"] == 4
    assert "recommendation:" in capsys.readouterr().out


def test_recommendation():
    # a slow network and a small model: compression pays
    p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="onebit", kernels_json=False,
               engine_json=False)
    assert p["best"] == "onebit" and p["recommendation"].startswith("use onebit")
    assert "lower bound" in p["recommendation"]  # compute was not measured
    # fast links, big batch: communication is small next to compute
    p = P.plan(params=7e9, gpus=64, inter="ib-ndr400", compressor="fp16", kernels_json=False, engine_json=False)
    assert "plain is fine" in p["recommendation"]
    p = P.plan(params=70e9, gpus=64, tp=8, pp=8, kernels_json=False)
    assert p["topology"]["dp"] == 1 and "no gradient all-reduce" in p["recommendation"]


def test_compute_estimate_and_overlap():
    p = P.plan(params=70e9, gpus=64, gpu="h100", mfu=0.4, tokens_per_step=4e6, kernels_json=False)
    assert p["compute"]["seconds"] == pytest.approx(6 * 70e9 * 4e6 / (64 * 989e12 * 0.4))
    q = P.plan(params=70e9, gpus=64, gpu="h100", mfu=0.4, tokens_per_step=4e6, overlap=1.0, kernels_json=False)
    assert all(m["step_s"] <= n["step_s"] for m, n in zip(q["methods"], p["methods"]))


def test_python_m_pycomm_plan():
    r = subprocess.run([sys.executable, "-m", "pycomm", "plan", "--params", "70e9", "--gpus", "8",
                        "--intra", "pcie4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "280 GB" in r.stdout and "4.38 s" in r.stdout


def test_docs_examples_run():
    import doctest
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "plan.md")
    result = doctest.testfile(path, module_relative=False)
    assert result.failed == 0 and result.attempted >= 5


ENGINE_DOC = {"gpu": "GPU9", "backend": "nccl", "date": "2026-12-04T10:00:00", "records": [
    {"method": "onebit", "status": "ok", "numel": 1 << 26, "chunks": 1, "block_size": 2048, "engine_ms": 1.1,
     "variants": {"1M": {"status": "ok", "chunks": 64, "engine_ms": 11.7}}}],
    "bucket": {"numel": 6553600, "methods": {"onebit": {"chunk_numel": 1 << 26, "gpu_ms": 0.37}}}}


def test_engine_cost_is_the_compressor_compute(tmp_path):
    path = tmp_path / "allreduce-cuda-gpu9-2026-12-04.json"
    path.write_text(json.dumps(ENGINE_DOC))
    c = P.engine_cost(ENGINE_DOC, "onebit")
    # The fit goes through the three measured times.
    for n, chunks, ms in ((1 << 26, 1, 1.1), (1 << 26, 64, 11.7), (6553600, 1, 0.37)):
        t = c["per_call_s"] + chunks * c["per_chunk_s"] + n * c["per_element_s"]
        assert t == pytest.approx(ms / 1e3)
    assert P.engine_cost(ENGINE_DOC, "onebit", block_size=256) is None  # not measured at that block
    assert P.engine_cost(ENGINE_DOC, "topk") is None
    p = P.plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="onebit", kernels_json=False,
               engine_json=str(path))
    ob = p["methods"][2]
    buckets, chunks = p["topology"]["buckets"], p["topology"]["compressed_chunks"]
    want = buckets * c["per_call_s"] + chunks * c["per_chunk_s"] + p["gradient_elements"] * c["per_element_s"]
    assert ob["compute"] == "measured" and ob["compute_s"] == pytest.approx(want)
    assert ob["total_s"] == pytest.approx(ob["wire_s"] + want)
    assert p["kernels"]["note"].startswith("engine measured on GPU9 (nccl, one rank), 2026-12-04")
    assert "lower bound" not in p["recommendation"]


def test_plain_wins_on_fast_links(tmp_path):
    # NVLink and a small model: the engine's time is more than plain's wire time.
    path = tmp_path / "allreduce-cuda-gpu9-2026-12-04.json"
    path.write_text(json.dumps(ENGINE_DOC))
    p = P.plan(params=100e6, gpus=8, gpus_per_node=8, intra="nvlink4", compressor="onebit", kernels_json=False,
               engine_json=str(path))
    assert p["best"] in ("flat ring", "hierarchical")
    assert "it wins here" in p["recommendation"] and "onebit would take" in p["recommendation"]


def test_default_chunk_follows_the_device():
    p = P.plan(params=1e9, gpus=16, compressor="onebit", kernels_json=False, engine_json=False)
    assert p["inputs"]["chunk_numel"] == spec.default_chunk_numel("cuda")
    q = P.plan(params=1e9, gpus=16, compressor="onebit", kernels_json=False, engine_json=False, kernel_device="cpu")
    assert q["inputs"]["chunk_numel"] == spec.default_chunk_numel("cpu")
    assert q["topology"]["compressed_chunks"] > p["topology"]["compressed_chunks"]


@pytest.mark.parametrize("compressor", ["none", "int4"])
def test_the_methods_that_change_the_optimizer_are_planned_beside(compressor):
    kw = dict(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", kernels_json=False, engine_json=False)
    p = P.plan(compressor=compressor, sync_every=8, **kw)
    onebit, diloco = p["alternatives"]
    assert onebit["method"] == "OneBitAdam (onebit momentum)"
    assert onebit["bytes_per_rank"] == P.plan(compressor="onebit", **kw)["methods"][2]["bytes_per_rank"]
    codec = P.plan(compressor=compressor, **kw)["methods"][0 if compressor == "none" else 2]
    assert diloco["method"].startswith("DiLoCo H=8")
    assert diloco["bytes_per_rank"] == pytest.approx(codec["bytes_per_rank"] / 8)
    assert diloco["wire_s"] == pytest.approx(codec["wire_s"] / 8)
    # The recommendation weighs the gradient methods only; "plain" is named as NCCL's, not pycomm's.
    assert "DiLoCo" not in p["recommendation"] and "OneBitAdam" not in p["recommendation"]
    assert P.plan(compressor="none", **kw)["alternatives"] and not P.plan(compressor="none", **{**kw, "gpus": 1})["alternatives"]


def test_the_package_ships_the_newest_engine_measurements(monkeypatch):
    # A copy, kept equal to the newest engine result of the source tree (the
    # engine benchmark writes both), so that a wheel plans as the tree does.
    import os

    shipped = sorted(os.listdir(P.MEASUREMENTS_DIR))
    assert shipped == ["allreduce-cuda-nvidia-h200.json"], shipped
    tree = [d for d in P._results_dirs() if d != P.MEASUREMENTS_DIR]
    monkeypatch.setattr(P, "_results_dirs", lambda: tree)
    newest = P.find_engine_json("cuda")
    assert newest is not None and not newest.startswith(P.MEASUREMENTS_DIR)
    with open(os.path.join(P.MEASUREMENTS_DIR, shipped[0])) as f, open(newest) as g:
        assert json.load(f) == json.load(g), newest


def test_a_wheel_plans_as_the_source_tree(monkeypatch):
    kw = dict(params=1.3e9, gpus=16, gpus_per_node=8, inter="100gbit", compressor="onebit", kernels_json=False)
    tree = P.plan(**kw)
    monkeypatch.setattr(P, "_results_dirs", lambda: [P.MEASUREMENTS_DIR])  # what an installed wheel has
    wheel = P.plan(**kw)
    assert wheel["recommendation"] == tree["recommendation"]
    assert wheel["kernels"]["engine"]["path"].startswith(P.MEASUREMENTS_DIR)
    assert [m["compute"] for m in wheel["methods"]] == [m["compute"] for m in tree["methods"]]


def test_a_model_that_does_not_fit_unsharded_is_said(capsys):
    big = P.plan(params=70e9, gpus=64, gpus_per_node=8, kernels_json=False, engine_json=False)
    assert big["memory"]["fits"] is False and big["memory"]["bytes_per_gpu"] == 70e9 * (P.STATE_BYTES + 4)
    small = P.plan(params=1e9, gpus=64, gpus_per_node=8, kernels_json=False, engine_json=False)
    assert small["memory"]["fits"] is True
    assert P.main(["plan", "--params", "70e9", "--gpus", "64"]) == 0
    assert "it does not fit unsharded" in capsys.readouterr().out
