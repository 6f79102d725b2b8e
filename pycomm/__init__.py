"""pycomm: gradient compression for PyTorch distributed training.

Example::

    >>> import torch, pycomm
    >>> c = pycomm.get_compressor("onebit", block_size=2048)
    >>> grad, residual = torch.randn(10_000), torch.zeros(10_000)
    >>> payload = c.compress(grad, residual)   # error feedback kept in residual
    >>> dense = c.decompress(payload)
    >>> pycomm.available_impls("onebit")       # doctest: +SKIP
    ['reference', 'cpu']
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .compressors import (
    Compressor,
    OneBitCompressor,
    OneBitPayload,
    TopKCompressor,
    TopKPayload,
    compressor_class,
    compressor_names,
    register_compressor,
)
from .distributed import spec as _spec  # noqa: F401 - registers the method table's quant rows

__version__ = "0.1.0"


def get_compressor(name: str, **kwargs) -> Compressor:
    """Build a compressor by name.

    ``impl`` ("auto" by default) chooses the implementation: "auto" picks the
    fastest one that runs for each tensor's device; a name ("reference",
    "cpu", "cuda", "triton") is used as asked or raises if it cannot run here.

    Example::

        >>> import pycomm
        >>> pycomm.get_compressor("topk", density=0.001, approx=True)
        TopKCompressor(density=0.001, approx=True, impl='auto')
    """
    cls = compressor_class(name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        if "unexpected keyword" in str(exc):
            raise TypeError(f"compressor {name!r}: {exc}") from None
        raise


def available_impls(name: str, device: Optional[torch.device | str] = None) -> List[str]:
    """Implementations of compressor ``name`` that can run on this machine
    (on ``device`` if given), e.g. ``["reference", "cpu"]``."""
    cls = compressor_class(name)
    out = []
    for impl_name, impl in cls.impls.items():
        if impl.why_unavailable() is not None:
            continue
        if device is not None and torch.device(device).type not in impl.devices:
            continue
        out.append(impl_name)
    return out


__all__ = [
    "Compressor",
    "OneBitCompressor",
    "OneBitPayload",
    "TopKCompressor",
    "TopKPayload",
    "available_impls",
    "compressor_names",
    "get_compressor",
    "register_compressor",
]
