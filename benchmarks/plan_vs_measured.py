"""The cost model of ``pycomm plan`` against measured emulated runs.

Reads a ``pycomm-bench ddp`` JSON and, for every (method, bandwidth) it
holds, compares the model's wire time (:func:`pycomm.plan.predict_allreduce_time`
on the link's measured bus bandwidth, the run's bucket count) with the
measured communication share of a step: median step time minus the compute
time measured in the same run without communication.

    python benchmarks/plan_vs_measured.py                       # newest benchmarks/results/ddp-cpu-*.json
    python benchmarks/plan_vs_measured.py path/to/ddp.json --alpha 50e-6
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

from tabulate import tabulate

from pycomm.plan import predict_allreduce_time

#: bench method -> (model method, density)
MODEL = {"allreduce": ("allreduce", None), "fp16": ("fp16", None), "bf16": ("bf16", None)}


def model_of(method: str):
    if method in MODEL:
        return MODEL[method]
    base = method.replace("-backend", "").replace("-noef", "")
    if base == "onebit":
        return "onebit", None
    if base.startswith("topk-"):
        return "topk", float(base.split("-", 1)[1])
    return None  # PowerSGD: not modelled


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default=None)
    ap.add_argument("--alpha", type=float, default=50e-6, help="latency per message, s (default: 50e-6, TCP)")
    ap.add_argument("--buckets", type=int, default=5, help="DDP buckets per step (4.9M params, 4 MB buckets: 5)")
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args(argv)
    path = args.json or max(glob.glob(os.path.join("benchmarks", "results", "ddp-cpu-*.json")), default=None)
    if path is None:
        print("no benchmarks/results/ddp-cpu-*.json: run pycomm-bench ddp first", file=sys.stderr)
        return 2
    rows = []
    for r in json.load(open(path, encoding="utf-8")):
        mm = model_of(r["method"])
        if mm is None:
            continue
        method, density = mm
        p = predict_allreduce_time(method, r["gradient_numel"], r["ranks"], r["link_busbw_measured"] / 8,
                                   args.alpha, density=density or 0.01, block_size=args.block_size,
                                   chunks=args.buckets)
        measured = r["step_time_median_s"] - r["compute_time_s"]
        rows.append([r["method"], "unshaped" if r["bandwidth"] is None else f"{r['bandwidth'] / 1e9:g} Gbit/s",
                     f"{p['wire_s'] * 1e3:.1f}", f"{measured * 1e3:.1f}",
                     f"{measured / p['wire_s']:.2f}" if p["wire_s"] > 0 else "-",
                     "yes" if math.isfinite(measured) and abs(measured / p["wire_s"] - 1) <= 0.25 else "no"])
    print(f"{path}: model wire time vs measured (median step - compute), alpha {args.alpha:g} s")
    print(tabulate(rows, headers=["method", "link", "model ms", "measured ms", "measured/model", "within 25%"],
                   tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
