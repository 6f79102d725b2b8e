"""What every compressor shares: argument checks, impl selection, the registry.

Each family of pycomm's compressing methods (the ``family`` column of
``pycomm.distributed.spec.METHOD_TABLE``) has one module in this package. It
defines a :class:`Compressor` subclass, registered under each of the
family's method names, and a table of implementations (``Impl`` objects,
:func:`family_impls`) keyed by name: ``reference`` (pure torch, the test
oracle), ``cpu`` (C++ ops), ``cuda`` (CUDA ops) and ``triton``.

What pycomm knows about a method (its kind, bits, default block size,
whether it rounds or keeps residuals) is its row of
``pycomm.distributed.spec.METHOD_TABLE``, mirrored by the engine in
csrc/distributed/spec.h; every list of methods derives from that table. So
adding a method means its kernels, a module here, and a row in both tables.
A registered compressor (:func:`register_compressor`) needs none of these:
it is a user's class, run by name through :mod:`pycomm.compressors.plugin`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _ext

_REGISTRY: Dict[str, type] = {}

#: Order in which impl="auto" tries implementations, per device type.
AUTO_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("cuda", "triton", "reference")}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a compressor available to :func:`get_compressor`."""

    def deco(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"compressor {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def register_compressor(name: str, cls: type) -> type:
    """Make ``cls`` the registered compressor called ``name``: :func:`pycomm.get_compressor`
    builds it, and process groups, the DDP hook and the simulation run it
    (``compressor=name``; its contract: :mod:`pycomm.compressors.plugin`).

    Example::

        >>> import pycomm, torch
        >>> class Halves:
        ...     def compress(self, grad, residual):
        ...         return [grad.half()]
        ...     def decompress(self, payload, out, accumulate):
        ...         out.add_(payload[0].float()) if accumulate else out.copy_(payload[0])
        >>> _ = pycomm.register_compressor("halves-doc", Halves)
        >>> "halves-doc" in pycomm.compressor_names()
        True
    """
    if not isinstance(name, str) or not name or not isinstance(cls, type):
        raise TypeError(f"register_compressor(name, cls) needs a non-empty str and a class, got {name!r}, {cls!r}")
    return register(name)(cls)


def compressor_names() -> List[str]:
    """Names in the registry, sorted: the compressors of pycomm's methods and
    the registered compressors alike.

    >>> "int8" in compressor_names()
    True
    """
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown compressor {name!r}; available: {', '.join(compressor_names())}"
        ) from None


@dataclass(frozen=True)
class Impl:
    """One implementation of a compressor family.

    ``why_unavailable()`` returns None when the impl can run on this machine,
    else the reason (shown to a user who asked for it by name).
    ``devices`` lists the tensor device types it accepts.
    """

    name: str
    compress: Callable
    decompress: Callable
    why_unavailable: Callable[[], Optional[str]]
    devices: Sequence[str]


def family_impls(
    family: str,
    compress_reference: Callable,
    decompress_reference: Callable,
    why_no_cpu_ops: Callable[[], Optional[str]] = _ext.why_no_cpu_ops,
    why_no_cuda_ops: Callable[[], Optional[str]] = _ext.why_no_cuda_ops,
) -> Dict[str, Impl]:
    """The ``impls`` of the kernel family ``family``: ``reference``, the
    pure-torch functions given (any device); ``cpu`` and ``cuda``, the C++
    ops ``torch.ops.pycomm.<family>_compress`` / ``<family>_decompress``
    (available where ``why_no_cpu_ops`` / ``why_no_cuda_ops`` say so);
    ``triton``, the same ops with the suffix ``_triton``.

    Every impl is called as the reference is: ``compress(grad, residual,
    *settings)`` and ``decompress(*payload, *settings, out, accumulate)``;
    the ops take ``out`` first (the order of the C++ schemas).
    """

    def ops(suffix: str, load: Callable[[], object]) -> Tuple[Callable, Callable]:
        compress_name, decompress_name = f"{family}_compress{suffix}", f"{family}_decompress{suffix}"

        def compress(grad, residual, *settings):
            load()
            return getattr(torch.ops.pycomm, compress_name)(grad, residual, *settings)

        def decompress(*args):
            load()
            *payload_and_settings, out, accumulate = args
            getattr(torch.ops.pycomm, decompress_name)(out, *payload_and_settings, accumulate)

        return compress, decompress

    def load_triton() -> object:
        # The Triton kernels register their ops when pycomm/triton/<family>.py
        # is imported: here, and only when used, as pycomm imports without Triton.
        return importlib.import_module(f"..triton.{family}", __package__)

    cxx = ops("", lambda: None)
    return {
        "reference": Impl("reference", compress_reference, decompress_reference, lambda: None, ("cpu", "cuda")),
        "cpu": Impl("cpu", *cxx, why_no_cpu_ops, ("cpu",)),
        "cuda": Impl("cuda", *cxx, why_no_cuda_ops, ("cuda",)),
        "triton": Impl("triton", *ops("_triton", load_triton), _ext.why_no_triton, _ext.triton_devices()),
    }


class Compressor:
    """Base class: checks inputs, resolves the implementation, flattens.

    Subclasses set ``impls`` (name -> :class:`Impl`) and implement
    ``_compress_flat`` / ``_decompress_flat`` / ``payload_nbytes``.
    """

    name = "?"
    impls: Dict[str, Impl] = {}

    def __init__(self, impl: str = "auto") -> None:
        if not isinstance(impl, str):
            raise TypeError(f"impl must be a string, got {type(impl).__name__}")
        if impl != "auto":
            if impl not in self.impls:
                raise ValueError(
                    f"impl={impl!r} is not an implementation of {self.name!r}; "
                    f"choose one of {['auto', *self.impls]}"
                )
            why = self.impls[impl].why_unavailable()
            if why is not None:
                raise RuntimeError(f"{self.name} impl={impl!r} cannot run here: {why}")
        self.impl = impl

    # -- implementation choice -------------------------------------------------
    def resolve_impl(self, device: torch.device) -> Impl:
        """The implementation that will run for tensors on ``device``."""
        dev = torch.device(device).type
        if self.impl == "auto":
            for name in AUTO_ORDER.get(dev, ("reference",)):
                cand = self.impls.get(name)
                if cand is not None and dev in cand.devices and cand.why_unavailable() is None:
                    return cand
            raise RuntimeError(f"no {self.name} implementation runs on device {dev!r}")
        chosen = self.impls[self.impl]
        if dev not in chosen.devices:
            raise RuntimeError(
                f"{self.name} impl={self.impl!r} runs on {list(chosen.devices)} tensors, "
                f"got a tensor on {dev!r}"
            )
        return chosen

    # -- what compress and decompress share --------------------------------------
    def _flat_inputs(
        self, grad: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> Tuple[Impl, torch.Tensor, Optional[torch.Tensor]]:
        """Checks ``grad`` and ``residual``; returns the impl for ``grad``'s
        device, ``grad`` flat and contiguous (the kernels' layout; a copy only
        where it must be) and ``residual`` flat (a view: the impls update it
        in place)."""
        self._check_inputs(grad, residual)
        impl = self.resolve_impl(grad.device)
        flat = grad.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        res = residual.view(-1) if residual is not None else None
        return impl, flat, res

    def _check_payload_type(self, payload: Any, payload_type: type, *settings: str) -> None:
        """``payload`` must be a ``payload_type`` made with this compressor's
        ``settings`` (attribute names, e.g. ``block_size``): a payload of
        other settings would be decoded wrongly."""
        if not isinstance(payload, payload_type):
            raise TypeError(f"payload must be a {payload_type.__name__}, got {type(payload).__name__}")
        for name in settings:
            theirs, ours = getattr(payload, name), getattr(self, name)
            if theirs != ours:
                raise ValueError(f"payload has {name}={theirs}, this compressor {ours}")

    def _decode(
        self, payload: Any, device: torch.device, out: Optional[torch.Tensor], accumulate: bool, *args: Any
    ) -> torch.Tensor:
        """Decode ``payload`` (its tensors on ``device``): the impl's
        ``decompress(*args, out, accumulate)`` on ``out`` flattened. Without
        ``out``, into a new float32 tensor of ``payload.shape`` (written,
        nothing to add to); with it, ``out`` is checked against the payload."""
        if out is None:
            out = torch.empty(payload.shape, dtype=torch.float32, device=device)
            accumulate = False
        else:
            self._check_out(out, payload.numel, device)
        impl = self.resolve_impl(device)
        impl.decompress(*args, out.view(-1), accumulate)
        return out

    # -- checks ----------------------------------------------------------------
    @staticmethod
    def _check_inputs(grad: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
        if grad.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"grad must be float32, float16 or bfloat16, got {grad.dtype}"
            )
        if grad.numel() == 0:
            raise ValueError("grad is empty: there is nothing to compress")
        if residual is None:
            return
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.dtype != torch.float32:
            raise TypeError(f"residual must be float32, got {residual.dtype}")
        if residual.numel() != grad.numel():
            raise ValueError(
                f"residual has {residual.numel()} elements but grad has {grad.numel()}"
            )
        if residual.device != grad.device:
            raise ValueError(
                f"residual is on {residual.device} but grad is on {grad.device}"
            )
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous: it is updated in place")

    @staticmethod
    def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.float32:
            raise TypeError(f"out must be float32, got {out.dtype}")
        if out.numel() != numel:
            raise ValueError(f"out has {out.numel()} elements but the payload has {numel}")
        if out.device != device:
            raise ValueError(f"out is on {out.device} but the payload is on {device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous: it is written in place")


#: Largest value a C++ int64 argument can hold.
INT64_MAX = 2**63 - 1


def check_positive_int(name: str, value: object, maximum: Optional[int] = None) -> int:
    """``value`` if it is an int in [1, maximum], else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value!r}")
    return value


def check_density(density: object) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number in (0, 1], got {density!r}")
    d = float(density)
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return d
