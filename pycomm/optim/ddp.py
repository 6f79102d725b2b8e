"""The compressed-momentum optimizers and DDP: :meth:`attach` registers a
communication hook that averages the gradients exactly while the optimizer
needs exact averages (its warm-up, OneBitAdam's variance updates) and sends
nothing otherwise; with ``overlap=True`` the hook sends each bucket's
momenta, compressed, while backward runs, and ``step()`` applies them (as
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` couples
ZeroRedundancyOptimizer's step with DDP's buckets)."""

# No `from __future__ import annotations`: DDP compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor].
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import distributed as pd
from ..ddp.optimizer import OptimizerHookState, optimizer_hook
from ._checks import _all_finite, _check_scaler

__all__ = ["DDPAttach"]


class DDPAttach:
    """What couples a compressed-momentum optimizer with a DDP model: the
    hook's state, the overlapped bucket calls and the step that applies
    them. A base of :class:`pycomm.optim.base._CompressedMomentum`."""

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
        self._tracker.record(index, self._tracker.layout(bucket))
        entries, buf = self._bucket_entries(index)
        grads = {id(p): g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)}
        inv = None
        if self._scaler is not None and getattr(self._scaler, "_scale", None) is not None:
            inv = self._scaler._scale.double().reciprocal().float()
        buf, outs = self._pack(entries, grads, inv, buf=buf)
        key = work = None
        if buf is not None:
            key = self._key(1 + index)
            work = pd.all_reduce(buf, key=key, group=self._engine_group(), op="avg", async_op=True)
        if not self._sent:
            self._forwards_at_send = self._forwards
        self._sent[index] = (buf, outs, key, work)
        return work

    def _count_forward(self) -> None:
        if torch.is_grad_enabled():
            self._forwards += 1

    def _positions(self) -> Dict[int, int]:
        """Parameter id -> its position in the parameter groups (the same in
        every process that builds the same optimizer)."""
        return {id(p): i for i, (_, p) in enumerate(self._params())}

    def _bucket_entries(self, index: int) -> Tuple[List[Any], torch.Tensor]:
        """The layout entries of bucket ``index``'s parameters, in its
        order, and the buffer its momenta go out in (kept between steps)."""
        pos = self._tracker.layouts[index].positions
        cached = self._buckets.get(index)
        if cached is None or cached[0] != pos:
            positions = self._positions()
            by_pos = {positions[id(e.param)]: e for e in self._layout}
            entries = [by_pos[i] for i in pos if i in by_pos]
            total = sum(e.count for e in entries)
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
        if self._sent and self._forwards != self._forwards_at_send:
            # A micro-batch ran after the hook sent the momenta (under
            # model.no_sync(), which sends nothing): its gradient would be
            # in .grad but in no momentum that went out.
            self._undo_sent()
            raise ValueError(
                f"{type(self).__name__} with attach(model, overlap=True): a forward pass ran after DDP's backward "
                f"sent this step's momenta (accumulation with the backward outside model.no_sync() first?); its "
                f"gradient would be dropped. Accumulate under no_sync() with the LAST backward outside it, or "
                f"attach with overlap=False. Nothing was changed by this step."
            )
        for _, _, _, work in self._sent.values():
            if work is not None:
                work.wait()
        sent = [(self._buckets[i][1], buf, outs, key) for i, (buf, outs, key, _) in sorted(self._sent.items())]
        done = {id(e.param) for entries, *_ in sent for e in entries}
        positions = self._positions()
        missing = {positions[id(e.param)] for e in self._layout if id(e.param) not in done}
        calls = [(1 + i, self._bucket_entries(i)[0]) for i, layout in sorted(self._tracker.layouts.items())
                 if i not in self._sent and set(layout.positions) <= missing]
        covered = {id(e.param) for _, entries in calls for e in entries}
        rest = [e for e in self._layout if id(e.param) not in done and id(e.param) not in covered]
        if rest:
            calls.append((0, rest))
        carried = False
        grads = {id(p): p.grad for _, p in self._params() if p.grad is not None}
        for offset, entries in calls:
            buf, outs = self._pack(entries, grads)
            key = None
            if buf is not None:
                self._poison(buf, found_inf)  # tells every rank through the result
                key = self._key(offset)
                pd.all_reduce(buf, key=key, group=self._engine_group(), op="avg")
                carried = True
            sent.append((entries, buf, outs, key))
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
        if _check_scaler(scaler) is not None:
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
        # Before anything collective is created: the ranks must attach alike.
        self._agree({"attach(overlap=...)": overlap, "scaler": (scaler or self._scaler) is not None})
        if overlap:
            # The engine group now, on every rank alike, rather than from a
            # hook in the middle of backward.
            previous = self._scaler
            self._overlap, self._scaler = True, scaler or previous
            try:
                self._engine_group()
            except BaseException:
                self._overlap, self._scaler = False, previous
                raise
        self._tracker.detach(self._positions())  # a parameter's position: its place in this optimizer
        model.register_comm_hook(OptimizerHookState(self, ddp_group), optimizer_hook)
        # Forward passes that build a graph, to catch a micro-batch run after
        # the momenta went out (overlap=True).
        model.register_forward_pre_hook(lambda *_: self._count_forward())
        self._ddp_param_ids = frozenset(id(p) for p in ddp_params)
        self._attached = True
        self._agreed = False
        return model
