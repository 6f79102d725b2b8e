"""pycomm with training frameworks: small adapters where a framework needs one.

The frameworks stay optional: this package imports none of them; each
adapter module imports its own when it is imported.

* :mod:`pycomm.integrations.lightning`: :class:`~pycomm.integrations.lightning.CompressionCallback`
  registers the hook on every device type (Lightning's ``DDPStrategy``
  registers comm hooks on CUDA only) and keeps every rank's hook state in
  Lightning's checkpoint.
* :mod:`pycomm.integrations.accelerate`: :func:`~pycomm.integrations.accelerate.register_hook`
  registers the hook on the model ``accelerator.prepare`` returned and saves
  each rank's hook state with ``save_state`` / ``load_state``.
* :mod:`pycomm.integrations.transformers`: :func:`~pycomm.integrations.transformers.compress`
  registers the hook on the DDP model a Hugging Face Trainer prepares and
  keeps each rank's hook state in the Trainer's checkpoint folders;
  :func:`~pycomm.integrations.transformers.attach` does the same for a
  OneBitAdam or OneBitSGD given as the Trainer's optimizer.
* :mod:`pycomm.integrations.torchft`: :class:`~pycomm.integrations.torchft.FaultTolerantDiLoCo`
  runs :class:`pycomm.optim.DiLoCo`'s compressed outer sync inside torchft's
  fault tolerance (its Manager's quorum, healing and commit): replicas
  that leave and rejoin (docs/across_sites.md).
* Here, for frameworks that take only a backend name or initialize
  torch.distributed themselves: :func:`backend` (a backend name that carries
  pycomm's settings) and :func:`init_process_group` (the default group, from
  the launcher's environment, before the framework starts).
* :class:`PerRankState`: a checkpointable object that saves every rank's
  hook state where a framework saves one object from one rank.

Example (Lightning, 2 CPU processes)::

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy
    from pycomm.integrations import backend
    from pycomm.integrations.lightning import CompressionCallback

    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=DDPStrategy(process_group_backend=backend("onebit", block_size=256)),
                        callbacks=[CompressionCallback(compressor="onebit", block_size=256)])
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import distributed as pd
from ..ddp import CompressionState

__all__ = ["PerRankState", "backend", "ddp_of", "hook_state", "init_process_group", "load_rank_file", "rank_file",
           "read_rank_file"]

#: Backend names registered by :func:`backend`, and their settings.
_REGISTERED: Dict[str, Dict[str, Any]] = {}


def ddp_of(model: Any) -> Optional[DistributedDataParallel]:
    """The DDP model inside what a framework prepared (``torch.compile``
    wraps it in an ``OptimizedModule``), or None.

    >>> ddp_of(torch.nn.Linear(2, 2)) is None
    True
    """
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DistributedDataParallel) else None


def hook_state(state: Optional[CompressionState], settings: Dict[str, Any],
               reset_error_feedback: Any) -> CompressionState:
    """The arguments every adapter takes, checked: a hook state or the
    settings to make one, and the ``reset_error_feedback`` flag."""
    if state is not None and settings:
        raise TypeError(f"pass either a CompressionState or its settings, not both (got {sorted(settings)})")
    if not isinstance(reset_error_feedback, bool):
        raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
    state = state if state is not None else CompressionState(**settings)
    if not isinstance(state, CompressionState):
        raise TypeError(f"state must be a pycomm.ddp.CompressionState, got {type(state).__name__}")
    return state


def rank_file(directory: str, rank: int, what: str = "hook") -> str:
    """Where an adapter keeps rank ``rank``'s state (``what``: "hook" or
    "optimizer") in a checkpoint folder, beside the framework's own files.

    >>> rank_file("ckpt/checkpoint_3", 1)
    'ckpt/checkpoint_3/pycomm_hook_rank1.pt'
    >>> rank_file("ckpt/checkpoint_3", 0, "optimizer")
    'ckpt/checkpoint_3/pycomm_optimizer_rank0.pt'
    """
    return os.path.join(directory, f"pycomm_{what}_rank{rank}.pt")


def read_rank_file(directory: str, rank: int, reset_error_feedback: bool, how: str,
                   what: str = "hook") -> Dict[str, Any]:
    """Rank ``rank``'s saved state from a checkpoint folder; ``how``: the
    adapter call that saves it, for the error. A folder saved by fewer
    ranks gives rank 0's, with ``reset_error_feedback`` (whose load keeps
    all but the residuals)."""
    path = rank_file(directory, rank, what)
    if not os.path.exists(path):
        fallback = rank_file(directory, 0, what)
        if reset_error_feedback and os.path.exists(fallback):
            path = fallback  # more ranks than saved: all but the residuals
        else:
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint holds no pycomm {what} state for rank {rank} (saved without "
                f"{how}, or by fewer ranks; {how}(..., reset_error_feedback=True) starts the residuals over)")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_rank_file(state: CompressionState, directory: str, rank: int, reset_error_feedback: bool,
                   how: str) -> None:
    """Load rank ``rank``'s hook state from a checkpoint folder into
    ``state`` (:func:`read_rank_file`)."""
    state.load_state_dict(read_rank_file(directory, rank, reset_error_feedback, how),
                          reset_error_feedback=reset_error_feedback)


def _options(compressor: str, settings: Dict[str, Any]) -> pd.PycommOptions:
    if "inner" in settings and settings["inner"] is None:
        settings = {k: v for k, v in settings.items() if k != "inner"}
    return pd.PycommOptions(compressor=compressor, **settings)


def backend(compressor: str = "onebit", *, name: Optional[str] = None, **settings: Any) -> str:
    """A torch.distributed backend name whose groups are pycomm groups with
    these settings, for a framework that takes only a backend name
    (Lightning's ``DDPStrategy(process_group_backend=...)``, Accelerate's
    ``InitProcessGroupKwargs(backend=...)`` on GPUs, ``dist.init_process_group``).

    ``settings`` are those of :class:`pycomm.distributed.PycommOptions`
    (``block_size``, ``density``, ``min_compress_numel``, ``inner``, ...),
    checked here. The name is ``name``, or one derived from the settings
    (the same in every process). Every process must call this before the
    framework initializes torch.distributed; calling it again with the same
    settings returns the same name; a name taken with other settings raises.
    ``pg_options`` given with the name replace these settings.

    Example::

        >>> backend("topk", density=0.05)  # doctest: +ELLIPSIS
        'pycomm_topk_...'
        >>> backend("onebit", name="pycomm_fast", block_size=256)
        'pycomm_fast'
        >>> import torch.distributed as dist
        >>> dist.init_process_group(backend("topk", density=0.05), init_method="env://")  # doctest: +SKIP
    """
    options = _options(compressor, settings)  # checks them, naming the argument
    key = {"compressor": compressor, **{k: settings[k] for k in sorted(settings)}}
    if name is None:
        if settings:
            digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
            name = f"pycomm_{compressor}_{digest}"
        else:
            name = f"pycomm_{compressor}"
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not isinstance(name, str) or not name or not all(c.isalnum() or c == "_" for c in name):
        raise ValueError(f"name must be letters, digits and underscores, got {name!r}")
    name = name.lower()
    if name == pd.BACKEND_NAME:
        raise ValueError(f"name {name!r} is pycomm's own backend (its default settings); choose another")
    if name in _REGISTERED:
        if _REGISTERED[name] != key:
            raise ValueError(f"backend name {name!r} is already registered with {_REGISTERED[name]}, "
                             f"not {key}")
        return name
    if name.upper() in dist.Backend._plugins or name in dist.Backend.backend_list:
        raise ValueError(f"backend name {name!r} is taken by another torch.distributed backend")

    def create(dist_opts: Any, pg_options: Optional[pd.PycommOptions] = None) -> Any:
        return pd._create_backend(dist_opts, pg_options if pg_options is not None else options)

    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu", "cuda"])
    _REGISTERED[name] = key
    return name


def init_process_group(compressor: str = "onebit", backend: Optional[str] = None, **settings: Any) -> bool:
    """Initialize the default process group as a pycomm group from the
    launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``: torchrun, ``accelerate launch``, Lightning's launcher),
    before a framework that would initialize it with a plain backend, e.g.
    Accelerate on CPUs, which accepts no other backend name than Gloo and MPI
    there. The framework then finds the group initialized and uses it.

    ``backend`` is the inner backend ("gloo", "nccl"; None: by device) and
    ``settings`` those of :func:`pycomm.distributed.init_process_group`.
    Returns True if it initialized the group, False without a launcher
    (``WORLD_SIZE`` unset: one process, nothing to compress). Raises if
    torch.distributed is already initialized with another backend.

    Example (each process started by ``torchrun --nproc-per-node 2``)::

        from accelerate import Accelerator
        from pycomm.integrations import init_process_group

        init_process_group("onebit", block_size=256)    # before Accelerator()
        accelerator = Accelerator(cpu=True)
    """
    if dist.is_initialized():
        if pd.is_pycomm_group():
            return False
        raise RuntimeError(
            f"torch.distributed is already initialized with {dist.get_backend()!r}: call "
            f"pycomm.integrations.init_process_group before the framework initializes it"
        )
    if "WORLD_SIZE" not in os.environ:
        return False
    pd.init_process_group(compressor, backend, init_method="env://", **settings)
    return True


class PerRankState:
    """Every rank's :class:`~pycomm.ddp.CompressionState` as one
    checkpointable object, for a framework that saves one object from one
    rank (rank 0 writes the checkpoint) and loads it on every rank.

    ``state_dict()`` is a collective: every rank of the default group must
    call it, as frameworks do when they build a checkpoint on every rank;
    rank 0 gets every rank's state, the others their own. ``load_state_dict``
    picks this rank's state. A checkpoint saved with another number of
    ranks is refused unless ``reset_error_feedback=True`` (the iteration
    carries on, the residuals start over).

    Example (Accelerate: ``register_for_checkpointing`` saves rank 0's object only)::

        state = CompressionState(compressor="onebit")
        accelerator.register_for_checkpointing(PerRankState(state))
    """

    FORMAT = "pycomm.PerRankState/1"

    def __init__(self, state: CompressionState, reset_error_feedback: bool = False) -> None:
        if not isinstance(state, CompressionState):
            raise TypeError(f"state must be a pycomm.ddp.CompressionState, got {type(state).__name__}")
        if not isinstance(reset_error_feedback, bool):
            raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
        self.state = state
        self.reset_error_feedback = reset_error_feedback

    @staticmethod
    def _rank_world():
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def state_dict(self) -> Dict[str, Any]:
        """``{"format", "world_size", "ranks": {rank: CompressionState.state_dict()}}``:
        every rank's on rank 0, this rank's own elsewhere."""
        rank, world = self._rank_world()
        mine = self.state.state_dict()
        ranks = {rank: mine}
        if world > 1:
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if rank == 0:
                ranks = dict(enumerate(gathered))
        return {"format": self.FORMAT, "world_size": world, "ranks": ranks}

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Load this rank's state from what :meth:`state_dict` saved."""
        if not isinstance(saved, dict) or saved.get("format") != self.FORMAT:
            raise ValueError(f"not a {self.FORMAT} checkpoint (got {type(saved).__name__} "
                             f"{saved.get('format') if isinstance(saved, dict) else ''!r})")
        rank, world = self._rank_world()
        ranks = saved["ranks"]
        if rank in ranks:
            self.state.load_state_dict(ranks[rank], reset_error_feedback=self.reset_error_feedback)
        elif self.reset_error_feedback and ranks:
            self.state.load_state_dict(ranks[min(ranks)], reset_error_feedback=True)
        else:
            raise ValueError(
                f"this checkpoint holds the pycomm hook state of ranks {sorted(ranks)} (saved by "
                f"{saved['world_size']} ranks), none for rank {rank} of {world}: resume with the same "
                f"number of ranks, or pass reset_error_feedback=True to start the residuals over"
            )
