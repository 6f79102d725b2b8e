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
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .. import distributed as pd
from ..distributed import spec
from ..distributed.checks import agree, check_int, settings_digest
from ..distributed.session import KEY_SPAN, EngineSession, LoadedState, check_key_base, check_version, nest_legacy
from ._checks import _all_finite, _check_compressor, _check_int, _check_scaler, _unscale_
from ..ddp.buckets import BucketTracker, checked_layouts
from ..ddp.optimizer import optimizer_hook
from .ddp import DDPCoupling, couple

__all__ = ["KEY_BASE", "KEY_SPAN"]

#: Default engine key of the momentum buffer's residuals: 2^40, far above
#: the DDP hook's keys (bucket indices). Two of these optimizers sharing ONE
#: pycomm group need ``key_base`` values at least :data:`KEY_SPAN` apart
#: (refused otherwise).
KEY_BASE = 1 << 40
#: The version of ``state_dict()["pycomm"]``; version 1 (the engine
#: state's fields at its top level) loads too (``nest_legacy``).
_STATE_VERSION = 2
#: The fields of ``state_dict()["pycomm"]`` ("engine": the engine client's
#: state, EngineSession.state_dict).
_STATE_FIELDS = ("version", "step_count", "warmup_steps", "overlap", "buckets", "engine")


class LayoutEntry(NamedTuple):
    """One parameter's place in the flat buffer of momenta the optimizers
    all-reduce."""

    group: Dict[str, Any]
    param: torch.Tensor
    state: Dict[str, Any]
    #: "all": every element is sent; "some": the active ones (``masks``);
    #: None: none (frozen all warm-up).
    kind: Optional[str]
    #: For "some": (the active mask, its flat index or None when all are).
    masks: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    #: Where its elements start in the buffer, and how many there are.
    offset: int
    count: int


class _CompressedMomentum(Optimizer):
    """What OneBitAdam and OneBitSGD share: the warm-up's exact averaging,
    the compressed all-reduce of the momenta, frozen elements, non-finite
    steps, the DDP hook and the state. Subclasses give the update rules."""

    #: GradScaler.step calls step() on every rank, with ``grad_scale`` and
    #: ``found_inf`` set, instead of skipping it on the ranks that saw an inf.
    _step_supports_amp_scaling = True

    def __init__(self, params: Any, defaults: Dict[str, Any], *, warmup_steps: int, compressor: str,
                 process_group: Optional[dist.ProcessGroup], key_base: int,
                 compressor_settings: Dict[str, Any], scaler: Any = None) -> None:
        _check_int("warmup_steps", warmup_steps, 1)
        _check_compressor(compressor, compressor_settings)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        check_key_base(key_base)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.compressor = compressor
        self.compressor_settings = dict(compressor_settings)
        self.process_group = process_group
        self.key_base = key_base
        #: The engine client: the group, the keys [key_base, key_base +
        #: KEY_SPAN) and this rank's residuals under them.
        self._session = EngineSession(type(self).__name__, compressor, compressor_settings,
                                      process_group=process_group, key_base=key_base)
        if process_group is not None and dist.is_initialized() and pd.is_pycomm_group(process_group, self._device()):
            self._session.check_group(process_group, self._device())
        #: Steps taken (skipped non-finite steps are not counted). The
        #: warm-up is ``step_count < warmup_steps``.
        self.step_count = 0
        #: Non-finite steps skipped on every rank, in this process.
        self.skipped_steps = 0
        self._saved_overlap: Optional[bool] = None  # how the loaded residuals were keyed
        #: overlap=True: DDP's buckets, their layouts saved with the residuals
        self._tracker = BucketTracker(type(self).__name__)
        self._init_runtime()
        self.scaler = scaler

    @property
    def scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` that steps this optimizer (None:
        none). It must be handed over (constructor, this attribute, or
        ``attach(scaler=)``) when there is one: a step skipped on every rank
        is recorded in it, so that ``scaler.update()`` backs off on every
        rank, and with ``overlap=True`` its scale divides the gradients in
        the DDP hook."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: Any) -> None:
        self._scaler = _check_scaler(scaler)

    def _init_runtime(self) -> None:
        """What belongs to this process (not saved, not pickled)."""
        self._agreed = False  # the ranks' settings compared since the last change (_agree)
        # In the warm-up, once the ranks agreed with a flat all-reduce of
        # their own to carry the check (_averaged_grads): (the digest of the
        # settings but the step count, the size of that all-reduce, the step
        # count) as this rank expects them at its next step. None: compare
        # at every warm-up step.
        self._in_band: Optional[Tuple[int, int, int]] = None
        self._layout: Optional[List[LayoutEntry]] = None
        # Per parameter id, what a subclass derives once from frozen state
        # (OneBitAdam: the denominator); dropped with the layout.
        self._frozen: Dict[int, Tuple[Any, torch.Tensor]] = {}
        self._flat: Optional[torch.Tensor] = None  # the communicated buffer, reused
        self._scaler: Any = None
        #: The coupling with a DDP model (attach), None until then.
        self._ddp: Optional[DDPCoupling] = None

    _CONFIG = ("warmup_steps", "compressor", "compressor_settings", "key_base", "step_count", "skipped_steps",
               "_saved_overlap", "_tracker")

    def __getstate__(self) -> Dict[str, Any]:
        # torch keeps defaults, state and param_groups; add the configuration
        # and the residuals. The process group is not kept (the default
        # group of the process that unpickles), nor the DDP coupling.
        d = super().__getstate__()
        d.update({k: getattr(self, k) for k in self._CONFIG})
        d["_session"] = self._session  # pickles its residuals, not its group
        if self._engine is not None:
            d["_saved_overlap"] = self._overlap if self._ef() else None
        return d

    def __setstate__(self, d: Dict[str, Any]) -> None:
        # Unpickling fills a new object; torch's load_state_dict calls this
        # too, on a live one, whose engine group and DDP coupling stay.
        unpickled = "_layout" not in self.__dict__
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
            if _is_dtensor(p):
                raise ValueError(f"{type(self).__name__} takes plain tensors, got a DTensor parameter (FSDP2 or "
                                 f"tensor parallel): its momentum is sharded already. With FSDP2, compress the "
                                 f"gradients' reduce-scatter instead (pycomm.fsdp.compress) and use a torch optimizer")
            if isinstance(p, torch.Tensor) and (not p.is_floating_point() or p.is_complex() or p.is_sparse):
                raise ValueError(f"{type(self).__name__} takes dense real floating-point parameters, "
                                 f"got one of dtype {p.dtype}{' (sparse)' if p.is_sparse else ''}")
        super().add_param_group(param_group)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._layout = None
        self._frozen = {}
        self._agreed = False

    def _params(self) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    # -- groups ------------------------------------------------------------------
    def _plain_group(self) -> dist.ProcessGroup:
        return self._session.base_group()

    def _uses_ef(self) -> bool:
        return self.compressor == spec.AUTO_METHOD or spec.method_spec(self.compressor).residuals

    @property
    def _engine(self) -> Optional[dist.ProcessGroup]:
        return self._session.group

    def _engine_group(self) -> dist.ProcessGroup:
        """The pycomm group that runs the compressed all-reduce (created at the
        first compressed step over a plain group, on every rank alike);
        residuals loaded before it existed go in now."""
        if self._engine is None:
            self._plain_group()  # the error when torch.distributed is not up
            if self._session.waiting:
                self._check_overlap()
        return self._session.engine(self._device())

    def _key(self, offset: int) -> Optional[int]:
        """The engine key of ``offset`` (0: step()'s buffer; 1 + i: DDP
        bucket i with overlap=True), None when the compressor keeps no
        residuals."""
        if not self._uses_ef():
            return None
        self._engine_group()
        self._session.claim(offset)
        return self._session.key(offset)

    @property
    def _overlap(self) -> bool:
        """attach(model, overlap=True): the momenta go out per DDP bucket,
        from the DDP hook, while backward runs."""
        return self._ddp is not None and self._ddp.overlap

    def _check_overlap(self) -> None:
        # A refusal stays a refusal: the saved value is dropped only once it passed.
        saved = self._saved_overlap
        if saved is not None and saved != self._overlap:
            raise ValueError(
                f"{type(self).__name__}'s residuals were saved with attach(model, overlap={saved}) and this "
                f"optimizer runs overlap={self._overlap}: they are keyed per DDP bucket only with overlap=True; "
                f"attach the same way, or load with reset_error_feedback=True"
            )
        self._saved_overlap = None

    def _ef(self) -> Dict[int, Any]:
        """This optimizer's residuals, keyed relative to ``key_base``."""
        return self._session.residuals()

    def _exact_average(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Any:
        """Start the exact average of ``tensor`` over ``group`` in place;
        returns the Work (divide, then sum: torch's default DDP hook)."""
        if pd.is_pycomm_group(group, tensor.device):
            return pd.all_reduce(tensor, group=group, op="avg", compress=False, async_op=True)
        tensor.div_(dist.get_world_size(group))
        return dist.all_reduce(tensor, group=group, async_op=True)

    # -- settings every rank must share ------------------------------------------
    def _settings(self) -> Dict[str, Any]:
        """What every rank's optimizer must agree on, by the name a user
        knows it by."""
        skip = ("skipped_steps", "_saved_overlap", "_tracker")
        out = {k: getattr(self, k) for k in self._CONFIG if k not in skip}
        out["compressor_settings"] = sorted(self.compressor_settings.items())
        out["attach(model)"] = self._ddp is not None
        out["attach(overlap=...)"] = self._overlap
        out["parameter sizes"] = [p.numel() for _, p in self._params()]
        return out

    def _agree(self, settings: Optional[Dict[str, Any]] = None) -> None:
        """Compare :meth:`_settings` across the ranks: at the first step, after
        a load or ``attach``, and in the warm-up when a rank's settings
        changed (parameter groups may still change there: the warm-up's flat
        all-reduce carries a flag that says so, :meth:`_averaged_grads`), or
        at every warm-up step when this optimizer has no flat all-reduce of
        its own (every parameter in an attached model). One int64 per rank on
        the wire; the settings themselves only when they differ, so that
        every rank raises naming the setting and each rank's value (instead
        of a collective of the wrong size aborting inside the backend, or a
        hang when the ranks leave the warm-up at different steps)."""
        whole = settings is None
        self._session.same_group()  # before the first exchange: it would not meet over groups that differ
        agree(type(self).__name__, self._settings() if whole else settings, self._plain_group(), self._device())
        self._agreed = self._agreed or whole
        if whole:
            key = self._in_band_key()
            self._in_band = key if key[1] else None

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
            sparse = [i for i, (_, p) in enumerate(self._params()) if p.grad is not None and p.grad.is_sparse]
            if sparse:
                raise ValueError(f"{type(self).__name__} takes dense gradients; parameters {sparse[:5]} have sparse "
                                 f"ones (nn.Embedding(sparse=True)?): make them dense. Nothing was changed.")
            if (not self._agreed and not self.in_warmup) or (self.in_warmup and self._in_band is None):
                self._agree()
            # found_inf, not grad_scale: GradScaler sets grad_scale to None
            # after the user's scaler.unscale_(opt) (the clipping recipe),
            # while the momenta went out from scaled gradients all the same.
            if found_inf is not None and self._scaler is None:
                if self._ddp is not None:
                    self._ddp.undo_sent()
                raise ValueError(
                    f"{type(self).__name__} is stepped by a torch.amp.GradScaler it was not given: a step skipped "
                    f"on every rank must be recorded in it (and with overlap=True the momenta went out from "
                    f"scaled gradients). Pass the scaler: {type(self).__name__}(..., scaler=scaler), "
                    f"opt.scaler = scaler or attach(model, overlap=True, scaler=scaler). Nothing was changed by "
                    f"this step."
                )
            if grad_scale is not None:
                _unscale_([p.grad for _, p in self._params() if p.grad is not None], grad_scale)
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
        if self._in_band is not None:  # what the next warm-up step expects if nothing changes in between
            self._in_band = self._in_band[:2] + (self.step_count,) if self.in_warmup else None
        return loss

    def _tell_scaler(self) -> bool:
        """From GradScaler.step: mark this optimizer's step as having found
        an inf in the scaler's record, so that scaler.update() backs off on
        every rank (a rank whose own gradients were finite would otherwise
        grow its scale). True when a scaler was told."""
        if self._scaler is None or getattr(self, "found_inf", None) is None:
            return False
        for t in self._scaler._per_optimizer_states[id(self)]["found_inf_per_device"].values():
            t.fill_(1.0)
        return True

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
        own = self._own(entries)
        grads: Dict[int, Optional[torch.Tensor]] = {}
        bad = False
        if self.in_warmup and self._in_band is not None and self._in_band_key(own) != self._in_band:
            # This rank's settings changed since the ranks agreed on them (on
            # this rank alone, maybe): it sends what its peers expect, the
            # size they agreed on, flagged, and every rank compares them.
            buf = self._buffer(self._in_band[1])
            buf.zero_()
            buf[-1] = 1.0
            self._exact_average(buf, self._plain_group()).wait()
            return self._agreed_again(found_inf)
        if own:
            # One flat exact all-reduce: the gradients, one presence flag per
            # parameter (a parameter with no gradient on any rank is skipped,
            # as torch's optimizers skip a parameter whose grad is None), and
            # the flag of a rank whose settings changed (above).
            total = sum(p.numel() for _, p in own)
            buf = self._buffer(self._flat_numel(own))
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
            present = (flags > 0).tolist()
            if present[-1]:  # some rank's settings changed: compare them, then send again
                return self._agreed_again(found_inf)
            bad = not _all_finite(buf)
            offset = 0
            for i, (_, p) in enumerate(own):
                n = p.numel()
                grads[id(p)] = buf[offset:offset + n].view_as(p).to(p.dtype) if present[i] else None
                offset += n
        ddp = self._ddp.param_ids if self._ddp is not None else ()
        ddp_grads = [p.grad for g, p in entries if id(p) in ddp and p.grad is not None]
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

    def _own(self, entries: List[Tuple[Dict[str, Any], torch.Tensor]]) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
        """The parameters whose gradients this optimizer averages itself:
        those DDP averaged (attach) have averaged gradients already."""
        ddp = self._ddp.param_ids if self._ddp is not None else ()
        return [(g, p) for g, p in entries if id(p) not in ddp]

    @staticmethod
    def _flat_numel(own: List[Tuple[Dict[str, Any], torch.Tensor]]) -> int:
        """The size of the flat exact all-reduce of ``own`` (0: none): the
        gradients, a presence flag each, and the flag of a changed rank."""
        return sum(p.numel() for _, p in own) + len(own) + 1 if own else 0

    def _in_band_key(self, own: Optional[List[Tuple[Dict[str, Any], torch.Tensor]]] = None) -> Tuple[int, int, int]:
        """What the warm-up's in-band check compares: the digest of the
        settings but the step count (which every step changes), the size of
        the flat all-reduce of ``own``, and the step count."""
        settings = self._settings()
        del settings["step_count"]
        own = self._own(self._params()) if own is None else own
        return settings_digest(settings), self._flat_numel(own), self.step_count

    def _agreed_again(self, found_inf: Optional[torch.Tensor]) -> Optional[Dict[int, Optional[torch.Tensor]]]:
        """A rank's settings changed in the warm-up: every rank compares them
        (raising on every rank, naming each difference, when they differ),
        then sends its gradients again, at the size they now agree on."""
        self._agree()
        return self._averaged_grads(found_inf)

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

    def _build_layout(self) -> List["LayoutEntry"]:
        """A :class:`LayoutEntry` per parameter with state. The same on every
        rank: it follows from state that is identical everywhere."""
        layout, offset = [], 0
        for group, p in self._params():
            state = self.state.get(p)
            if not state or not self._has_state(state):
                continue
            self._freeze(p, state)
            mask = self._active_mask(p, state).reshape(-1)
            count = int(mask.sum())
            if count == p.numel() and p.dtype == torch.float32:
                layout.append(LayoutEntry(group, p, state, "all", None, offset, count))
            elif count == 0:
                layout.append(LayoutEntry(group, p, state, None, None, offset, 0))
            else:
                index = mask.nonzero().reshape(-1) if count < p.numel() else None
                layout.append(LayoutEntry(group, p, state, "some", (mask, index), offset, count))
            offset += count
        return layout

    def _pack(self, entries: List["LayoutEntry"], grads: Dict[int, torch.Tensor], inv_scale: Optional[torch.Tensor] = None,
              buf: Optional[torch.Tensor] = None) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        """The local momenta of the layout ``entries`` (from ``grads`` by
        parameter id; a missing gradient counts as zero): one flat buffer of
        their communicated elements (``buf`` when given; None when there are
        none) and each parameter's full local momentum (the buffer's views
        for "all")."""
        total = sum(e.count for e in entries)
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

    def _unpack_apply(self, entries: List["LayoutEntry"], buf: Optional[torch.Tensor], outs: List[torch.Tensor]) -> None:
        """Step the parameters of ``entries`` with the averaged momenta."""
        offset = 0
        for (group, p, state, kind, masks, _, count), m in zip(entries, outs, strict=True):
            if kind == "some":
                part = buf[offset:offset + count]
                if masks[1] is None:
                    m.reshape(-1).copy_(part)
                else:
                    m.view(-1).index_copy_(0, masks[1], part.to(m.dtype))
            if p.requires_grad:  # frozen since the layout was built: not moved, as torch would not
                self._apply(group, p, state, m)
            offset += count

    def _compressed_step(self, found_inf: Optional[torch.Tensor]) -> bool:
        if self._layout is None:
            self._layout = self._build_layout()
        if self._overlap:
            return self._ddp.step(found_inf)
        layout = self._layout
        grads = {id(p): p.grad for _, p in self._params() if p.grad is not None}
        buf, outs = self._pack(layout, grads, buf=self._buffer(sum(e.count for e in layout)))
        if buf is not None:
            self._poison(buf, found_inf)
            pd.all_reduce(buf, key=self._key(0), group=self._engine_group(), op="avg")
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
        if self._ddp is not None:
            self._ddp.hold = False
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
            if p.requires_grad:
                self._variance_update(group, p, state, None if g is None else g.view_as(p))
                self._apply(group, p, state, m)
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
        coupling = couple(self, model, overlap, scaler)
        # Before anything collective is created: the ranks must attach alike.
        self._agree({"attach(overlap=...)": overlap, "scaler": (scaler or self._scaler) is not None})
        if overlap:
            # The engine group now, on every rank alike, rather than from a
            # hook in the middle of backward.
            previous = self._scaler
            self._ddp, self._scaler = coupling, scaler or previous
            try:
                self._engine_group()
            except BaseException:
                self._ddp, self._scaler = None, previous
                raise
        self._tracker.detach(coupling.positions())  # a parameter's position: its place in this optimizer
        model.register_comm_hook(coupling, optimizer_hook)
        # Forward passes that build a graph, to catch a micro-batch run after
        # the momenta went out (overlap=True).
        model.register_forward_pre_hook(lambda *_: coupling.count_forward())
        self._ddp = coupling
        self._agreed = False
        return model

    # -- bytes -------------------------------------------------------------------
    def bytes_per_step(self, compressed: Optional[bool] = None) -> int:
        """Bytes this rank sends per step (the most any rank sends), by
        :func:`pycomm.distributed.spec.wire_bytes`: ``compressed=False``:
        the exact ring all-reduce of every gradient (the warm-up, or plain
        DDP); ``True``: the compressed all-reduce of the communicated
        momentum elements (before the layout is known: every element; with
        ``overlap=True``, once the buckets have been sent: one call per
        bucket); None: the current phase. A registered compressor counts its
        payload (``payload_nbytes``, or one compress of each chunk length)."""
        world = dist.get_world_size(self._plain_group())
        if compressed is None:
            compressed = not self.exact_now
        if not compressed:
            return spec.wire_bytes(spec.EXACT_METHOD, sum(p.numel() for _, p in self._params()), world)
        if self._layout is not None:
            numel = sum(e.count for e in self._layout)
        else:
            numel = sum(p.numel() for _, p in self._params())
        # "auto" picks per size: counted as the exact all-reduce it falls back to.
        method = spec.EXACT_METHOD if self.compressor == spec.AUTO_METHOD else self.compressor
        kw = self._session.wire_settings(self._device())
        if self._overlap and self._ddp.buckets:
            # One call per bucket (as sent in the last step), and one for the rest.
            sizes = [b[2].numel() for b in self._ddp.buckets.values()]
            sizes.append(numel - sum(sizes))
            return sum(spec.wire_bytes(method, n, world, **kw) for n in sizes)
        return spec.wire_bytes(method, numel, world, **kw)

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state plus a ``"pycomm"`` entry: step count,
        settings, and THIS rank's error-feedback residuals (each rank saves
        and loads its own)."""
        sd = super().state_dict()
        sd["pycomm"] = {
            "version": _STATE_VERSION,
            "step_count": self.step_count,
            "warmup_steps": self.warmup_steps,
            "overlap": self._overlap,
            "buckets": self._tracker.state(),
            "engine": self._session.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any], reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict`. A state saved by another rank or world
        size, or for another compressor, is refused (its residuals belong to
        that rank) unless ``reset_error_feedback=True``, which keeps
        everything but the residuals (they start from zero). A plain torch
        AdamW / SGD state loads too (no residuals; the step count is taken
        from the parameters' ``step``). The saved ``warmup_steps`` replaces
        the constructor's, with a warning when they differ."""
        if not isinstance(reset_error_feedback, bool):
            raise TypeError(f"reset_error_feedback must be a bool, got {reset_error_feedback!r}")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        sd = dict(state_dict)
        extra = sd.pop("pycomm", None)
        # Everything is checked before anything changes: a refused state
        # leaves the optimizer and the engine's residuals as they were.
        loaded = LoadedState(None, None if reset_error_feedback else {})  # torch's own state: no residuals
        if extra is not None:
            extra = self._checked_extra(extra)
            loaded = self._session.check_state(extra["engine"], "state_dict['pycomm']['engine']",
                                               reset_error_feedback)
            if loaded.residuals and self._engine is not None and extra["overlap"] != self._overlap:
                raise ValueError(
                    f"cannot load this {type(self).__name__} state: its residuals were keyed with attach(model, "
                    f"overlap={extra['overlap']}), this optimizer runs overlap={self._overlap}. Attach the same "
                    f"way, or pass reset_error_feedback=True to keep the rest and start the residuals over.")
        self._session.load_state_then(loaded, lambda: Optimizer.load_state_dict(self, sd))
        self._after_load()
        if extra is not None:
            self.step_count = extra["step_count"]
            if extra["warmup_steps"] != self.warmup_steps:
                # The saved warm-up decides (a resumed run freezes its
                # statistics at the same step); said, not silent.
                warnings.warn(f"{type(self).__name__}.load_state_dict: the loaded state runs warmup_steps="
                              f"{extra['warmup_steps']} (was {self.warmup_steps})", UserWarning, stacklevel=2)
                self.warmup_steps = extra["warmup_steps"]
        else:
            steps = [int(s["step"]) for s in self.state.values() if "step" in s]
            self.step_count = max(steps, default=0)
        self._layout = None
        self._frozen = {}
        self._flat = None
        self._agreed = False
        self._saved_overlap = extra["overlap"] if loaded.residuals and self._engine is None else None
        if self._ddp is not None:
            self._ddp.forget()
        self._tracker.layouts = extra["buckets"] if extra is not None and not reset_error_feedback else {}

    def _checked_extra(self, extra: Any) -> Dict[str, Any]:
        """``state_dict['pycomm']`` checked field by field (the engine
        state apart: the session's), naming the field that is wrong."""
        where = "state_dict['pycomm']"

        def upgrade(old: Dict[str, Any]) -> Dict[str, Any]:
            new = {k: v for k, v in nest_legacy(old, old.get("compressor")).items() if k != "compressor"}
            try:  # buckets were their parameters' positions; a bucket holds their elements
                numels = [p.numel() for _, p in self._params()]
                new["buckets"] = {i: (sum(numels[x] for x in pos), pos) for i, pos in (new["buckets"] or {}).items()}
            except (AttributeError, IndexError, KeyError, TypeError):
                raise ValueError(f"{where}['buckets'] must map bucket indices to parameter positions") from None
            return new

        extra = check_version(where, type(self).__name__, extra, _STATE_VERSION, _STATE_FIELDS, upgrade=upgrade)
        check_int(f"{where}['step_count']", extra["step_count"])
        check_int(f"{where}['warmup_steps']", extra["warmup_steps"], 1)
        if not isinstance(extra["overlap"], bool):
            raise ValueError(f"{where}['overlap'] must be a bool, got {extra['overlap']!r}")
        return dict(extra, buckets=checked_layouts(extra["buckets"], f"{where}['buckets']"))

    def _after_load(self) -> None:
        """Fix-ups of torch's load (which casts every tensor to the
        parameter's dtype)."""


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has none
        return False
    return isinstance(t, DTensor)
