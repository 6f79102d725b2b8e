"""onebit: 1-bit sign quantization with a per-block scale, fused error feedback.

Per block of ``block_size`` elements of ``c = grad + residual``:
``scale = mean |c|``, payload = sign bits (1 = non-negative) packed 32 per
32-bit word + one float32 scale per block; decoding gives ``+scale`` or
``-scale``; the new residual is ``c - decoded`` (nothing lost, only deferred).
The format is defined once in ``kernels/include/pycomm/compress_math.h``;
the reference functions below mirror it line by line and are the oracle of
every test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import _ext
from ..wire import MAX_BLOCK_SIZE, WORD_BITS
from .base import Compressor, check_positive_int, family_impls, register


@dataclass
class OneBitPayload:
    """Packed signs and scales of one compressed tensor.

    ``bits`` is int32 (the 32-bit words; ``bits.view(torch.uint32)`` gives
    them unsigned) because every collective backend can send int32.
    """

    bits: torch.Tensor  # int32 [ceil(numel / 32)]
    scales: torch.Tensor  # float32 [ceil(numel / block_size)]
    numel: int
    shape: Tuple[int, ...]
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.bits.numel() * 4 + self.scales.numel() * 4


# --------------------------------------------------------------- reference ---
def _pack_bits_reference(bitvals: torch.Tensor) -> torch.Tensor:
    """bool [n] -> int32 words, bit i of word w = element 32w + i."""
    n = bitvals.numel()
    words = -(-n // WORD_BITS)
    padded = torch.zeros(words * WORD_BITS, dtype=torch.int64, device=bitvals.device)
    padded[:n] = bitvals.to(torch.int64)
    shifts = torch.arange(WORD_BITS, dtype=torch.int64, device=bitvals.device)
    packed = (padded.view(words, WORD_BITS) << shifts).sum(dim=1)
    # Reinterpret as signed 32-bit: values >= 2^31 wrap, as the C++ uint32 does.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def _unpack_bits_reference(bits: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(WORD_BITS, dtype=torch.int64, device=bits.device)
    unpacked = (bits.to(torch.int64).unsqueeze(1) >> shifts) & 1
    return unpacked.reshape(-1)[:numel].bool()


def _block_scales_reference(c: torch.Tensor, block_size: int) -> torch.Tensor:
    n = c.numel()
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=c.device)
    padded[:n] = c.abs()
    sums = padded.view(blocks, block_size).sum(dim=1)
    lengths = torch.full((blocks,), float(block_size), device=c.device)
    lengths[-1] = n - (blocks - 1) * block_size  # a partial block uses its own length
    return sums / lengths


def compress_reference(
    grad: torch.Tensor, residual: Optional[torch.Tensor], block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch onebit compress of a flat contiguous tensor; updates residual."""
    c = grad.float() + residual if residual is not None else grad.float()
    scales = _block_scales_reference(c, block_size)
    positive = c >= 0  # NaN -> False, -0.0 -> True (compress_math.h)
    bits = _pack_bits_reference(positive)
    if residual is not None:
        per_elem = scales.repeat_interleave(block_size)[: c.numel()]
        decoded = torch.where(positive, per_elem, -per_elem)
        residual.copy_(c - decoded)
    return bits, scales


def decompress_reference(
    bits: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool
) -> None:
    n = out.numel()
    positive = _unpack_bits_reference(bits, n)
    per_elem = scales.repeat_interleave(block_size)[:n]
    decoded = torch.where(positive, per_elem, -per_elem)
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)


# ------------------------------------------------------- other impls -------
# The C++ ops pycomm::onebit_compress / onebit_decompress and their Triton
# twins (pycomm/triton/onebit.py).
IMPLS = family_impls("onebit", compress_reference, decompress_reference)


@register("onebit")
class OneBitCompressor(Compressor):
    """1-bit sign compressor with a mean-magnitude scale per block.

    Example::

        >>> import torch, pycomm
        >>> c = pycomm.get_compressor("onebit", block_size=64)
        >>> g = torch.randn(1000)
        >>> r = torch.zeros(1000)
        >>> p = c.compress(g, r)            # r now holds what was not sent
        >>> out = c.decompress(p)
        >>> torch.allclose(out + r, g, atol=1e-6)
        True
        >>> c.payload_nbytes(1000)          # 32 words + 16 scales, 4 bytes each
        192
    """

    impls = IMPLS

    def __init__(self, block_size: int = 2048, impl: str = "auto") -> None:
        check_positive_int("block_size", block_size, MAX_BLOCK_SIZE)  # the kernels' limit
        if block_size % WORD_BITS:
            raise ValueError(
                f"block_size must be a multiple of {WORD_BITS} (a packed word may not "
                f"straddle two blocks), got {block_size}"
            )
        super().__init__(impl)
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"OneBitCompressor(block_size={self.block_size}, impl={self.impl!r})"

    def payload_nbytes(self, numel: int) -> int:
        """Exact bytes the payload of a ``numel``-element tensor puts on the wire."""
        check_positive_int("numel", numel)
        words = -(-numel // WORD_BITS)
        blocks = -(-numel // self.block_size)
        return 4 * words + 4 * blocks

    def compress(self, grad: torch.Tensor, residual: Optional[torch.Tensor] = None) -> OneBitPayload:
        """Compress ``grad + residual``; ``residual`` (if given) becomes the new error."""
        impl, flat, res = self._flat_inputs(grad, residual)
        bits, scales = impl.compress(flat, res, self.block_size)
        return OneBitPayload(bits, scales, grad.numel(), tuple(grad.shape), self.block_size)

    def decompress(
        self, payload: OneBitPayload, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        """Decode to float32 (``payload.shape``); with ``out``, write (or add) in place."""
        self._check_payload_type(payload, OneBitPayload, "block_size")
        # Every impl decodes only a payload of the right layout.
        for name, t, dtype, size in (("bits", payload.bits, torch.int32, -(-payload.numel // WORD_BITS)),
                                     ("scales", payload.scales, torch.float32, -(-payload.numel // self.block_size))):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != size:
                raise ValueError(f"payload.{name} must be a 1-D {dtype} tensor of {size} elements for "
                                 f"{payload.numel} elements")
        return self._decode(
            payload, payload.bits.device, out, accumulate, payload.bits, payload.scales, self.block_size
        )


# Shapes of the op outputs without running the kernel (torch.compile, meta
# tensors, opcheck).
if _ext.has_ops():

    @torch.library.register_fake("pycomm::onebit_compress")
    def _onebit_compress_fake(grad, residual, block_size):
        n = grad.numel()
        words = -(-n // WORD_BITS)
        blocks = -(-n // block_size)
        return grad.new_empty((words,), dtype=torch.int32), grad.new_empty((blocks,), dtype=torch.float32)

    @torch.library.register_fake("pycomm::onebit_decompress")
    def _onebit_decompress_fake(out, bits, scales, block_size, accumulate):
        return None
