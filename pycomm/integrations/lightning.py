"""Lightning: compressed gradients with ``DDPStrategy`` on every device type,
and the hook's state of every rank in Lightning's checkpoints.

Lightning's ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers
a comm hook only on CUDA (on CPU it trains with exact gradients and says
nothing) and keeps its state out of the checkpoint. Use
:class:`CompressionCallback` instead: it registers
:func:`pycomm.ddp.compressed_hook` on the DDP model at ``on_fit_start``,
whatever the device, and saves every rank's
:class:`~pycomm.ddp.CompressionState` (iteration, bucket layout, this rank's
error-feedback residuals) in the checkpoint Lightning writes, so that
``trainer.fit(model, ckpt_path=...)`` resumes them.

Example (``python train.py``: Lightning starts the 2 processes)::

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy
    from pycomm.integrations.lightning import CompressionCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(),
                        callbacks=[CompressionCallback(compressor="onebit", block_size=256,
                                                       start_iter=10)])
    trainer.fit(model)                         # compressed from iteration 10 on
    trainer.fit(model, ckpt_path="last.ckpt")  # residuals restored, each rank its own

Imports Lightning (``lightning``, else ``pytorch_lightning``) when imported.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..ddp import CompressionState, compressed_hook
from . import PerRankState

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError(
            "pycomm.integrations.lightning needs Lightning: pip install lightning "
            "(or pip install 'pycomm[integrations]')"
        ) from exc

__all__ = ["CompressionCallback"]


class CompressionCallback(Callback):
    """Compress DDP's gradient all-reduce with :func:`pycomm.ddp.compressed_hook`
    and keep the hook's state of every rank in Lightning's checkpoints.

    Args:
        state: the :class:`~pycomm.ddp.CompressionState` to use; None: one
            made from ``settings`` (the arguments of ``CompressionState``,
            e.g. ``compressor="topk", density=0.01, start_iter=10``).
        reset_error_feedback: when resuming from a checkpoint of another
            number of ranks (or another model), keep the iteration and start
            the residuals over instead of refusing it.

    The hook is registered at ``on_fit_start`` on the model the strategy
    wrapped in ``DistributedDataParallel`` (``DDPStrategy``, any device,
    any backend, e.g. ``process_group_backend=pycomm.integrations.backend(...)``).
    With one process there is nothing to reduce and nothing is registered.
    Do not also pass ``ddp_comm_hook`` to the strategy.

    The checkpoint Lightning writes (on rank 0) holds every rank's state
    under ``checkpoint["callbacks"]["pycomm.CompressionCallback"]``: building
    it gathers the states to rank 0 (Lightning builds checkpoints on every
    rank). Its size is about the gradient's, in float32, per rank (onebit:
    a little more).

    Example::

        >>> cb = CompressionCallback(compressor="topk", density=0.01, start_iter=10)
        >>> cb.state.compressor, cb.state_key
        ('topk', 'pycomm.CompressionCallback')
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, callbacks=[cb])   # doctest: +SKIP
    """

    def __init__(self, state: Optional[CompressionState] = None, *, reset_error_feedback: bool = False,
                 **settings: Any) -> None:
        super().__init__()
        if state is not None and settings:
            raise TypeError(f"pass either a CompressionState or its settings, not both (got {sorted(settings)})")
        self.state = state if state is not None else CompressionState(**settings)
        self._ranks = PerRankState(self.state, reset_error_feedback=reset_error_feedback)
        self._registered_on: Optional[DistributedDataParallel] = None

    @property
    def state_key(self) -> str:
        return "pycomm.CompressionCallback"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        model = getattr(strategy, "model", None)
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                "CompressionCallback registers pycomm's hook itself: do not also pass ddp_comm_hook "
                "to the strategy"
            )
        if not isinstance(model, DistributedDataParallel):
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise TypeError(
                    f"CompressionCallback compresses DistributedDataParallel's gradients: use "
                    f"strategy='ddp' (DDPStrategy); {type(strategy).__name__} wrapped the model in "
                    f"{type(model).__name__}"
                )
            return  # one process: nothing to reduce
        if model is self._registered_on:
            return  # a second fit() on the same wrapped model
        model.register_comm_hook(self.state, compressed_hook)
        self._registered_on = model

    def state_dict(self) -> Dict[str, Any]:
        return self._ranks.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._ranks.load_state_dict(state_dict)
