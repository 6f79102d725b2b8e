"""compressor="auto" (docs/auto.md): the model, the decision table, and
groups that calibrate themselves or load a saved calibration."""

import json
import os
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _dist import run_ranks

from pycomm.distributed.auto import CANDIDATES, NO_BOUND, SIZES, Calibration
from pycomm.distributed.simulate import simulate_allreduce

TIMEOUT = 120.0


def _cal(seconds, min_numel=1, world=2):
    return Calibration(world, 1, "cpu", {"min_compress_numel": min_numel}, [1000, 100000], seconds)


def _method_of(table, n):
    for bound, method in table:
        if n < bound:
            return method
    return "none"


def test_fit_recovers_lines_and_never_goes_negative():
    cal = _cal({"none": [0.002, 0.2], "onebit": [0.005, 0.0149]})
    a, b = cal.fit()["none"]
    assert a == pytest.approx(0.0, abs=1e-12) and b == pytest.approx(2e-6)
    # A method measured *faster* at the larger size (noise): slope 0, not negative.
    cal = _cal({"none": [0.002, 0.001]})
    assert cal.fit()["none"] == (pytest.approx(0.0015), 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-5, 1.0), st.floats(1e-5, 1.0)), min_size=4, max_size=4),
       st.integers(1, 5000))
def test_table_agrees_with_choose_everywhere(times, min_numel):
    cal = _cal({m: sorted(t) for m, t in zip(CANDIDATES, times)}, min_numel)
    table = cal.size_methods()
    assert table[-1][0] == NO_BOUND
    assert [b for b, _ in table] == sorted({b for b, _ in table})  # increasing bounds
    probes = {1, min_numel - 1, min_numel, 10**3, 10**5, 10**7, 10**9} | {b for b, _ in table[:-1]}
    probes |= {b - 1 for b, _ in table[:-1]}
    for n in sorted(p for p in probes if p >= 1):
        assert _method_of(table, n) == cal.choose(n), n


def test_lossy_methods_need_the_margin_and_small_tensors_stay_exact():
    # onebit predicted 5% faster than exact at every size: not enough (10%).
    cal = _cal({"none": [0.01, 1.0], "onebit": [0.0095, 0.95]})
    assert {m for _, m in cal.size_methods()} == {"none"}
    cal = _cal({"none": [0.01, 1.0], "onebit": [0.02, 0.05]}, min_numel=65536)
    assert cal.choose(1000) == "none"  # below min_compress_numel
    assert cal.choose(1 << 20) == "onebit"
    assert cal.size_methods()[0] == (65536, "none")


def test_saved_calibration_roundtrip(tmp_path):
    cal = _cal({m: [0.001, 0.01] for m in CANDIDATES})
    path = tmp_path / "cal.json"
    cal.save(str(path))
    back = Calibration.from_dict(json.loads(path.read_text()))
    assert back == cal and back.key() == cal.key() and back.digest() == cal.digest()
    assert "chosen" in cal.format() and "measured ms" in cal.format()
    from pycomm.distributed.auto import main

    main([str(path)])  # prints the table of a saved calibration
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json")])


# ------------------------------------------------------------ in groups ----
def _inputs(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (1 + rank)


def _auto(rank, world, path, sizes):
    import pycomm.distributed as pd

    pd.init_process_group(compressor="auto", backend="gloo", init_method="env://", calibration=path,
                          min_compress_numel=1000, block_size=256,
                          timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])))
    cal = pd.calibration()
    outs = []
    for n in sizes:
        x = _inputs(rank, n)
        pd.all_reduce(x, op="avg")
        outs.append(x)
    return cal.to_dict(), pd.options_of()["size_methods"], outs, pd.calibration().loaded_from


def _saved(path, world, seconds):
    # The settings the group above runs with: what a matching file holds.
    settings = {"chunk_numel": 1 << 20, "block_size": 256, "density": 0.01, "approx": True,
                "min_compress_numel": 1000, "min_gain": 0.1}
    Calibration(world, 1, "cpu", settings, list(SIZES), seconds, measured_at="test").save(str(path))


def test_loaded_calibration_decides_per_size(tmp_path):
    # A saved calibration where exact wins below ~2^18 and onebit above:
    # each size runs its method, every rank alike, nothing measured.
    path = tmp_path / "cal.json"
    _saved(path, 2, {"none": [0.001, 0.016], "fp16": [0.002, 0.03], "onebit": [0.004, 0.005],
                     "topk": [0.003, 0.02], "int8": [0.003, 0.012], "int4": [0.003, 0.008]})
    sizes = [500, 5000, 1 << 20]
    res = run_ranks(_auto, 2, str(path), sizes, timeout=TIMEOUT, init_process_group=False)
    assert res[0][1] == res[1][1] and res[0][3] == str(path)
    cal = Calibration.from_dict(res[0][0])
    assert [cal.choose(n) for n in sizes] == ["none", "none", "onebit"]
    xs = [[_inputs(r, n) for r in range(2)] for n in sizes]
    for i, n in enumerate(sizes):
        if cal.choose(n) == "none":
            want = (xs[i][0] + xs[i][1]) / 2
        else:
            want = simulate_allreduce(xs[i], "onebit", op="avg", impl="cpu", block_size=256)[0]
        for r in range(2):
            assert torch.equal(res[r][2][i], want), (n, r)


def test_measured_when_missing_or_stale_and_saved(tmp_path):
    path = tmp_path / "cal.json"
    _saved(path, 3, {m: [0.001, 0.002] for m in CANDIDATES})  # made for 3 ranks: stale
    res = run_ranks(_auto, 2, str(path), [5000], timeout=TIMEOUT, init_process_group=False)
    assert res[0][3] is None  # measured, not loaded
    assert res[0][1] == res[1][1] and res[0][0] == res[1][0]  # one decision on every rank
    saved = json.loads(path.read_text())
    assert saved["world_size"] == 2 and saved["seconds"] == res[0][0]["seconds"]
    assert all(t > 0 for ts in saved["seconds"].values() for t in ts)
    assert torch.equal(res[0][2][0], res[1][2][0])


def _hook_on_plain_group(rank, world, path):
    import pycomm.distributed as pd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(512, 512))  # one 262K-element bucket
    state = CompressionState(compressor="auto", start_iter=2, calibration=path)
    model.register_comm_hook(state, compressed_hook)
    for step in range(4):
        model(torch.randn(8, 512, generator=torch.Generator().manual_seed(rank + 10 * step))).sum().backward()
    cal = pd.calibration(state._engine)
    return {"choice": cal.choose(512 * 512 + 512), "grads": torch.cat([p.grad.reshape(-1) for p in model.parameters()])}


def test_hook_runs_auto_on_a_plain_group(tmp_path):
    # Over a plain Gloo group the hook wraps the group with compressor="auto":
    # a calibration is measured (and saved), every bucket runs its choice,
    # and every rank ends with the same gradients.
    path = tmp_path / "cal.json"
    res = run_ranks(_hook_on_plain_group, 2, str(path), timeout=TIMEOUT)
    assert res[0]["choice"] == res[1]["choice"] and res[0]["choice"] in CANDIDATES
    assert torch.equal(res[0]["grads"], res[1]["grads"])
    assert json.loads(path.read_text())["world_size"] == 2
