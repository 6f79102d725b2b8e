"""pd.profile: where the engine's worker thread spends its time. The counts
(calls, inner collectives, forwarded collectives) are exact for a known
sequence of calls; the phases are nested in a call's run time, so they
cannot add up to more than it. No timing bounds: only the structure."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from pycomm.distributed import spec

N, CHUNK = 5000, 2000
CHUNKS = len(spec.chunk_bounds(N, CHUNK))  # 3 of 1667
CALLS = 3
# Elements per call: int4's over 2 ranks above spec.GATHER_NUMEL (its
# two-phase all-reduce), onebit's below (gathered whole).
SIZE = {"onebit": N, "int4": 9000, "topk": N, "fp16": N}


def _rank(rank, world):
    import pycomm.distributed as pd

    out = {}
    for method in ("onebit", "int4", "topk", "fp16"):
        pg = pd.wrap(compressor=method, min_compress_numel=64, chunk_numel=CHUNK)
        fresh = pd.profile(pg)
        for step in range(CALLS):
            pd.all_reduce(torch.randn(SIZE[method]), key=1, group=pg)
        dist.all_reduce(torch.ones(3), group=pg)  # below min_compress_numel: forwarded
        p = pd.profile(pg, reset=True)
        out[method] = (fresh, p, pd.profile(pg))
    pg = pd.wrap(compressor="int8", min_compress_numel=1, chunk_numel=CHUNK)
    pd.reduce_scatter(torch.empty(N), torch.randn(world * N), key=2, group=pg)
    pd.all_gather(torch.empty(world * N), torch.randn(N), key=3, group=pg)
    out["rs+ag"] = pd.profile(pg)
    try:
        pd.profile(pg, reset=1)
        out["bad reset"] = None
    except TypeError as exc:
        out["bad reset"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, timeout=240)


def _per_call(method):
    """Inner collectives per call: a block codec's two-phase all-reduce an
    all_to_all and an all_gather per chunk; a gathered one (topk, a small
    tensor's block codec) an all_gather per chunk; fp16 one all-reduce."""
    if method == "fp16":
        return 1
    chunks = len(spec.chunk_bounds(SIZE[method], CHUNK))
    return chunks if spec.all_reduce_gathers(method, SIZE[method], 2) else 2 * chunks


# Plus the call check's all_gather at the key's first use.
PER_CALL = {m: _per_call(m) for m in SIZE}


@pytest.mark.parametrize("method", list(PER_CALL))
def test_counts_are_exact(results, method):
    assert PER_CALL["int4"] == 2 * 5 and PER_CALL["onebit"] == CHUNKS  # both algorithms counted
    for fresh, p, after_reset in (r[method] for r in results):
        assert fresh["calls"] == 0 and fresh["collectives"] == 0 and fresh["run_s"] == 0
        assert p["calls"] == CALLS
        assert p["forwarded"] == 1
        assert p["collectives"] == 1 + CALLS * PER_CALL[method]
        assert after_reset["calls"] == 0 and after_reset["collectives"] == 0
        assert after_reset["run_s"] == 0 and after_reset["wire_s"] == 0


@pytest.mark.parametrize("method", list(PER_CALL))
def test_phases_are_parts_of_the_run(results, method):
    for _, p, _ in (r[method] for r in results):
        parts = p["check_s"] + p["encode_s"] + p["wire_s"] + p["decode_s"] + p["sync_s"]
        assert p["run_s"] > 0 and p["wire_s"] > 0 and p["encode_s"] > 0 and p["decode_s"] > 0
        assert parts <= p["run_s"] * (1 + 1e-9) + 1e-9
        assert p["other_s"] == pytest.approx(p["run_s"] - parts, abs=1e-9)
        assert all(p[k] >= 0 for k in ("queued_s", "forwarded_s", "check_s", "sync_s"))


def test_reduce_scatter_and_all_gather_are_counted(results):
    for r in results:
        p = r["rs+ag"]
        # Two calls; each a check, an exchange per chunk; the reduce-scatter's
        # residual rollback agreement (a MIN all-reduce).
        assert p["calls"] == 2
        assert p["collectives"] == (1 + CHUNKS + 1) + (1 + CHUNKS)


def test_reset_must_be_a_bool(results):
    assert all("reset must be a bool" in r["bad reset"] for r in results)


def test_bad_group_is_named():
    import pycomm.distributed as pd

    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        pd.profile(object())
