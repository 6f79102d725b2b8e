"""The multi-process test harness (tests/_dist.py): a failing rank ends the
run at once with its error, a hanging one within the timeout, named."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _dist import RankError, run_ranks


def _rank_fails(rank, world):
    # init_process_group=False: the harness only set the environment (as for
    # a backend test that initializes its own group).
    import os
    from datetime import timedelta

    timeout = timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"]))
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    if rank == 1:
        raise KeyError("boom on rank one")
    dist.barrier()  # rank 0 would wait here until the timeout without the harness


def test_harness_reports_rank_errors_quickly():
    # Rank 0 waits in a barrier that only the harness ends: the error that
    # comes out is rank 1's own, not rank 0's later timeout.
    with pytest.raises(RankError, match="boom on rank one") as info:
        run_ranks(_rank_fails, 2, timeout=60.0, init_process_group=False)
    assert info.value.rank == 1


def _rank_hangs(rank, world):
    if rank == 1:
        import time

        time.sleep(600)  # never reports
    return rank


def test_harness_times_out_naming_the_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish"):
        # No process group (nothing to wait for at start-up); the timeout only
        # has to cover spawning and importing torch on a loaded machine.
        run_ranks(_rank_hangs, 2, timeout=12.0, init_process_group=False)
