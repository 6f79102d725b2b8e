"""The cost models against measured emulated runs.

Reads ``pycomm-bench ddp`` JSON files and, for every (method, bandwidth)
they hold, compares two predictions with the measured communication cost of
a step: its median step time minus that of the same DDP training with a hook
that sends nothing, measured in the same run (``nocomm_step_time_s``; runs
that predate it: minus the compute time alone).

* wire: :func:`pycomm.plan.predict_allreduce_time` (what ``pycomm plan``
  uses) on the link's measured bus bandwidth, the run's bucket count, bytes
  and latency only;
* calibrated: the alpha-beta lines of ``compressor="auto"`` (docs/auto.md),
  measured through a pycomm group on the same emulated link and ranks at the
  start of the same run (the run must include the ``auto`` method), summed
  over the run's DDP buckets.

    python benchmarks/plan_vs_measured.py                       # benchmarks/results/ddp/cpu-4ranks.json
    python benchmarks/plan_vs_measured.py a.json b.json --alpha 50e-6
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from pycomm.distributed import spec
from pycomm.distributed.auto import Calibration
from pycomm.plan import predict_allreduce_time
from pycomm_bench import table
from pycomm_bench.methods import ALLREDUCE, AUTO, parse_method


def model_of(method: str):
    """(the cost model's method, density) of a ``pycomm-bench ddp`` method name;
    None for those it does not model (PowerSGD, auto).

    >>> model_of("topk-0.01-noef-backend"), model_of("allreduce"), model_of("powersgd-4")
    (('topk', 0.01), ('allreduce', None), None)
    """
    m = parse_method(method)
    if m.kind == "exact":
        return ALLREDUCE, None
    if m.kind is not None:  # every method of the table is modelled
        return m.compressor, m.density
    return None


#: model method -> the calibration's name for it: the methods auto chooses
#: from, the exact one under the model's name for it
CALIBRATED = {(ALLREDUCE if m == spec.EXACT_METHOD else m): m for m in spec.AUTO_METHODS}


def calibrated_prediction(records, r):
    """Seconds the auto calibration of ``r``'s run predicts for its buckets, or None."""
    mm = model_of(r["method"])
    if mm is None or mm[0] not in CALIBRATED or (mm[1] not in (None, 0.01)):
        return None  # the calibration measures topk at the group's density, 0.01
    auto = next((a for a in records if a["method"] == AUTO and a["bandwidth"] == r["bandwidth"]
                 and "auto_calibration" in a), None)
    if auto is None:
        return None
    cal = Calibration.from_dict(auto["auto_calibration"])
    return sum(cal.predict(CALIBRATED[mm[0]], int(n)) for n in auto["auto_bucket_methods"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="*", default=None)
    ap.add_argument("--alpha", type=float, default=50e-6, help="latency per message, s (default: 50e-6, TCP)")
    ap.add_argument("--buckets", type=int, default=5, help="DDP buckets per step (4.9M params, 4 MB buckets: 5)")
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args(argv)
    paths = args.json or [next(iter(glob.glob(os.path.join("benchmarks", "results", "ddp", "cpu-4ranks.json"))), None)]
    if paths == [None]:
        print("no benchmarks/results/ddp/cpu-4ranks.json: run pycomm-bench ddp first", file=sys.stderr)
        return 2
    rows = []
    for path in paths:
        records = json.load(open(path, encoding="utf-8"))
        for r in records:
            mm = model_of(r["method"])
            if mm is None:
                continue
            method, density = mm
            p = predict_allreduce_time(method, r["gradient_numel"], r["ranks"], r["link_busbw_measured"] / 8,
                                       args.alpha, density=density or 0.01, block_size=args.block_size,
                                       chunks=args.buckets)
            # A step's communication cost: the step minus the same DDP step
            # with a hook that sends nothing (older runs: minus compute alone).
            base = r.get("nocomm_step_time_s") or r["compute_time_s"]
            measured = r["step_time_median_s"] - base
            cal = calibrated_prediction(records, r)
            rows.append([r["method"], r["ranks"],
                         "unshaped" if r["bandwidth"] is None else f"{r['bandwidth'] / 1e9:g} Gbit/s",
                         f"{measured * 1e3:.1f}", f"{p['wire_s'] * 1e3:.1f}",
                         f"{measured / p['wire_s']:.2f}" if p["wire_s"] > 0 else "-",
                         "-" if cal is None else f"{cal * 1e3:.1f}",
                         "-" if cal is None else f"{measured / cal:.2f}",
                         "-" if cal is None else ("yes" if abs(measured / cal - 1) <= 0.25 else "no")])
    print(f"{', '.join(paths)}: measured (median step - step without communication) vs the wire model (alpha {args.alpha:g} s) "
          "and vs the auto calibration of the same run")
    print(table(rows, ["method", "ranks", "link", "measured ms", "wire model ms", "measured/wire",
                       "calibrated ms", "measured/calibrated", "calibrated within 25%"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
