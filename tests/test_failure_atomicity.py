"""A compressed call that fails part-way (here: a compressor raising at its
second chunk on every rank) leaves every residual as it was before the call,
as a non-finite one does, for the all-reduce, the reduce-scatter and the
all-gather; and the group keeps working afterwards."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import plugin_flaky  # noqa: F401  (registers "flaky")

N = 3000
# Compress calls per call: all-reduce and all-gather 3 (chunks of 1000); the
# reduce-scatter 4 (2 chunks of the 1500-element shard x 2 destinations).
FAIL_AT = {"all_reduce": 5, "reduce_scatter": 6, "all_gather": 5}


def _rank(rank, world, collective):
    import plugin_flaky  # noqa: F401

    import pycomm.distributed as pd

    # The first call succeeds; the second fails at its second compress (the
    # first one's residual already updated in place).
    pg = pd.wrap(compressor="flaky", compressor_options={"fail_at": FAIL_AT[collective]}, min_compress_numel=1,
                 chunk_numel=1000)
    gen = torch.Generator().manual_seed(rank)

    def call():
        if collective == "all_reduce":
            pd.all_reduce(torch.randn(N, generator=gen) / 3, key=4, group=pg)
        elif collective == "reduce_scatter":
            pd.reduce_scatter(torch.empty(N // world), torch.randn(N, generator=gen) / 3, key=4, group=pg)
        else:
            pd.all_gather(torch.empty(N * world), torch.randn(N, generator=gen) / 3, key=4, group=pg)

    call()
    before = pd.error_feedback_state(pg)[4]["worker"].clone()
    try:
        call()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = pd.error_feedback_state(pg)[4]["worker"]
    check = torch.ones(4)
    pd.all_reduce(check, group=pd.wrap(compressor="none"))  # the ranks are still in step
    return error, before, after, check


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_failed_call_leaves_residuals_as_they_were(collective):
    for error, before, after, check in run_ranks(_rank, 2, collective, timeout=90):
        assert error is not None and f"failing at call {FAIL_AT[collective]} on purpose" in error, error
        assert before.abs().sum() > 0  # the first call left residuals
        assert torch.equal(before, after)
        assert check.tolist() == [2.0] * 4
