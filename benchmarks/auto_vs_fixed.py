"""compressor="auto" against every fixed method of the same DDP runs.

Reads ``pycomm-bench ddp`` JSON files holding an ``auto`` run and, per
(ranks, bandwidth), compares its median step time with the best fixed
method's and with plain all-reduce's (the targets: within 10% of the best
fixed method, never more than 5% slower than plain), and lists the methods
the calibration chose for the buckets.

    python benchmarks/auto_vs_fixed.py benchmarks/results/ddp/cpu-*ranks-auto.json
"""

from __future__ import annotations

import argparse
import json
import sys

from pycomm_bench import table


def rows_of(records):
    rows = []
    for bw in sorted({r["bandwidth"] for r in records}, key=lambda b: float("inf") if b is None else b):
        at = {r["method"]: r for r in records if r["bandwidth"] == bw}
        if "auto" not in at or "allreduce" not in at:
            continue
        auto, plain = at["auto"]["step_time_median_s"], at["allreduce"]["step_time_median_s"]
        fixed = {m: r["step_time_median_s"] for m, r in at.items() if m != "auto"}
        best = min(fixed, key=fixed.get)
        chosen = sorted(set(at["auto"].get("auto_bucket_methods", {}).values()))
        rows.append({
            "ranks": at["auto"]["ranks"], "link": "unshaped" if bw is None else f"{bw / 1e9:g} Gbit/s",
            "auto ms": round(auto * 1e3, 1), "chose": ",".join(chosen),
            "best fixed": best, "best ms": round(fixed[best] * 1e3, 1),
            "auto / best": round(auto / fixed[best], 3), "within 10%": auto <= 1.10 * fixed[best],
            "plain ms": round(plain * 1e3, 1), "auto / plain": round(auto / plain, 3),
            "not >5% slower than plain": auto <= 1.05 * plain,
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    args = ap.parse_args(argv)
    rows = [row for path in args.json for row in rows_of(json.load(open(path, encoding="utf-8")))]
    if not rows:
        print("no run with both auto and allreduce in these files", file=sys.stderr)
        return 2
    print(table(rows, "keys", tablefmt="github", numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
