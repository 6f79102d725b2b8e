"""One client's use of the engine: its group, its keys, its residuals.

The DDP hook (:class:`pycomm.ddp.CompressionState`), the compressed-momentum
optimizers (:mod:`pycomm.optim`) and :mod:`pycomm.fsdp` all do the same
things around the engine's keyed collectives: find or create the pycomm
group that runs their calls, check that a pycomm group they were handed runs
their settings, own a range of keys in it, and save, validate and load the
residuals under those keys. :class:`EngineSession` does it once, so they all
run the same checks and say the same things when a check fails.

The session also owns the one format a client saves its residuals in
(:meth:`EngineSession.state_dict`: version, the world and rank they belong
to, the method, the residuals by key offset) and its checks
(:meth:`EngineSession.check_state`): the clients nest it under their own
state's ``"engine"`` entry and keep only their own fields.

Example::

    >>> s = EngineSession("my trainer", "int8", {"block_size": 128}, key_base=1 << 30)
    >>> s.key(3) - (1 << 30), s.owns((1 << 30) + 3), s.owns(0)
    (3, True, False)
    >>> s.residuals()   # nothing run, nothing loaded
    {}
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _ext
from ..compressors.plugin import options_json, payload_nbytes
from . import spec
from .checks import MAX_KEY, check_fields, check_int, check_residual_fields, is_int

__all__ = ["EngineSession", "KEY_SPAN", "STATE_VERSION", "check_residual", "check_residuals", "check_version",
           "copy_residual", "nest_legacy"]

#: Keys a session owns from its ``key_base``: ``[key_base, key_base +
#: KEY_SPAN)``. Two sessions on one pycomm group need ranges that do not
#: overlap (refused otherwise: they would train each other's residuals).
KEY_SPAN = 1 << 20
#: The version of :meth:`EngineSession.state_dict`'s format, and its fields.
STATE_VERSION = 1
STATE_FIELDS = ("version", "world_size", "rank", "method", "residuals")

# Live sessions per engine group: (key range, owner name) of each, to refuse
# two clients whose key ranges overlap in one group.
_claims: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[int, Tuple[int, int, str]]]" = \
    weakref.WeakKeyDictionary()


def check_key_base(key_base: Any, span: int = KEY_SPAN, name: str = "key_base") -> int:
    """``key_base`` checked: an int with ``[key_base, key_base + span)``
    inside the engine's keys (non-negative int64).

    >>> check_key_base(2 ** 63)
    Traceback (most recent call last):
    ...
    ValueError: key_base must be in [0, 9223372036854775807 - 1048575] (keys are int64 and a session owns 1048576 of them), got 9223372036854775808
    """
    if not is_int(key_base):
        raise TypeError(f"{name} must be an int, got {key_base!r}")
    if not 0 <= key_base <= MAX_KEY - (span - 1):
        raise ValueError(f"{name} must be in [0, {MAX_KEY} - {span - 1}] (keys are int64 and a session owns "
                         f"{span} of them), got {key_base}")
    return key_base


def check_version(where: str, owner: str, state: Any, version: int, fields: Sequence[str],
                  optional: Sequence[str] = (), upgrade: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
                  ) -> Dict[str, Any]:
    """A client's saved state (``where``: its name in errors) checked to be
    ``owner``'s of ``version`` with ``fields`` (and maybe ``optional``);
    with ``upgrade``, one of the version before is turned into this one
    (states saved before the engine state had an entry of its own:
    :func:`nest_legacy`). Returns the state of this version.

    >>> check_version("state", "trainer", {"version": 1}, 2, ("version", "step"))
    Traceback (most recent call last):
    ...
    ValueError: state['version']: not a trainer state of version 2 (got 1)
    """
    if upgrade is not None and isinstance(state, dict) and state.get("version") == version - 1:
        state = dict(upgrade(state), version=version)
    if not isinstance(state, dict) or state.get("version") != version:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        older = f" or {version - 1}" if upgrade is not None else ""
        raise ValueError(f"{where}['version']: not a{'n' if owner[0] in 'aeiou' else ''} {owner} state of version "
                         f"{version}{older} (got {got!r})")
    check_fields(where, state, fields, optional)
    return state


# ------------------------------------------------------------ residuals ---
def copy_residual(ef: Dict[str, Any], device: Optional[torch.device] = None) -> Dict[str, Any]:
    """A copy of one key's residuals (on ``device`` when given), sharing no
    tensor with ``ef``."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if device is not None and t.device != device:
            return t.to(device, copy=True).contiguous()
        return t.clone(memory_format=torch.contiguous_format)

    out = {k: v for k, v in ef.items() if k not in ("worker", "server")}
    out["worker"] = copy(ef["worker"])
    out["server"] = [copy(s) for s in ef["server"]]
    return out


def residual_on(ef: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """``ef`` (a copy the caller owns) with its tensors on ``device``."""
    if all(t.device == device for t in [ef["worker"], *ef["server"]]):
        return ef
    return copy_residual(ef, device)


def check_residual(label: str, ef: Any, methods: Sequence[str], rank: Optional[Tuple[int, int]] = None,
                   block_size: Optional[int] = None) -> Dict[str, Any]:
    """One key's residuals checked (their fields here, their layout by
    the engine's own check, the one every load of residuals runs) and
    copied; ``methods``: the methods they may belong to. Raises, naming
    ``label`` and the field, for anything the engine would refuse or train
    on wrongly: a missing or unknown field, a size, a tensor of another
    shape, dtype or device, a non-finite value (it would spread to every
    rank at the next call). With ``rank`` (``(rank, world size)`` of the
    saved state) and residuals of that world size, a block codec's server
    residuals must be that rank's segments at ``block_size`` (None: the
    method's default), as the engine will run them (residuals of another
    world size are the engine's to refuse)."""
    check_residual_fields(label, ef)
    method = ef["method"]
    if method not in methods:
        raise ValueError(f"{label}['method'] is {method!r}, but the residuals loaded here are of "
                         f"{list(methods)}")
    base = method.partition("/")[0]
    block = spec.block_size_for(base, block_size) if spec.method_spec(base).kind == "block" else 0
    # The layout rules are the engine's: one check for its loads and this one.
    if _ext.why_no_cpu_ops() is not None:
        raise RuntimeError(_ext.why_no_cpu_ops())
    _ext._C.check_residual_layout(label, ef, rank[0] if rank is not None and rank[1] == ef["world_size"] else -1,
                                  block)
    return copy_residual(ef)


def check_residuals(label: str, residuals: Any, methods: Sequence[str], span: Optional[int] = None,
                    rank: Optional[Tuple[int, int]] = None, block_size: Optional[int] = None
                    ) -> Dict[int, Dict[str, Any]]:
    """A dict ``{key: residuals}`` checked whole (:func:`check_residual`
    for each, with ``rank`` and ``block_size``) and copied: keys
    non-negative ints, below ``span`` when given. Nothing is changed
    anywhere when it raises."""
    if not isinstance(residuals, dict):
        raise TypeError(f"{label} must be the dict of residuals state_dict() saved, "
                        f"got {type(residuals).__name__}")
    out = {}
    for key, ef in residuals.items():
        where = f"{label}[{key!r}]"
        check_int(f"{where}: a key", key, 0, span)
        out[key] = check_residual(where, ef, methods, rank=rank, block_size=block_size)
    return out


def residual_methods(compressor: str, collective: str = "") -> Tuple[str, ...]:
    """The methods whose residuals a client running ``compressor`` keeps:
    its own, or, for "auto", any that keeps residuals; ``collective``: the
    suffix of a reduce-scatter's or all-gather's residuals
    (``spec.REDUCE_SCATTER_SUFFIX``), "" for an all-reduce's."""
    return spec.EF_METHODS if compressor == spec.AUTO_METHOD else (compressor + collective,)


def nest_legacy(state: Dict[str, Any], method: str) -> Dict[str, Any]:
    """A client's state saved before the engine state had an entry of its
    own (``world_size``, ``rank`` and ``error_feedback`` beside the client's
    fields), with those as the ``"engine"`` entry of this format; other
    fields as they were, for the client to check.

    >>> sorted(nest_legacy({"version": 2, "world_size": 2, "rank": 1, "error_feedback": {}}, "onebit")["engine"])
    ['method', 'rank', 'residuals', 'version', 'world_size']
    """
    out = {k: v for k, v in state.items() if k not in ("world_size", "rank", "error_feedback")}
    out["engine"] = {"version": STATE_VERSION, "world_size": state.get("world_size"), "rank": state.get("rank"),
                     "method": method, "residuals": state.get("error_feedback") or {}}
    return out


#: Per process: how often each owner checked its group (the store keys of
#: :func:`same_group` are numbered by it, alike on every rank; not by key
#: base, so that ranks whose key bases differ still meet and are told).
_GROUP_CHECKS: Dict[str, int] = {}


def same_group(owner: str, group: dist.ProcessGroup, key_base: int = 0) -> None:
    """Raise on every rank when the ranks that run ``owner`` together name
    different groups (one passes a pycomm group and another none; other
    members) or key bases: a collective over groups that differ never
    meets, so a settings exchange would wait out the timeout. Through the default store,
    not a collective: each rank writes the members and backend of its group
    and reads what each member wrote. A rank that never comes raises at the
    store's timeout, naming it. Once per client, at its first collective."""
    members = dist.get_process_group_ranks(group)
    if len(members) < 2 and dist.get_world_size() < 2:
        return
    n = _GROUP_CHECKS.get(owner, 0)
    _GROUP_CHECKS[owner] = n + 1
    mine = f"ranks {members} ({dist.get_backend(group)}) with key_base={key_base}"
    store = dist.distributed_c10d._get_default_store()
    prefix = f"pycomm/group/{owner}/{n}/"
    me = dist.get_rank()
    store.set(prefix + str(me), mine)
    others = [r for r in members if r != me]
    try:
        theirs = [v.decode() for v in store.multi_get([prefix + str(r) for r in others])] if others else []
    except (RuntimeError, dist.DistError) as exc:  # DistStoreError: a rank that never came
        raise RuntimeError(f"{owner}: not every rank of {members} reached its first step within the store's "
                           f"timeout ({store.timeout}); every rank of the group makes it") from exc
    differ = [(r, t) for r, t in zip(others, theirs) if t != mine]
    if differ:
        raise ValueError(
            f"{owner}: the ranks run it over different process groups or key bases: this rank ({me}) over {mine}; "
            + "; ".join(f"rank {r} over {t}" for r, t in differ)
            + ". Pass every rank its group (made up front by every rank, in one order), or none on every "
              "rank. Nothing was changed.")


# -------------------------------------------------------------- session ---
def check_world(owner: str, saved: Optional[Tuple[int, int]], here: Tuple[int, int]) -> None:
    """The world/rank check of every client's loaded residuals, defined
    once: residuals saved by rank ``saved[1]`` of ``saved[0]`` (None: none
    to check) belong to that rank of that world; ``here`` is ``(world
    size, rank)`` now.

    >>> check_world("DiLoCo", (2, 1), (2, 0))
    Traceback (most recent call last):
    ...
    ValueError: cannot load this DiLoCo state: it holds rank 1 of 2's residuals, this is rank 0 of 2. Every rank saves and loads its own state, or pass reset_error_feedback=True to keep the rest and start the residuals over
    """
    if saved is None or tuple(saved) == tuple(here):
        return
    why = (f"it was saved with world size {saved[0]}, this group has {here[0]}" if saved[0] != here[0] else
           f"it holds rank {saved[1]} of {saved[0]}'s residuals, this is rank {here[1]} of {here[0]}")
    raise ValueError(f"cannot load this {owner} state: {why}. Every rank saves and loads its own state, or pass "
                     f"reset_error_feedback=True to keep the rest and start the residuals over")


def _release(group: dist.ProcessGroup) -> None:
    """Destroy a pycomm group a session made, when the session goes."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - torch.distributed already torn down: nothing left to free
        pass


class LoadedState(NamedTuple):
    """A state checked by :meth:`EngineSession.check_state`, for
    :meth:`EngineSession.load_state`."""

    #: (world size, rank) the residuals belong to, still to be checked
    #: (torch.distributed was not up); None: checked, or nothing to check.
    world: Optional[Tuple[int, int]]
    #: Residuals by key offset (copies); None: start them over.
    residuals: Optional[Dict[int, Dict[str, Any]]]


class EngineSession:
    """The engine as one client uses it.

    ``owner``: the client's name in errors (``"OneBitAdam"``). ``compressor``
    and ``settings`` (:class:`pycomm.distributed.PycommOptions` fields but
    the compressor): what the client's calls run. ``process_group``: the
    group given by the user (None: the default group). A plain group is
    wrapped into a pycomm group of the session's settings at the first
    :meth:`engine` call, on every rank alike; a pycomm group is used as it
    is, after :meth:`check_group` (unless ``private_group``: then it is
    wrapped too). The session owns the keys ``[key_base, key_base +
    key_span)`` of that group; another live session whose range overlaps
    them in the same group is refused.

    Residuals are kept relative to ``key_base``: :meth:`residuals` returns
    and :meth:`load_residuals` takes ``{offset: residuals}``. Loaded before
    the group exists, they wait and go in at the first :meth:`engine`.

    Example::

        s = EngineSession("trainer", "onebit", {}, key_base=1 << 40)
        pg = s.engine(torch.device("cpu"))
        pd.all_reduce(t, key=s.key(0), group=pg)
        saved = s.residuals()          # {0: {...}}
    """

    def __init__(self, owner: str, compressor: str, settings: Dict[str, Any], *,
                 process_group: Optional[dist.ProcessGroup] = None, key_base: int = 0,
                 key_span: int = KEY_SPAN, private_group: bool = False, collective: str = "") -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        self.owner = owner
        self.compressor = compressor
        self.settings = dict(settings)
        self.process_group = process_group
        self.key_base = check_key_base(key_base, key_span)
        self.key_span = key_span
        self.private_group = private_group
        #: The residuals' collective suffix (``residual_methods``).
        self.collective = collective
        self._pending: Optional[Dict[int, Any]] = None  # residuals loaded before the group exists
        #: (world size, rank) of loaded residuals, checked when the group is made.
        self._saved_world: Optional[Tuple[int, int]] = None
        self.detach()

    def detach(self) -> None:
        """Forget the process's group (after unpickling: a new process)."""
        self._engine: Optional[dist.ProcessGroup] = None
        self._device: Optional[torch.device] = None
        self._private = False  # the engine group is this session's own
        self._same_group = False  # same_group() done in this process
        #: Offsets whose residual in a shared group is this session's.
        self._claimed: set = set()

    # -- groups ----------------------------------------------------------------
    def base_group(self) -> dist.ProcessGroup:
        """The group the user gave, or the default group."""
        if not dist.is_initialized():
            raise RuntimeError(f"{self.owner} needs torch.distributed: call dist.init_process_group "
                               f"(or pycomm.distributed.init_process_group) first")
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def same_group(self) -> None:
        """:func:`same_group` over :meth:`base_group`, once per session."""
        if not self._same_group:
            same_group(self.owner, self.base_group(), self.key_base)
            self._same_group = True

    def world(self) -> Tuple[int, int]:
        """``(world size, rank)`` in the base group."""
        group = self.base_group()
        return dist.get_world_size(group), dist.get_rank(group)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The engine group, once :meth:`engine` made or found it."""
        return self._engine

    @property
    def device(self) -> Optional[torch.device]:
        return self._device

    @property
    def waiting(self) -> bool:
        """True when loaded residuals wait for the engine group."""
        return bool(self._pending)

    @property
    def private(self) -> bool:
        """True when the engine group is this session's own (it made it)."""
        return self._private

    def engine(self, device: torch.device) -> dist.ProcessGroup:
        """The pycomm group that runs this session's calls on ``device``
        (created at the first call, on every rank alike); residuals loaded
        before it existed go in now."""
        if self._engine is not None:
            return self._engine
        from . import is_pycomm_group, wrap

        self._check_saved_world()
        base = self.base_group()
        shared = is_pycomm_group(base, device) and not self.private_group
        if shared:
            self.check_group(base, device)
            engine = base
        else:
            size, world = dist.get_world_size(base), dist.get_world_size()
            if size < world:
                # torch's new_group needs every rank of the world, in one
                # order; the ranks of one subgroup alone would make groups
                # whose names collide with another subgroup's (cross-talk).
                raise ValueError(
                    f"{self.owner} runs over a subgroup ({size} of the world's {world} ranks) that is not a pycomm "
                    f"group: the pycomm group it would wrap it into must be made by every rank of the world, in "
                    f"one order, which the ranks of one subgroup cannot do. Make the pycomm groups up front, on "
                    f"every rank: for each subgroup, dist.new_group(ranks, backend='pycomm', pg_options="
                    f"pycomm.distributed.PycommOptions(compressor={self.compressor!r}, ...)), and pass this "
                    f"rank's as process_group")
            settings = dict(self.settings)
            if is_pycomm_group(base, device):
                settings["inner"] = "nccl" if device.type == "cuda" else "gloo"
            engine = wrap(base, compressor=self.compressor, **settings)
        self._claim_range(engine)
        self._engine, self._device, self._private = engine, device, not shared
        if not shared:
            # The group this session made is its own: released with it (its
            # threads, sockets and residuals), not at the end of the process.
            weakref.finalize(self, _release, engine)
        pending, self._pending = self._pending, None
        if pending:
            self._install(pending)
        return engine

    def adopt(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Run on ``group``, a pycomm group the client made for itself
        (pycomm.fsdp's): residuals loaded before go in now."""
        self._check_saved_world()
        self._claim_range(group)
        self._engine, self._device, self._private = group, device, True
        pending, self._pending = self._pending, None
        if pending:
            self._install(pending)

    def _check_saved_world(self) -> None:
        # Forgotten only once it passed: a retried step checks again.
        if self._saved_world is not None:
            check_world(self.owner, self._saved_world, self.world())
        self._saved_world = None

    def check_group(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """A pycomm group compresses with its own settings: refuse one whose
        settings are not this session's, naming each that differs."""
        from . import options_of

        theirs = dict(options_of(group, device.type if isinstance(device, torch.device) else device))
        kind = spec.method_spec(self.compressor).kind if self.compressor != spec.AUTO_METHOD else spec.AUTO_METHOD
        mine: Dict[str, Any] = {"method": self.compressor}
        if kind == "block":
            mine["block_size"] = spec.block_size_for(self.compressor, self.settings.get("block_size"))
            theirs["block_size"] = spec.block_size_for(self.compressor, theirs.get("block_size") or None)
        if kind == "sparse":
            for name in ("density", "approx"):
                if name in self.settings:
                    mine[name] = self.settings[name]
        if self.compressor in spec.ROUNDING_METHODS or kind == spec.AUTO_METHOD:
            rounding = self.settings.get("rounding", "nearest")
            mine.update(rounding=rounding, seed=self.settings.get("seed", 0) if rounding == "stochastic" else 0)
        if self.settings.get("chunk_numel") is not None:
            mine["chunk_numel"] = self.settings["chunk_numel"]
        if kind == "plugin":
            mine["plugin_options"] = options_json(self.compressor, self.settings.get("compressor_options"))
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            raise ValueError(
                f"{self.owner} asks for " + ", ".join(f"{'compressor' if k == 'method' else k}={v[1]!r}"
                                                      for k, v in diff.items())
                + " but its process group runs the pycomm backend with "
                + ", ".join(f"{'compressor' if k == 'method' else k}={v[0]!r}" for k, v in diff.items())
                + ": the group's settings decide, so make them agree"
            )

    def _claim_range(self, engine: dist.ProcessGroup) -> None:
        lo, hi = self.key_base, self.key_base + self.key_span
        live = _claims.setdefault(engine, {})
        for sid, (olo, ohi, owner) in list(live.items()):
            if sid == id(self):
                continue
            if lo < ohi and olo < hi:
                raise ValueError(
                    f"{self.owner} would use the keys [{lo}, {hi}) of its pycomm group, which {owner} already "
                    f"uses ([{olo}, {ohi})): they would train each other's error-feedback residuals. Give one "
                    f"of them another key_base (at least {self.key_span} apart)"
                )
        live[id(self)] = (lo, hi, self.owner)
        weakref.finalize(self, live.pop, id(self), None)

    def wire_settings(self, device: torch.device) -> Dict[str, Any]:
        """What :func:`spec.wire_bytes` counts this session's calls on
        ``device`` by: the settings of its engine group (made, or a pycomm
        group it was given), else its own, with the defaults a group would
        take; and a registered compressor's payload size."""
        from . import is_pycomm_group, options_of

        group, s = self._engine, self.settings
        if group is None and dist.is_initialized() and not self.private_group \
                and is_pycomm_group(self.base_group(), device):
            group = self.base_group()
        if group is not None:
            o = options_of(group, device.type)
            out = {k: o[k] for k in ("chunk_numel", "block_size", "density", "approx")}
        else:
            out = {"chunk_numel": s.get("chunk_numel") or spec.default_chunk_numel(device.type, s.get("inner")),
                   "block_size": s.get("block_size"), "density": s.get("density", 0.01),
                   "approx": s.get("approx", True)}
        plugin = self.compressor != spec.AUTO_METHOD and spec.method_spec(self.compressor).kind == "plugin"
        out["payload_nbytes"] = payload_nbytes(self.compressor, s.get("compressor_options")) if plugin else None
        return out

    # -- keys ------------------------------------------------------------------
    def key(self, offset: int) -> int:
        """The engine key of this session's ``offset``."""
        if not 0 <= offset < self.key_span:
            raise ValueError(f"{self.owner}: key offset {offset} is outside [0, {self.key_span})")
        return self.key_base + offset

    def owns(self, key: int) -> bool:
        return self.key_base <= key < self.key_base + self.key_span

    def claim(self, offset: int) -> None:
        """Before this session's first use of ``offset`` in a shared group:
        drop what other code left under its key, so the residual starts at 0."""
        if self._engine is None:
            raise RuntimeError(f"{self.owner}: claim() before the engine group exists")
        if self._private or offset in self._claimed:
            return
        from . import reset_error_feedback

        reset_error_feedback(self.key(offset), group=self._engine, device=self._device.type)
        self._claimed.add(offset)

    # -- residuals ---------------------------------------------------------------
    def residuals(self) -> Dict[int, Dict[str, Any]]:
        """This rank's residuals under this session's keys, by offset
        (copies): from the engine (after every call handed to it; in a
        shared group, the keys it ran or loaded), or those loaded and still
        waiting for it."""
        if self._engine is None:
            return {k: copy_residual(v) for k, v in (self._pending or {}).items()}
        from . import error_feedback_state

        full = error_feedback_state(self._engine, self._device.type)
        mine = {k - self.key_base: v for k, v in full.items() if self.owns(k)}
        if not self._private:  # in a shared group: the keys this session ran or loaded
            mine = {k: v for k, v in mine.items() if k in self._claimed}
        return mine

    def residual_nbytes(self) -> int:
        """Bytes of this session's residuals now (one buffer each: the
        engine keeps a second of the same size for its rollback)."""
        return sum(t.numel() * t.element_size() for ef in self.residuals().values()
                   for t in [ef["worker"], *ef["server"]])

    def kept_nbytes(self) -> int:
        """Bytes the engine keeps between calls for itself
        (:func:`pycomm.distributed.kept_nbytes`) when the engine group is
        this session's own; 0 for a shared group (its buffer serves every
        user of the group) or before the group exists."""
        from . import kept_nbytes

        if self._engine is None or not self._private:
            return 0
        return kept_nbytes(self._engine, self._device.type)

    def load_residuals(self, residuals: Dict[int, Dict[str, Any]]) -> None:
        """Make ``residuals`` (``{offset: residuals}``, checked by the
        caller with :func:`check_residuals`, and this session's to keep)
        this session's residuals: in the engine group, or waiting for it.
        The engine refuses residuals of another world size, method or
        chunk before it changes anything."""
        if self._engine is None:
            self._pending = dict(residuals)
            return
        self._install(residuals)

    def _install(self, residuals: Dict[int, Dict[str, Any]]) -> None:
        from . import error_feedback_state, load_error_feedback_state

        new = {self.key(k): residual_on(v, self._device) for k, v in residuals.items()}
        # The engine's load replaces its whole store: keep every other key's.
        current = error_feedback_state(self._engine, self._device.type)
        new = {**{k: v for k, v in current.items() if not self.owns(k)}, **new}
        load_error_feedback_state(new, self._engine, self._device.type)
        self._claimed = set(residuals)

    def reset_residuals(self) -> None:
        """Start every residual of this session over (zero)."""
        self._pending = None
        if self._engine is None:
            return
        from . import error_feedback_state, load_error_feedback_state

        current = error_feedback_state(self._engine, self._device.type)
        load_error_feedback_state({k: v for k, v in current.items() if not self.owns(k)},
                                  self._engine, self._device.type)
        self._claimed = set()

    def undo(self, offsets: Iterable[int]) -> None:
        """Put back the residuals of this session's keys ``offsets`` as they
        were before their last call (pycomm.distributed.undo_error_feedback)."""
        keys: List[int] = [self.key(k) for k in offsets]
        if keys:
            from . import undo_error_feedback

            undo_error_feedback(keys, self._engine, self._device.type)

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals in the one format every client nests in
        its state (under ``"engine"``): the version, the world size and rank
        they belong to (None before torch.distributed is up and nothing was
        loaded), the method, and the residuals by key offset (copies).

        >>> EngineSession("trainer", "int8", {}).state_dict()
        {'version': 1, 'world_size': None, 'rank': None, 'method': 'int8', 'residuals': {}}
        """
        world, rank = self.world() if dist.is_initialized() else (self._saved_world or (None, None))
        return {"version": STATE_VERSION, "world_size": world, "rank": rank, "method": self.compressor,
                "residuals": self.residuals()}

    def check_state(self, state: Any, where: str, reset: bool = False, span: Optional[int] = None,
                    chunk_numel: Optional[int] = None) -> LoadedState:
        """``state`` (a :meth:`state_dict`; ``where``: its name in errors)
        checked whole, without changing anything: its fields, the world and
        rank (against this process's when torch.distributed is up), the
        method, and every residual (:func:`check_residuals`, at this
        session's block size; key offsets below ``span``, default its key
        span; ``chunk_numel``: the chunk the client's group runs, when known
        before the group exists). ``reset``: the residuals are dropped (not
        checked), and so is the rank they belong to."""
        if not isinstance(reset, bool):
            raise TypeError(f"reset_error_feedback must be a bool, got {reset!r}")
        check_version(where, "engine", state, STATE_VERSION, STATE_FIELDS)
        world, rank = state["world_size"], state["rank"]
        if (world is None) != (rank is None):
            raise ValueError(f"{where}['world_size'] and {where}['rank'] must both be None or both ints, "
                             f"got {world!r} and {rank!r}")
        if world is not None:
            check_int(f"{where}['rank']", rank, 0, check_int(f"{where}['world_size']", world, 1))
        if reset:
            return LoadedState(None, None)
        residuals = state["residuals"]
        if residuals and state["method"] != self.compressor:
            raise ValueError(f"cannot load this {self.owner} state: its residuals are {state['method']!r}'s, this "
                             f"{self.owner} runs {self.compressor!r}. Load it where {state['method']!r} runs, or pass "
                             f"reset_error_feedback=True to keep the rest and start the residuals over")
        saved = None if world is None else (world, rank)
        if residuals and saved is not None and dist.is_initialized():
            check_world(self.owner, saved, self.world())
            saved = None
        residuals = check_residuals(f"{where}['residuals']", residuals,
                                    residual_methods(self.compressor, self.collective), span=span or self.key_span,
                                    rank=None if world is None else (rank, world),
                                    block_size=self.settings.get("block_size"))
        for key, ef in residuals.items():
            if chunk_numel is not None and ef["chunk_numel"] != chunk_numel:
                raise ValueError(f"{where}['residuals'][{key}]['chunk_numel'] is {ef['chunk_numel']}, this "
                                 f"{self.owner} runs chunk_numel={chunk_numel}: run the saved chunk_numel, or pass "
                                 f"reset_error_feedback=True to keep the rest and start the residuals over")
        return LoadedState(saved if residuals else None, residuals)

    def load_state(self, loaded: LoadedState) -> None:
        """Make ``loaded`` (from :meth:`check_state`) this session's
        residuals: the engine's, or waiting for its group, whose world and
        rank are checked when it is made. The engine refuses residuals of
        another world size or chunk before it changes anything."""
        if loaded.residuals is None:
            self.reset_residuals()
        else:
            self.load_residuals(loaded.residuals)
        self._saved_world = loaded.world

    def load_state_then(self, loaded: LoadedState, *loads: Callable[[], Any]) -> None:
        """:meth:`load_state`, then the client's own ``loads`` (each refuses
        before it changes anything, as torch's optimizers do): when one
        raises, the residuals, and the rank they belong to, go back as they
        were. The engine first: it refuses residuals of another world size
        or chunk before it changes anything."""
        before, saved_world = self.residuals(), self._saved_world
        self.load_state(loaded)
        try:
            for load in loads:
                load()
        except BaseException:
            self.load_residuals(before)
            self._saved_world = saved_world
            raise

    def __getstate__(self) -> Dict[str, Any]:
        # The group belongs to this process: an unpickled session starts
        # without one, its residuals waiting.
        d = {k: v for k, v in self.__dict__.items() if k not in ("_engine", "_device", "_private", "_claimed")}
        d["process_group"] = None
        d["_pending"] = self.residuals() or None
        return d

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.detach()

