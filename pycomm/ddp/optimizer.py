"""The DDP communication hook of the compressed-momentum optimizers
(:meth:`pycomm.optim.OneBitAdam.attach`): the exact average of the
gradients while the optimizer needs one (its warm-up, OneBitAdam's variance
updates); otherwise no gradient communication at all (the optimizer
all-reduces the momenta, compressed), or, with ``overlap=True``, each
bucket's momenta sent compressed from the hook while backward runs, for
``step()`` to apply (the shape of PyTorch's ``_hook_then_optimizer``, with
the optimizer's own communication in place of the gradients').

The hook's state is the optimizer's coupling with the model
(:class:`pycomm.optim.ddp.DDPCoupling`: DDP's group, the optimizer, and the
overlapped bucket calls). Bucket tracking (which backward pass of this
process, the bucket's layout) and error delivery are the ones the
compressed-gradient hook uses (:mod:`pycomm.ddp.buckets`).
"""

# No `from __future__ import annotations`: DDP compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor].
from typing import Any

import torch
import torch.distributed as dist

from .buckets import failed

__all__ = ["optimizer_hook"]


def optimizer_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact average during the optimizer's warm-up and its exact steps
    after it; otherwise the local gradient as it is (with ``overlap=True``:
    the bucket's momenta sent, compressed). A failure is raised by
    ``loss.backward()`` as a RuntimeError with its text (DDP ends the pass:
    the optimizer's refusals leave the model to go on). ``state``: the
    optimizer's :class:`pycomm.optim.ddp.DDPCoupling`.

    Example (what ``opt.attach(model)`` registers)::

        model.register_comm_hook(pycomm.optim.ddp.couple(opt, model, False, None), optimizer_hook)
    """
    tensor = bucket.buffer()
    opt = state.optimizer
    stable = opt._tracker.start(bucket)
    try:
        if opt.exact_now:
            work = opt._exact_average(tensor, state.process_group)
        elif state.overlap:
            work = state.send(bucket, stable)  # None: nothing of this bucket goes out now
        else:
            work = None
    except Exception as exc:  # noqa: BLE001 - raised by backward()
        return failed(exc, as_itself=False)
    if work is not None:
        # DDP waits for it at the end of backward; the gradients stay local
        # unless it averaged them.
        return work.get_future().then(lambda _: tensor)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done
