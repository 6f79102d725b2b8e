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

:func:`attach` does the same for a compressed-momentum optimizer given to
the Trainer (``Trainer(optimizers=(OneBitAdam(...), None))``): it attaches
it to the DDP model the Trainer prepares (after the warm-up DDP sends
nothing; the optimizer all-reduces the momenta), writes every rank's
optimizer state to ``pycomm_optimizer_rank{R}.pt`` and, on resume, loads
this rank's where the Trainer would load rank 0's ``optimizer.pt`` on every
rank (whose residuals are rank 0's).

Example (``torchrun --nproc-per-node 2 train.py``)::

    from transformers import Trainer, TrainingArguments
    from pycomm.integrations.transformers import compress

    trainer = Trainer(model=model, args=TrainingArguments("out", save_steps=100, ...), train_dataset=data)
    state = compress(trainer, compressor="int8", start_iter=10)
    trainer.train()                                  # later: trainer.train(resume_from_checkpoint=True)

    # or the momenta compressed instead of the gradients:
    opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=100)
    trainer = Trainer(model=model, args=..., train_dataset=data, optimizers=(opt, None))
    attach(trainer)

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
from ..optim.base import _CompressedMomentum
from . import ddp_of, hook_state, load_rank_file, rank_file, read_rank_file

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:
    raise ImportError(
        "pycomm.integrations.transformers needs transformers: pip install transformers "
        "(or pip install 'pycomm[integrations]')"
    ) from exc

__all__ = ["CompressionCallback", "OptimizerCallback", "attach", "compress", "state_file"]


#: Where rank ``rank``'s hook state lives in a Trainer checkpoint folder.
state_file = rank_file


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _PerRankCallback(TrainerCallback):
    """What the callbacks share: the Trainer (callbacks are not given it),
    the checkpoint folder the current ``train()`` resumes from, and this
    rank's file (``what``) in each checkpoint folder the Trainer saves."""

    what = ""

    def __init__(self, trainer: Any, reset_error_feedback: bool) -> None:
        self.trainer = trainer
        self.reset_error_feedback = reset_error_feedback
        #: The checkpoint folder the current train() resumes from (None: a fresh run).
        self.resume_from: Optional[str] = None
        self._registered: Optional[DistributedDataParallel] = None

    def _ddp(self) -> Optional[DistributedDataParallel]:
        """The Trainer's DDP model when it is one not seen before (None otherwise)."""
        ddp = ddp_of(self.trainer.model_wrapped)
        if ddp is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise TypeError(f"pycomm: the Trainer's model is not DistributedDataParallel "
                            f"(got {type(self.trainer.model_wrapped).__name__}); pycomm runs over DDP")
        if ddp is None or ddp is self._registered:
            return None
        self._registered = ddp
        return ddp

    def _saved(self) -> Any:
        raise NotImplementedError  # each callback's state

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank, after the Trainer wrote the folder (from rank 0).
        folder = os.path.join(self.trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self._saved(), rank_file(folder, _rank(), self.what))


def _add(trainer: Any, callback: _PerRankCallback, how: str) -> None:
    """Add ``callback`` to ``trainer`` (once) and let it know the folder each
    ``train()`` resumes from, as the Trainer resolves it (callbacks are not told)."""
    if any(isinstance(cb, type(callback)) for cb in trainer.callback_handler.callbacks):
        raise ValueError(f"{how}() was already called on this Trainer: call it once, with every setting")
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_and_resume(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(trainer.args.output_dir)
        callback.resume_from = folder if isinstance(folder, (str, os.PathLike)) else None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_and_resume


class CompressionCallback(_PerRankCallback):
    """The callback :func:`compress` adds to a Trainer: the hook on its DDP
    model, each rank's hook state in its checkpoints."""

    what = "hook"

    def __init__(self, trainer: Any, state: CompressionState, reset_error_feedback: bool) -> None:
        super().__init__(trainer, reset_error_feedback)
        self.state = state

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp.register_comm_hook(self.state, compressed_hook)
        if self.resume_from is not None:
            load_rank_file(self.state, self.resume_from, _rank(), self.reset_error_feedback, "compress")

    def _saved(self) -> Any:
        return self.state.state_dict()


class OptimizerCallback(_PerRankCallback):
    """The callback :func:`attach` adds to a Trainer: the optimizer attached
    to its DDP model, each rank's optimizer state in its checkpoints."""

    what = "optimizer"

    def __init__(self, trainer: Any, optimizer: _CompressedMomentum, overlap: bool,
                 reset_error_feedback: bool) -> None:
        super().__init__(trainer, reset_error_feedback)
        self.optimizer = optimizer
        self.overlap = overlap

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self._ddp()
        if ddp is not None:
            self.optimizer.attach(ddp, overlap=self.overlap)

    def _saved(self) -> Any:
        return self.optimizer.state_dict()

    def load(self, trainer_load: Any, checkpoint: Optional[str]) -> Any:
        """The Trainer's ``_load_optimizer_and_scheduler(checkpoint)``, with
        this rank's optimizer state loaded where the Trainer hands every
        rank rank 0's ``optimizer.pt``."""
        if checkpoint is None:
            return trainer_load(checkpoint)
        own = read_rank_file(checkpoint, _rank(), self.reset_error_feedback, "attach", self.what)
        opt, reset = self.optimizer, self.reset_error_feedback
        loaded = []

        def load_own(state_dict: Any) -> None:  # the Trainer's copy of rank 0's state is set aside
            type(opt).load_state_dict(opt, own, reset_error_feedback=reset)
            loaded.append(True)

        opt.load_state_dict = load_own  # for the Trainer's one call, through Accelerate's wrapper
        try:
            out = trainer_load(checkpoint)
        finally:
            del opt.load_state_dict
        if not loaded:
            raise RuntimeError(f"pycomm: the Trainer resumed from {checkpoint} without loading its optimizer state; "
                               f"this transformers version loads it another way, which attach() does not follow")
        return out


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
    _add(trainer, CompressionCallback(trainer, state, reset_error_feedback), "compress")
    return state


def attach(trainer: Any, overlap: bool = False, reset_error_feedback: bool = False) -> _CompressedMomentum:
    """Run ``trainer`` with the compressed-momentum optimizer it was given
    (``Trainer(..., optimizers=(OneBitAdam(...), scheduler or None))``):
    attached to the DDP model the Trainer prepares (``optimizer.attach``:
    exact gradients during the warm-up, then the momenta all-reduced
    compressed and DDP's all-reduce skipped), each rank's optimizer state
    saved in the Trainer's checkpoint folders and this rank's loaded when
    ``train(resume_from_checkpoint=...)`` resumes (the Trainer itself
    saves rank 0's state and loads it on every rank). Call it on every rank
    after building the Trainer, before ``train()``. Returns the optimizer.

    After the warm-up each rank's gradients stay local, so the Trainer's
    gradient clipping (``max_grad_norm``) clips each rank's own; with
    ``overlap=True`` the momenta go out during backward and clipping has no
    effect (``optimizer.attach``).

    Args:
        trainer: a ``transformers.Trainer`` given a pycomm optimizer.
        overlap: ``optimizer.attach(ddp, overlap=...)``.
        reset_error_feedback: resuming from a checkpoint of another number
            of ranks keeps the rest and starts the residuals over instead of
            refusing it.

    Example::

        opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=100)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        attach(trainer)
        trainer.train()                      # later: trainer.train(resume_from_checkpoint=True)
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if not isinstance(reset_error_feedback, bool):
        raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
    optimizer = trainer.optimizer
    if not isinstance(optimizer, _CompressedMomentum):
        raise TypeError(f"attach() needs a Trainer given a pycomm optimizer (Trainer(..., optimizers=(OneBitAdam(...), "
                        f"None))), got {type(optimizer).__name__}")
    trainer_load = getattr(trainer, "_load_optimizer_and_scheduler", None)
    if trainer_load is None:
        raise RuntimeError("pycomm: this transformers version's Trainer has no _load_optimizer_and_scheduler, "
                           "which attach() follows to load each rank's optimizer state")
    callback = OptimizerCallback(trainer, optimizer, overlap, reset_error_feedback)
    _add(trainer, callback, "attach")
    trainer._load_optimizer_and_scheduler = functools.partial(callback.load, trainer_load)
    return optimizer
