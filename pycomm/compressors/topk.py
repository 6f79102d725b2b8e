"""topk: keep the k largest-magnitude entries of ``c = grad + residual``.

``k = max(1, ceil(density * n))``. Exact mode returns exactly k entries (ties
broken by the lowest index). Approximate mode estimates the threshold from a
deterministic strided sample (Deep Gradient Compression), counts once over
the full tensor, corrects the sample rank once if the count is off, and falls
back to the exact threshold if it is still off: it always returns between k
and floor(1.25 k) entries, and since every entry at or above the threshold is
kept, the exact top-k is always among them (recall 1 up to ties).

Selection runs on integer keys: the float's bits with the sign cleared, every
NaN mapped to one key above +Inf (see ``kernels/include/pycomm/compress_math.h``),
so a NaN or Inf gradient is always sent, never hidden. The payload holds int32
indices sorted ascending and float32 values; the residual keeps everything
that was not sent and is zero where an entry was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import _ext
from .base import Compressor, check_density, family_impls, register

from ..wire import (  # noqa: F401  (the rules, re-exported for the reference's readers)
    INF_KEY,
    NAN_KEY,
    SAMPLE_HITS,
    SAMPLE_MIN,
    accept,
    retry_rank,
    sample_rank,
    sample_stride,
    topk_capacity,
    topk_k,
)


@dataclass
class TopKPayload:
    """Selected entries of one compressed tensor (indices sorted ascending)."""

    indices: torch.Tensor  # int32 [count]
    values: torch.Tensor  # float32 [count]
    numel: int
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * 4 + self.values.numel() * 4


def keys_reference(c: torch.Tensor) -> torch.Tensor:
    """Magnitude keys as int64: sign bit cleared, every NaN -> NAN_KEY."""
    key = (c.view(torch.int32).to(torch.int64)) & 0x7FFFFFFF
    return torch.where(key > INF_KEY, torch.full_like(key, NAN_KEY), key)


def _kth_largest(keys: torch.Tensor, rank: int) -> int:
    return int(torch.topk(keys, rank, sorted=True).values[-1])


def _select(keys: torch.Tensor, threshold: int, eq_budget: Optional[int]) -> torch.Tensor:
    """Indices (ascending) with key > threshold, plus the first eq_budget
    (all, if None) with key == threshold."""
    above = keys > threshold
    equal = keys == threshold
    if eq_budget is not None:
        eq_idx = torch.nonzero(equal).flatten()[:eq_budget]
        equal = torch.zeros_like(equal)
        equal[eq_idx] = True
    return torch.nonzero(above | equal).flatten()


def select_reference(c: torch.Tensor, k: int, approx: bool) -> torch.Tensor:
    """Indices (int64, ascending) that the topk compressor sends for ``c``."""
    n = c.numel()
    keys = keys_reference(c)
    if approx:
        stride = sample_stride(n, k)
        s = n // stride
        sample = keys[stride // 2 :: stride][:s]
        rank = sample_rank(n, k, s)
        for attempt in range(2):
            threshold = _kth_largest(sample, rank)
            count = int((keys >= threshold).sum())
            if accept(count, k):
                return _select(keys, threshold, None)
            if attempt == 0:
                new_rank = retry_rank(rank, k, count, s)
                if new_rank == rank:
                    break
                rank = new_rank
    threshold = _kth_largest(keys, k)
    n_above = int((keys > threshold).sum())
    return _select(keys, threshold, k - n_above)


def compress_reference(
    grad: torch.Tensor, residual: Optional[torch.Tensor], k: int, approx: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch topk compress of a flat contiguous tensor; updates residual."""
    c = grad.float() + residual if residual is not None else grad.float()
    idx = select_reference(c, k, approx)
    values = c[idx]
    if residual is not None:
        c[idx] = 0.0
        residual.copy_(c)
    return idx.to(torch.int32), values


def decompress_reference(
    indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    idx = indices.long()
    if accumulate:
        out.index_add_(0, idx, values)
    else:
        out.zero_()
        out[idx] = values


# ------------------------------------------------------- other impls -------
# The C++ ops pycomm::topk_compress / topk_decompress and their Triton twins
# (pycomm/triton/topk.py).
IMPLS = family_impls("topk", compress_reference, decompress_reference)


@register("topk")
class TopKCompressor(Compressor):
    """Top-k sparsification with fused error feedback.

    Example::

        >>> import torch, pycomm
        >>> c = pycomm.get_compressor("topk", density=0.01, approx=False)
        >>> g = torch.randn(10_000)
        >>> r = torch.zeros(10_000)
        >>> p = c.compress(g, r)
        >>> p.indices.numel()               # exactly ceil(0.01 * 10000)
        100
        >>> torch.equal(c.decompress(p) + r, g)
        True
    """

    impls = IMPLS

    def __init__(self, density: float = 0.01, approx: bool = True, impl: str = "auto") -> None:
        self.density = check_density(density)
        if not isinstance(approx, bool):
            raise TypeError(f"approx must be a bool, got {approx!r}")
        super().__init__(impl)
        self.approx = approx

    def __repr__(self) -> str:
        return f"TopKCompressor(density={self.density}, approx={self.approx}, impl={self.impl!r})"

    def k(self, numel: int) -> int:
        """Number of entries exact mode sends for a ``numel``-element tensor."""
        return topk_k(numel, self.density)

    def payload_nbytes(self, numel: int) -> int:
        """Bytes on the wire: exactly 8 k in exact mode; in approximate mode the
        fixed capacity, 8 floor(1.25 k), that a collective reserves."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"numel must be a positive integer, got {numel!r}")
        k = self.k(numel)
        return 8 * (topk_capacity(k) if self.approx else k)

    def compress(self, grad: torch.Tensor, residual: Optional[torch.Tensor] = None) -> TopKPayload:
        """Select from ``grad + residual``; ``residual`` (if given) keeps the rest."""
        impl, flat, res = self._flat_inputs(grad, residual)
        idx, vals = impl.compress(flat, res, self.k(flat.numel()), self.approx)
        return TopKPayload(idx, vals, grad.numel(), tuple(grad.shape))

    def decompress(
        self, payload: TopKPayload, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        """Scatter to a dense float32 tensor (``payload.shape``); with ``out``,
        write in place (zeros elsewhere) or, with ``accumulate``, add."""
        self._check_payload_type(payload, TopKPayload)
        _check_payload(payload)
        return self._decode(payload, payload.values.device, out, accumulate, payload.indices, payload.values)


def _check_payload(p: TopKPayload) -> None:
    """Every impl decodes only what a compressor could have made: int32
    indices, strictly ascending in [0, numel), one float32 value each (a
    forged or corrupt payload is refused, never wrapped or added twice)."""
    idx, vals = p.indices, p.values
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32 or idx.dim() != 1:
        raise ValueError("payload.indices must be a 1-D int32 tensor")
    if not isinstance(vals, torch.Tensor) or vals.dtype != torch.float32 or vals.dim() != 1:
        raise ValueError("payload.values must be a 1-D float32 tensor")
    if idx.numel() != vals.numel() or idx.device != vals.device:
        raise ValueError(f"payload has {idx.numel()} indices on {idx.device} but {vals.numel()} values "
                         f"on {vals.device}")
    if idx.numel() > p.numel:
        raise ValueError(f"payload has {idx.numel()} entries for {p.numel} elements")
    if idx.numel() and not (bool(idx[0] >= 0) and bool(idx[-1] < p.numel) and bool((idx[1:] > idx[:-1]).all())):
        raise ValueError(f"payload.indices must be strictly ascending and lie in [0, {p.numel})")


# Shapes of the op outputs without running the kernel (torch.compile, meta
# tensors, opcheck). The count is data-dependent: between k and the capacity.
if _ext.has_ops():

    @torch.library.register_fake("pycomm::topk_compress")
    def _topk_compress_fake(grad, residual, k, approx):
        hi = topk_capacity(k) if approx else k
        count = torch.library.get_ctx().new_dynamic_size(min=k, max=hi) if approx else k
        return grad.new_empty((count,), dtype=torch.int32), grad.new_empty((count,), dtype=torch.float32)

    @torch.library.register_fake("pycomm::topk_decompress")
    def _topk_decompress_fake(out, indices, values, accumulate):
        return None
