"""OneBitAdam: AdamW whose momentum is all-reduced compressed (1-bit Adam)."""

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from ._checks import _check_betas, _check_float, _check_int, _scalar_dtype
from .base import KEY_BASE, _CompressedMomentum

__all__ = ["OneBitAdam"]


class OneBitAdam(_CompressedMomentum):
    """AdamW whose momentum is all-reduced compressed after a warm-up (1-bit
    Adam), with the variance refreshed by an exact step every 20, over any
    process group.

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
            training goes on (default 20: the setting that kept plain
            AdamW's held-out loss in the quality study, docs/optim.md); 0:
            frozen for good, as DeepSpeed's 1-bit Adam (the fewest bytes).
            Bytes per step after the warm-up are on average
            ``((K - 1) * compressed + exact) / K``.
        compressor: the engine's method for the momentum: "onebit" (default),
            "topk", "fp16", "bf16", "none", any method the engine adds (e.g.
            "int8", "int4") or a compressor registered with
            ``pycomm.register_compressor``.
        process_group: the data-parallel group (None: the default group);
            Gloo, NCCL or pycomm.
        key_base: the engine key of the residuals (:data:`KEY_BASE`).
        scaler: the ``torch.amp.GradScaler`` that steps this optimizer, if
            any (required then): a step skipped on every rank because one
            rank's gradient was not finite is recorded in it, so that
            ``scaler.update()`` backs off on every rank.
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
        scaler = torch.amp.GradScaler()       # optional: then OneBitAdam(..., scaler=scaler)
        opt.scaler = scaler
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
        scaler: Any = None,
        variance_update_every: int = 20,
        **compressor_settings: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._check_group(defaults)
        #: After the warm-up, every this many steps one step averages the
        #: gradients exactly and updates the variance (0: frozen for good).
        self.variance_update_every = _check_int("variance_update_every", variance_update_every, 0)
        super().__init__(params, defaults, warmup_steps=warmup_steps, compressor=compressor,
                         process_group=process_group, key_base=key_base, scaler=scaler,
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
