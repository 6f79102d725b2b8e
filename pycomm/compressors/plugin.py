"""Registered compressors run in the C++ engine.

A registered compressor is a class registered by name with
:func:`pycomm.register_compressor`. Besides pycomm's own methods (the rows
of ``pycomm.distributed.spec.METHOD_TABLE``), the engine runs any registered
class that follows this contract, in pure Python (torch ops only) or calling
its own kernels:

- ``__init__(**options)``: the settings (``compressor_options`` of a group;
  JSON-serializable values);
- ``compress(grad, residual) -> list of tensors``: the payload of ``grad``
  (a 1-D float32 tensor); its tensors' shapes and dtypes depend only on
  ``grad.numel()`` (every rank must be able to split every other rank's
  bytes like its own; the engine compares them across ranks per chunk and
  raises on every rank when they differ). With error feedback ``residual`` is a float32 tensor
  of the same size, to be used and updated in place (``c = grad + residual;
  residual <- c - decompress(payload)``); without, it is None;
- ``decompress(payload, out, accumulate)``: writes (``accumulate=False``) or
  adds (``True``) the decoded payload into the float32 tensor ``out``.

The engine gathers every rank's payload of each chunk, and every rank
decodes them in rank order into the result (docs/allreduce.md, "Registered
compressors"); the simulation does the same, so it is the oracle here too.
It reaches the class through two torch.library ops, ``pycomm::plugin_compress``
and ``pycomm::plugin_decompress``, registered below, which look the
compressor up by name.

Example (a user's own file; nothing in pycomm changes)::

    import torch, pycomm

    class Int8AbsMax:
        def __init__(self):
            pass

        def compress(self, grad, residual):
            c = grad if residual is None else grad + residual
            scale = c.abs().max().clamp(min=1e-30) / 127
            q = torch.round(c / scale).to(torch.int8)
            if residual is not None:
                residual.copy_(c - q.float() * scale)
            return [q, scale.reshape(1)]

        def decompress(self, payload, out, accumulate):
            q, scale = payload
            if accumulate:
                out.add_(q.float() * scale)
            else:
                out.copy_(q.float() * scale)

    pycomm.register_compressor("int8-absmax", Int8AbsMax)
    pd.init_process_group(compressor="int8-absmax", backend="gloo", ...)
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Dict, List, Optional

import torch

from .base import compressor_class


def payload_nbytes(name: str, options: Optional[Dict[str, Any]] = None) -> Callable[[int], int]:
    """Bytes of registered compressor ``name``'s payload per chunk length
    (what ``spec.wire_bytes`` needs for it): its ``payload_nbytes(m)`` when
    the class has one, else one compress of ``m`` zeros measured.

    >>> import pycomm
    >>> class Halves:
    ...     def compress(self, grad, residual):
    ...         return [grad.half()]
    ...     def decompress(self, payload, out, accumulate):
    ...         out.copy_(payload[0])
    >>> _ = pycomm.register_compressor("halves-bytes-doc", Halves)
    >>> payload_nbytes("halves-bytes-doc")(1000)
    2000
    """
    comp = _instance(name, options_json(name, options))
    if hasattr(comp, "payload_nbytes"):
        return lambda m: int(comp.payload_nbytes(m))

    def measured(m: int) -> int:
        payload = comp.compress(torch.zeros(m), None)
        tensors = payload if isinstance(payload, (list, tuple)) else [payload]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    return measured


def options_json(name: str, options: Optional[Dict[str, Any]]) -> str:
    """The options of compressor ``name`` as the engine passes them (JSON,
    keys sorted, so equal settings give equal text on every rank), checked
    by building the compressor once here."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise TypeError(f"compressor_options must be a dict or None, got {type(options).__name__}")
    try:
        text = json.dumps(options, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"compressor_options must be JSON-serializable: {exc}") from None
    _instance(name, text)
    return text


@functools.lru_cache(maxsize=64)
def _instance(name: str, options: str) -> Any:
    cls = compressor_class(name)
    try:
        obj = cls(**json.loads(options))
    except TypeError as exc:
        raise TypeError(f"compressor {name!r} does not take the options {options}: {exc}") from None
    for method in ("compress", "decompress"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"compressor {name!r} has no {method}() method; see pycomm.compressors.plugin")
    return obj


@torch.library.custom_op("pycomm::plugin_compress", mutates_args=("residual",))
def plugin_compress(name: str, options: str, grad: torch.Tensor, residual: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """The payload of ``grad`` by the registered compressor ``name``."""
    payload = _instance(name, options).compress(grad, residual)
    if isinstance(payload, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in payload):
        raise TypeError(f"compressor {name!r}: compress() must return a list of tensors")
    # Fresh tensors: an op's outputs may not alias its inputs.
    return [p.clone() if p.data_ptr() in (grad.data_ptr(), getattr(residual, "data_ptr", int)()) else p
            for p in payload]


@torch.library.custom_op("pycomm::plugin_decompress", mutates_args=("out",))
def plugin_decompress(name: str, options: str, payload: List[torch.Tensor], out: torch.Tensor,
                      accumulate: bool) -> None:
    """Decode ``payload`` into ``out`` (added when ``accumulate``)."""
    _instance(name, options).decompress(payload, out, accumulate)
