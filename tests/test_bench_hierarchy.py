"""``pycomm-bench hierarchy`` end to end on a small case: every method runs,
agrees across ranks and with the single-process simulation, and (on emulated nodes) the hierarchical all-reduce
sends fewer bytes out of each node than the flat one."""

import json
import subprocess
import sys

from _dist import subprocess_env

from pycomm_bench.netem import emulation_available


def test_small_run(tmp_path):
    emulated = emulation_available()[0]
    out = tmp_path / "h.json"
    link = ["--bandwidth", "1gbit"] if emulated else ["--no-netns", "--bandwidth", "none"]
    cmd = [sys.executable, "-m", "pycomm_bench", "hierarchy", "--ranks", "4", "--ranks-per-node", "2",
           "--sizes", "256k", "--repeats", "2", "--warmup", "0", "--json", str(out),
           "--netns-prefix", "pycommtest-hier", *link]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    recs = {r["method"]: r for r in doc["records"]}
    assert sorted(recs) == sorted(["plain", "onebit-flat", "onebit-hier", "topk-flat", "topk-hier"])
    assert all(r["identical_on_all_ranks"] and r["matches_simulation"] and r["median_s"] > 0 for r in recs.values())
    assert doc["emulated"] is emulated and doc["ranks_per_node"] == 2
    if emulated:
        for c in ("onebit", "topk"):
            assert recs[f"{c}-hier"]["node_bytes_out_per_call"] < 0.8 * recs[f"{c}-flat"]["node_bytes_out_per_call"]
        assert recs["onebit-flat"]["node_bytes_out_per_call"] < 0.2 * recs["plain"]["node_bytes_out_per_call"]
    assert "onebit-hier" in proc.stdout
