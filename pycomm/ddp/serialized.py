"""Run any DDP communication hook one bucket at a time.

PyTorch's ``powerSGD_hook`` issues its P and Q all-reduces from
``Future.then()`` callbacks (the backend's threads) while DDP calls the hook
for the next bucket on the autograd thread. With two or more buckets on Gloo
the ranks then issue collectives in different orders: Gloo pairs collectives
of different sizes and aborts, or every rank hangs (docs/powersgd_on_gloo.md
has the evidence). :func:`serialized_hook` removes the race without touching
the hook.
"""

# No `from __future__ import annotations`: DDP compares a hook's annotations
# with dist.GradBucket and torch.futures.Future as objects; the wrapper's
# own are left out so that any hook can be wrapped.
import queue
import threading
import traceback
from typing import Any, Callable

import torch

__all__ = ["serialized_hook"]


def serialized_hook(hook: Callable[[Any, Any], torch.futures.Future]) -> Callable[[Any, Any], torch.futures.Future]:
    """Wrap a DDP comm hook so that buckets are reduced strictly one after another.

    ``hook(state, bucket)`` (e.g. ``powerSGD_hook``) runs, unmodified, on one
    worker thread per wrapper, in the order DDP hands the buckets over (the
    bucket index order, the same on every rank); that thread waits until the
    hook's whole future chain (including collectives issued from its
    ``then()`` callbacks) has completed before it starts the next bucket. The
    wrapper returns a future at once, so backward computation still overlaps
    with communication; what is lost is overlap BETWEEN buckets' collectives.

    Example::

        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        from pycomm.ddp import serialized_hook

        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                start_powerSGD_iter=2)
        ddp.register_comm_hook(state, serialized_hook(P.powerSGD_hook))

    Only valid when nothing else issues collectives on the same group while
    the backward pass runs (DDP's ``find_unused_parameters=True`` does: use a
    separate process group for the hook state then).
    """
    if not callable(hook):
        raise TypeError(f"hook must be callable (a DDP comm hook), got {type(hook).__name__}")
    tasks: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()

    def loop() -> None:
        while True:
            tasks.get()()

    threading.Thread(target=loop, name="pycomm-serialized-hook", daemon=True).start()

    def wrapped(state, bucket):
        fut: torch.futures.Future = torch.futures.Future()

        def task() -> None:
            try:
                fut.set_result(hook(state, bucket).wait())
            except BaseException as e:  # noqa: BLE001 - DDP re-raises it
                # DDP's reducer re-raises only str(e) ("Unable to cast <str(e)>
                # to Tensor"): put the hook's traceback into the message.
                fut.set_exception(RuntimeError(f"comm hook raised {type(e).__name__}: {e}\n{traceback.format_exc()}"))

        tasks.put(task)
        return fut

    return wrapped
