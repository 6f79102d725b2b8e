"""Calls one rank cannot run raise on every rank, in time, and the group
keeps working: a dtype no compressor takes, an empty tensor, a bad
reduce-scatter / all-gather pair on one rank only; a calibration file that
cannot be written; a calibration whose measurements are corrupt (measured
again). Bounded by the harness timeout, far below the group's."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import pytest
import torch
from _dist import run_ranks

TIMEOUT = 120


def _one_rank_bad(rank, world, case):
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="int8", min_compress_numel=1)
    good = torch.randn(1000)
    calls = {
        "float64": lambda: pd.all_reduce(good.double() if rank == 1 else good, key=2, group=pg),
        "int32": lambda: pd.all_reduce(torch.ones(1000, dtype=torch.int32) if rank == 0 else good, group=pg),
        "empty": lambda: pd.all_reduce(torch.empty(0) if rank == 1 else good, key=3, group=pg),
        "reduce_scatter output": lambda: pd.reduce_scatter(torch.empty(500 if rank == 0 else 499), good,
                                                           key=4, group=pg),
        "all_gather float64": lambda: pd.all_gather(torch.empty(2000, dtype=torch.float64 if rank else torch.float32),
                                                    good.double() if rank else good, group=pg),
        "all float64": lambda: pd.all_reduce(good.double(), group=pg),
    }
    try:
        calls[case]()
        error = None
    except (RuntimeError, ValueError, TypeError) as exc:
        error = str(exc)
    check = torch.full((1000,), float(rank))
    pd.all_reduce(check, key=5, group=pg, op="avg")  # still in step
    return error, check


CASES = {
    "float64": "float32, float16 or bfloat16",
    "int32": "float32, float16 or bfloat16",
    "empty": "empty",
    "reduce_scatter output": "world size",
    "all_gather float64": "float32, float16 or bfloat16",
    "all float64": "float32, float16 or bfloat16",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_one_rank_refuses_raises_everywhere(case):
    res = run_ranks(_one_rank_bad, 2, case, timeout=TIMEOUT)
    for rank, (error, check) in enumerate(res):
        assert error is not None, f"rank {rank} did not raise"
        # The refusing rank names its reason; the peer the difference.
        assert CASES[case] in error or "a call it refused" in error, (rank, error)
        torch.testing.assert_close(check, torch.full((1000,), 0.5), atol=0.01, rtol=0)


def _auto_group(rank, world, path):
    import pycomm.distributed as pd

    try:
        pd.init_process_group(compressor="auto", backend="gloo", init_method="env://", calibration=path,
                              timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])))
    except ValueError as exc:
        return "error", str(exc)
    return "ok", pd.calibration().loaded_from


def test_unwritable_calibration_path_raises_on_every_rank(tmp_path):
    for path in (tmp_path / "missing-dir" / "cal.json", tmp_path):  # no folder; a folder
        res = run_ranks(_auto_group, 2, str(path), timeout=TIMEOUT, init_process_group=False)
        for kind, msg in res:
            assert kind == "error" and "calibration=" in msg and "cannot be written" in msg, msg


def test_corrupt_measurements_are_measured_again(tmp_path, caplog):
    from pycomm.distributed.auto import CANDIDATES, SIZES, Calibration, _load

    path = tmp_path / "cal.json"
    res = run_ranks(_auto_group, 2, str(path), timeout=TIMEOUT, init_process_group=False)
    assert [r[0] for r in res] == ["ok", "ok"] and path.exists()
    good = json.loads(path.read_text())
    want = Calibration.from_dict(dict(good)).key()
    assert _load(str(path), want) is not None
    for corrupt in ({"none": [1.0]}, {**good["seconds"], "int4": ["x", 1.0]},
                    {**good["seconds"], "onebit": [0.0, -1.0]}, "nonsense"):
        path.write_text(json.dumps({**good, "seconds": corrupt}))
        with caplog.at_level(logging.WARNING, logger="pycomm.distributed.auto"):
            assert _load(str(path), want) is None
        assert "corrupt measurements" in caplog.text and str(path) in caplog.text
        caplog.clear()
    assert set(good["seconds"]) == set(CANDIDATES) and all(len(v) == len(SIZES) for v in good["seconds"].values())
