"""DDP communication hook that all-reduces gradient buckets compressed.

Usage::

    from pycomm.ddp import CompressionState, compressed_hook

    state = CompressionState(process_group=None, compressor="topk", density=0.01,
                             start_iter=10, error_feedback=True)
    ddp.register_comm_hook(state, compressed_hook)
    ...
    torch.save(state.state_dict(), f"hook_rank{rank}.pt")      # every rank its own
    state.load_state_dict(torch.load(f"hook_rank{rank}.pt"))

Every bucket goes through pycomm's one engine (the C++ backend behind the
``"pycomm"`` process groups, csrc/distributed): the hook only decides, per
bucket, what the engine runs, and always reduces to the AVERAGE over ranks
(DDP hands the bucket over NOT divided by the world size):

* iterations ``< start_iter`` (warm-up): the engine's exact all-reduce;
* afterwards: the compressed all-reduce, ``pycomm.distributed.all_reduce(t,
  key=bucket.index(), op="avg", async_op=True)``, with the residuals of
  error feedback kept by the engine under the bucket index.

The engine's group is the state's process group itself when that runs the
pycomm backend (``pycomm.distributed.init_process_group`` or ``wrap``); any
other group (Gloo, NCCL) is wrapped once, at the first bucket, into a pycomm
group over the same ranks with the state's settings, so ``hierarchy`` and
``compressor="auto"`` work over any group. The engine issues every
collective of the hook from one thread in submission order (bucket after
bucket, the same on every rank) and completes the Future the hook returns.

Error-feedback residuals are kept per bucket index. DDP rebuilds its buckets
after the first iteration of every process (the first iteration has one
bucket holding every parameter), so indices mean something only from the
second iteration on: ``start_iter >= 2`` is enforced, and after a restore
(first iteration of a fresh process, buckets not yet rebuilt) the hook cuts
DDP's bucket into the saved buckets, parameter by parameter, so that a
resumed run continues exactly as an uninterrupted one.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import distributed as pd
from ..compressors.base import check_density
from ..compressors.plugin import is_plugin, options_json
from ..distributed.spec import EF_METHODS, GROUP_METHODS, check_mode

__all__ = ["CompressionState", "compressed_hook"]

#: What the hook can run: every method of a group but "none" (no hook needed).
COMPRESSORS = tuple(m for m in GROUP_METHODS if m != "none")
_STATE_VERSION = 2


class CompressionState:
    """State of :func:`compressed_hook`: configuration, iteration count, the
    bucket layout, and the engine group that runs the buckets.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        compressor: "onebit", "topk", "fp16", "bf16", "auto" (a method per
            bucket size from a calibration of the link: docs/auto.md), or a
            compressor registered with :func:`pycomm.register_compressor`.
        compressor_options: the settings of a registered compressor.
        density: fraction of entries topk sends per chunk.
        approx: topk's approximate (threshold) selection instead of exact.
        block_size: onebit block length (a multiple of 32).
        chunk_numel: the engine's pipelining chunk (None: its default).
        start_iter: iterations before this one use an exact all-reduce; must
            be >= 2 (bucket indices are only stable once DDP has rebuilt its
            buckets after the first iteration).
        error_feedback: keep residuals (onebit, topk; fp16/bf16 have none).
        impl: kernels the engine runs: "auto" (the compiled ones of the
            tensor's device); the engine has no other yet.
        check_calls: when ranks compare their calls, to raise on every rank
            on a mismatch instead of hanging: "first" (first use of each
            bucket), "every" or "off"; ``PYCOMM_DEBUG=detail`` means "every".
        hierarchy: "auto", "flat" or ranks per node, as
            :class:`pycomm.distributed.PycommOptions` (docs/hierarchy.md).
        calibration: for ``compressor="auto"``, a JSON path to load the
            calibration from or save it to.
        private_group: run over a new pycomm group even when
            ``process_group`` already is one. The hook always runs over a
            group of its own when ``process_group`` is not a pycomm group.

    The engine's group over a plain ``process_group`` is created at the first
    bucket (``dist.new_group``: every rank of the default group takes part
    when ``process_group`` is the world). Other collectives that DDP issues on
    ``process_group`` (e.g. with ``find_unused_parameters=True``) cannot
    interleave with the hook's, which run on that group of their own.

    Example::

        >>> state = CompressionState(compressor="onebit", block_size=2048, start_iter=100)
        >>> ddp_model.register_comm_hook(state, compressed_hook)      # doctest: +SKIP
        >>> torch.save(state.state_dict(), f"hook_rank{rank}.pt")    # doctest: +SKIP

    ``state_dict()`` holds the iteration, the configuration, and this rank's
    residuals and bucket layout: each rank saves and loads its own.
    ``load_state_dict`` refuses a state saved with another world size or by
    another rank (and, at the first iteration where DDP's buckets are known,
    one saved with another bucket layout) unless
    ``reset_error_feedback=True``, which keeps the iteration and drops the
    residuals. Pickling keeps everything but the process group (restored as
    the default group), like PyTorch's PowerSGD state.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        compressor: str = "topk",
        *,
        density: float = 0.01,
        approx: bool = True,
        block_size: int = 2048,
        chunk_numel: Optional[int] = None,
        start_iter: int = 10,
        error_feedback: bool = True,
        impl: str = "auto",
        private_group: bool = False,
        check_calls: str = "first",
        hierarchy: Any = "auto",
        calibration: Optional[str] = None,
        compressor_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}"
            )
        if not isinstance(private_group, bool):
            raise TypeError(f"private_group must be a bool, got {private_group!r}")
        if impl != "auto":
            raise ValueError(
                f"impl={impl!r}: the hook runs the engine's compiled kernels (impl='auto'); "
                f"choose one of ['auto']"
            )
        check_mode(check_calls, "check_calls")  # validates
        # The engine's own checks, before anything runs: a bad value raises
        # here, on every rank, naming the argument.
        known = compressor in GROUP_METHODS or is_plugin(compressor)
        pd.PycommOptions(compressor=compressor if known else "onebit", hierarchy=hierarchy,
                         calibration=calibration, compressor_options=compressor_options if known else None)
        self.compressor_options = compressor_options
        self.process_group = process_group
        self._apply_config(
            dict(
                compressor=compressor, density=density, approx=approx, block_size=block_size,
                chunk_numel=chunk_numel, start_iter=start_iter, error_feedback=error_feedback,
            )
        )
        self.check_calls = check_calls
        self.impl = impl
        self.hierarchy = hierarchy
        self.calibration = calibration
        self.private_group = private_group
        #: Backward passes completed (counted at the last bucket of each).
        self.iteration = 0
        #: Bucket index -> (numel, parameter positions), recorded once DDP's
        #: buckets are stable; a position is a parameter's index in the
        #: concatenated parameter lists of DDP's initial buckets (deterministic
        #: for a given model and DDP configuration, in any process).
        self.bucket_layouts: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
        self._saved_world: Optional[Tuple[int, int]] = None  # (world, rank) a loaded state expects
        #: Residuals loaded before the engine's group exists (per bucket key).
        self._pending_ef: Optional[Dict[int, Any]] = None
        self._init_runtime()

    # -- configuration ---------------------------------------------------------
    def _apply_config(self, cfg: Dict[str, Any]) -> None:
        compressor = cfg["compressor"]
        if compressor not in COMPRESSORS and not is_plugin(compressor):
            raise ValueError(f"compressor must be one of {list(COMPRESSORS)} or a registered compressor "
                             f"(pycomm.register_compressor), got {compressor!r}")
        start_iter = cfg["start_iter"]
        if isinstance(start_iter, bool) or not isinstance(start_iter, int):
            raise TypeError(f"start_iter must be an int, got {start_iter!r}")
        if start_iter < 2:
            raise ValueError(
                f"start_iter must be >= 2, got {start_iter}: DDP rebuilds its gradient buckets "
                f"after the first iteration, so bucket.index(), which keys the error-feedback "
                f"residuals, is not stable before the second (pytorch issue #51427)"
            )
        chunk_numel = cfg["chunk_numel"]
        if chunk_numel is not None:
            pd.PycommOptions(chunk_numel=chunk_numel)  # validates, naming the argument
        if not isinstance(cfg["error_feedback"], bool):
            raise TypeError(f"error_feedback must be a bool, got {cfg['error_feedback']!r}")
        density = check_density(cfg["density"])
        if not isinstance(cfg["approx"], bool):
            raise TypeError(f"approx must be a bool, got {cfg['approx']!r}")
        pd.PycommOptions(block_size=cfg["block_size"])  # validates block_size
        self.compressor = compressor
        self.density = density
        self.approx = cfg["approx"]
        self.block_size = cfg["block_size"]
        self.chunk_numel = chunk_numel
        self.start_iter = start_iter
        self.error_feedback = cfg["error_feedback"]

    def config(self) -> Dict[str, Any]:
        """The configuration as a dict (what :meth:`state_dict` saves)."""
        return {
            "compressor": self.compressor,
            "density": self.density,
            "approx": self.approx,
            "block_size": self.block_size,
            "chunk_numel": self.chunk_numel,
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
        }

    def _uses_ef(self) -> bool:
        # "auto": the engine keeps residuals for the buckets it sends by onebit or topk.
        return self.error_feedback and (self.compressor in (*EF_METHODS, "auto") or is_plugin(self.compressor))

    # -- runtime (not saved, not pickled) --------------------------------------
    def _init_runtime(self) -> None:
        self._engine: Optional[dist.ProcessGroup] = None
        self._positions: Dict[int, int] = {}  # id(parameter) -> position
        self._local_iter = 0  # backward passes seen by this object in this process
        self._warned_unmapped = False

    def _base_group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("torch.distributed is not initialized")
        return group

    def _engine_group(self, device: torch.device) -> dist.ProcessGroup:
        """The pycomm group that runs this state's buckets (created at the
        first call over a plain group, on every rank alike)."""
        if self._engine is not None:
            return self._engine
        base = self._base_group()
        if pd.is_pycomm_group(base, device) and not self.private_group:
            self._check_pycomm_group(base, device)
            engine = base
        else:
            settings = dict(block_size=self.block_size, density=self.density, approx=self.approx,
                            check_calls=self.check_calls, hierarchy=self.hierarchy,
                            calibration=self.calibration, compressor_options=self.compressor_options)
            if self.chunk_numel is not None:
                settings["chunk_numel"] = self.chunk_numel
            if pd.is_pycomm_group(base, device):
                settings["inner"] = "nccl" if device.type == "cuda" else "gloo"
            engine = pd.wrap(base, compressor=self.compressor, **settings)
        if self._pending_ef is not None:
            pd.load_error_feedback_state(self._pending_ef, engine, str(device.type))
            self._pending_ef = None
        self._engine = engine
        return engine

    def _check_pycomm_group(self, group, device) -> None:
        """A pycomm group compresses with its own settings: they must be this state's."""
        opts = pd.options_of(group, device)
        mine = {"method": self.compressor}
        if self.compressor == "onebit":
            mine["block_size"] = self.block_size
        if self.compressor == "topk":
            mine.update(density=self.density, approx=self.approx)
        if self.chunk_numel is not None:
            mine["chunk_numel"] = self.chunk_numel
        if is_plugin(self.compressor):
            mine["plugin_options"] = options_json(self.compressor, self.compressor_options)
        diff = {k: (opts[k], v) for k, v in mine.items() if opts[k] != v}
        if diff:
            raise ValueError(
                "this CompressionState asks for "
                + ", ".join(f"{k}={v[1]!r}" for k, v in diff.items())
                + " but its process group runs the pycomm backend with "
                + ", ".join(f"{k}={v[0]!r}" for k, v in diff.items())
                + ": the group's settings decide, so make them agree"
            )

    def _error_feedback(self) -> Dict[int, Any]:
        """This rank's residuals: the engine's, or those loaded for it."""
        if self._engine is not None:
            # Read through the engine's queue: after every bucket handed to it.
            return pd.error_feedback_state(self._engine, self._device_type())
        return dict(self._pending_ef or {})

    def _device_type(self) -> str:
        return "cuda" if pd.is_pycomm_group(self._engine, "cuda") else "cpu"

    def _world(self) -> Tuple[int, int]:
        return dist.get_world_size(self.process_group), dist.get_rank(self.process_group)

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration, configuration, bucket layout and this rank's residuals."""
        world, rank = self._world() if dist.is_initialized() else (None, None)
        if self._saved_world is not None and world is None:
            world, rank = self._saved_world
        return {
            "version": _STATE_VERSION,
            "config": self.config(),
            "iteration": self.iteration,
            "world_size": world,
            "rank": rank,
            "bucket_layouts": {i: (n, list(p)) for i, (n, p) in self.bucket_layouts.items()},
            # The engine's residuals, per bucket key.
            "error_feedback": self._error_feedback(),
        }

    def load_state_dict(self, state: Dict[str, Any], reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict`: iteration, configuration (the saved one
        replaces the constructor's), bucket layout and residuals.

        Raises ValueError for a state saved with another world size or by
        another rank, unless ``reset_error_feedback=True``: then the
        iteration and configuration are restored and the residuals and
        bucket layout start over. A saved bucket layout that does not match
        DDP's buckets (another model, another ``bucket_cap_mb``) is refused
        at the first iteration where DDP's buckets are known: ``backward()``
        raises the ValueError.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"not a CompressionState state_dict of version {_STATE_VERSION} "
                f"(got version {state.get('version') if isinstance(state, dict) else None!r})"
            )
        saved_ef = state.get("error_feedback")
        if not isinstance(saved_ef, dict):
            raise ValueError("state['error_feedback'] must be the dict of residuals state_dict() saved")
        prev = self.config()
        try:
            self._apply_config(dict(state["config"]))
        except Exception:
            self._apply_config(prev)
            raise
        saved_world = (state.get("world_size"), state.get("rank"))
        problems = []
        if saved_world[0] is not None and dist.is_initialized():
            world, rank = self._world()
            if saved_world[0] != world:
                problems.append(f"it was saved with world size {saved_world[0]}, this group has {world}")
            elif saved_world[1] != rank:
                problems.append(f"it holds rank {saved_world[1]}'s residuals, this is rank {rank}")
        if problems and not reset_error_feedback:
            self._apply_config(prev)
            raise ValueError(
                "cannot load this CompressionState: " + "; ".join(problems)
                + ". Save and load each rank's own state, or pass reset_error_feedback=True "
                "to keep the iteration and start the residuals over."
            )
        self.iteration = int(state["iteration"])
        if reset_error_feedback:
            self.bucket_layouts = {}
            self._saved_world = None
            self._pending_ef = None
            if self._engine is not None:
                pd.reset_error_feedback(group=self._engine, device=self._device_type())
            return
        layouts = {int(i): (int(n), tuple(p)) for i, (n, p) in state["bucket_layouts"].items()}
        if self._engine is not None:
            pd.load_error_feedback_state(dict(saved_ef), self._engine, self._device_type())
        else:
            self._pending_ef = dict(saved_ef)  # checked by the engine when its group exists
        self.bucket_layouts = layouts
        # Checked at the first hook call if the group was not up at load time.
        self._saved_world = saved_world if saved_world[0] is not None else None

    def __getstate__(self) -> Dict[str, Any]:
        keep = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k == "_saved_world"}
        keep["process_group"] = None
        keep["_pending_ef"] = self._error_feedback() or None
        return keep

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.process_group = None  # the default group of the process that unpickles
        self._init_runtime()

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"CompressionState({cfg}, iteration={self.iteration})"

    # -- planning (on the hook's calling thread) --------------------------------
    def _bucket_positions(self, params: List[torch.Tensor]) -> Tuple[int, ...]:
        out = []
        for p in params:
            pos = self._positions.get(id(p))
            if pos is None:
                pos = self._positions[id(p)] = len(self._positions)
            out.append(pos)
        return tuple(out)

    def _check_world(self) -> None:
        if self._saved_world is None:
            return
        world, rank = self._world()
        if self._saved_world != (world, rank):
            raise ValueError(
                f"CompressionState was loaded from a state of rank {self._saved_world[1]} of "
                f"{self._saved_world[0]}, but this is rank {rank} of {world}; load it with "
                f"reset_error_feedback=True to start the residuals over"
            )
        self._saved_world = None


def _failed(exc: BaseException) -> torch.futures.Future:
    """A future that fails with ``exc``. Raised from a callback rather than
    set with ``set_exception``: DDP then reports "ValueError: <message>"
    instead of "Unable to cast <message> to Tensor"."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)

    def fail(_):
        raise exc

    return done.then(fail)


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ranks, compressed.

    Register with ``ddp_model.register_comm_hook(state, compressed_hook)``
    before the first forward. Returns a ``torch.futures.Future`` at once; the
    engine completes it with the averaged bucket, or with the exception that
    stopped it, which then surfaces from ``loss.backward()``.

    Example (on every rank, after ``dist.init_process_group``)::

        from torch.nn.parallel import DistributedDataParallel as DDP
        from pycomm.ddp import CompressionState, compressed_hook

        ddp = DDP(model)
        state = CompressionState(compressor="topk", density=0.01, start_iter=10)
        ddp.register_comm_hook(state, compressed_hook)
        for x, y in data:
            loss_fn(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    """
    if not isinstance(state, CompressionState):
        return _failed(TypeError(
            f"compressed_hook needs a pycomm.ddp.CompressionState as its state, got {type(state).__name__}"
        ))
    tensor = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    it, local = state.iteration, state._local_iter
    if is_last:  # one backward pass = one iteration, whatever happens below
        state.iteration += 1
        state._local_iter += 1
    try:
        state._check_world()
        params = bucket.parameters()
        positions = state._bucket_positions(params)
    except Exception as exc:
        return _failed(exc)
    warm = it < state.start_iter
    # Before DDP's first bucket rebuild in this process (its first iteration)
    # the buckets are not the ones the residuals belong to.
    stable = local >= 1

    numel = tensor.numel()
    record = (numel, positions)
    try:
        if stable:
            known = state.bucket_layouts.get(index)
            if known is None:
                state.bucket_layouts[index] = record
            elif known != record:
                if not warm or any(k == index for k in state._error_feedback()):
                    raise ValueError(
                        f"DDP bucket {index} holds {numel} elements (parameters {list(positions)}), "
                        f"but the residuals of bucket {index} were saved for {known[0]} elements "
                        f"(parameters {list(known[1])}): another model or bucket_cap_mb? Load the "
                        f"state with reset_error_feedback=True to start the residuals over"
                    )
                state.bucket_layouts[index] = record
        # This bucket is one whose residuals are kept under its index (else:
        # the first iteration of a resumed process, before DDP's rebuild).
        keyed = stable or state.bucket_layouts.get(index) == record
        group = state._engine_group(tensor.device)
    except Exception as exc:
        return _failed(exc)

    def done(work) -> torch.futures.Future:
        return work.get_future().then(lambda f: _first_tensor(f.value(), tensor))

    try:
        if warm:
            return done(pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False))
        if keyed:
            key = index if state._uses_ef() else None
            return done(pd.all_reduce(tensor, key=key, group=group, op="avg", async_op=True))
        return _remapped(state, bucket, tensor, positions, group, it)
    except Exception as exc:
        return _failed(exc)


def _remapped(state, bucket, tensor, positions, group, it) -> torch.futures.Future:
    """The first iteration of a resumed process: the residuals are keyed by
    the saved buckets, so DDP's unrebuilt bucket is cut into those, each
    reduced on its own under its key, as when saved; exact if they do not
    tile it."""
    parts = _saved_parts(state, bucket, tensor, positions, it)
    if parts is None:
        work = pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False)
        return work.get_future().then(lambda f: _first_tensor(f.value(), tensor))
    # One engine call per saved bucket, issued now in index order (the
    # engine runs them in submission order, the same on every rank).
    pending = []
    for index, slices in parts:
        flat = torch.cat([tensor[o : o + n] for o, n in slices])
        key = index if state._uses_ef() else None
        work = pd.all_reduce(flat, key=key, group=group, op="avg", async_op=True)
        pending.append((work.get_future(), flat, slices))

    def copy_back(_):
        for f, flat, slices in pending:
            f.wait()  # raises that call's error, if any
            start = 0
            for o, n in slices:
                tensor[o : o + n].copy_(flat[start : start + n])
                start += n
        return tensor

    return torch.futures.collect_all([f for f, _, _ in pending]).then(copy_back)


def _first_tensor(value: Any, default: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return default



def _saved_parts(state: CompressionState, bucket, tensor, positions, it) -> Optional[List[Tuple[int, List[Tuple[int, int]]]]]:
    """First iteration of a process that resumes a saved state: DDP's bucket
    is not yet one of the saved ones (it holds every parameter). Returns the
    saved buckets it contains, as ``[(index, [(offset, numel) in this
    bucket's buffer, per parameter])]``, or None (with a warning, once) if
    they do not tile it."""
    buf_ptr, esize = tensor.data_ptr(), tensor.element_size()
    where = {}  # position -> (offset, numel) in this bucket's buffer
    for pos, g in zip(positions, bucket.gradients()):
        where[pos] = ((g.data_ptr() - buf_ptr) // esize, g.numel())
    mine = set(positions)
    parts = []
    for index in sorted(state.bucket_layouts):
        numel, pos = state.bucket_layouts[index]
        if set(pos) <= mine:
            parts.append((index, numel, pos))
    covered = [p for _, _, pos in parts for p in pos]
    ok = (
        parts
        and len(covered) == len(mine)
        and set(covered) == mine
        and all(sum(where[p][1] for p in pos) == numel for _, numel, pos in parts)
    )
    if not ok:
        if not state._warned_unmapped:
            state._warned_unmapped = True
            warnings.warn(
                f"pycomm CompressionState: at iteration {it}, DDP has not rebuilt its buckets in "
                f"this process yet and bucket {bucket.index()} does not match the saved bucket "
                f"layout; this iteration is all-reduced uncompressed (residuals kept)",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    return [(index, [where[p] for p in pos]) for index, _, pos in parts]
