"""Accelerate: the compressed hook on the prepared model, and each rank's hook
state in ``accelerator.save_state`` / ``load_state``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its
own ``DDPCommunicationHookType`` (any other hook is ignored without a word),
and ``accelerator.register_for_checkpointing(obj)`` saves rank 0's object
alone, which the other ranks then load. :func:`register_hook` does both
right: it registers :func:`pycomm.ddp.compressed_hook` on the model
``accelerator.prepare`` returned, and saves every rank's
:class:`~pycomm.ddp.CompressionState` to its own file of the checkpoint
folder (``pycomm_hook_rank{R}.pt``, as Accelerate does for each rank's RNG
state), restored by ``load_state``.

Example (``torchrun --nproc-per-node 2 train.py``)::

    from accelerate import Accelerator
    from pycomm.integrations import init_process_group
    from pycomm.integrations.accelerate import register_hook

    init_process_group("onebit", block_size=256)  # optional: the pycomm backend (CPU too)
    accelerator = Accelerator(cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_hook(accelerator, model, compressor="onebit", block_size=256, start_iter=10)
    ...
    accelerator.save_state("ckpt")     # every rank writes ckpt/pycomm_hook_rank{R}.pt
    accelerator.load_state("ckpt")     # every rank reads its own

Imports Accelerate when imported.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..ddp import CompressionState, compressed_hook
from . import ddp_of, hook_state, load_rank_file, rank_file

try:
    import accelerate  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "pycomm.integrations.accelerate needs Accelerate: pip install accelerate "
        "(or pip install 'pycomm[integrations]')"
    ) from exc

__all__ = ["register_hook", "state_file"]


#: Where :func:`register_hook` saves rank ``rank``'s hook state in a checkpoint folder.
state_file = rank_file


def register_hook(accelerator: Any, model: Any, state: Optional[CompressionState] = None, *,
                  reset_error_feedback: bool = False, **settings: Any) -> CompressionState:
    """Register :func:`pycomm.ddp.compressed_hook` on ``model`` (what
    ``accelerator.prepare`` returned) and checkpoint each rank's hook state
    with ``accelerator.save_state`` / ``load_state``. Returns the state.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the prepared model: ``DistributedDataParallel`` with several
            processes (or ``torch.compile``'s wrapper around it); with one
            process nothing is registered (nothing to reduce), the state is
            still saved and loaded.
        state: the :class:`~pycomm.ddp.CompressionState`; None: one made
            from ``settings`` (``compressor="onebit", start_iter=10``, ...).
        reset_error_feedback: on ``load_state`` from a checkpoint of another
            number of ranks, keep the iteration and start the residuals over
            instead of refusing it.

    Call it after ``prepare`` and before the first backward pass, and before
    ``load_state`` when resuming. Raises if the accelerator was given
    ``DistributedDataParallelKwargs(comm_hook=...)`` with anything but
    ``DDPCommunicationHookType.NO`` (two hooks cannot both run).

    Example::

        model, opt = accelerator.prepare(model, opt)
        state = register_hook(accelerator, model, compressor="topk", density=0.01)
    """
    state = hook_state(state, settings, reset_error_feedback)
    handler = getattr(accelerator, "ddp_handler", None)
    hook = getattr(handler, "comm_hook", None)
    if hook is not None and getattr(hook, "value", hook) != "no":
        raise ValueError(
            f"the accelerator has DistributedDataParallelKwargs(comm_hook={hook!r}): Accelerate takes only "
            f"its own DDPCommunicationHookType there (a pycomm hook would be ignored), and a second hook "
            f"cannot run; leave comm_hook unset and let register_hook register pycomm's"
        )
    if ddp_of(model) is not None:  # also under torch.compile (an OptimizedModule around it)
        ddp_of(model).register_comm_hook(state, compressed_hook)
    elif accelerator.num_processes > 1:
        raise TypeError(
            f"model must be the DistributedDataParallel model accelerator.prepare(model) returned, "
            f"got {type(model).__name__}"
        )

    def rank() -> int:
        return dist.get_rank() if dist.is_initialized() else accelerator.process_index

    def save(models, weights, output_dir) -> None:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state.state_dict(), state_file(output_dir, rank()))

    def load(models, input_dir) -> None:
        load_rank_file(state, input_dir, rank(), reset_error_feedback, "register_hook")

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state
