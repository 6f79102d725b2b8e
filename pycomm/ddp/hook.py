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
pycomm backend (``pycomm.distributed.init_process_group`` or ``wrap``; None
and ``dist.group.WORLD`` both name the default group); any other group
(Gloo, NCCL) is wrapped once, at the first bucket, into a pycomm group over
the same ranks with the state's settings, so ``hierarchy`` and
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

Over a pycomm group that other code shares (the default group of
``pd.init_process_group``), the state owns the keys it uses: the residual of
a bucket index is the state's own (loaded, or zero at its first use by this
state), never one left under that key by earlier code; ``state_dict()``
saves only those keys.

A failure inside the hook (a refusal of the hook, or an error of the
engine) is raised by ``loss.backward()`` as the original exception, with its
own type and message.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import distributed as pd
from ..compressors.base import check_density
from ..distributed.spec import is_plugin
from ..distributed.session import KEY_SPAN, EngineSession, agree, check_residuals, check_world, residual_methods
from ..distributed.spec import EF_METHODS, GROUP_METHODS, ROUNDING_METHODS, check_mode, error_feedback_for

__all__ = ["CompressionState", "compressed_hook"]

#: What the hook can run: every method of a group but "none" (no hook needed).
COMPRESSORS = tuple(m for m in GROUP_METHODS if m != "none")
_STATE_VERSION = 2
#: The fields of a state_dict, and of its "config" and residual entries.
_STATE_FIELDS = ("version", "config", "iteration", "world_size", "rank", "bucket_layouts", "error_feedback")
_CONFIG_FIELDS = ("compressor", "density", "approx", "block_size", "chunk_numel", "start_iter", "error_feedback",
                  "rounding", "seed")
#: Config fields a saved state may lack (saved before they existed), with the
#: value they then take.
_CONFIG_DEFAULTS = {"rounding": "nearest", "seed": 0}
#: The settings an engine group is built with (the others only steer the hook).
_ENGINE_FIELDS = ("compressor", "density", "approx", "block_size", "chunk_numel", "rounding", "seed")


#: onebit with error feedback on gradients feeds the residual's delay into a
#: momentum optimizer's state; the measured cost is in docs/results.md
#: ("The quality study"), not here, where it would go stale.
ONEBIT_MOMENTUM_WARNING = (
    "pycomm: compressor='onebit' with error feedback on gradients costs final loss with momentum "
    "optimizers (AdamW and SGD with momentum ended tens of percent above plain all-reduce in the project's "
    "quality study: docs/results.md, 'The quality study'). With momentum, prefer compressor='int8' or "
    "'int4', or compress the momentum instead: pycomm.optim.OneBitAdam / OneBitSGD."
)
_warned_onebit = False


def _warn_onebit_with_momentum() -> None:
    global _warned_onebit
    if not _warned_onebit:
        _warned_onebit = True
        warnings.warn(ONEBIT_MOMENTUM_WARNING, UserWarning, stacklevel=3)


class CompressionState:
    """State of :func:`compressed_hook`: configuration, iteration count, the
    bucket layout, and the engine group that runs the buckets.

    Args:
        process_group: the group DDP reduces over (None or
            ``dist.group.WORLD``: the default group).
        compressor: "onebit", "topk", "fp16", "bf16", any other method of
            ``pycomm.distributed.spec.GROUP_METHODS``, "auto" (a method per
            bucket size from a calibration of the link: docs/auto.md), or a
            compressor registered with :func:`pycomm.register_compressor`.
        compressor_options: the settings of a registered compressor.
        density: fraction of entries topk sends per chunk.
        approx: topk's approximate (threshold) selection instead of exact.
        block_size: block length of the block codecs such as onebit (a
            multiple of 32); None: the method's default
            (``spec.DEFAULT_BLOCK_SIZE``).
        chunk_numel: the engine's pipelining chunk (None: its default).
        start_iter: iterations before this one use an exact all-reduce; must
            be >= 2 (bucket indices are only stable once DDP has rebuilt its
            buckets after the first iteration).
        error_feedback: keep residuals; None: the method's default
            (``spec.error_feedback_for``: on for onebit, topk, int2 and
            registered compressors, off for int8/int4, none for fp16/bf16).
        rounding: how int8/int4 round, "nearest" or "stochastic" (unbiased;
            seeded from ``seed``, the bucket and its call count, which the
            residuals' state saves), as
            :class:`pycomm.distributed.PycommOptions`.
        seed: the seed of stochastic rounding, in [0, 2**32).
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
        >>> state
        CompressionState(compressor='onebit', density=0.01, approx=True, block_size=2048, chunk_numel=None, start_iter=100, error_feedback=True, rounding='nearest', seed=0, iteration=0)
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
        block_size: Optional[int] = None,
        chunk_numel: Optional[int] = None,
        start_iter: int = 10,
        error_feedback: Optional[bool] = None,
        rounding: str = "nearest",
        seed: int = 0,
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
        check_mode(check_calls, "check_calls")  # validates
        # The engine's own checks, before anything runs: a bad value raises
        # here, on every rank, naming the argument.
        known = compressor in GROUP_METHODS or is_plugin(compressor)  # else _checked_config names it
        pd.check_options(hierarchy=hierarchy, calibration=calibration,
                         **(dict(compressor=compressor, compressor_options=compressor_options) if known else {}))
        if known:  # the one rule: None is the method's default (spec.error_feedback_for)
            error_feedback = error_feedback_for(compressor, error_feedback)
        self.compressor_options = compressor_options
        self.process_group = process_group
        self._set_config(_checked_config(
            dict(
                compressor=compressor, density=density, approx=approx, block_size=block_size,
                chunk_numel=chunk_numel, start_iter=start_iter, error_feedback=error_feedback,
                rounding=rounding, seed=seed,
            )
        ))
        self.check_calls = check_calls
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
        self._init_runtime()
        self._session = self._new_session()
        if compressor == "onebit" and error_feedback:
            _warn_onebit_with_momentum()

    # -- configuration ---------------------------------------------------------
    def _set_config(self, cfg: Dict[str, Any]) -> None:
        for name in _CONFIG_FIELDS:
            setattr(self, name, cfg[name])

    def config(self) -> Dict[str, Any]:
        """The configuration as a dict (what :meth:`state_dict` saves).

        Example::

            >>> CompressionState(compressor="topk", density=0.05, start_iter=4).config()["density"]
            0.05
        """
        return {name: getattr(self, name) for name in _CONFIG_FIELDS}

    def _uses_ef(self) -> bool:
        # "auto": the engine keeps residuals for the buckets it sends by a method with them.
        return self.error_feedback and (self.compressor in (*EF_METHODS, "auto") or is_plugin(self.compressor))

    # -- runtime (not saved, not pickled) --------------------------------------
    def _init_runtime(self) -> None:
        self._agreed = False  # the ranks' configurations compared (at the first bucket)
        self._positions: Dict[int, int] = {}  # id(parameter) -> position
        self._local_iter = 0  # backward passes seen by this object in this process
        self._warned_unmapped = False

    def _new_session(self, pending: Optional[Dict[int, Any]] = None) -> EngineSession:
        """The engine client of this configuration: bucket ``i``'s residuals
        under key ``i`` of the group (``pending``: residuals loaded for it)."""
        settings = dict(block_size=self.block_size, density=self.density, approx=self.approx,
                        rounding=self.rounding, seed=self.seed, check_calls=self.check_calls,
                        hierarchy=self.hierarchy, calibration=self.calibration,
                        compressor_options=self.compressor_options)
        if self.chunk_numel is not None:
            settings["chunk_numel"] = self.chunk_numel
        session = EngineSession("this CompressionState", self.compressor, settings,
                                process_group=self.process_group, private_group=self.private_group)
        if pending:
            session.load_residuals(pending)
        return session

    @property
    def _engine(self) -> Optional[dist.ProcessGroup]:
        return self._session.group

    def _engine_group(self, device: torch.device) -> dist.ProcessGroup:
        """The pycomm group that runs this state's buckets (created at the
        first call over a plain group, on every rank alike); residuals loaded
        before it existed are handed to it now."""
        return self._session.engine(device)

    def _error_feedback(self) -> Dict[int, Any]:
        """This rank's residuals (copies) per bucket key."""
        return self._session.residuals()

    def _world(self) -> Tuple[int, int]:
        return self._session.world()

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration, configuration, bucket layout and this rank's residuals.

        Every rank saves its own (the residuals differ between ranks); the
        tensors are copies, so the dict does not change as training goes on.

        Example::

            >>> sd = CompressionState(compressor="onebit", start_iter=4).state_dict()
            >>> sd["version"], sd["iteration"], sd["error_feedback"]
            (2, 0, {})
        """
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

        All or nothing: the whole state is checked first (version,
        configuration, iteration, bucket layouts, every residual's fields,
        shape and dtype), and a refused state leaves this object, and its
        engine's residuals, exactly as they were; the error names the
        offending field, e.g. ``state['config']['start_iter']``. The
        residuals are copied: the caller's tensors are never trained in
        place, so the same dict can be loaded again.

        Raises ValueError for a state saved with another world size or by
        another rank, unless ``reset_error_feedback=True``: then the
        iteration and configuration are restored and the residuals and
        bucket layout start over (in a shared pycomm group too). A saved
        bucket layout that does not match DDP's buckets (another model,
        another ``bucket_cap_mb``) is refused at the first iteration where
        DDP's buckets are known: ``backward()`` raises the ValueError. Once
        this state has run buckets, a state whose engine settings
        (compressor, block_size, density, approx, chunk_numel, rounding,
        seed) differ is
        refused: load it into a new CompressionState instead.

        Example::

            >>> a = CompressionState(compressor="topk", start_iter=4)
            >>> b = CompressionState(compressor="onebit", start_iter=2)
            >>> b.load_state_dict(a.state_dict())
            >>> b.compressor, b.start_iter
            ('topk', 4)
            >>> b.load_state_dict(dict(a.state_dict(), iteration=-1))
            Traceback (most recent call last):
            ...
            ValueError: state['iteration'] must be a non-negative int, got -1
        """
        if not isinstance(reset_error_feedback, bool):
            raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
        cfg, iteration, saved_world, layouts, residuals = _checked_state(state)
        problems = []
        if saved_world[0] is not None and dist.is_initialized():
            world, rank = self._world()
            if saved_world[0] != world:
                problems.append(f"it was saved with world size {saved_world[0]}, this group has {world}")
            elif saved_world[1] != rank:
                problems.append(f"it holds rank {saved_world[1]}'s residuals, this is rank {rank}")
        if problems and not reset_error_feedback:
            raise ValueError(
                "cannot load this CompressionState: " + "; ".join(problems)
                + ". Save and load each rank's own state, or pass reset_error_feedback=True "
                "to keep the iteration and start the residuals over."
            )
        if self._engine is not None:
            mine = self.config()
            changed = [f for f in _ENGINE_FIELDS if cfg[f] != mine[f]]
            if changed:
                raise ValueError(
                    "cannot load this CompressionState: "
                    + ", ".join(f"state['config'][{f!r}] is {cfg[f]!r}" for f in changed)
                    + ", but this state's engine group already runs with "
                    + ", ".join(f"{f}={mine[f]!r}" for f in changed)
                    + ". Load it before the first backward pass, or into a new CompressionState."
                )
        # The engine last of the checks: it refuses residuals of another
        # world size, method or chunk_numel before it changes anything.
        if self._engine is not None:
            if reset_error_feedback:
                self._session.reset_residuals()
            else:
                self._session.load_residuals(residuals)
        replaced = {f: (getattr(self, f), cfg[f]) for f in _ENGINE_FIELDS if cfg[f] != getattr(self, f)}
        if replaced:
            # The saved configuration decides (documented); said, not silent.
            warnings.warn("CompressionState.load_state_dict: the loaded state runs "
                          + ", ".join(f"{f}={new!r} (was {old!r})" for f, (old, new) in replaced.items()),
                          UserWarning, stacklevel=2)
        self._set_config(cfg)
        self._agreed = False  # compared again at the next bucket
        if self._engine is None:  # a new configuration: a new client, the residuals waiting for it
            self._session = self._new_session(None if reset_error_feedback else residuals)
        self.iteration = iteration
        if reset_error_feedback:
            self.bucket_layouts = {}
            self._saved_world = None
        else:
            self.bucket_layouts = layouts
            # Checked at the first hook call if the group was not up at load time.
            self._saved_world = saved_world if saved_world[0] is not None else None

    def __getstate__(self) -> Dict[str, Any]:
        keep = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k == "_saved_world"}
        keep["process_group"] = None
        keep["_pending_ef"] = self._error_feedback() or None
        return keep

    def __setstate__(self, d: Dict[str, Any]) -> None:
        pending = d.pop("_pending_ef", None)
        self.__dict__.update(d)
        self.process_group = None  # the default group of the process that unpickles
        self._init_runtime()
        self._session = self._new_session(pending)

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
        if self._saved_world is not None:
            check_world("CompressionState", self._saved_world, self._world())
        self._saved_world = None


# ------------------------------------------------------------ validation ---
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _labelled(label: Optional[str], check: Callable[[], Any]) -> Any:
    """``check()``, its TypeError/ValueError prefixed with ``label`` (the
    field of a loaded state) when there is one."""
    if label is None:
        return check()
    try:
        return check()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{label}: {exc}") from None


def _checked_config(cfg: Dict[str, Any], where: Optional[str] = None) -> Dict[str, Any]:
    """The configuration, validated and normalized, without side effects.
    ``where``: the name of the dict in a loaded state, for the errors."""

    def label(name):
        return None if where is None else f"{where}[{name!r}]"

    if where is not None:
        if not isinstance(cfg, dict):
            raise TypeError(f"{where} must be a dict, got {type(cfg).__name__}")
        cfg = {**_CONFIG_DEFAULTS, **cfg}
        missing = [f for f in _CONFIG_FIELDS if f not in cfg]
        unknown = sorted(map(str, set(cfg) - set(_CONFIG_FIELDS)))
        if missing or unknown:
            raise ValueError(f"{where} must hold the fields {list(_CONFIG_FIELDS)}"
                             + (f"; missing {missing}" if missing else "")
                             + (f"; unknown {unknown}" if unknown else ""))
    compressor = cfg["compressor"]
    if compressor not in COMPRESSORS and not is_plugin(compressor):
        raise ValueError(f"{label('compressor') or 'compressor'} must be one of {list(COMPRESSORS)} or a "
                         f"registered compressor (pycomm.register_compressor), got {compressor!r}")
    start_iter = cfg["start_iter"]
    name = label("start_iter") or "start_iter"
    if not _is_int(start_iter):
        raise TypeError(f"{name} must be an int, got {start_iter!r}")
    if start_iter < 2:
        raise ValueError(
            f"{name} must be >= 2, got {start_iter}: DDP rebuilds its gradient buckets "
            f"after the first iteration, so bucket.index(), which keys the error-feedback "
            f"residuals, is not stable before the second (pytorch issue #51427)"
        )
    chunk_numel, block_size = cfg["chunk_numel"], cfg["block_size"]
    _labelled(label("chunk_numel"), lambda: pd.check_options(chunk_numel=chunk_numel))
    _labelled(label("block_size"), lambda: pd.check_options(block_size=block_size))
    for flag in ("error_feedback", "approx"):
        if not isinstance(cfg[flag], bool):
            raise TypeError(f"{label(flag) or flag} must be a bool, got {cfg[flag]!r}")
    density = _labelled(label("density"), lambda: check_density(cfg["density"]))
    rounding, seed = cfg["rounding"], cfg["seed"]
    # The group's own checks (whether this compressor rounds is checked next).
    _labelled(label("rounding"), lambda: pd.check_options(rounding=rounding))
    _labelled(label("seed"), lambda: pd.check_options(seed=seed))
    if rounding == "stochastic" and compressor not in (*ROUNDING_METHODS, "auto"):
        raise ValueError(f"{label('rounding') or 'rounding'}: rounding='stochastic' is for the "
                         f"{', '.join(ROUNDING_METHODS)} compressors (or 'auto'); {compressor!r} does not round")
    return dict(compressor=compressor, density=density, approx=cfg["approx"], block_size=block_size,
                chunk_numel=chunk_numel, start_iter=start_iter, error_feedback=cfg["error_feedback"],
                rounding=rounding, seed=seed)


def _checked_state(state: Any):
    """Everything :meth:`CompressionState.load_state_dict` needs, checked and
    copied: ``(config, iteration, (world_size, rank), bucket_layouts,
    residuals)``. Raises, naming the field, before anything is changed."""
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state['version']: not a CompressionState state_dict of version "
                         f"{_STATE_VERSION} (got {got!r})")
    missing = [f for f in _STATE_FIELDS if f not in state]
    unknown = sorted(map(str, set(state) - set(_STATE_FIELDS)))
    if missing or unknown:
        raise ValueError(f"state must hold the fields {list(_STATE_FIELDS)}"
                         + (f"; missing {missing}" if missing else "")
                         + (f"; unknown {unknown}" if unknown else ""))
    cfg = _checked_config(state["config"], "state['config']")
    iteration = state["iteration"]
    if not _is_int(iteration) or iteration < 0:
        raise ValueError(f"state['iteration'] must be a non-negative int, got {iteration!r}")
    world, rank = state["world_size"], state["rank"]
    if (world is None) != (rank is None):
        raise ValueError(f"state['world_size'] and state['rank'] must both be None or both ints, "
                         f"got {world!r} and {rank!r}")
    if world is not None:
        if not _is_int(world) or world < 1:
            raise ValueError(f"state['world_size'] must be a positive int or None, got {world!r}")
        if not _is_int(rank) or not 0 <= rank < world:
            raise ValueError(f"state['rank'] must be an int in [0, {world}), got {rank!r}")
    layouts = _checked_layouts(state["bucket_layouts"])
    residuals = check_residuals("state['error_feedback']", state["error_feedback"],
                                residual_methods(cfg["compressor"]), span=KEY_SPAN)
    return cfg, iteration, (world, rank), layouts, residuals


def _checked_layouts(layouts: Any) -> Dict[int, Tuple[int, Tuple[int, ...]]]:
    if not isinstance(layouts, dict):
        raise TypeError(f"state['bucket_layouts'] must be a dict, got {type(layouts).__name__}")
    out: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
    owner: Dict[int, int] = {}  # parameter position -> bucket
    for index, value in layouts.items():
        label = f"state['bucket_layouts'][{index!r}]"
        if not _is_int(index) or index < 0:
            raise ValueError(f"{label}: a key must be a bucket index (a non-negative int)")
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"{label} must be (numel, [parameter positions]), got {value!r}")
        numel, positions = value
        if not _is_int(numel) or numel < 1:
            raise ValueError(f"{label}: numel must be a positive int, got {numel!r}")
        if not isinstance(positions, (list, tuple)) or not positions:
            raise ValueError(f"{label}: the parameter positions must be a non-empty list, got {positions!r}")
        for p in positions:
            if not _is_int(p) or p < 0:
                raise ValueError(f"{label}: a parameter position must be a non-negative int, got {p!r}")
            if p in owner:
                raise ValueError(f"{label}: parameter {p} is also in bucket {owner[p]}")
            owner[p] = index
        out[index] = (numel, tuple(positions))
    return out


# --------------------------------------------------------- error delivery ---
def _at_end_of_backward(check: Callable[[], None]) -> None:
    """Run ``check`` when the current backward pass has computed every
    gradient, before DDP's own end-of-backward step (which this hook's
    buckets precede). An exception it raises comes out of
    ``loss.backward()`` as itself: DDP would report only a RuntimeError with
    the exception's text. Nothing when not inside a backward pass."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(check)
    except RuntimeError:  # not inside a backward pass: the Future still fails
        pass


def _failed(exc: BaseException) -> torch.futures.Future:
    """A future that fails with ``exc``, and ``exc`` raised by backward()."""

    def check():
        raise exc

    _at_end_of_backward(check)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)
    return done.then(lambda _: check())


def _result(raw: List[torch.futures.Future], finish: Callable[[], torch.Tensor]) -> torch.futures.Future:
    """The future DDP waits on: ``finish()`` once every engine future in
    ``raw`` has completed. A failure (the engine's, or one in ``finish``)
    is raised by backward() as the original exception."""
    errors: List[BaseException] = []

    def then(_):
        try:
            for f in raw:
                f.wait()
            return finish()
        except BaseException as exc:
            errors.append(exc)
            raise

    source = raw[0] if len(raw) == 1 else torch.futures.collect_all(raw)
    result = source.then(then)

    def check():
        for f in raw:
            f.wait()  # the engine's error, with its own type
        try:
            result.wait()
        except BaseException:
            if errors:
                raise errors[0] from None
            raise

    _at_end_of_backward(check)
    return result


# -------------------------------------------------------------------- hook ---
def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ranks, compressed.

    Register with ``ddp_model.register_comm_hook(state, compressed_hook)``
    before the first forward. Returns a ``torch.futures.Future`` at once; the
    engine completes it with the averaged bucket. A failure (a refusal of
    the hook, an error of the engine) is raised by ``loss.backward()`` as
    the original exception, with its type and message.

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
        if not state._agreed:
            # The first bucket of this process: every rank's hook must run
            # the same configuration, or the ranks part at start_iter.
            agree("CompressionState", {**state.config(), "iteration": it}, state._session.base_group(),
                  tensor.device)
            state._agreed = True
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
                if not warm or index in state._error_feedback():
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

    try:
        if warm:
            work = pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False)
        elif keyed:
            key = index if state._uses_ef() else None
            if key is not None:
                state._session.claim(key)
            work = pd.all_reduce(tensor, key=key, group=group, op="avg", async_op=True)
        else:
            return _remapped(state, bucket, tensor, positions, group, it)
        raw = work.get_future()
        return _result([raw], lambda: _first_tensor(raw.value(), tensor))
    except Exception as exc:
        return _failed(exc)


def _remapped(state, bucket, tensor, positions, group, it) -> torch.futures.Future:
    """The first iteration of a resumed process: the residuals are keyed by
    the saved buckets, so DDP's unrebuilt bucket is cut into those, each
    reduced on its own under its key, as when saved; exact if they do not
    tile it."""
    parts = _saved_parts(state, bucket, tensor, positions, it)
    if parts is None:
        raw = pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False).get_future()
        return _result([raw], lambda: _first_tensor(raw.value(), tensor))
    # One engine call per saved bucket, issued now in index order (the
    # engine runs them in submission order, the same on every rank).
    pending = []
    for index, slices in parts:
        flat = torch.cat([tensor[o : o + n] for o, n in slices])
        key = index if state._uses_ef() else None
        if key is not None:
            state._session.claim(key)
        work = pd.all_reduce(flat, key=key, group=group, op="avg", async_op=True)
        pending.append((work.get_future(), flat, slices))

    def copy_back():
        for _, flat, slices in pending:
            start = 0
            for o, n in slices:
                tensor[o : o + n].copy_(flat[start : start + n])
                start += n
        return tensor

    return _result([f for f, _, _ in pending], copy_back)


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
