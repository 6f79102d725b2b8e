"""Multi-process test harness: run a function on W local ranks, bounded in time.

Example (in a test module; ``fn`` must be a module-level function so that the
spawned processes can import it)::

    import torch, torch.distributed as dist
    from _dist import run_ranks

    def _sum_ranks(rank, world_size):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]

Each rank is a fresh process ("spawn" context) that initializes
torch.distributed on 127.0.0.1 with a free port (Gloo by default), runs
``fn(rank, world_size, *args)`` and destroys the process group. Return values
(anything picklable, tensors included) come back in rank order. A rank's
exception is re-raised in the parent as :class:`RankError` carrying the rank
and the child's traceback text; a run that exceeds ``timeout`` kills every
rank and raises :class:`TimeoutError` naming the ranks that did not finish.

``init_process_group=False`` initializes nothing: the ranks only get
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK (and, in
``PYCOMM_TEST_TIMEOUT``, the process-group timeout to use in seconds), so a
backend test can call its own init (e.g. ``pycomm.distributed.
init_process_group``) with ``init_method="env://"`` or the address it likes.
The harness still destroys whatever default group is left at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["RankError", "free_port", "run_ranks", "pg_timeout_for", "reinit_on_a_new_port"]

_HOST = "127.0.0.1"


class RankError(RuntimeError):
    """A rank raised: ``rank`` is which, ``remote_traceback`` the child's text."""

    def __init__(self, rank: int, remote_traceback: str, others: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        msg = f"rank {rank} raised:\n{remote_traceback}"
        if others:
            msg += f"\n{others}"
        super().__init__(msg)


def refusal(fn: Callable[[], Any]) -> Optional[str]:
    """The ValueError ``fn()`` raises, as text (None if it returns): what a
    rank reports back about a call that must be refused."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def reinit_on_a_new_port(rank: int) -> None:
    """Destroy the default group; the next ``init_method="env://"`` group
    meets on a fresh port. On the old port a fast rank could read the old
    group's addresses from a store that is still up and connect to a socket
    that is gone (a "connection reset" in the next init)."""
    import torch.distributed as dist

    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def pg_timeout_for(timeout: float) -> float:
    """Process-group timeout for a harness timeout: a bit under it, so that a
    hung collective raises inside the rank (with a traceback) before the
    harness has to kill it."""
    return max(1.0, min(timeout * 0.85, timeout - 5.0))


def _child(fn, rank, world_size, args, port, backend, init, pg_timeout, threads, results):
    # Everything the parent sees goes through `results` as plain pickled bytes
    # (pickle.dumps, not the queue's ForkingPickler: that would share tensor
    # storage through file descriptors, which die with this process).
    os.environ.update(
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        PYCOMM_TEST_TIMEOUT=str(pg_timeout),
    )
    status, payload = "err", b""
    dist = None
    try:
        import torch
        import torch.distributed as dist

        if threads is not None:
            # W ranks share a few cores: one intra-op thread each avoids
            # oversubscription and makes float results independent of load.
            torch.set_num_threads(threads)
        if init:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{_HOST}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
            )
        value = fn(rank, world_size, *args)
        status, payload = "ok", pickle.dumps(value)
    except BaseException:  # noqa: BLE001 - report anything, even SystemExit
        status, payload = "err", traceback.format_exc().encode()
    try:
        # Report (and flush) BEFORE tearing the group down: a failing rank's
        # own error then reaches the parent before its peers' "connection
        # closed" errors that the teardown causes.
        results.put((rank, status, payload))
        results.close()
        results.join_thread()
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: Optional[str] = "gloo",
    init_process_group: bool = True,
    threads: Optional[int] = 1,
    may_die: Sequence[int] = (),
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Returns the per-rank return values in rank order. ``backend`` is the
    backend given to ``init_process_group`` (ignored with
    ``init_process_group=False``). ``threads`` sets ``torch.set_num_threads``
    in every rank (None leaves torch's default). Raises :class:`RankError`
    for the first rank to report a failure (the others' last lines follow),
    :class:`TimeoutError` if the ranks have not all finished after
    ``timeout`` seconds (all ranks are killed first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    pg_timeout = pg_timeout_for(timeout)
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, args, port, backend, init_process_group, pg_timeout, threads, results),
            name=f"rank{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)

    done: dict = {}
    errors: dict = {}
    exited_at: dict = {}  # rank -> when its process was first seen gone
    deadline = time.monotonic() + timeout
    grace_end = None  # after a failure, the others get a short grace period
    try:
        while len(done) < world_size:
            now = time.monotonic()
            end = deadline if grace_end is None else min(deadline, grace_end)
            if now >= end:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.2, end - now))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM
                # kill) never will: after a second (its message could still be
                # in flight) record it instead of waiting out the timeout.
                for r, p in enumerate(procs):
                    if r in done or p.exitcode is None:
                        continue
                    exited_at.setdefault(r, now)
                    if now - exited_at[r] > 1.0:
                        done[r] = None
                        if r not in may_die:
                            errors[r] = f"process exited with code {p.exitcode} without reporting\n"
                            grace_end = grace_end or now + 3.0
                continue
            if rank in done:
                continue
            if status == "ok":
                done[rank] = pickle.loads(payload)
            else:
                done[rank] = None
                errors[rank] = payload.decode(errors="replace")
                # Peers of a failed rank usually hang in a collective: let them
                # report their own error briefly, then stop waiting.
                grace_end = grace_end or time.monotonic() + 3.0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        results.close()

    if errors:
        # The first rank to report is usually the cause; the others typically
        # fail because it left (connection closed) or timed out waiting.
        first = next(iter(errors))
        others = [f"rank {r}: {errors[r].strip().splitlines()[-1]}" for r in sorted(errors) if r != first]
        missing = [r for r in range(world_size) if r not in done]
        if missing:
            others.append(f"ranks {missing} did not finish (killed)")
        raise RankError(first, errors[first], "\n".join(others))
    missing = [r for r in range(world_size) if r not in done]
    if missing:
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s; all ranks were killed"
        )
    return [done[r] for r in range(world_size)]


def subprocess_env() -> dict:
    """``os.environ`` for a ``python -m pycomm...`` or ``python -m
    pycomm_bench`` subprocess: works from a source checkout too (the
    subprocess finds this checkout's pycomm and benchmark harness, bench/,
    first)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "bench"), env.get("PYTHONPATH")) if p)
    return env
