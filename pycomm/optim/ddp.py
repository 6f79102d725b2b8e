"""A compressed-momentum optimizer coupled with a DDP model
(:meth:`pycomm.optim.OneBitAdam.attach`): :class:`DDPCoupling` is the state
of the DDP communication hook (:func:`pycomm.ddp.optimizer.optimizer_hook`),
an object the optimizer owns (None until ``attach``). It averages the
gradients exactly while the optimizer needs exact averages (its warm-up,
OneBitAdam's variance updates) and sends nothing otherwise; with
``overlap=True`` it sends each bucket's momenta, compressed, while backward
runs, and the optimizer's ``step()`` applies them (as
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` couples
ZeroRedundancyOptimizer's step with DDP's buckets).

The coupling reaches the optimizer through a narrow interface: the layout
of the momenta (``_layout``/``_build_layout``), packing them (``_pack``)
and applying their averages (``_unpack_apply``), the engine key of an
offset (``_key``) and the groups (``_engine_group``, ``_plain_group``), the
DDP bucket layouts saved with the residuals (``_tracker``) and the exact
average (``_exact_average``, from the hook).
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import distributed as pd
from ._checks import _all_finite, _check_scaler

__all__ = ["DDPCoupling", "couple"]


class DDPCoupling:
    """One optimizer coupled with one DDP model: DDP's group, the parameters
    DDP averages, and with ``overlap=True`` this step's bucket calls."""

    def __init__(self, optimizer: Any, process_group: dist.ProcessGroup, param_ids: frozenset,
                 overlap: bool) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        #: The parameters DDP averages (their gradients arrive averaged).
        self.param_ids = param_ids
        self.overlap = overlap
        # DDP bucket index -> (its parameter positions, their layout entries, the buffer sent)
        self.buckets: Dict[int, Tuple[Tuple[int, ...], List[Any], torch.Tensor]] = {}
        # This step's calls: bucket index -> (buffer, local momenta, key, Work).
        self.sent: Dict[int, Tuple[Optional[torch.Tensor], List[Any], Optional[int], Any]] = {}
        self.hold = False  # after a refused backward, until step()
        self.forwards = self.forwards_at_send = 0  # forwards of the DDP model; the count at this step's send

    def forget(self) -> None:
        """Drop the buckets' layouts and calls (after a load)."""
        self.buckets, self.sent = {}, {}

    def count_forward(self) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1

    # -- overlap with DDP's backward ---------------------------------------------
    def send(self, bucket: dist.GradBucket, stable: bool) -> Any:
        """From the DDP hook after the warm-up, with ``overlap=True``: the
        local momenta of the bucket's parameters, averaged by the compressed
        all-reduce under the bucket's key while backward goes on. Returns the
        Work (None when nothing in the bucket is communicated now).
        ``stable``: DDP has rebuilt its buckets in this process (after its
        first backward); before that (a resumed run) the bucket is not one
        the residuals belong to, and step() sends its parameters instead."""
        opt = self.optimizer
        index = bucket.index()
        if self.hold:
            return None  # a refused backward: step() sends what it needs
        if index in self.sent:
            # Nothing of this step stays sent; the rest of this backward
            # sends nothing, and step() averages what it finds in .grad.
            self.undo_sent()
            self.hold = True
            raise RuntimeError(
                f"{type(opt).__name__} with attach(model, overlap=True) sends each DDP bucket once per step, "
                f"but bucket {index} came twice before step(): accumulate gradients under model.no_sync() "
                f"(the last backward of the step outside it), or attach with overlap=False"
            )
        if not stable:
            return None
        if opt._layout is None:
            opt._layout = opt._build_layout()
        opt._tracker.record(index, opt._tracker.layout(bucket))
        entries, buf = self._bucket_entries(index)
        grads = {id(p): g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)}
        inv = None
        scaler = opt.scaler
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            inv = scaler._scale.double().reciprocal().float()
        buf, outs = opt._pack(entries, grads, inv, buf=buf)
        key = work = None
        if buf is not None:
            key = opt._key(1 + index)
            work = pd.all_reduce(buf, key=key, group=opt._engine_group(), op="avg", async_op=True)
        if not self.sent:
            self.forwards_at_send = self.forwards
        self.sent[index] = (buf, outs, key, work)
        return work

    def positions(self) -> Dict[int, int]:
        """Parameter id -> its position in the optimizer's parameters (the
        same in every process that builds the same optimizer)."""
        return {id(p): i for i, (_, p) in enumerate(self.optimizer._params())}

    def _bucket_entries(self, index: int) -> Tuple[List[Any], torch.Tensor]:
        """The layout entries of bucket ``index``'s parameters, in its
        order, and the buffer its momenta go out in (kept between steps)."""
        opt = self.optimizer
        pos = opt._tracker.layouts[index].positions
        cached = self.buckets.get(index)
        if cached is None or cached[0] != pos:
            positions = self.positions()
            by_pos = {positions[id(e.param)]: e for e in opt._layout}
            entries = [by_pos[i] for i in pos if i in by_pos]
            total = sum(e.count for e in entries)
            buf = torch.empty(total, dtype=torch.float32, device=opt._device())
            cached = self.buckets[index] = (pos, entries, buf)
        return cached[1], cached[2]

    def undo_sent(self) -> None:
        """Forget this step's bucket calls, putting their residuals back."""
        sent, self.sent = self.sent, {}
        keys = []
        for buf, _, key, work in sent.values():
            if work is not None:
                work.wait()
                if key is not None and _all_finite(buf):
                    keys.append(key)  # a non-finite call kept its old residuals itself
        if keys:
            opt = self.optimizer
            pd.undo_error_feedback(keys, opt._engine_group(), opt._device().type)

    def step(self, found_inf: Optional[torch.Tensor]) -> bool:
        """The optimizer's compressed step with ``overlap=True``: the
        buckets' momenta came from the DDP hook. What no hook sent is sent
        here: the parameters of each known bucket that did not come (DDP's
        first backward in a resumed process), under its key, then the
        parameters no bucket holds, in one call under ``key_base``. A step
        that is not finite everywhere undoes every call's residuals, so that
        it changes nothing. False: skipped on every rank."""
        opt = self.optimizer
        self.hold = False
        if self.sent and self.forwards != self.forwards_at_send:
            # A micro-batch ran after the hook sent the momenta (under
            # model.no_sync(), which sends nothing): its gradient would be
            # in .grad but in no momentum that went out.
            self.undo_sent()
            raise ValueError(
                f"{type(opt).__name__} with attach(model, overlap=True): a forward pass ran after DDP's backward "
                f"sent this step's momenta (accumulation with the backward outside model.no_sync() first?); its "
                f"gradient would be dropped. Accumulate under no_sync() with the LAST backward outside it, or "
                f"attach with overlap=False. Nothing was changed by this step."
            )
        for _, _, _, work in self.sent.values():
            if work is not None:
                work.wait()
        sent = [(self.buckets[i][1], buf, outs, key) for i, (buf, outs, key, _) in sorted(self.sent.items())]
        done = {id(e.param) for entries, *_ in sent for e in entries}
        positions = self.positions()
        missing = {positions[id(e.param)] for e in opt._layout if id(e.param) not in done}
        calls = [(1 + i, self._bucket_entries(i)[0]) for i, layout in sorted(opt._tracker.layouts.items())
                 if i not in self.sent and set(layout.positions) <= missing]
        covered = {id(e.param) for _, entries in calls for e in entries}
        rest = [e for e in opt._layout if id(e.param) not in done and id(e.param) not in covered]
        if rest:
            calls.append((0, rest))
        carried = False
        grads = {id(p): p.grad for _, p in opt._params() if p.grad is not None}
        for offset, entries in calls:
            buf, outs = opt._pack(entries, grads)
            key = None
            if buf is not None:
                opt._poison(buf, found_inf)  # tells every rank through the result
                key = opt._key(offset)
                pd.all_reduce(buf, key=key, group=opt._engine_group(), op="avg")
                carried = True
            sent.append((entries, buf, outs, key))
        skip = False
        if not carried and found_inf is not None:
            # No call of this step carried this rank's GradScaler flag: agree on it.
            flag = found_inf.detach().reshape(1).float().clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=opt._plain_group())
            skip = bool(flag[0] > 0)
        finite = [b is None or _all_finite(b) for _, b, _, _ in sent]
        self.sent = {}
        if skip or not all(finite):
            keys = [key for (_, _, _, key), ok in zip(sent, finite, strict=True) if ok and key is not None]
            if keys:
                pd.undo_error_feedback(keys, opt._engine_group(), opt._device().type)
            return False
        for entries, buf, outs, _ in sent:
            opt._unpack_apply(entries, buf, outs)
        return True


def couple(optimizer: Any, model: Any, overlap: bool, scaler: Any) -> DDPCoupling:
    """Check that ``optimizer`` can be coupled with the DDP ``model`` (see
    :meth:`pycomm.optim.OneBitAdam.attach`, which calls it) and return the
    coupling; registers nothing."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    name = type(optimizer).__name__
    if not isinstance(model, DDP):
        raise TypeError(f"attach() takes a torch.nn.parallel.DistributedDataParallel model, "
                        f"got {type(model).__name__}")
    if optimizer._ddp is not None:
        raise ValueError(f"this {name} is already attached to a DDP model")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if _check_scaler(scaler) is not None and not overlap:
        raise ValueError("scaler= is for overlap=True (without overlap, step() unscales the gradients "
                         "GradScaler.step hands it)")
    if overlap and optimizer.warmup_steps < 2:
        raise ValueError(f"overlap=True needs warmup_steps >= 2 (DDP rebuilds its buckets after the first "
                         f"step), got {optimizer.warmup_steps}")
    ddp_params = getattr(model, "_module_parameters", None)
    if ddp_params is None:
        ignore = getattr(model, "parameters_to_ignore", set())
        ddp_params = [p for n, p in model.module.named_parameters() if n not in ignore]
    ddp_params = [p for p in ddp_params if p.requires_grad]
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.module.named_parameters()}
    missing = [names.get(id(p), "?") for p in ddp_params if id(p) not in mine]
    if missing:
        raise ValueError(
            f"DDP reduces parameters that are not in this {name}: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; after the warm-up DDP no longer averages "
            f"gradients, so every parameter of the model must be updated by this optimizer"
        )
    ranks = dist.get_process_group_ranks(optimizer._plain_group())
    ddp_ranks = dist.get_process_group_ranks(model.process_group)
    if ddp_ranks != ranks:
        raise ValueError(f"the DDP model reduces over ranks {ddp_ranks}, this optimizer over {ranks}: "
                         f"pass process_group=model.process_group")
    return DDPCoupling(optimizer, model.process_group, frozenset(id(p) for p in ddp_params), overlap)
