"""OneBitSGD: momentum SGD whose momentum is all-reduced compressed."""

from typing import Any, Dict, Iterable, Optional

import torch
import torch.distributed as dist

from ._checks import _check_float
from .base import KEY_BASE, _CompressedMomentum

__all__ = ["OneBitSGD"]


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
        scaler: Any = None,
        **compressor_settings: Any,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        self._check_group(defaults)
        super().__init__(params, defaults, warmup_steps=warmup_steps, compressor=compressor,
                         process_group=process_group, key_base=key_base, scaler=scaler,
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
