"""Failing and slow ranks: a rank killed with SIGKILL in the middle of a run
makes every other rank raise within the configured timeout, naming itself,
the operation and (with two ranks) the peer; a rank that is merely slow,
for less than the timeout, changes nothing. Both entry points: the "pycomm"
backend and the DDP hook over plain Gloo (which runs the same engine).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.ddp import CompressionState, compressed_hook

PG_TIMEOUT = 5.0  # seconds: the process-group timeout the ranks configure
N = 300_000


def _die_or_fail(rank, world, path, victim_step, model_steps=6):
    """Runs compressed all-reduces; the last rank SIGKILLs itself at
    `victim_step`. The others return how long their failing call took and
    the error message."""
    import pycomm.distributed as pd

    timeout = timedelta(seconds=PG_TIMEOUT)
    if path == "backend":
        pd.init_process_group(compressor="onebit", backend="gloo", init_method="env://", timeout=timeout)

        def step(i):
            pd.all_reduce(torch.randn(N), key=3, op="avg")
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        model = DDP(nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 512)), bucket_cap_mb=0.5)
        model.register_comm_hook(CompressionState(compressor="topk", start_iter=2), compressed_hook)

        def step(i):
            model(torch.randn(8, 64)).sum().backward()

    for i in range(model_steps):
        if rank == world - 1 and i == victim_step:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            step(i)
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            return {"error": f"{type(exc).__name__}: {exc}", "step": i}
    return {"error": None, "step": None}


@pytest.mark.parametrize("path", ["backend", "hook"])
@pytest.mark.parametrize("world", [2, 4])
def test_killed_rank_makes_the_others_raise_in_time(path, world):
    victim_step = 3  # after the hook's warm-up, in compressed steps
    # The bound on how long noticing may take is the harness timeout itself:
    # a survivor still waiting then fails the test (no elapsed-time assert).
    results = run_ranks(_die_or_fail, world, path, victim_step, timeout=PG_TIMEOUT + 40,
                        init_process_group=False, may_die=[world - 1])
    assert results[world - 1] is None  # killed, never reported
    for rank, res in enumerate(results[: world - 1]):
        assert res["error"] is not None, f"rank {rank} did not notice the dead peer"
        assert res["step"] == victim_step, res
        msg = res["error"]
        assert f"pycomm rank {rank} of {world}" in msg, msg
        if path == "backend":
            assert f"all_reduce key=3 {N} float32 onebit avg failed" in msg, msg
        else:
            assert "all_reduce key=" in msg and "float32 topk avg failed" in msg, msg
        if world == 2:
            assert "(peer: rank 1)" in msg, msg


def _slow_rank(rank, world):
    """The same all-reduce twice (fresh residuals each time): the second with
    rank 1 sleeping 2.5 s (far under the timeout) before its call."""
    import pycomm.distributed as pd

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, generator=g)
    out = []
    pg = pd.wrap(compressor="onebit")
    for key, sleep in ((0, 0.0), (1, 2.5 if rank == 1 else 0.0)):
        y = x.clone()
        time.sleep(sleep)
        pd.all_reduce(y, key=key, group=pg, op="avg")
        out.append(y)
    return out


def test_slow_rank_changes_nothing():
    results = run_ranks(_slow_rank, 2, timeout=60)
    for rank, (fast, slow) in enumerate(results):
        assert torch.equal(fast, slow), f"rank {rank}: the slow call gave another result"
        assert torch.equal(slow, results[0][1])
