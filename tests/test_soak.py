"""A short soak (benchmarks/soak.py, 200 calls instead of 2,000): memory,
file descriptors and threads stay put, and results stay right, over many
compressed all-reduces with several in flight at once."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--calls", "200",
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["calls"] == 200
    assert len(report["checks"]) == 9 and all(report["checks"].values()), report["checks"]
    for res in report["ranks"].values():
        assert res["keyless_checked"] >= 30  # every fifth call, sizes below 1M
