"""DiLoCo: data-parallel training that synchronizes rarely, with compressed,
optionally streamed outer updates (docs/diloco.md).

Every rank holds the whole model and trains it with its own inner optimizer
(any ``torch.optim`` optimizer, AdamW in the papers) on its own data, with no
gradient communication. Every ``sync_every`` (H) inner steps the ranks
average the *pseudo-gradient* ``delta = anchor - params`` (``anchor``: the
parameters at the last synchronization) through pycomm's engine, compressed
with any method, and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9
by default: Douillard et al. 2023) steps the anchor with that average as its
gradient. Every rank then continues from the new anchor.

Streaming (Streaming DiLoCo, 2025): ``fragments=F`` splits the parameters
into F contiguous fragments (parameter order, about equal sizes) synced at
staggered steps, one fragment every H/F inner steps, each once per H steps;
``delay=tau`` lets a fragment's all-reduce run in the background (an
asynchronous engine Work) for tau inner steps before its result is applied.
Applied late, the outer update keeps the local progress the rank made
meanwhile: ``params = new_anchor + (params_now - params_at_send)``.

A replica sharded with FSDP2 over the "shard" dimension of a 2-D mesh
(``mesh=``) syncs each rank's local shards over the "replicate" dimension:
everything DiLoCo keeps is then per local shard.

Two options for codecs of about one bit per element (onebit), where the
codec's error dominates the loss (docs/across_sites.md, "onebit"):
``rotate`` sends the pseudo-gradient in a randomized Hadamard basis (blocks
of :data:`ROTATION_SIZE`; DRIVE, Vargaftik et al. 2021): the average is the
same, but every block of the rotated vector is close to Gaussian, so a
sign with one scale per block loses less of it. ``compress_update`` keeps
the outer momentum on each replica, of its own pseudo-gradients, and sends
the outer update (with Nesterov: ``delta + momentum * buffer``) instead of
the pseudo-gradient, as 1-bit Adam sends the momentum: the codec's error,
fed back, then no longer goes through the momentum. Exact averages are
unchanged by either (to float32 rounding).

Memory beyond the model and the inner optimizer: one copy of the parameters
(the anchor, in their dtype), the outer momentum (another copy, when the
outer momentum is not 0), a float32 buffer of the largest fragment (two with
``delay > 0``: the local pseudo-gradient is kept until the result is
applied) and, with error feedback, the engine's residuals (about one float32
copy of the parameters per rank plus its server share, each doubled for the
engine's rollback copy): :meth:`DiLoCo.memory_bytes`.
"""

from __future__ import annotations

import io
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .. import distributed as pd
from ..distributed import spec
from ..distributed.checks import agree, check_fields, check_int
from ..distributed.session import KEY_SPAN, EngineSession, _release, check_version, nest_legacy
from ._checks import _all_finite, _check_compressor, _check_float, _check_int, _unscale_

__all__ = ["DILOCO_KEY_BASE", "DiLoCo", "ROTATION_SIZE"]

#: Default engine key of fragment 0's residuals (fragment f: ``key_base +
#: f``): 2^41, above the DDP hook's bucket indices and the default key range
#: of :class:`pycomm.optim.OneBitAdam` (2^40 + [0, 2^20)).
DILOCO_KEY_BASE = 1 << 41
#: Elements per block of ``rotate``'s randomized Hadamard transform (a
#: power of two; blocks of every block codec's default size hold whole ones).
ROTATION_SIZE = 256
#: The random signs of the transform, one per element of a block, the same
#: on every rank and in every release (from a fixed multiplicative hash).
_ROTATION_SIGNS = [1.0 - 2.0 * (((i * 2654435761 + 40503) >> 13) & 1) for i in range(ROTATION_SIZE)]
#: The version of ``state_dict()["pycomm"]``; version 1 (the engine
#: state's fields at its top level) loads too (``nest_legacy``).
_STATE_VERSION = 2
#: The settings every rank must share; compared at the first sync.
_SHARED = ("sync_every", "fragments", "delay", "compressor", "error_feedback", "compressor_settings",
           "outer_lr", "outer_momentum", "nesterov", "rotate", "compress_update", "key_base", "parameters")
#: The settings a loaded state must share, with their values in a state
#: saved before the setting existed.
_LOADED = {name: {"rotate": False, "compress_update": False}.get(name) for name in _SHARED
           if name not in ("compressor_settings", "key_base")}


class DiLoCo:
    """Rare, compressed synchronization of whole-model replicas around any
    inner optimizer (DiLoCo; Streaming DiLoCo with ``fragments``/``delay``).

    Args:
        model: the ``torch.nn.Module`` every rank holds whole (or an iterable
            of its parameters); its parameters that require a gradient are
            synchronized, in ``model.parameters()`` order. Buffers (e.g.
            BatchNorm statistics) stay local.
        inner: the inner optimizer over the model's parameters (e.g.
            ``torch.optim.AdamW``); :meth:`step` calls its ``step()``.
        sync_every: H >= 1, inner steps between two syncs of a fragment.
        fragments: F >= 1 contiguous fragments (at most the number of
            parameters; H must be a multiple of F). Fragment ``f`` is synced
            after inner step ``t`` when ``t % H == ((f + 1) * H / F) % H``.
        delay: inner steps (0 <= delay < H / F) between a fragment's send and
            the application of its average; 0 waits for the all-reduce.
        outer_lr, outer_momentum, nesterov: the outer optimizer,
            ``torch.optim.SGD(lr, momentum, nesterov)`` over the anchor
            (Nesterov applies when ``outer_momentum > 0``).
        compressor: the engine's method for the pseudo-gradient, one of
            ``pycomm.distributed.spec.METHODS`` (the default,
            ``spec.EXACT_METHOD``, is the exact average), or a compressor
            registered with ``pycomm.register_compressor``.
        error_feedback: keep the compression error and add it to the next
            sync of the same fragment (engine key ``key_base + f``); None:
            the method's default (``spec.method_spec(m).error_feedback``).
        rotate: send the pseudo-gradient (or update) rotated by a randomized
            Hadamard transform in blocks of :data:`ROTATION_SIZE` (each
            fragment zero-padded to whole blocks: the bytes count the
            padding), and rotate the average back. With "none" or a block
            codec only.
        compress_update: keep the outer momentum per replica and send the
            outer update instead of the pseudo-gradient (see the module
            docstring); the anchor then steps by the average update.
        process_group: the replicas' group (None: the default group): Gloo,
            NCCL (wrapped once, at the first sync, into a pycomm group with
            ``compressor`` and ``compressor_settings``) or a pycomm group
            (used as it is; its method must be ``compressor``).
        key_base: the engine key of fragment 0 (:data:`DILOCO_KEY_BASE`).
        mesh: for a replica sharded with FSDP2 (every module
            ``fully_shard``-ed over ``mesh["shard"]``): the 2-D DeviceMesh
            ``("replicate", "shard")``. Each rank then syncs its local shards
            with the ranks of its "replicate" dimension (one pycomm group per
            shard, made here: build DiLoCo on every rank), a fragment holds
            whole FSDP modules, and :meth:`state_dict` is laid out for
            ``torch.distributed.checkpoint`` (docs/across_sites.md). Not
            with ``process_group``.
        **compressor_settings: the engine group's settings (``block_size``,
            ``chunk_numel``, ``density``, ``rounding``, ...:
            :class:`pycomm.distributed.PycommOptions`).

    Every rank calls :meth:`step` once per inner step (it is a collective
    at sync steps); gradient accumulation and clipping happen before it,
    as with the inner optimizer alone. Under ``torch.amp.GradScaler``,
    ``scaler.step(diloco)`` unscales the gradients and skips the *inner*
    step on the ranks that found an inf (the step still counts on every
    rank, so the sync schedule stays the same everywhere). A sync whose
    averaged pseudo-gradient is not finite (a NaN or Inf on any rank makes
    it so on every rank) is skipped on every rank: anchor, outer momentum
    and residuals stay as they were.

    Memory: see the module docstring and :meth:`memory_bytes`.

    Example (on every rank, after ``dist.init_process_group("gloo")``)::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = DiLoCo(model, inner, sync_every=16, compressor="int4")
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()              # inner step; every 16th also syncs
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"rank{rank}.pt")

    Without a process group, the bad settings raise at once:

    >>> import torch
    >>> net = torch.nn.Linear(4, 2)
    >>> DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=4, fragments=2, delay=2)
    Traceback (most recent call last):
    ...
    ValueError: delay=2 must be less than sync_every / fragments = 2 (one sync in flight at a time)
    >>> opt = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=4, fragments=2, delay=1)
    >>> opt.fragment_sizes(), opt.sync_steps(8)
    ([8, 2], [(2, 0), (4, 1), (6, 0), (8, 1)])
    """

    #: GradScaler.step calls step() on every rank (with ``grad_scale`` and
    #: ``found_inf`` set), so that a rank that found an inf still counts
    #: the step and stays on the others' sync schedule.
    _step_supports_amp_scaling = True
    #: The dimensions of ``mesh=``: the replicas and the shards of each
    #: (a subclass whose replicas meet elsewhere shards over ("shard",) alone).
    _MESH_DIMS: Tuple[str, ...] = ("replicate", "shard")

    def __init__(
        self,
        model: Any,
        inner: Optimizer,
        sync_every: int = 16,
        fragments: int = 1,
        delay: int = 0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compressor: str = spec.EXACT_METHOD,
        error_feedback: Optional[bool] = None,
        rotate: bool = False,
        compress_update: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        key_base: int = DILOCO_KEY_BASE,
        mesh: Any = None,
        **compressor_settings: Any,
    ) -> None:
        if not isinstance(inner, Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            raise ValueError("model: DiLoCo takes the replica itself, not a DistributedDataParallel model (DDP "
                             "would average every step's gradients, which DiLoCo exists not to do): pass "
                             "model.module, or the model before wrapping it")
        everything = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        for p in everything:
            if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.is_complex() or p.is_sparse:
                raise ValueError("model: DiLoCo takes a torch.nn.Module (or its parameters) with dense real "
                                 "floating-point parameters")
        # Zero-element parameters have nothing to sync (and would make empty fragments).
        params = [p for p in everything if p.requires_grad and p.numel()]
        if not params:
            raise ValueError("model has no parameters that require a gradient")
        known = {id(p) for p in everything}
        foreign = sum(1 for g in inner.param_groups for p in g["params"] if id(p) not in known)
        if foreign:
            raise ValueError(f"inner: the inner optimizer trains {foreign} parameter(s) that are not the model's "
                             f"(built over a copy of the model?); DiLoCo would never sync them. Build it over "
                             f"model.parameters()")
        sharded = [i for i, p in enumerate(params) if _is_dtensor(p)]
        if mesh is None and sharded:
            raise ValueError(f"model: parameter(s) {sharded[:5]} are DTensors (a replica sharded with FSDP2's "
                             f"fully_shard): pass mesh=, the {len(self._MESH_DIMS)}-D DeviceMesh {self._MESH_DIMS} whose 'shard' "
                             f"dimension the replica is sharded over")
        if mesh is not None:
            _check_mesh(mesh, model, params, process_group, self._MESH_DIMS)
        #: The 2-D ("replicate", "shard") DeviceMesh of a sharded replica, or None.
        self.mesh = mesh
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"model: all parameters must be on one device, got {sorted(map(str, devices))}")
        self.sync_every = _check_int("sync_every", sync_every, 1)
        self.fragments = _check_int("fragments", fragments, 1)
        # A fragment holds whole parameters; of a sharded replica, whole FSDP
        # modules (a fragment's all-reduce then follows the modules' shards).
        units = _units(model, params) if mesh is not None else list(range(len(params)))
        atoms = [i for i in range(len(params)) if i == 0 or units[i] != units[i - 1]]
        if self.fragments > len(atoms):
            raise ValueError(f"fragments={fragments} is more than the model's {len(atoms)} "
                             + ("runs of parameters of one FSDP module (a fragment holds whole FSDP modules)"
                                if mesh is not None else "parameters (a fragment holds whole parameters)"))
        if self.fragments > KEY_SPAN:
            raise ValueError(f"fragments={fragments} must be at most {KEY_SPAN} (one engine key each)")
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments={fragments} must divide sync_every={sync_every} (one fragment is synced "
                             f"every sync_every / fragments inner steps)")
        self.delay = _check_int("delay", delay, 0)
        if self.delay >= self.sync_every // self.fragments:
            raise ValueError(f"delay={delay} must be less than sync_every / fragments = "
                             f"{self.sync_every // self.fragments} (one sync in flight at a time)")
        self.outer_lr = _check_float("outer_lr", outer_lr)
        self.outer_momentum = _check_float("outer_momentum", outer_momentum, 0.0, 1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
        self.nesterov = nesterov
        _check_compressor(compressor, compressor_settings)
        try:
            method = spec.method_spec(compressor)
        except ValueError:
            # "auto" picks a method per size: its bytes and residuals are not one method's.
            raise ValueError(f"compressor must be one of {list(spec.METHODS)} or a registered compressor, "
                             f"got {compressor!r}") from None
        error_feedback = spec.error_feedback_for(method.name, error_feedback)
        for name, value in (("rotate", rotate), ("compress_update", compress_update)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if rotate and method.kind not in ("block", "exact"):
            raise ValueError(f"rotate=True applies to the exact average and the block codecs "
                             f"({', '.join(spec.BLOCK_METHODS)}), not to {compressor!r}: a rotation spreads "
                             f"what a sparse or cast codec keeps over every element")
        self.rotate = rotate
        self.compress_update = compress_update
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.compressor_settings = dict(compressor_settings)
        # The engine group (found or made at the first sync), the keys
        # key_base + f and the residuals under them.
        if mesh is not None and "replicate" in self._MESH_DIMS:
            # The ranks that hold the same shard of every replica: one pycomm
            # group per shard, made here by every rank of the world.
            process_group = _replicate_group(mesh, compressor, compressor_settings)
            weakref.finalize(self, _release, process_group)
        self._session = EngineSession("DiLoCo", compressor, compressor_settings, process_group=process_group,
                                      key_base=key_base)
        self.process_group = process_group
        self.key_base = key_base
        self.inner = inner
        self._model = model
        self.params = params
        # The parameter set is fixed here: which of the model's parameters
        # train, checked before every sync (one frozen or unfrozen later
        # would move unsynced, or be stepped on a zero pseudo-gradient).
        self._everything = everything
        self._trainable = [p.requires_grad for p in everything]
        # Bounds from the global sizes: the same fragments on every rank.
        ends = atoms[1:] + [len(params)]
        self._bounds = [([*atoms, len(params)])[b] for b in _fragment_bounds(
            [sum(p.numel() for p in params[a:e]) for a, e in zip(atoms, ends)], self.fragments)]
        # The anchor: the parameters as last synchronized (identical on every
        # rank as long as every rank starts from the same model), stepped by
        # a torch SGD whose state (the outer momentum) is torch's own.
        self.anchor = [p.detach().clone() for p in self._shards()]
        momentum = self.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=momentum,
                                     nesterov=self.nesterov and momentum > 0)
        if momentum > 0:
            # Held from the start, as memory_bytes() counts it (zeros: torch's
            # first step then computes what it computes without a buffer).
            for a in self.anchor:
                self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        #: Inner steps taken (every call of step(), on every rank alike).
        self.step_count = 0
        #: Syncs applied, and syncs skipped as not finite, in this run.
        self.syncs = 0
        self.skipped_syncs = 0
        self._checked = False
        # The sync in flight: {"fragment", "apply_at", "work"}; its average
        # arrives in self._buf, the local pseudo-gradient sent is kept in
        # self._local (delay > 0).
        self._pending: Optional[Dict[str, Any]] = None
        largest = max(self._wire_sizes())
        # Zeros: rotate's padding is sent as zeros.
        self._buf = torch.zeros(largest, dtype=torch.float32, device=params[0].device)
        self._local = torch.empty_like(self._buf) if self.delay else None
        self._signs = torch.tensor(_ROTATION_SIGNS, device=params[0].device) if rotate else None

    # -- the schedule -------------------------------------------------------------
    def fragment_sizes(self) -> List[int]:
        """Elements of each fragment this rank syncs, in order (of a sharded
        replica: of its local shards)."""
        shards = self._shards()
        return [sum(p.numel() for p in shards[a:b]) for a, b in zip(self._bounds, self._bounds[1:])]

    def _wire_sizes(self) -> List[int]:
        """Elements of each fragment's all-reduce: :meth:`fragment_sizes`,
        padded to whole rotation blocks with ``rotate``."""
        sizes = self.fragment_sizes()
        return [-(-n // ROTATION_SIZE) * ROTATION_SIZE for n in sizes] if self.rotate else sizes

    def _shards(self) -> List[torch.Tensor]:
        """The tensors this rank syncs: the parameters, or (a sharded
        replica) their local shards, views that an in-place write changes."""
        return [p.to_local() for p in self.params] if self.mesh is not None else self.params

    def due(self, t: int) -> Optional[int]:
        """The fragment sent after inner step ``t`` (1-based), or None."""
        if t < 1:
            return None
        period = self.sync_every // self.fragments
        r = t % self.sync_every
        f = (r if r else self.sync_every) // period - 1
        return f if r % period == 0 else None

    def sync_steps(self, steps: int) -> List[Tuple[int, int]]:
        """``(t, fragment)`` of every send during inner steps 1..``steps``."""
        return [(t, self.due(t)) for t in range(1, steps + 1) if self.due(t) is not None]

    # -- torch optimizer surface (GradScaler, schedulers of the inner one) -----------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    # -- the step -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One inner step (``inner.step(closure)``), then what the schedule
        says: the in-flight sync applied at its step, and the due fragment's
        pseudo-gradient sent. A collective at sync steps: every rank calls it."""
        try:
            return self._step(closure)
        except BaseException:
            # GradScaler.step deletes these only when step() returns: a
            # later step must not unscale again.
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise

    def _step(self, closure: Optional[Callable[[], Any]]) -> Any:
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        grad_scale = getattr(self, "grad_scale", None)
        # What can refuse comes before the inner step: a refused step changes
        # nothing, and a retried one checks again.
        if not self._checked:
            self._check_ranks()
        if self.due(self.step_count + 1) is not None:
            self._check_parameter_set()
        loss = None
        if grad_scale is not None:
            # This rank's found-inf flag: the given one or'ed with this check.
            grads = [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
            found_inf = sum((f.cpu() for f in _unscale_(grads, grad_scale)), torch.zeros(()) if found_inf is None
                            else found_inf.float().cpu())
        if found_inf is None or not bool(found_inf > 0):
            with torch.enable_grad():
                loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.step_count += 1
        t = self.step_count
        if self._pending is not None and self._pending["apply_at"] <= t:
            self._apply()
        f = self.due(t)
        if f is not None:
            self._send(f)
            if self.delay == 0:
                self._apply()
        return loss

    def _check_parameter_set(self) -> None:
        changed = [i for i, (p, was) in enumerate(zip(self._everything, self._trainable)) if p.requires_grad != was]
        if changed:
            raise ValueError(
                f"DiLoCo: parameter(s) {changed[:5]} of the model were frozen or unfrozen after DiLoCo was "
                f"built; its parameter set is fixed then (a parameter unfrozen later would "
                f"train unsynced, one frozen later would still move at each sync). Build a new DiLoCo (and inner "
                f"optimizer) when the trainable parameters change. Nothing was changed by this step.")

    def _plain_group(self) -> dist.ProcessGroup:
        return self._session.base_group()

    def _settings(self) -> Dict[str, Any]:
        return {
            "sync_every": self.sync_every, "fragments": self.fragments, "delay": self.delay,
            "compressor": self.compressor, "error_feedback": self.error_feedback,
            "compressor_settings": sorted(self.compressor_settings.items()), "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "nesterov": self.nesterov, "rotate": self.rotate,
            "compress_update": self.compress_update, "key_base": self.key_base,
            "parameters": [p.numel() for p in self.params],
        }

    def _check_ranks(self) -> None:
        """At the first step of this process, and the first after a load:
        in one exchange (``agree``: one int64 per rank), every rank's
        settings, step count (a rank resumed from another step would sync
        other fragments), parameter dtypes and a checksum of the anchor
        (replicas that start apart never agree), so that a rank that
        differs raises on every rank, naming the setting and each rank's
        value, before any inner step, instead of a hang at a later sync or a
        silently different run. Then the engine group, made now on every
        rank alike (and the rank of loaded residuals checked)."""
        mine = self._settings()
        shared = {k: mine[k] for k in _SHARED}
        shared["step_count"] = self.step_count
        shared["parameter dtypes"] = sorted({str(p.dtype) for p in self.params})
        if self.mesh is not None:  # the same shard of every replica, element for element
            shared["shard sizes"] = [tuple(t.shape) for t in self._shards()]
        # Exact on every rank that holds the same anchor (the same kernels on the same values).
        checksum = sum((i + 1) * a.double().sum() for i, a in enumerate(self.anchor))
        shared["anchor checksum"] = float(checksum)
        self._session.same_group()  # before the exchange: it would not meet over groups that differ
        agree("DiLoCo", shared, self._plain_group(), self.params[0].device)
        self._engine_group()
        self._checked = True

    def _engine_group(self) -> dist.ProcessGroup:
        return self._session.engine(self.params[0].device)

    def _send(self, f: int, zeros: bool = False) -> None:
        """Start the average of fragment ``f``'s pseudo-gradient (of its
        outer update, with ``compress_update``); ``zeros``: send zeros."""
        engine = self._engine_group()
        a, b = self._bounds[f], self._bounds[f + 1]
        shards = self._shards()[a:b]
        n = sum(p.numel() for p in shards)
        buf, offset = self._buf[:n], 0
        beta = self.outer_momentum
        for p, anchor in zip(shards, self.anchor[a:b]):
            k = p.numel()
            torch.sub(anchor.reshape(-1), p.detach().reshape(-1), out=buf[offset:offset + k])
            offset += k
        if self._local is not None:
            self._local[:n].copy_(buf)
        if zeros:
            buf.zero_()
        elif self.compress_update and beta > 0:
            # torch's SGD: buffer' = beta * buffer + delta, update = delta +
            # beta * buffer' (Nesterov) or buffer'; the buffer itself moves
            # in _apply, once the sync is applied.
            offset = 0
            for anchor in self.anchor[a:b]:
                k, u = anchor.numel(), buf[offset:offset + anchor.numel()]
                m = self.outer.state[anchor]["momentum_buffer"].reshape(-1)
                if self.nesterov:
                    u.mul_(1 + beta).add_(m, alpha=beta * beta)
                else:
                    u.add_(m, alpha=beta)
                offset += k
        if self.rotate and n:
            buf = self._buf[:self._wire_sizes()[f]]
            buf[n:].zero_()
            _hadamard(buf.view(-1, ROTATION_SIZE).mul_(self._signs))
        key = None
        if self.error_feedback:
            self._session.claim(f)
            key = self._session.key(f)
        # A fragment whose local shards are all empty (a sharded replica's
        # last rank can hold no rows) has nothing to send, on every rank of
        # its replicate group alike.
        work = pd.all_reduce(buf, key=key, group=engine, op="avg", async_op=True) if n else None
        self._pending = {"fragment": f, "apply_at": self.step_count + self.delay, "work": work}

    def _arrive(self) -> None:
        """Wait for the in-flight all-reduce (its result stays unapplied)."""
        work = self._pending.pop("work", None)
        if work is not None:
            try:
                work.wait()
            except BaseException:
                self._pending = None  # a failed sync is never applied (nor saved) later
                raise
            self._received(self._pending["fragment"])

    def _received(self, f: int) -> None:
        """Fragment ``f``'s average, as the all-reduce left it in the buffer,
        rotated back with ``rotate`` (once per all-reduce)."""
        n = self.fragment_sizes()[f]
        if self.rotate and n:
            blocks = self._buf[:self._wire_sizes()[f]].view(-1, ROTATION_SIZE)
            _hadamard(blocks).mul_(self._signs)

    def _apply(self) -> None:
        """The outer step of the in-flight fragment: skipped on every rank
        when the average is not finite (the engine then kept its residuals),
        else the anchor stepped and the local parameters moved to it, plus
        the local progress since the send (delay > 0)."""
        self._arrive()
        pending, self._pending = self._pending, None
        f = pending["fragment"]
        a, b = self._bounds[f], self._bounds[f + 1]
        params, anchors = self._shards()[a:b], self.anchor[a:b]
        n = sum(p.numel() for p in params)
        avg = self._buf[:n]
        if not _all_finite(avg):
            self.skipped_syncs += 1
            warnings.warn(f"DiLoCo: the pseudo-gradient of fragment {f} sent at step "
                          f"{pending['apply_at'] - self.delay} was not finite on some rank; that sync was "
                          f"skipped on every rank (anchor, outer momentum and residuals unchanged)",
                          RuntimeWarning, stacklevel=3)
            return
        offset = 0
        own = self.compress_update and self.outer_momentum > 0
        for p, anchor in zip(params, anchors):
            k = p.numel()
            if own:
                # This replica's momentum, of its own pseudo-gradient (sent
                # delay steps ago: params - anchor is still it at delay 0).
                delta = (self._local[offset:offset + k].view_as(p) if self._local is not None
                         else anchor - p.detach())
                self.outer.state[anchor]["momentum_buffer"].mul_(self.outer_momentum).add_(delta)
            if self._local is not None:
                # params_now - params_at_send = params_now - anchor + local delta
                p.sub_(anchor).add_(self._local[offset:offset + k].view_as(p).to(p.dtype))
            if own:
                anchor.sub_(avg[offset:offset + k].view_as(anchor).to(anchor.dtype),
                            alpha=self.outer.param_groups[0]["lr"])
            else:
                anchor.grad = avg[offset:offset + k].view_as(anchor).to(anchor.dtype)
            offset += k
        if not own:
            self.outer.step()  # steps the anchors with a gradient: this fragment's
        for p, anchor in zip(params, anchors):
            anchor.grad = None
            if self._local is not None:
                p.add_(anchor)
            else:
                p.copy_(anchor)
        self.syncs += 1

    @torch.no_grad()
    def finish(self, sync_all: bool = True) -> None:
        """End of training, on every rank: apply the sync in flight now (it
        would otherwise be applied ``delay`` steps after its send), then, with
        ``sync_all``, sync every fragment once more, at once: every rank ends
        with the same parameters, the new anchor (the local progress since
        each fragment's last sync goes into that outer step, not lost).
        Training may go on after it. A final sync that is not finite is
        skipped (with its warning), and the ranks then keep their own
        parameters.

        Example::

            for x, y in data:
                ...
                opt.step()
            opt.finish()      # one model on every rank
            torch.save(model.state_dict(), "final.pt")
        """
        if not isinstance(sync_all, bool):
            raise TypeError(f"sync_all must be a bool, got {sync_all!r}")
        if self._pending is not None:
            self._apply()
        if sync_all:
            if not self._checked:
                self._check_ranks()
            for f in range(self.fragments):
                # Nothing moves between this send and its apply, so the local
                # progress added back (delay > 0) is zero: parameters = anchor.
                self._send(f)
                self._apply()

    # -- bytes and memory -------------------------------------------------------
    def bytes_per_sync(self, world_size: Optional[int] = None) -> int:
        """Bytes this rank sends to sync every fragment once (one all-reduce
        per fragment, ``spec.wire_bytes``); ``world_size``: the group's."""
        world = dist.get_world_size(self._plain_group()) if world_size is None else world_size
        settings = self._session.wire_settings(self.params[0].device)
        return sum(spec.wire_bytes(self.compressor, n, world, **settings) for n in self._wire_sizes())

    def bytes_per_step(self, world_size: Optional[int] = None) -> float:
        """Bytes this rank sends per inner step, on average: :meth:`bytes_per_sync` / H."""
        return self.bytes_per_sync(world_size) / self.sync_every

    def memory_bytes(self) -> int:
        """Bytes this object holds beyond the model and the inner optimizer:
        the anchor (one copy of the parameters), the outer momentum (one
        more, when ``outer_momentum > 0``), the fragment buffer(s) (and
        ``rotate``'s signs), the
        residuals the engine holds now for this object's keys (allocated at
        each fragment's first sync with error feedback; counted twice: the
        engine keeps a second buffer of each for its rollback) and what the
        engine keeps for itself now (:func:`pycomm.distributed.kept_nbytes`:
        with the exact or a 16-bit method on a CPU, a send buffer of the
        largest fragment, from the first sync on), when the engine group is
        this object's own."""
        copy = sum(p.numel() * p.element_size() for p in self._shards())
        total = copy * (2 if self.outer_momentum > 0 else 1)
        total += self._buf.numel() * self._buf.element_size() * (2 if self._local is not None else 1)
        total += 0 if self._signs is None else self._signs.numel() * self._signs.element_size()
        return total + 2 * self._session.residual_nbytes() + self._session.kept_nbytes()

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state, the outer optimizer's (its
        momentum), the anchor, and a ``"pycomm"`` entry: step count, the
        settings, THIS rank's residuals (every rank saves its own) and the
        sync in flight, if any: its all-reduce is waited for (not applied)
        and its average saved, so that a resumed run applies it at the same
        step as an uninterrupted one."""
        state = self._local_state()
        return self._sharded_state(state) if self.mesh is not None else state

    def _local_state(self) -> Dict[str, Any]:
        """:meth:`state_dict` with this rank's tensors as they are (of a
        sharded replica: local shards, the inner state as torch keeps it)."""
        pending = None
        if self._pending is not None:
            self._arrive()
            f = self._pending["fragment"]
            n = self.fragment_sizes()[f]
            pending = {"fragment": f, "apply_at": self._pending["apply_at"], "average": self._buf[:n].clone(),
                       "local": None if self._local is None else self._local[:n].clone()}
        settings = self._settings()
        settings["compressor_settings"] = dict(self.compressor_settings)
        state = {
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            "anchor": [a.detach().clone() for a in self.anchor],
            "pycomm": {
                "version": _STATE_VERSION,
                "step_count": self.step_count,
                "syncs": self.syncs,
                "skipped_syncs": self.skipped_syncs,
                "settings": settings,
                "pending": pending,
                "engine": self._session.state_dict(),
            },
        }
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` (load the model's own state too). A
        state of other settings (H, F, delay, compressor, error feedback,
        parameter sizes) is refused, naming the setting; one of another rank
        or world size too (its residuals are that rank's) unless
        ``reset_error_feedback=True``, which starts the residuals over."""
        load_inner = self.inner.load_state_dict
        if self.mesh is not None:
            state_dict, load_inner = self._unsharded_state(state_dict), self._load_sharded_inner
        self._load_local(state_dict, load_inner, reset_error_feedback)

    def _load_local(self, state_dict: Dict[str, Any], load_inner: Callable[[Any], None],
                    reset_error_feedback: bool) -> None:
        """:meth:`load_state_dict` of a :meth:`_local_state`, the inner
        state loaded by ``load_inner``."""
        extra = self._checked_state(state_dict)
        loaded = self._session.check_state(extra["engine"], "state_dict['pycomm']['engine']", reset_error_feedback,
                                           span=self.fragments,
                                           chunk_numel=self._session.wire_settings(self.params[0].device)["chunk_numel"])
        # Every check above changed nothing; then the engine, then torch's loads.
        self._session.load_state_then(loaded, lambda: load_inner(state_dict["inner"]),
                                      lambda: self.outer.load_state_dict(state_dict["outer"]))
        self._drop_pending()
        self._checked = False  # the ranks compare the loaded step count and anchor at the next step
        for a, s in zip(self.anchor, state_dict["anchor"]):
            a.copy_(s)
        self.step_count, self.syncs, self.skipped_syncs = (extra.get(k, 0) for k in ("step_count", "syncs",
                                                                                     "skipped_syncs"))
        pending = extra.get("pending")
        if pending is not None:
            n = pending["average"].numel()
            self._buf[:n].copy_(pending["average"])
            if self._local is not None:
                self._local[:n].copy_(pending["local"])
            self._pending = {"fragment": pending["fragment"], "apply_at": pending["apply_at"]}

    # A sharded replica's state is laid out for torch.distributed.checkpoint
    # (DCP), saved per replica over its "shard" group: DCP keeps one copy of
    # what holds the same key on several ranks, so what is this rank's own is
    # either a DTensor (the anchor, the outer momentum, the inner state: DCP
    # saves each rank's shard) or under a key of this rank's shard.
    def _sharded_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        def spread(i: int, t: torch.Tensor) -> Any:
            from torch.distributed.tensor import DTensor

            p = self.params[i]
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        outer = state["outer"]
        outer["state"] = {i: {k: spread(i, v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                          for i, entry in outer["state"].items()}
        own = io.BytesIO()
        torch.save(state["pycomm"], own)
        # The inner state by parameter name, made on a fresh optimizer too
        # (DCP loads into the state it is given: it must hold every entry).
        return {"inner": get_optimizer_state_dict(self._model, self.inner), "outer": outer,
                "anchor": [spread(i, a) for i, a in enumerate(state["anchor"])],
                "pycomm": {self._shard_key(): own.getvalue()}}

    def _unsharded_state(self, state_dict: Any) -> Dict[str, Any]:
        """:meth:`_sharded_state` undone (the local shards, this rank's
        entry), for the checks of every state."""
        from torch.distributed.tensor import DTensor

        check_fields("state_dict", state_dict, ("inner", "outer", "anchor", "pycomm"))
        key, mine = self._shard_key(), state_dict["pycomm"]
        if not isinstance(mine, dict) or not isinstance(mine.get(key), bytes):
            raise ValueError(f"cannot load this DiLoCo state: state_dict['pycomm'] holds no entry {key!r} of this "
                             f"rank's shard (a state of an unsharded DiLoCo, or of other shards?); got "
                             f"{sorted(mine) if isinstance(mine, dict) else type(mine).__name__}")
        local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)
        outer = state_dict["outer"]
        if isinstance(outer, dict) and isinstance(outer.get("state"), dict):
            outer = dict(outer, state={i: {k: local(v) for k, v in e.items()} if isinstance(e, dict) else e
                                       for i, e in outer["state"].items()})
        anchor = state_dict["anchor"]
        anchor = [local(a) for a in anchor] if isinstance(anchor, (list, tuple)) else anchor
        return {"inner": state_dict["inner"], "outer": outer, "anchor": anchor,
                "pycomm": torch.load(io.BytesIO(mine[key]), weights_only=True)}

    def _load_sharded_inner(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self._model, self.inner, state)

    def _shard_key(self) -> str:
        return f"shard{self.mesh.get_local_rank('shard')}"

    def _checked_state(self, state_dict: Any) -> Dict[str, Any]:
        """``state_dict``'s own fields (the engine state apart: the
        session's; the inner and outer states: torch's) checked, before
        anything changes, naming the field; returns its ``"pycomm"`` entry.
        A loaded anchor or sync in flight must be finite: it would spread
        to every parameter at the next sync."""
        check_fields("state_dict", state_dict, ("inner", "outer", "anchor", "pycomm"))
        where = "state_dict['pycomm']"
        extra = check_version(where, "DiLoCo", state_dict["pycomm"], _STATE_VERSION,
                              ("version", "step_count", "settings", "engine"), ("syncs", "skipped_syncs", "pending"),
                              upgrade=lambda old: nest_legacy(old, self.compressor))
        for name in [n for n in ("step_count", "syncs", "skipped_syncs") if n in extra]:
            check_int(f"{where}[{name!r}]", extra[name])
        saved, mine = extra["settings"], self._settings()
        if not isinstance(saved, dict):
            raise TypeError(f"{where}['settings'] must be a dict, got {type(saved).__name__}")
        differ = [f"saved with {name}={saved.get(name, old)!r}, this DiLoCo has {name}={mine[name]!r}"
                  for name, old in _LOADED.items() if saved.get(name, old) != mine[name]]
        if differ:  # every difference named at once, as the ranks' comparison does
            raise ValueError("cannot load this DiLoCo state: it was " + "; ".join(differ))
        anchors = state_dict["anchor"]
        if not isinstance(anchors, (list, tuple)) or len(anchors) != len(self.anchor) or any(
                not isinstance(s, torch.Tensor) or s.shape != a.shape for s, a in zip(anchors, self.anchor)):
            raise ValueError(f"cannot load this DiLoCo state: its anchor tensors are not this DiLoCo's parameters "
                             f"(this DiLoCo has {len(self.anchor)} of shapes {[tuple(a.shape) for a in self.anchor]})")
        for i, s in enumerate(anchors):
            if not _all_finite(s):
                raise ValueError(f"state_dict['anchor'][{i}] holds a non-finite value")
        pending = extra.get("pending")
        if pending is not None:
            check_fields(f"{where}['pending']", pending, ("fragment", "apply_at", "average", "local"))
            f = check_int(f"{where}['pending']['fragment']", pending["fragment"], 0, self.fragments)
            check_int(f"{where}['pending']['apply_at']", pending["apply_at"])
            n = self.fragment_sizes()[f]
            for name in ("average", "local") if self._local is not None else ("average",):
                t = pending[name]
                if not isinstance(t, torch.Tensor) or t.shape != (n,) or not t.is_floating_point() or not _all_finite(t):
                    raise ValueError(f"{where}['pending'][{name!r}] must be fragment {f}'s {n} finite floats, got "
                                     + (f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                                        else type(t).__name__))
        return extra

    def _drop_pending(self) -> None:
        """Drop the sync in flight without applying it (after waiting for
        its all-reduce): what loading a state does first."""
        if self._pending is not None:
            self._arrive()
            self._pending = None

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, fragments={self.fragments}, delay={self.delay}, "
                f"compressor={self.compressor!r}, error_feedback={self.error_feedback}, "
                f"outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, nesterov={self.nesterov}"
                + (", rotate=True" if self.rotate else "") + (", compress_update=True" if self.compress_update else "")
                + ")")


def _hadamard(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (rows of a power-of-two length k) times the orthonormal
    Hadamard matrix ``H / sqrt(k)``, in place (its own inverse): the fast
    Walsh-Hadamard transform, log2(k) passes of sums and differences.

    >>> x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    >>> _hadamard(x.clone())
    tensor([[0.5000, 0.5000, 0.5000, 0.5000],
            [2.0000, 0.0000, 0.0000, 0.0000]])
    """
    rows, k = blocks.shape
    y, h = blocks, 1
    while h < k:
        pairs = y.reshape(rows, k // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return blocks.copy_(y.reshape(rows, k)).mul_(k ** -0.5)


def _fragment_bounds(numels: List[int], fragments: int) -> List[int]:
    """Parameter indices where the fragments start (and the end): contiguous
    runs of whole parameters, each closed once it reaches its share of the
    elements, each holding at least one parameter.

    >>> _fragment_bounds([4, 4, 4, 4], 2), _fragment_bounds([100, 1, 1], 3), _fragment_bounds([1, 1, 100], 2)
    ([0, 2, 4], [0, 1, 2, 3], [0, 2, 3])
    """
    total, bounds, cum = sum(numels), [0], 0
    for i, n in enumerate(numels):
        cum += n
        f = len(bounds)
        left = len(numels) - (i + 1)
        if f < fragments and left >= fragments - f and (cum * fragments >= f * total or left == fragments - f):
            bounds.append(i + 1)
    bounds.append(len(numels))
    return bounds


# -------------------------------------------------------- sharded replicas ---
def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _check_mesh(mesh: Any, model: Any, params: List[torch.Tensor], process_group: Any,
                dims: Tuple[str, ...]) -> None:
    """A sharded replica's mesh: of the dimensions ``dims`` (("replicate",
    "shard"), or ("shard",) alone), every synced parameter a DTensor sharded
    over its "shard" dimension."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}")
    if tuple(mesh.mesh_dim_names or ()) != dims:
        sizes = "(replicas, shards)" if len(dims) == 2 else "(shards,)"
        raise ValueError(f"mesh must be {len(dims)}-D with the dimensions {dims} (init_device_mesh(device, {sizes}, "
                         f"mesh_dim_names={dims})), got {mesh.ndim}-D with names {mesh.mesh_dim_names}")
    if process_group is not None:
        raise ValueError("process_group: give mesh or process_group, not both (with a mesh, DiLoCo syncs over "
                         "its 'replicate' dimension)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError("model: with mesh=, DiLoCo takes the sharded torch.nn.Module itself (its FSDP modules "
                        "bound the fragments), not an iterable of parameters")
    shard = mesh["shard"]
    for i, p in enumerate(params):
        if not _is_dtensor(p) or p.device_mesh != shard or not all(isinstance(x, Shard) for x in p.placements):
            where = (f"a DTensor over {p.device_mesh} with placements {p.placements}" if _is_dtensor(p)
                     else "a plain tensor")
            raise ValueError(f"model: parameter {i} is {where}, not sharded over mesh['shard']: shard the replica "
                             f"with fully_shard(module, mesh=mesh['shard']) for its modules and the root")


def _units(model: torch.nn.Module, params: List[torch.Tensor]) -> List[int]:
    """Which FSDP module manages each parameter (its index in
    ``model.modules()``): the innermost ``fully_shard``-ed module holding it,
    FSDP2's own rule (a module's ``fully_shard`` takes the parameters its
    sharded submodules did not)."""
    from torch.distributed.fsdp import FSDPModule

    owner: Dict[int, int] = {}
    for i, m in enumerate(model.modules()):  # pre-order: a submodule comes after its parents
        if isinstance(m, FSDPModule):
            for p in m.parameters():
                owner[id(p)] = i
    return [owner.get(id(p), -1) for p in params]


def _replicate_group(mesh: Any, compressor: str, settings: Dict[str, Any]) -> dist.ProcessGroup:
    """This rank's pycomm group over the mesh's "replicate" dimension (the
    ranks holding the same shard of every replica). torch's ``new_group``
    needs every rank of the world, in one order: every rank makes every
    shard's group, and keeps its own."""
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
    options = pd.PycommOptions(compressor=compressor, inner="nccl" if mesh.device_type == "cuda" else "gloo",
                               **settings)
    timeout = pd.timeout_of(mesh.get_group("replicate"))
    mine = None
    for column in grid.t().tolist():
        group = dist.new_group(column, backend=pd.BACKEND_NAME, pg_options=options, timeout=timeout)
        if dist.get_rank() in column:
            mine = group
    return mine
