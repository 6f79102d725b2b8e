"""Argument checks and small helpers the compressed-momentum optimizers share."""

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .. import distributed as pd

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


def _check_scaler(scaler: Any) -> Any:
    """``scaler``: a ``torch.amp.GradScaler`` or None."""
    if scaler is not None:
        from torch.amp import GradScaler

        if not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    return scaler


def _check_compressor(compressor: Any, settings: Dict[str, Any]) -> None:
    """The engine's own checks, before anything runs: a bad value raises
    here, naming the argument."""
    if not isinstance(compressor, str):
        raise TypeError(f"compressor must be a str, got {compressor!r}")
    allowed = [f.name for f in dataclasses.fields(pd.PycommOptions) if f.name != "compressor"]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"unknown compressor settings {unknown}; allowed: {allowed}")
    pd.check_options(compressor=compressor, **settings)  # "compressor must be one of ..."


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: one read (a sum is finite only if
    every term is), the exact check only when the sum itself is not."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _unscale_(grads: Iterable[torch.Tensor], grad_scale: torch.Tensor) -> List[torch.Tensor]:
    """What ``GradScaler.unscale_`` does to ``grads`` (in place, grouped by
    device and dtype as torch groups them, the inverse scale computed in
    float64); returns each group's found-inf flag (a float32 scalar on the
    group's device, nonzero where a value was not finite): reading them is
    the caller's choice (a host sync on a GPU)."""
    inv = grad_scale.double().reciprocal().float()
    by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (device, _), group in by_key.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv.to(device))
        flags.append(found)
    return flags
