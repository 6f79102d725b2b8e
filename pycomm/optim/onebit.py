"""Compressed-momentum optimizers: :class:`OneBitAdam` and :class:`OneBitSGD`.

The algorithm (1-bit Adam, which DeepSpeed ships as ``OneBitAdam``; the SGD
counterpart is the same idea with torch's momentum SGD): for the first ``warmup_steps`` steps the
gradients are averaged over the ranks EXACTLY and the update is torch's own
(``torch.optim.AdamW`` / ``torch.optim.SGD``, called through their functional
forms, so the warm-up is theirs bit for bit). Then:

* OneBitAdam freezes the variance ``v`` (and its bias correction,
  ``1 - beta2^T`` with ``T`` the parameter's step count at the freeze);
  with ``variance_update_every=K``, every K-th step after the warm-up
  averages the gradients exactly instead (as the warm-up does), takes the
  momentum from that average on every rank alike (nothing compressed, no
  residual changes) and updates ``v = beta2^d v + (1 - beta2^d) g^2``, ``d``
  steps after its last update (``T`` becomes this step);
* each rank updates the momentum with its LOCAL gradient (``m = lerp(m, g,
  1 - beta1)``; SGD: ``buf = momentum * buf + g + weight_decay * p``);
* the momenta of every parameter, flattened into one buffer, are averaged by
  the engine's compressed all-reduce (``pycomm.distributed.all_reduce(buf,
  key=key_base, op="avg")``): every rank compresses its momentum with its
  worker residual, the server of each segment re-compresses the average
  with its server residual, and every rank decodes the same bytes, so the
  averaged momentum, which becomes ``m`` on every rank, is identical
  everywhere;
* the update uses that momentum: AdamW's ``p *= 1 - lr * wd; p -= lr / (1 -
  beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^T) + eps)``; SGD's ``p -= lr *
  buf`` (Nesterov: ``p -= lr * (buf + momentum * (buf - buf_old))``, which is
  torch's ``g + momentum * buf`` with the averaged gradient written through
  the momenta, the only form every rank can compute alike).

Design decisions (docs/optim.md has the long form):

* **Groups.** ``process_group`` is any group: Gloo, NCCL or a ``"pycomm"``
  one. A plain group is wrapped once, at the first compressed step, into a
  pycomm group over the same ranks with this optimizer's compressor and
  settings (``pycomm.distributed.wrap``; every rank of the default group
  takes part, as in ``dist.new_group``); a pycomm group is used as it is
  (its settings must name the same compressor). Exact all-reduces (warm-up)
  always run on the plain group (``compress=False`` on a pycomm group).
* **DDP.** :meth:`attach` registers a DDP communication hook: the exact
  average during the warm-up, no communication at all after it (DDP's
  all-reduce is skipped; the gradients stay local), and the optimizer then
  does not all-reduce gradients itself. Without DDP, ``step()`` averages the
  gradients during the warm-up (one flat all-reduce per step). With
  ``attach(model, overlap=True)`` the hook sends each bucket's momenta,
  compressed, while backward runs, and ``step()`` applies them.
* **Keys.** The residuals live in the engine under the key ``key_base``
  (default :data:`KEY_BASE`, far above the DDP hook's bucket indices), and
  with ``overlap=True`` under ``key_base + 1 + i`` for DDP bucket ``i``.
* **Zero gradients need no mask.** Elements whose gradient was exactly zero
  (or absent) during the whole warm-up on every rank are *frozen*: Adam's
  frozen variance is exactly 0 there (SGD tracks a ``grad_seen`` mask during
  the warm-up), they are kept out of the communicated buffer, and they move
  only as torch's optimizer moves an element with a zero gradient (weight
  decay; a momentum that decays). With a zero variance AdamW would divide by
  ``eps``; sign compression would give them +-scale of their block: this is
  what DeepSpeed needs a user mask for. Parameters with no optimizer state
  (no gradient anywhere during the warm-up) are never updated afterwards.
  After the warm-up every parameter with state is stepped every step; a
  missing gradient counts as zero (as DDP counts an unused parameter).
* **Non-finite steps.** A NaN or Inf in any rank's gradient (or GradScaler's
  found-inf flag, injected into the buffer as a NaN) makes the all-reduced
  buffer non-finite on EVERY rank (docs/allreduce.md, "Non-finite
  results"); the engine then rolls its residuals back, and the step is
  skipped on every rank: parameters, ``m``, ``v``, step counts and residuals
  stay as they were (with ``overlap=True``, the buckets whose calls were
  finite are undone: :func:`pycomm.distributed.undo_error_feedback`). The optimizer sets ``_step_supports_amp_scaling``, so
  ``GradScaler.step`` always calls ``step()`` (a rank that skipped alone
  would leave its peers waiting in the collective); ``step()`` unscales the
  gradients itself and, when called from ``GradScaler.step``, records the
  agreed skip in the scaler's found-inf record for this optimizer, so
  ``scaler.update()`` backs off on every rank. Without a GradScaler a
  non-finite step is skipped the same way, with a RuntimeWarning.
* **State.** ``state_dict()`` holds torch's per-parameter state (``step``,
  ``exp_avg``, ``exp_avg_sq`` / ``momentum_buffer``, plus ``variance_step``
  or ``grad_seen``) and a ``"pycomm"`` entry: the optimizer's step count and
  THIS rank's residuals (they differ per rank: every rank saves and loads its
  own). A resumed run continues bit for bit.
"""

# No `from __future__ import annotations`: DDP compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor].
import dataclasses
import math
import sys
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .. import distributed as pd
from ..compressors.plugin import is_plugin
from ..distributed import spec

__all__ = ["KEY_BASE", "KEY_SPAN", "OneBitAdam", "OneBitSGD"]

#: Default engine key of the momentum buffer's residuals: 2^40, far above
#: the DDP hook's keys (bucket indices). Two of these optimizers sharing ONE
#: pycomm group need different ``key_base`` values.
KEY_BASE = 1 << 40
#: Keys an optimizer uses: ``key_base`` (the momentum buffer of ``step()``)
#: and, with ``attach(model, overlap=True)``, ``key_base + 1 + i`` for DDP's
#: bucket ``i``. Two optimizers on one pycomm group need ``key_base`` values
#: at least this far apart.
KEY_SPAN = 1 << 20
_STATE_VERSION = 1


# --------------------------------------------------------------- checks ----
def _check_float(name: str, value: Any, lo: float = 0.0, hi: Optional[float] = None,
                 hi_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < lo or (hi is not None and (value >= hi if hi_open else value > hi)):
        rng = f"[{lo}, {hi})" if hi is not None and hi_open else f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {'in ' if hi is not None else ''}{rng}, got {value!r}")
    return value


def _check_betas(betas: Any) -> Tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), each in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r} (betas={tuple(betas)!r})")
    return float(betas[0]), float(betas[1])


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_compressor(compressor: Any, settings: Dict[str, Any]) -> None:
    """The engine's own checks, before anything runs: a bad value raises
    here, naming the argument."""
    if not isinstance(compressor, str):
        raise TypeError(f"compressor must be a str, got {compressor!r}")
    allowed = [f.name for f in dataclasses.fields(pd.PycommOptions) if f.name != "compressor"]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"unknown compressor settings {unknown}; allowed: {allowed}")
    pd.PycommOptions(compressor=compressor, **settings)  # "compressor must be one of ..."


# ----------------------------------------------------------- optimizer ----
class _CompressedMomentum(Optimizer):
    """What OneBitAdam and OneBitSGD share: the warm-up's exact averaging,
    the compressed all-reduce of the momenta, frozen elements, non-finite
    steps, the DDP hook and the state. Subclasses give the update rules."""

    #: GradScaler.step calls step() on every rank, with ``grad_scale`` and
    #: ``found_inf`` set, instead of skipping it on the ranks that saw an inf.
    _step_supports_amp_scaling = True

    def __init__(self, params: Any, defaults: Dict[str, Any], *, warmup_steps: int, compressor: str,
                 process_group: Optional[dist.ProcessGroup], key_base: int,
                 compressor_settings: Dict[str, Any]) -> None:
        _check_int("warmup_steps", warmup_steps, 1)
        _check_compressor(compressor, compressor_settings)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        _check_int("key_base", key_base, 0)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.compressor = compressor
        self.compressor_settings = dict(compressor_settings)
        self.process_group = process_group
        self.key_base = key_base
        if process_group is not None and dist.is_initialized() and pd.is_pycomm_group(process_group, self._device()):
            self._check_pycomm_group(process_group)
        #: Steps taken (skipped non-finite steps are not counted). The
        #: warm-up is ``step_count < warmup_steps``.
        self.step_count = 0
        #: Non-finite steps skipped on every rank, in this process.
        self.skipped_steps = 0
        self._pending_ef: Optional[Dict[int, Any]] = None  # residuals loaded before the engine exists
        self._saved_world: Optional[Tuple[int, int]] = None
        self._saved_overlap: Optional[bool] = None  # how the loaded residuals were keyed
        #: overlap=True: DDP bucket index -> positions of its parameters (saved with the residuals)
        self._bucket_pos: Dict[int, Tuple[int, ...]] = {}
        self._init_runtime()

    def _init_runtime(self) -> None:
        """What belongs to this process (not saved, not pickled)."""
        self._engine: Optional[dist.ProcessGroup] = None
        self._layout: Optional[List[Any]] = None
        # Per parameter id, what a subclass derives once from frozen state
        # (OneBitAdam: the denominator); dropped with the layout.
        self._frozen: Dict[int, Tuple[Any, torch.Tensor]] = {}
        self._ddp_param_ids: frozenset = frozenset()
        self._attached = False
        self._flat: Optional[torch.Tensor] = None  # the communicated buffer, reused
        # attach(model, overlap=True): the momenta go out per DDP bucket,
        # from the DDP hook, while backward runs.
        self._overlap = False
        self._scaler: Any = None
        # DDP bucket index -> (its parameters' ids, their layout entries, the buffer sent)
        self._buckets: Dict[int, Tuple[Tuple[int, ...], List[Any], torch.Tensor]] = {}
        self._sent: Dict[int, Tuple[Optional[torch.Tensor], List[Any], Optional[int], Any]] = {}  # this step's
        self._hold = False  # after a refused backward, until step()
        self._backwards = 0  # backward passes DDP ran in this process (its buckets are rebuilt after the first)

    _CONFIG = ("warmup_steps", "compressor", "compressor_settings", "key_base", "step_count", "skipped_steps",
               "_saved_world", "_saved_overlap", "_bucket_pos")

    def __getstate__(self) -> Dict[str, Any]:
        # torch keeps defaults, state and param_groups; add the configuration
        # and the residuals. The process group is not kept (the default
        # group of the process that unpickles), nor the DDP coupling.
        d = super().__getstate__()
        d.update({k: getattr(self, k) for k in self._CONFIG})
        d["_pending_ef"] = self._ef() or None
        if self._engine is not None:
            d["_saved_overlap"] = self._overlap if d["_pending_ef"] else None
        return d

    def __setstate__(self, d: Dict[str, Any]) -> None:
        # Unpickling fills a new object; torch's load_state_dict calls this
        # too, on a live one, whose engine group and DDP coupling stay.
        unpickled = "_engine" not in self.__dict__
        super().__setstate__(d)
        if unpickled:
            self.process_group = None
            self._init_runtime()

    # -- hooks for the subclasses -----------------------------------------------
    def _check_group(self, group: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _has_state(self, state: Dict[str, Any]) -> bool:
        raise NotImplementedError

    def _active_mask(self, p: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        """Bool mask of the elements that are communicated (not frozen)."""
        raise NotImplementedError

    def _warmup_update(self, group: Dict[str, Any], params: List[torch.Tensor],
                       grads: List[torch.Tensor]) -> None:
        raise NotImplementedError

    def _freeze(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        """Called once per parameter with state when the layout is built."""

    def _variance_due(self) -> bool:
        """True when this step, after the warm-up, averages the gradients
        exactly to update frozen statistics (OneBitAdam's variance)."""
        return False

    def _variance_update(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any],
                         grad: Optional[torch.Tensor]) -> None:
        """Update frozen statistics from the exactly averaged ``grad`` (None:
        zero), before :meth:`_apply` of the same step."""

    def _local_momentum(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any],
                        grad: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _apply(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any],
               momentum: torch.Tensor) -> None:
        raise NotImplementedError

    # -- parameter groups ------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "step_count", 0) >= getattr(self, "warmup_steps", 1):
            raise ValueError(
                f"{type(self).__name__}.add_param_group after the warm-up: parameters added now would "
                f"have no warm-up statistics to freeze; add them before step {self.warmup_steps}"
            )
        merged = dict(self.defaults)
        merged.update({k: v for k, v in param_group.items() if k != "params"})
        self._check_group(merged)
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):
            param_group = dict(param_group, params=list(params))  # a generator is read once
            params = param_group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else params:
            if isinstance(p, torch.Tensor) and (not p.is_floating_point() or p.is_complex() or p.is_sparse):
                raise ValueError(f"{type(self).__name__} takes dense real floating-point parameters, "
                                 f"got one of dtype {p.dtype}{' (sparse)' if p.is_sparse else ''}")
        super().add_param_group(param_group)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._layout = None
        self._frozen = {}

    def _params(self) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    # -- groups ------------------------------------------------------------------
    def _plain_group(self) -> dist.ProcessGroup:
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}.step needs torch.distributed: call "
                               f"dist.init_process_group (or pycomm.distributed.init_process_group) first")
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _uses_ef(self) -> bool:
        return self.compressor in (*spec.EF_METHODS, "auto") or is_plugin(self.compressor)

    def _engine_group(self) -> dist.ProcessGroup:
        """The pycomm group that runs the compressed all-reduce (created at the
        first compressed step over a plain group, on every rank alike)."""
        if self._engine is not None:
            return self._engine
        base, device = self._plain_group(), self._device()
        self._check_world()
        if pd.is_pycomm_group(base, device):
            self._check_pycomm_group(base)
            engine = base
        else:
            engine = pd.wrap(base, compressor=self.compressor, **self.compressor_settings)
        self._engine = engine
        if self._pending_ef is not None:
            self._check_overlap()
            pending, self._pending_ef = self._pending_ef, None
            self._load_ef(pending)
        return engine

    def _check_overlap(self) -> None:
        saved, self._saved_overlap = self._saved_overlap, None
        if saved is not None and saved != self._overlap:
            raise ValueError(
                f"{type(self).__name__}'s residuals were saved with attach(model, overlap={saved}) and this "
                f"optimizer runs overlap={self._overlap}: they are keyed per DDP bucket only with overlap=True; "
                f"attach the same way, or load with reset_error_feedback=True"
            )

    def _check_pycomm_group(self, group: dist.ProcessGroup) -> None:
        method = pd.options_of(group, self._device().type)["method"]
        if method != self.compressor:
            raise ValueError(
                f"{type(self).__name__} asks for compressor={self.compressor!r} but its process_group "
                f"runs the pycomm backend with {method!r}: the group's settings decide, so make them agree"
            )

    def _check_world(self) -> None:
        if self._saved_world is None:
            return
        pg = self._plain_group()
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        saved, self._saved_world = self._saved_world, None
        if saved != (world, rank):
            raise ValueError(
                f"{type(self).__name__} was loaded from the state of rank {saved[1]} of {saved[0]}, but this "
                f"is rank {rank} of {world}; every rank loads its own state, or load with "
                f"reset_error_feedback=True to start the residuals over"
            )

    def _ef(self) -> Dict[int, Any]:
        """This optimizer's residuals, keyed relative to ``key_base``."""
        if self._engine is None:
            return dict(self._pending_ef or {})
        full = pd.error_feedback_state(self._engine, self._device().type)
        return {k - self.key_base: v for k, v in full.items() if self._owns(k)}

    def _owns(self, key: int) -> bool:
        return self.key_base <= key < self.key_base + KEY_SPAN

    def _load_ef(self, mine: Dict[int, Any]) -> None:
        """Replace this optimizer's residuals in the engine, keeping any other
        key's (the engine's load replaces its whole store)."""
        dev = self._device().type
        full = {k: v for k, v in pd.error_feedback_state(self._engine, dev).items() if not self._owns(k)}
        full.update({self.key_base + int(k): v for k, v in mine.items()})
        pd.load_error_feedback_state(full, self._engine, dev)

    def _exact_average(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Any:
        """Start the exact average of ``tensor`` over ``group`` in place;
        returns the Work (divide, then sum: torch's default DDP hook)."""
        if pd.is_pycomm_group(group, tensor.device):
            return pd.all_reduce(tensor, group=group, op="avg", compress=False, async_op=True)
        tensor.div_(dist.get_world_size(group))
        return dist.all_reduce(tensor, group=group, async_op=True)

    # -- the step --------------------------------------------------------------
    @property
    def in_warmup(self) -> bool:
        """True during the warm-up (torch's update on exact averages)."""
        return self.step_count < self.warmup_steps

    @property
    def exact_now(self) -> bool:
        """True when the next step averages the gradients exactly: the
        warm-up, and after it OneBitAdam's variance updates."""
        return self.in_warmup or self._variance_due()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step on every rank (a collective: every rank calls it).

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``) the
        gradients are unscaled here, and a step with a non-finite gradient
        on any rank is skipped on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        try:
            if grad_scale is not None and self._overlap and not self.exact_now and self._scaler is None:
                self._undo_sent()
                raise ValueError(
                    f"{type(self).__name__} was attached with overlap=True and no scaler, but is stepped by a "
                    f"GradScaler: the momenta were sent from scaled gradients. Pass the scaler: "
                    f"attach(model, overlap=True, scaler=scaler). Nothing was changed by this step."
                )
            if grad_scale is not None:
                self._unscale(grad_scale)
            if self.in_warmup:
                ok = self._warmup_step(found_inf)
            elif self._variance_due():
                ok = self._exact_step(found_inf)
            else:
                ok = self._compressed_step(found_inf)
        except BaseException:
            # GradScaler.step removes these only when step() returns: a later
            # step() must not see them.
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        if ok:
            self.step_count += 1
        else:
            self.skipped_steps += 1
            if not self._tell_scaler() and found_inf is None:
                warnings.warn(
                    f"{type(self).__name__}: a gradient was not finite on some rank at step "
                    f"{self.step_count}; the step was skipped on every rank (nothing changed)",
                    RuntimeWarning, stacklevel=2,
                )
        return loss

    def _unscale(self, grad_scale: torch.Tensor) -> None:
        # What GradScaler.unscale_ does, with its inverse (computed in float64).
        inv = grad_scale.double().reciprocal().float()
        by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for _, p in self._params():
            if p.grad is not None:
                by_key.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_key.items():
            dummy = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, dummy, inv.to(device))

    def _tell_scaler(self) -> bool:
        """When called from GradScaler.step: mark this optimizer's step as
        having found an inf in the scaler's record, so that scaler.update()
        backs off on every rank (a rank whose own gradients were finite
        would otherwise grow its scale). True when a scaler was told."""
        try:
            from torch.amp.grad_scaler import GradScaler

            code = GradScaler.step.__code__
            frame = sys._getframe(1)
            for _ in range(8):
                if frame is None:
                    return False
                if frame.f_code is code and frame.f_locals.get("optimizer") is self:
                    scaler = frame.f_locals.get("self")
                    record = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
                    for t in record.values():
                        t.fill_(1.0)
                    return True
                frame = frame.f_back
        except Exception:  # noqa: BLE001 - a torch without these internals: the skip still agrees
            return False
        return False

    @staticmethod
    def _poison(buf: torch.Tensor, found_inf: Optional[torch.Tensor]) -> None:
        """A NaN in the buffer when this rank's GradScaler found an inf, so
        that the collective's result tells every rank (no extra collective,
        no host sync)."""
        if found_inf is not None and buf.numel():
            nan = torch.full((), float("nan"), dtype=buf.dtype, device=buf.device)
            buf[:1].copy_(torch.where(found_inf.to(buf.device) > 0, nan, buf[:1]))

    def _buffer(self, numel: int) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != numel:
            self._flat = torch.empty(numel, dtype=torch.float32, device=self._device())
        return self._flat

    def _averaged_grads(self, found_inf: Optional[torch.Tensor]) -> Optional[Dict[int, Optional[torch.Tensor]]]:
        """The gradients averaged exactly over the ranks, by parameter id
        (None for a parameter with no gradient on any rank), or None when one
        is not finite on some rank (the same answer on every rank)."""
        entries = self._params()
        # Parameters DDP averaged (attach) have averaged gradients already.
        own = [(g, p) for g, p in entries if id(p) not in self._ddp_param_ids]
        grads: Dict[int, Optional[torch.Tensor]] = {}
        bad = False
        if own:
            # One flat exact all-reduce: the gradients, then one presence flag
            # per parameter (a parameter with no gradient on any rank is
            # skipped, as torch's optimizers skip a parameter whose grad is None).
            total = sum(p.numel() for _, p in own)
            buf = self._buffer(total + len(own))
            flags = buf[total:]
            flags.zero_()
            offset = 0
            for i, (_, p) in enumerate(own):
                n = p.numel()
                if p.grad is None:
                    buf[offset:offset + n].zero_()
                else:
                    buf[offset:offset + n].copy_(p.grad.reshape(-1))
                    flags[i] = 1.0
                offset += n
            self._poison(buf, found_inf)
            self._exact_average(buf, self._plain_group()).wait()
            bad = not _all_finite(buf)
            offset = 0
            present = (flags > 0).tolist()
            for i, (_, p) in enumerate(own):
                n = p.numel()
                grads[id(p)] = buf[offset:offset + n].view_as(p).to(p.dtype) if present[i] else None
                offset += n
        ddp_grads = [p.grad for g, p in entries if id(p) in self._ddp_param_ids and p.grad is not None]
        if ddp_grads and not bad:
            # Identical on every rank (DDP averaged them): so is this check.
            # With a GradScaler its flag says it (poisoned into the flat
            # buffer above when this optimizer has parameters of its own).
            if found_inf is not None:
                bad = not own and bool(found_inf > 0)
            else:
                bad = not bool(torch.stack([torch.isfinite(t).all() for t in ddp_grads]).all())
        if bad:
            return None
        for _, p in entries:
            if id(p) not in grads:
                grads[id(p)] = p.grad
        return grads

    def _warmup_step(self, found_inf: Optional[torch.Tensor]) -> bool:
        grads = self._averaged_grads(found_inf)
        if grads is None:
            return False
        for group in self.param_groups:
            params, gs = [], []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                gr = grads.get(id(p))
                if gr is not None:
                    params.append(p)
                    gs.append(gr)
            if params:
                self._warmup_update(group, params, gs)
        if self.step_count + 1 >= self.warmup_steps:
            self._flat = None  # the warm-up buffer is not the compressed one
        return True

    def _build_layout(self) -> List[Any]:
        """Per parameter with state: (group, p, state, active index or
        "all"/None, offset into the buffer). The same on every rank: it
        follows from state that is identical everywhere."""
        layout, offset = [], 0
        for group, p in self._params():
            state = self.state.get(p)
            if not state or not self._has_state(state):
                continue
            self._freeze(p, state)
            mask = self._active_mask(p, state).reshape(-1)
            count = int(mask.sum())
            if count == p.numel() and p.dtype == torch.float32:
                layout.append((group, p, state, "all", None, offset, count))
            elif count == 0:
                layout.append((group, p, state, None, None, offset, 0))
            else:
                index = mask.nonzero().reshape(-1) if count < p.numel() else None
                layout.append((group, p, state, "some", (mask, index), offset, count))
            offset += count
        return layout

    def _pack(self, entries: List[Any], grads: Dict[int, torch.Tensor], inv_scale: Optional[torch.Tensor] = None,
              buf: Optional[torch.Tensor] = None) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        """The local momenta of the layout ``entries`` (from ``grads`` by
        parameter id; a missing gradient counts as zero): one flat buffer of
        their communicated elements (``buf`` when given; None when there are
        none) and each parameter's full local momentum (the buffer's views
        for "all")."""
        total = sum(e[6] for e in entries)
        if not total:
            buf = None
        elif buf is None:
            buf = torch.empty(total, dtype=torch.float32, device=self._device())
        outs: List[torch.Tensor] = []
        offset = 0
        for group, p, state, kind, masks, _, count in entries:
            grad = grads.get(id(p))
            if grad is not None and inv_scale is not None:
                grad = grad * inv_scale.to(grad.dtype)
            if kind == "all":
                g = grad if grad is not None else torch.zeros_like(p)
                out = buf[offset:offset + count].view_as(p)
                self._local_momentum(group, p, state, g.view_as(p), out)
            else:
                # Frozen elements: a zero gradient, the same on every rank.
                if grad is None or kind is None:
                    g = torch.zeros_like(p)
                else:
                    g = grad.view_as(p).masked_fill(~masks[0].view_as(p), 0)
                out = torch.empty_like(p, memory_format=torch.contiguous_format)
                self._local_momentum(group, p, state, g, out)
                if kind == "some":
                    flat = out.reshape(-1)
                    buf[offset:offset + count].copy_(flat if masks[1] is None else flat.index_select(0, masks[1]))
            outs.append(out)
            offset += count
        return buf, outs

    def _unpack_apply(self, entries: List[Any], buf: Optional[torch.Tensor], outs: List[torch.Tensor]) -> None:
        """Step the parameters of ``entries`` with the averaged momenta."""
        offset = 0
        for (group, p, state, kind, masks, _, count), m in zip(entries, outs, strict=True):
            if kind == "some":
                part = buf[offset:offset + count]
                if masks[1] is None:
                    m.reshape(-1).copy_(part)
                else:
                    m.view(-1).index_copy_(0, masks[1], part.to(m.dtype))
            self._apply(group, p, state, m)
            offset += count

    def _compressed_step(self, found_inf: Optional[torch.Tensor]) -> bool:
        if self._layout is None:
            self._layout = self._build_layout()
        if self._overlap:
            return self._overlapped_step(found_inf)
        layout = self._layout
        grads = {id(p): p.grad for _, p in self._params() if p.grad is not None}
        buf, outs = self._pack(layout, grads, buf=self._buffer(sum(e[6] for e in layout)))
        if buf is not None:
            self._poison(buf, found_inf)
            key = self.key_base if self._uses_ef() else None
            pd.all_reduce(buf, key=key, group=self._engine_group(), op="avg")
            if not _all_finite(buf):
                return False  # the engine rolled its residuals back on every rank
        self._unpack_apply(layout, buf, outs)
        return True

    def _exact_step(self, found_inf: Optional[torch.Tensor]) -> bool:
        """A step after the warm-up on exactly averaged gradients (with DDP,
        the hook averaged them): every rank computes the same momentum from
        them, so nothing is compressed and no residual changes; the frozen
        statistics are updated (:meth:`_variance_update`), then the step is
        the compressed steps' update. Frozen elements get a zero gradient,
        as in every step after the warm-up."""
        self._hold = False
        if self._layout is None:
            self._layout = self._build_layout()
        grads = self._averaged_grads(found_inf)
        if grads is None:
            return False
        grads = {k: g for k, g in grads.items() if g is not None}
        _, outs = self._pack(self._layout, grads)
        for (group, p, state, kind, masks, _, _), m in zip(self._layout, outs, strict=True):
            g = grads.get(id(p))
            if g is not None and kind != "all":
                g = None if kind is None else g.view_as(p).masked_fill(~masks[0].view_as(p), 0)
            self._variance_update(group, p, state, None if g is None else g.view_as(p))
            self._apply(group, p, state, m)
        return True

    # -- overlap with DDP's backward ---------------------------------------------
    def _send_bucket(self, bucket: dist.GradBucket, stable: bool) -> Any:
        """From the DDP hook after the warm-up, with ``overlap=True``: the
        local momenta of the bucket's parameters, averaged by the compressed
        all-reduce under the bucket's key while backward goes on. Returns the
        Work (None when nothing in the bucket is communicated now).
        ``stable``: DDP has rebuilt its buckets in this process (after its
        first backward); before that (a resumed run) the bucket is not one
        the residuals belong to, and step() sends its parameters instead."""
        index = bucket.index()
        if self._hold:
            return None  # a refused backward: step() sends what it needs
        if index in self._sent:
            # Nothing of this step stays sent; the rest of this backward
            # sends nothing, and step() averages what it finds in .grad.
            self._undo_sent()
            self._hold = True
            raise RuntimeError(
                f"{type(self).__name__} with attach(model, overlap=True) sends each DDP bucket once per step, "
                f"but bucket {index} came twice before step(): accumulate gradients under model.no_sync() "
                f"(the last backward of the step outside it), or attach with overlap=False"
            )
        if not stable:
            return None
        if self._layout is None:
            self._layout = self._build_layout()
        params = bucket.parameters()
        positions = self._positions()
        pos = tuple(positions[id(p)] for p in params)
        known = self._bucket_pos.get(index)
        if known is None:
            self._bucket_pos[index] = pos
        elif known != pos:
            raise ValueError(
                f"DDP bucket {index} holds parameters {list(pos)}, but {type(self).__name__}'s residuals of "
                f"bucket {index} were saved for parameters {list(known)}: another model or bucket_cap_mb? "
                f"Load the state with reset_error_feedback=True to start the residuals over"
            )
        entries, buf = self._bucket_entries(index)
        grads = {id(p): g for p, g in zip(params, bucket.gradients(), strict=True)}
        inv = None
        if self._scaler is not None and getattr(self._scaler, "_scale", None) is not None:
            inv = self._scaler._scale.double().reciprocal().float()
        buf, outs = self._pack(entries, grads, inv, buf=buf)
        key = work = None
        if buf is not None:
            key = self.key_base + 1 + index if self._uses_ef() else None
            work = pd.all_reduce(buf, key=key, group=self._engine_group(), op="avg", async_op=True)
        self._sent[index] = (buf, outs, key, work)
        return work

    def _positions(self) -> Dict[int, int]:
        """Parameter id -> its position in the parameter groups (the same in
        every process that builds the same optimizer)."""
        return {id(p): i for i, (_, p) in enumerate(self._params())}

    def _bucket_entries(self, index: int) -> Tuple[List[Any], torch.Tensor]:
        """The layout entries of bucket ``index``'s parameters, in its
        order, and the buffer its momenta go out in (kept between steps)."""
        pos = self._bucket_pos[index]
        cached = self._buckets.get(index)
        if cached is None or cached[0] != pos:
            positions = self._positions()
            by_pos = {positions[id(e[1])]: e for e in self._layout}
            entries = [by_pos[i] for i in pos if i in by_pos]
            total = sum(e[6] for e in entries)
            buf = torch.empty(total, dtype=torch.float32, device=self._device())
            cached = self._buckets[index] = (pos, entries, buf)
        return cached[1], cached[2]

    def _undo_sent(self) -> None:
        """Forget this step's bucket calls, putting their residuals back."""
        sent, self._sent = self._sent, {}
        keys = []
        for buf, _, key, work in sent.values():
            if work is not None:
                work.wait()
                if key is not None and _all_finite(buf):
                    keys.append(key)  # a non-finite call kept its old residuals itself
        if keys:
            pd.undo_error_feedback(keys, self._engine_group(), self._device().type)

    def _overlapped_step(self, found_inf: Optional[torch.Tensor]) -> bool:
        """The buckets' momenta came from the DDP hook. What no hook sent is
        sent here: the parameters of each known bucket that did not come
        (DDP's first backward in a resumed process), under its key, then
        the parameters no bucket holds, in one call under ``key_base``. A
        step that is not finite everywhere undoes every call's residuals,
        so that it changes nothing."""
        self._hold = False
        for _, _, _, work in self._sent.values():
            if work is not None:
                work.wait()
        sent = [(self._buckets[i][1], buf, outs, key) for i, (buf, outs, key, _) in sorted(self._sent.items())]
        done = {id(e[1]) for entries, *_ in sent for e in entries}
        positions = self._positions()
        missing = {positions[id(e[1])] for e in self._layout if id(e[1]) not in done}
        calls = [(self.key_base + 1 + i, self._bucket_entries(i)[0]) for i, pos in sorted(self._bucket_pos.items())
                 if i not in self._sent and set(pos) <= missing]
        covered = {id(e[1]) for _, entries in calls for e in entries}
        rest = [e for e in self._layout if id(e[1]) not in done and id(e[1]) not in covered]
        if rest:
            calls.append((self.key_base, rest))
        carried = False
        grads = {id(p): p.grad for _, p in self._params() if p.grad is not None}
        for key, entries in calls:
            buf, outs = self._pack(entries, grads)
            if buf is not None:
                self._poison(buf, found_inf)  # tells every rank through the result
                key = key if self._uses_ef() else None
                pd.all_reduce(buf, key=key, group=self._engine_group(), op="avg")
                carried = True
            sent.append((entries, buf, outs, key if buf is not None else None))
        skip = False
        if not carried and found_inf is not None:
            # No call of this step carried this rank's GradScaler flag: agree on it.
            flag = found_inf.detach().reshape(1).float().clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._plain_group())
            skip = bool(flag[0] > 0)
        finite = [b is None or _all_finite(b) for _, b, _, _ in sent]
        if skip or not all(finite):
            keys = [key for (_, _, _, key), ok in zip(sent, finite, strict=True) if ok and key is not None]
            self._sent = {}
            if keys:
                pd.undo_error_feedback(keys, self._engine_group(), self._device().type)
            return False
        self._sent = {}
        for entries, buf, outs, _ in sent:
            self._unpack_apply(entries, buf, outs)
        return True

    # -- DDP ---------------------------------------------------------------------
    def attach(self, model: Any, overlap: bool = False, scaler: Any = None) -> Any:
        """Couple this optimizer with a DDP model (call once, on every rank,
        before the first backward): registers a DDP communication hook that
        averages the gradients exactly during the warm-up (and on
        OneBitAdam's variance updates) and skips DDP's all-reduce otherwise
        (the gradients stay local; this optimizer all-reduces the momenta,
        compressed). Returns ``model``.

        ``overlap=True`` sends the momenta from the hook instead, per DDP
        bucket, while backward runs (as DDP overlaps its gradient all-reduce;
        each bucket's residuals under its own key, ``key_base + 1 + i``):
        ``step()`` then only applies them. The momentum is taken from the
        gradient as backward leaves it, so what changes ``.grad`` between
        backward and ``step()`` (gradient clipping) has no effect, and a
        GradScaler must be passed as ``scaler`` (its scale divides the
        gradients in the hook). Gradient accumulation: the backwards before
        the last under ``model.no_sync()``. Needs ``warmup_steps >= 2`` (DDP
        rebuilds its buckets after the first step). Like
        ``ZeroRedundancyOptimizer(overlap_with_ddp=True)``, it is opt-in.

        Every parameter DDP reduces must be in this optimizer (after the
        warm-up nothing else averages them). Parameters of this optimizer that
        DDP does not reduce are averaged by ``step()`` during the warm-up.
        DDP takes one communication hook: this one replaces any other.

        Example::

            model = DDP(net)
            opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=100)
            opt.attach(model)                  # or attach(model, overlap=True)
        """
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not isinstance(model, DDP):
            raise TypeError(f"attach() takes a torch.nn.parallel.DistributedDataParallel model, "
                            f"got {type(model).__name__}")
        if self._attached:
            raise ValueError(f"this {type(self).__name__} is already attached to a DDP model")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        if scaler is not None:
            from torch.amp import GradScaler

            if not isinstance(scaler, GradScaler):
                raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
            if not overlap:
                raise ValueError("scaler= is for overlap=True (without overlap, step() unscales the gradients "
                                 "GradScaler.step hands it)")
        if overlap and self.warmup_steps < 2:
            raise ValueError(f"overlap=True needs warmup_steps >= 2 (DDP rebuilds its buckets after the first "
                             f"step), got {self.warmup_steps}")
        ddp_params = getattr(model, "_module_parameters", None)
        if ddp_params is None:
            ignore = getattr(model, "parameters_to_ignore", set())
            ddp_params = [p for n, p in model.module.named_parameters() if n not in ignore]
        ddp_params = [p for p in ddp_params if p.requires_grad]
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        names = {id(p): n for n, p in model.module.named_parameters()}
        missing = [names.get(id(p), "?") for p in ddp_params if id(p) not in mine]
        if missing:
            raise ValueError(
                f"DDP reduces parameters that are not in this {type(self).__name__}: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; after the warm-up DDP no longer averages "
                f"gradients, so every parameter of the model must be updated by this optimizer"
            )
        group = self._plain_group()
        ddp_group = model.process_group
        if dist.get_process_group_ranks(ddp_group) != dist.get_process_group_ranks(group):
            raise ValueError(
                f"the DDP model reduces over ranks {dist.get_process_group_ranks(ddp_group)}, this "
                f"optimizer over {dist.get_process_group_ranks(group)}: pass process_group=model.process_group"
            )
        if overlap:
            # The engine group now, on every rank alike, rather than from a
            # hook in the middle of backward.
            self._overlap, self._scaler = True, scaler
            try:
                self._engine_group()
            except BaseException:
                self._overlap, self._scaler = False, None
                raise
        model.register_comm_hook(_DDPCoupling(self, ddp_group), _onebit_ddp_hook)
        self._ddp_param_ids = frozenset(id(p) for p in ddp_params)
        self._attached = True
        return model

    # -- bytes -------------------------------------------------------------------
    def bytes_per_step(self, compressed: Optional[bool] = None) -> int:
        """Bytes this rank sends per step (the most any rank sends), counted
        from the spec as ``pycomm.bench.allreduce.bytes_sent`` counts them:
        ``compressed=False``: the exact ring all-reduce of every gradient
        (the warm-up, or plain DDP); ``True``: the compressed all-reduce of
        the communicated momentum elements (before the layout is known: every
        element; with ``overlap=True``, once the buckets have been sent: one
        call per bucket); None: the current phase. Methods with no count of their
        own in the spec (registered compressors) are counted as the engine's
        all-gather of their payload (``payload_nbytes`` or one compress of
        each chunk length)."""
        world = dist.get_world_size(self._plain_group())
        if compressed is None:
            compressed = not self.exact_now
        if not compressed:
            return _ring_bytes(sum(p.numel() for _, p in self._params()), world, 4)
        if self._layout is not None:
            numel = sum(e[6] for e in self._layout)
        else:
            numel = sum(p.numel() for _, p in self._params())
        settings = dict(self.compressor_settings)
        if not settings.get("chunk_numel") and self._engine is not None:
            # The chunk the engine runs (its default depends on the backend it wraps).
            settings["chunk_numel"] = pd.options_of(self._engine, self._device().type)["chunk_numel"]
        if self._overlap and self._buckets:
            # One call per bucket (as sent in the last step), and one for the rest.
            sizes = [b[2].numel() for b in self._buckets.values()]
            sizes.append(numel - sum(sizes))
            return sum(_compressed_bytes(self.compressor, settings, n, world) for n in sizes)
        return _compressed_bytes(self.compressor, settings, numel, world)

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state plus a ``"pycomm"`` entry: step count,
        settings, and THIS rank's error-feedback residuals (each rank saves
        and loads its own)."""
        sd = super().state_dict()
        world = rank = None
        if dist.is_initialized():
            pg = self._plain_group()
            world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        elif self._saved_world is not None:
            world, rank = self._saved_world
        sd["pycomm"] = {
            "version": _STATE_VERSION,
            "step_count": self.step_count,
            "warmup_steps": self.warmup_steps,
            "compressor": self.compressor,
            "overlap": self._overlap,
            "buckets": {int(i): list(pos) for i, pos in self._bucket_pos.items()},
            "world_size": world,
            "rank": rank,
            "error_feedback": self._ef(),
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any], reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict`. A state saved by another rank or world
        size, or for another compressor, is refused (its residuals belong to
        that rank) unless ``reset_error_feedback=True``, which keeps
        everything but the residuals (they start from zero). A plain torch
        AdamW / SGD state loads too (no residuals; the step count is taken
        from the parameters' ``step``)."""
        if not isinstance(reset_error_feedback, bool):
            raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
        sd = dict(state_dict)
        extra = sd.pop("pycomm", None)
        ef: Dict[int, Any] = {}
        saved_world = None
        if extra is not None:
            if not isinstance(extra, dict) or extra.get("version") != _STATE_VERSION:
                raise ValueError(f"state_dict['pycomm'] is not a {type(self).__name__} state of version "
                                 f"{_STATE_VERSION}")
            ef = dict(extra.get("error_feedback") or {})
            if extra.get("world_size") is not None:
                saved_world = (int(extra["world_size"]), int(extra["rank"]))
            problems = []
            if ef and extra.get("compressor") != self.compressor:
                problems.append(f"its residuals are {extra.get('compressor')!r}'s, this optimizer runs "
                                f"{self.compressor!r}")
            if ef and saved_world is not None and dist.is_initialized():
                pg = self._plain_group()
                world, rank = dist.get_world_size(pg), dist.get_rank(pg)
                if saved_world != (world, rank):
                    problems.append(f"it holds rank {saved_world[1]} of {saved_world[0]}'s residuals, "
                                    f"this is rank {rank} of {world}")
            saved_overlap = bool(extra.get("overlap", False))
            if ef and self._engine is not None and saved_overlap != self._overlap:
                problems.append(f"its residuals were keyed with attach(model, overlap={saved_overlap}), this "
                                f"optimizer runs overlap={self._overlap}")
            if problems and not reset_error_feedback:
                raise ValueError(
                    f"cannot load this {type(self).__name__} state: " + "; ".join(problems)
                    + ". Every rank saves and loads its own state, or pass reset_error_feedback=True "
                    "to keep the rest and start the residuals over."
                )
        super().load_state_dict(sd)
        self._after_load()
        if extra is not None:
            self.step_count = int(extra["step_count"])
        else:
            steps = [int(s["step"]) for s in self.state.values() if "step" in s]
            self.step_count = max(steps, default=0)
        if reset_error_feedback:
            ef, saved_world = {}, None
        self._layout = None
        self._frozen = {}
        self._flat = None
        self._saved_world = saved_world if ef else None
        self._saved_overlap = bool(extra.get("overlap", False)) if ef and extra is not None else None
        self._buckets, self._sent = {}, {}
        self._bucket_pos = ({int(i): tuple(int(x) for x in pos) for i, pos in (extra.get("buckets") or {}).items()}
                            if extra is not None and not reset_error_feedback else {})
        if self._engine is not None:
            self._saved_overlap = None  # checked above
            self._check_world()
            self._load_ef(ef)
        else:
            self._pending_ef = ef

    def _after_load(self) -> None:
        """Fix-ups of torch's load (which casts every tensor to the
        parameter's dtype)."""


def _ring_bytes(numel: int, world: int, itemsize: int) -> int:
    return 0 if world < 2 else 2 * (world - 1) * itemsize * numel // world


def _compressed_bytes(method: str, settings: Dict[str, Any], numel: int, world: int) -> int:
    if world < 2 or numel == 0:
        return 0
    if method in ("none", "auto"):
        return _ring_bytes(numel, world, 4)
    if method in ("fp16", "bf16"):
        return _ring_bytes(numel, world, 2)
    chunk = settings.get("chunk_numel") or spec.DEFAULT_CHUNK_NUMEL
    block_bits = getattr(spec, "BLOCK_BITS", {"onebit": 0})  # the two-phase block codecs
    total = [0] * world
    for begin, end in spec.chunk_bounds(numel, chunk):
        m = end - begin
        if method in block_bits:
            # Per chunk: the all_to_all sends segment j's payload to rank j
            # (j != r), the all_gather this rank's server payload, padded to
            # segment 0's, and the call's tag to each of the W-1 peers.
            block = _block_size(method, settings.get("block_size"))
            segments = getattr(spec, "block_segments", None) or spec.onebit_segments
            _, segs = segments(m, world, block)
            sizes = [_block_wire_numel(e - b, block, block_bits[method]) for b, e in segs]
            for r in range(world):
                total[r] += 4 * (sum(sizes[j] for j in range(world) if j != r)
                                 + (world - 1) * (sizes[0] + spec.TAG_WORDS))
        elif method == "topk":
            wire = spec.topk_wire_numel(m, settings.get("density", 0.01), settings.get("approx", True))
            for r in range(world):
                total[r] += 4 * (world - 1) * wire
        else:  # a registered compressor: every rank's payload and tag gathered by every rank
            payload = _payload_nbytes(method, settings, m) + 4 * spec.TAG_WORDS
            for r in range(world):
                total[r] += (world - 1) * payload
    return max(total)


def _block_size(method: str, block_size: Optional[int]) -> int:
    if block_size:
        return int(block_size)
    defaults = getattr(spec, "DEFAULT_BLOCK_SIZE", {})
    return int(defaults.get(method, 2048))


def _block_wire_numel(length: int, block_size: int, bits: int) -> int:
    if hasattr(spec, "block_wire_numel"):
        return spec.block_wire_numel(length, block_size, bits)
    return spec.onebit_wire_numel(length, block_size)


def _payload_nbytes(method: str, settings: Dict[str, Any], m: int) -> int:
    import pycomm

    opts = dict(settings.get("compressor_options") or {})
    try:
        comp = pycomm.get_compressor(method, **opts)
        if hasattr(comp, "payload_nbytes"):
            return int(comp.payload_nbytes(m))
    except Exception:  # noqa: BLE001 - a plugin class: measure one payload instead
        comp = pycomm.compressor_class(method)(**opts)
    payload = comp.compress(torch.zeros(m), None)
    tensors = payload if isinstance(payload, (list, tuple)) else [payload]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------ DDP ----
class _DDPCoupling:
    """The state of :func:`_onebit_ddp_hook`: the optimizer and DDP's group."""

    def __init__(self, optimizer: _CompressedMomentum, process_group: dist.ProcessGroup) -> None:
        self.optimizer = optimizer
        self.process_group = process_group


def _onebit_ddp_hook(state: _DDPCoupling, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact average during the optimizer's warm-up and its exact steps
    after it (OneBitAdam's variance updates); otherwise the local gradient
    as it is, with no communication of gradients (with ``overlap=True``: the
    bucket's momenta are sent, compressed)."""
    tensor = bucket.buffer()
    opt = state.optimizer
    if opt.exact_now:
        if bucket.is_last():
            opt._backwards += 1
        try:
            work = opt._exact_average(tensor, state.process_group)
            return work.get_future().then(lambda _: tensor)
        except Exception as exc:  # noqa: BLE001 - surfaces from backward()
            return _failed(exc)
    stable = opt._backwards >= 1
    if bucket.is_last():
        opt._backwards += 1
    if opt._overlap:
        try:
            work = opt._send_bucket(bucket, stable)
        except Exception as exc:  # noqa: BLE001 - surfaces from backward()
            return _failed(exc)
        if work is not None:
            # DDP waits for it at the end of backward; the gradients stay local.
            return work.get_future().then(lambda _: tensor)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done


def _failed(exc: BaseException) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)

    def fail(_):
        raise exc

    return done.then(fail)


# ------------------------------------------------------------- OneBitAdam ----
class OneBitAdam(_CompressedMomentum):
    """AdamW whose momentum is all-reduced compressed after a warm-up, with
    the variance frozen (1-bit Adam), over any process group.

    Args:
        params: parameters or parameter groups, as for torch optimizers.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled
            weight decay, bias correction); per group.
        warmup_steps: steps (>= 1) with exact averaged gradients and torch's
            AdamW update; the variance freezes after them.
        variance_update_every: K > 0: after the warm-up, every K-th step
            averages the gradients exactly (a plain all-reduce, sent instead
            of the compressed momentum) and updates the variance from them
            (``v = beta2^d v + (1 - beta2^d) g^2``, ``d`` steps since its last
            update), which keeps Adam's step size tracking the gradients as
            training goes on; 0 (default): frozen for good, as DeepSpeed's
            1-bit Adam. Bytes per step after the warm-up are then on average
            ``((K - 1) * compressed + exact) / K``.
        compressor: the engine's method for the momentum: "onebit" (default),
            "topk", "fp16", "bf16", "none", any method the engine adds (e.g.
            "int8", "int4") or a compressor registered with
            ``pycomm.register_compressor``.
        process_group: the data-parallel group (None: the default group);
            Gloo, NCCL or pycomm.
        key_base: the engine key of the residuals (:data:`KEY_BASE`).
        **compressor_settings: settings of the engine group created over a
            plain ``process_group`` (``block_size``, ``chunk_numel``,
            ``density``, ``hierarchy``, ``compressor_options``, ...: those of
            :class:`pycomm.distributed.PycommOptions`).

    Without DDP, call ``loss.backward()`` then ``optimizer.step()`` on every
    rank; with DDP, :meth:`attach` the model first. Every rank saves its own
    ``state_dict()`` (the residuals differ per rank).

    Example (on every rank, after ``dist.init_process_group``)::

        from pycomm.optim import OneBitAdam

        model = DDP(net)
        opt = OneBitAdam(model.parameters(), lr=3e-4, weight_decay=0.01,
                         warmup_steps=1000, compressor="onebit", block_size=2048)
        opt.attach(model)                     # DDP's all-reduce stops after the warm-up
        scaler = torch.amp.GradScaler()       # optional
        for x, y in data:
            opt.zero_grad()
            scaler.scale(loss_fn(model(x), y)).backward()
            scaler.step(opt)                  # a non-finite step is skipped on every rank
            scaler.update()
        torch.save(opt.state_dict(), f"opt_rank{dist.get_rank()}.pt")
        print(opt.bytes_per_step(compressed=False) / opt.bytes_per_step(compressed=True))
    """

    _CONFIG = _CompressedMomentum._CONFIG + ("variance_update_every",)
    variance_update_every = 0  # what a pickle from before the setting existed meant

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        warmup_steps: int = 100,
        compressor: str = "onebit",
        process_group: Optional[dist.ProcessGroup] = None,
        key_base: int = KEY_BASE,
        variance_update_every: int = 0,
        **compressor_settings: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._check_group(defaults)
        #: After the warm-up, every this many steps one step averages the
        #: gradients exactly and updates the variance (0: frozen for good).
        self.variance_update_every = _check_int("variance_update_every", variance_update_every, 0)
        super().__init__(params, defaults, warmup_steps=warmup_steps, compressor=compressor,
                         process_group=process_group, key_base=key_base,
                         compressor_settings=compressor_settings)

    def _check_group(self, group: Dict[str, Any]) -> None:
        group["lr"] = _check_float("lr", group["lr"])
        group["betas"] = _check_betas(group["betas"])
        group["eps"] = _check_float("eps", group["eps"])
        group["weight_decay"] = _check_float("weight_decay", group["weight_decay"])

    def _has_state(self, state: Dict[str, Any]) -> bool:
        return "exp_avg_sq" in state

    def _active_mask(self, p: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        return state["exp_avg_sq"] != 0

    def _freeze(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        # The step count at which the variance (and its bias correction) froze.
        if "variance_step" not in state:
            state["variance_step"] = int(state["step"])

    def _variance_due(self) -> bool:
        every = self.variance_update_every
        return every > 0 and not self.in_warmup and (self.step_count - self.warmup_steps + 1) % every == 0

    def _variance_update(self, group, p, state, grad) -> None:
        # The exact gradient of step t stands for the d steps since the
        # variance's last update: v = beta2^d v + (1 - beta2^d) g^2, whose
        # bias correction is 1 - beta2^t (as Adam's own, for d = 1).
        t = int(state["step"]) + 1
        decay = group["betas"][1] ** (t - int(state["variance_step"]))
        v = state["exp_avg_sq"]
        v.mul_(decay)
        if grad is not None:
            v.addcmul_(grad, grad, value=1 - decay)
        state["variance_step"] = t
        self._frozen.pop(id(p), None)

    def _warmup_update(self, group, params, grads) -> None:
        from torch.optim.adam import adam

        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:  # as torch.optim.Adam._init_group (no fused/capturable)
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False,
             differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _local_momentum(self, group, p, state, grad, out) -> None:
        torch.lerp(state["exp_avg"], grad, 1 - group["betas"][0], out=out)

    def _apply(self, group, p, state, momentum) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        exp_avg = state["exp_avg"]
        exp_avg.copy_(momentum.view_as(exp_avg))
        state["step"] += 1
        step = float(state["step"])
        if wd != 0:
            p.mul_(1 - lr * wd)
        step_size = lr / (1 - beta1 ** step)
        cached = self._frozen.get(id(p))
        if cached is None or cached[0] != (eps, beta2):
            # The variance and its bias correction are frozen: so is this,
            # computed once (again if eps or beta2 change) instead of three
            # passes over v every step.
            bias_correction2_sqrt = (1 - beta2 ** float(state["variance_step"])) ** 0.5
            cached = self._frozen[id(p)] = ((eps, beta2),
                                            (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps))
        p.addcdiv_(exp_avg, cached[1], value=-step_size)


# -------------------------------------------------------------- OneBitSGD ----
class OneBitSGD(_CompressedMomentum):
    """Momentum SGD whose momentum is all-reduced compressed after a warm-up,
    over any process group (``torch.optim.SGD`` semantics, dampening 0).

    Args:
        params: parameters or parameter groups.
        lr, momentum, weight_decay, nesterov: as ``torch.optim.SGD``
            (coupled weight decay: added to the gradient); per group.
        warmup_steps, compressor, process_group, key_base,
        **compressor_settings: as :class:`OneBitAdam`.

    Elements whose gradient was zero during the whole warm-up are frozen
    (tracked in the ``grad_seen`` state): they follow torch's SGD with a zero
    gradient (weight decay only) and are never communicated.

    Example (on every rank)::

        from pycomm.optim import OneBitSGD

        opt = OneBitSGD(model.parameters(), lr=0.1, momentum=0.9, warmup_steps=200,
                        compressor="onebit", block_size=2048)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                        # averages during the warm-up, then momenta compressed
    """


    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        warmup_steps: int = 100,
        compressor: str = "onebit",
        process_group: Optional[dist.ProcessGroup] = None,
        key_base: int = KEY_BASE,
        **compressor_settings: Any,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        self._check_group(defaults)
        super().__init__(params, defaults, warmup_steps=warmup_steps, compressor=compressor,
                         process_group=process_group, key_base=key_base,
                         compressor_settings=compressor_settings)

    def _check_group(self, group: Dict[str, Any]) -> None:
        group["lr"] = _check_float("lr", group["lr"])
        group["momentum"] = _check_float("momentum", group["momentum"], 0.0, 1.0)
        group["weight_decay"] = _check_float("weight_decay", group["weight_decay"])
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
        if group["nesterov"] and group["momentum"] == 0:
            raise ValueError("nesterov=True needs a momentum > 0")

    def _has_state(self, state: Dict[str, Any]) -> bool:
        return "grad_seen" in state

    def _active_mask(self, p: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        return state["grad_seen"]

    def _after_load(self) -> None:
        for state in self.state.values():
            if "grad_seen" in state:
                state["grad_seen"] = state["grad_seen"] != 0
            elif "momentum_buffer" in state and state["momentum_buffer"] is not None:
                # A torch.optim.SGD state: no record of zero gradients; communicate all.
                state["grad_seen"] = torch.ones_like(state["momentum_buffer"], dtype=torch.bool)

    def _warmup_update(self, group, params, grads) -> None:
        from torch.optim.sgd import sgd

        momentum = group["momentum"]
        bufs = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 else []
        sgd(params, grads, bufs, has_sparse_grad=False, foreach=None, fused=None, grad_scale=None,
            found_inf=None, weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=0.0, nesterov=group["nesterov"], maximize=False)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            state = self.state[p]
            if momentum != 0:
                state["momentum_buffer"] = bufs[i]
            seen = state.get("grad_seen")
            if seen is None:
                seen = state["grad_seen"] = torch.zeros_like(p, dtype=torch.bool)
            seen.logical_or_(g != 0)

    def _local_momentum(self, group, p, state, grad, out) -> None:
        wd, momentum = group["weight_decay"], group["momentum"]
        d_p = grad.add(p, alpha=wd) if wd != 0 else grad
        if momentum != 0:
            torch.mul(state["momentum_buffer"], momentum, out=out)
            out.add_(d_p)
        else:
            out.copy_(d_p)

    def _apply(self, group, p, state, momentum_) -> None:
        momentum, lr = group["momentum"], group["lr"]
        if momentum == 0:
            p.add_(momentum_.view_as(p), alpha=-lr)
            return
        buf = state["momentum_buffer"]
        new = momentum_.view_as(buf)
        if group["nesterov"]:
            d_p = torch.add(new, torch.sub(new, buf), alpha=momentum)
            buf.copy_(new)
            p.add_(d_p, alpha=-lr)
        else:
            buf.copy_(new)
            p.add_(buf, alpha=-lr)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: one read (a sum is finite only if
    every term is), the exact check only when the sum itself is not."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
