"""Hugging Face Trainer: the compressed DDP hook on the model the Trainer
prepares, and each rank's hook state inside the Trainer's own checkpoint
folders.

The Trainer builds its DDP model inside ``train()`` (through Accelerate) and
never calls ``accelerator.save_state``, so neither a comm hook registered
beforehand nor :func:`pycomm.integrations.accelerate.register_hook`'s
checkpointing would reach it. :func:`compress` adds a ``TrainerCallback``
that registers :func:`pycomm.ddp.compressed_hook` when training begins (on
the DDP model, also under ``torch_compile=True``), writes every rank's
:class:`~pycomm.ddp.CompressionState` to ``pycomm_hook_rank{R}.pt`` in each
``checkpoint-N`` folder the Trainer saves, and loads this rank's from the
folder ``train(resume_from_checkpoint=...)`` resumes from, so that a
resumed run continues bit for bit. Gradient accumulation works as DDP's
``no_sync`` does: one hook call per optimizer step.

Example (``torchrun --nproc-per-node 2 train.py``)::

    from transformers import Trainer, TrainingArguments
    from pycomm.integrations.transformers import compress

    trainer = Trainer(model=model, args=TrainingArguments("out", save_steps=100, ...), train_dataset=data)
    state = compress(trainer, compressor="int8", start_iter=10)
    trainer.train()                                  # later: trainer.train(resume_from_checkpoint=True)

Imports transformers when imported.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..ddp import CompressionState, compressed_hook
from . import ddp_of, hook_state, load_rank_file, rank_file

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:
    raise ImportError(
        "pycomm.integrations.transformers needs transformers: pip install transformers "
        "(or pip install 'pycomm[integrations]')"
    ) from exc

__all__ = ["CompressionCallback", "compress", "state_file"]


#: Where rank ``rank``'s hook state lives in a Trainer checkpoint folder.
state_file = rank_file


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CompressionCallback(TrainerCallback):
    """The callback :func:`compress` adds to a Trainer (made by it: it needs
    the Trainer, which callbacks are not given)."""

    def __init__(self, trainer: Any, state: CompressionState, reset_error_feedback: bool) -> None:
        self.trainer = trainer
        self.state = state
        self.reset_error_feedback = reset_error_feedback
        #: The checkpoint folder the current train() resumes from (None: a fresh run).
        self.resume_from: Optional[str] = None
        self._registered: Optional[DistributedDataParallel] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = ddp_of(self.trainer.model_wrapped)
        if ddp is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise TypeError(f"pycomm: the Trainer's model is not DistributedDataParallel "
                            f"(got {type(self.trainer.model_wrapped).__name__}); compress() runs over DDP")
        if ddp is not None and ddp is not self._registered:
            ddp.register_comm_hook(self.state, compressed_hook)
            self._registered = ddp
        if self.resume_from is not None:
            self._load(self.resume_from)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank, after the Trainer wrote the folder (from rank 0).
        folder = os.path.join(self.trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), state_file(folder, _rank()))

    def _load(self, folder: str) -> None:
        load_rank_file(self.state, folder, _rank(), self.reset_error_feedback, "compress")


def compress(trainer: Any, state: Optional[CompressionState] = None, *, reset_error_feedback: bool = False,
             **settings: Any) -> CompressionState:
    """Compress ``trainer``'s DDP gradients with :func:`pycomm.ddp.compressed_hook`
    and keep each rank's hook state in the Trainer's checkpoints. Call it on
    every rank after building the Trainer, before ``train()``. Returns the
    hook's state.

    Args:
        trainer: a ``transformers.Trainer``.
        state: the :class:`~pycomm.ddp.CompressionState`; None: one made
            from ``settings`` (``compressor="int8", start_iter=10``, ...).
        reset_error_feedback: resuming from a checkpoint of another number
            of ranks keeps the iteration and starts the residuals over
            instead of refusing it.

    Example::

        state = compress(trainer, compressor="onebit", block_size=256, start_iter=20)
        trainer.train(resume_from_checkpoint="out/checkpoint-40")
    """
    state = hook_state(state, settings, reset_error_feedback)
    if any(isinstance(cb, CompressionCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("compress() was already called on this Trainer: call it once, with every setting")
    callback = CompressionCallback(trainer, state, reset_error_feedback)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_and_resume(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        # The folder train() resumes from, as the Trainer resolves it: the
        # callbacks are not told.
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(trainer.args.output_dir)
        callback.resume_from = folder if isinstance(folder, (str, os.PathLike)) else None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_and_resume
    return state
