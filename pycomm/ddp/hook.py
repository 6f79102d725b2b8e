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
own type and message, after DDP ended its backward pass (the bucket is left
as it was): the same DDP model trains on once the cause is fixed.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import distributed as pd
from ..distributed.spec import is_plugin
from ..distributed.checks import agree, check_fields, check_int, is_int
from ..distributed.session import EngineSession, check_version, nest_legacy
from .buckets import BucketLayout, BucketTracker, checked_layouts, failed, result
from ..distributed.spec import AUTO_METHOD, EF_METHODS, EXACT_METHOD, GROUP_METHODS, check_mode, error_feedback_for

__all__ = ["CompressionState", "compressed_hook"]

#: What the hook can run: every method of a group but "none" (no hook needed).
COMPRESSORS = tuple(m for m in GROUP_METHODS if m != EXACT_METHOD)
#: The version of a state_dict; version 2 (the engine state's fields at the
#: top level) loads too (``nest_legacy``).
_STATE_VERSION = 3
#: The fields of a state_dict, and of its "config" entry ("engine": the
#: engine client's state, EngineSession.state_dict).
_STATE_FIELDS = ("version", "config", "iteration", "bucket_layouts", "engine")
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
            (``spec.error_feedback_for``, from the method's row: on for
            onebit, topk and registered compressors, off for int8/int4,
            none for fp16/bf16; each row of ``spec.METHOD_TABLE`` says its own).
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
        _check_compressor(compressor, "compressor")
        pd.check_options(hierarchy=hierarchy, calibration=calibration, compressor=compressor,
                         compressor_options=compressor_options)
        # The one rule: None is the method's default (spec.error_feedback_for).
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
        #: DDP's buckets: their layouts (saved), the backward passes of this
        #: process; a parameter's position is its index in the concatenated
        #: parameter lists of DDP's initial buckets (deterministic for a
        #: given model and DDP configuration, in any process).
        self.buckets = BucketTracker("CompressionState")
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
        return self.error_feedback and (self.compressor in (*EF_METHODS, AUTO_METHOD) or is_plugin(self.compressor))

    @property
    def bucket_layouts(self) -> Dict[int, BucketLayout]:
        """Bucket index -> its layout (numel, parameter positions), recorded
        once DDP's buckets are stable."""
        return self.buckets.layouts

    # -- runtime (not saved, not pickled) --------------------------------------
    def _init_runtime(self) -> None:
        self._agreed = False  # the ranks' configurations compared (at the first bucket)
        self._warned_unmapped = False

    def _new_session(self, cfg: Optional[Dict[str, Any]] = None) -> EngineSession:
        """The engine client of configuration ``cfg`` (None: this one):
        bucket ``i``'s residuals under key ``i`` of the group."""
        cfg = self.config() if cfg is None else cfg
        settings = {k: cfg[k] for k in _ENGINE_FIELDS if k != "compressor" and cfg[k] is not None}
        settings.update(check_calls=self.check_calls, hierarchy=self.hierarchy, calibration=self.calibration,
                        compressor_options=self.compressor_options)
        return EngineSession("CompressionState", cfg["compressor"], settings,
                             process_group=self.process_group, private_group=self.private_group)

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

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration, configuration, bucket layout and this rank's residuals.

        Every rank saves its own (the residuals differ between ranks); the
        tensors are copies, so the dict does not change as training goes on.

        Example::

            >>> sd = CompressionState(compressor="onebit", start_iter=4).state_dict()
            >>> sd["version"], sd["iteration"], sd["engine"]["residuals"]
            (3, 0, {})
        """
        return {
            "version": _STATE_VERSION,
            "config": self.config(),
            "iteration": self.iteration,
            "bucket_layouts": self.buckets.state(),
            "engine": self._session.state_dict(),  # world, rank and residuals per bucket key
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
        cfg, iteration, layouts, engine_state = _checked_state(state)
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
        # Before the engine group exists, a new configuration is a new client.
        session = self._session if self._engine is not None else self._new_session(cfg)
        loaded = session.check_state(engine_state, "state['engine']", reset_error_feedback)
        session.load_state(loaded)  # the engine's own checks last: it refuses before it changes anything
        replaced = {f: (getattr(self, f), cfg[f]) for f in _ENGINE_FIELDS if cfg[f] != getattr(self, f)}
        if replaced:
            # The saved configuration decides (documented); said, not silent.
            warnings.warn("CompressionState.load_state_dict: the loaded state runs "
                          + ", ".join(f"{f}={new!r} (was {old!r})" for f, (old, new) in replaced.items()),
                          UserWarning, stacklevel=2)
        self._session = session
        self._set_config(cfg)
        self._agreed = False  # compared again at the next bucket
        self.iteration = iteration
        self.buckets.layouts = {} if reset_error_feedback else layouts

    def __getstate__(self) -> Dict[str, Any]:
        keep = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k == "_session"}
        keep["process_group"] = None  # the default group of the process that unpickles
        return keep  # the session pickles its residuals, not its group

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._init_runtime()

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"CompressionState({cfg}, iteration={self.iteration})"

# ------------------------------------------------------------ validation ---
def _labelled(label: Optional[str], check: Callable[[], Any]) -> Any:
    """``check()``, its TypeError/ValueError prefixed with ``label`` (the
    field of a loaded state) when there is one."""
    if label is None:
        return check()
    try:
        return check()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{label}: {exc}") from None


def _check_compressor(compressor: Any, name: str) -> None:
    """What the hook runs: a group method but "none" (DDP's own all-reduce
    is exact), or a registered compressor."""
    if compressor not in COMPRESSORS and not is_plugin(compressor):
        raise ValueError(f"{name} must be one of {list(COMPRESSORS)} or a registered compressor "
                         f"(pycomm.register_compressor), got {compressor!r}")


def _checked_config(cfg: Dict[str, Any], where: Optional[str] = None) -> Dict[str, Any]:
    """The configuration, validated and normalized, without side effects.
    ``where``: the name of the dict in a loaded state, for the errors."""

    def label(name):
        return None if where is None else f"{where}[{name!r}]"

    if where is not None:
        if not isinstance(cfg, dict):
            raise TypeError(f"{where} must be a dict, got {type(cfg).__name__}")
        cfg = {**_CONFIG_DEFAULTS, **cfg}
        check_fields(where, cfg, _CONFIG_FIELDS)
    _check_compressor(cfg["compressor"], label("compressor") or "compressor")
    out = {}
    for name in _ENGINE_FIELDS:  # the group's own checks, one field at a time to name it
        out.update(_labelled(label(name), lambda: pd.check_options(**{name: cfg[name]})))
    _labelled(label("rounding"), lambda: pd.check_options(compressor=cfg["compressor"], rounding=cfg["rounding"]))
    start_iter, name = cfg["start_iter"], label("start_iter") or "start_iter"
    if not is_int(start_iter):
        raise TypeError(f"{name} must be an int, got {start_iter!r}")
    if start_iter < 2:
        raise ValueError(
            f"{name} must be >= 2, got {start_iter}: DDP rebuilds its gradient buckets "
            f"after the first iteration, so bucket.index(), which keys the error-feedback "
            f"residuals, is not stable before the second (pytorch issue #51427)"
        )
    if not isinstance(cfg["error_feedback"], bool):
        raise TypeError(f"{label('error_feedback') or 'error_feedback'} must be a bool, got {cfg['error_feedback']!r}")
    return {**out, "start_iter": start_iter, "error_feedback": cfg["error_feedback"]}


def _checked_state(state: Any):
    """The hook's own fields of a state (:meth:`CompressionState.
    load_state_dict`), checked and copied: ``(config, iteration,
    bucket_layouts, engine state)``; the engine state is the session's to
    check. Raises, naming the field, before anything is changed."""
    def upgrade(old: Dict[str, Any]) -> Dict[str, Any]:
        cfg = old.get("config")
        return nest_legacy(old, cfg.get("compressor") if isinstance(cfg, dict) else None)

    state = check_version("state", "CompressionState", state, _STATE_VERSION, _STATE_FIELDS, upgrade=upgrade)
    cfg = _checked_config(state["config"], "state['config']")
    iteration = check_int("state['iteration']", state["iteration"])
    return cfg, iteration, checked_layouts(state["bucket_layouts"], "state['bucket_layouts']"), state["engine"]


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
        return failed(TypeError(
            f"compressed_hook needs a pycomm.ddp.CompressionState as its state, got {type(state).__name__}"
        ))
    tensor = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    it = state.iteration
    # Before DDP's first bucket rebuild in this process (its first iteration)
    # the buckets are not the ones the residuals belong to.
    stable = state.buckets.start(bucket)
    if is_last:  # one backward pass = one iteration, whatever happens below
        state.iteration += 1
    try:
        if not state._agreed:
            # The first bucket of this process: every rank's hook must run
            # the same configuration, or the ranks part at start_iter.
            agree("CompressionState", {**state.config(), "iteration": it}, state._session.base_group(),
                  tensor.device)
            state._agreed = True
        layout = state.buckets.layout(bucket)
    except Exception as exc:
        return failed(exc, tensor)
    warm = it < state.start_iter
    try:
        if stable:
            # A layout other than the saved one: refused once it matters (after
            # the warm-up, or with residuals kept under this index).
            known = state.bucket_layouts.get(index)
            state.buckets.record(index, layout, replace=known is not None and known != layout and warm
                                 and index not in state._error_feedback())
        # This bucket is one whose residuals are kept under its index (else:
        # the first iteration of a resumed process, before DDP's rebuild).
        keyed = stable or state.bucket_layouts.get(index) == layout
        group = state._engine_group(tensor.device)
    except Exception as exc:
        return failed(exc, tensor)

    try:
        if warm:
            work = pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False)
        elif keyed:
            key = index if state._uses_ef() else None
            if key is not None:
                state._session.claim(key)
            work = pd.all_reduce(tensor, key=key, group=group, op="avg", async_op=True)
        else:
            return _remapped(state, bucket, tensor, layout.positions, group, it)
        raw = work.get_future()
        return result([raw], lambda: _first_tensor(raw.value(), tensor), tensor)
    except Exception as exc:
        return failed(exc, tensor)


def _remapped(state, bucket, tensor, positions, group, it) -> torch.futures.Future:
    """The first iteration of a resumed process: the residuals are keyed by
    the saved buckets, so DDP's unrebuilt bucket is cut into those, each
    reduced on its own under its key, as when saved; exact if they do not
    tile it."""
    parts = _saved_parts(state, bucket, tensor, positions, it)
    if parts is None:
        raw = pd.all_reduce(tensor, group=group, op="avg", async_op=True, compress=False).get_future()
        return result([raw], lambda: _first_tensor(raw.value(), tensor), tensor)
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

    return result([f for f, _, _ in pending], copy_back, tensor)


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
