"""Block quantization to ``bits``-bit levels (the method table's rows of the
"quant" family, e.g. int8) with fused error feedback.

Per block of ``block_size`` elements of ``c = grad + residual`` (the last
block partial):

* ``amax = max |c|`` (NaN if any element is NaN);
* ``scale = amax / qmax`` with ``qmax = 2**(bits-1) - 1`` (127, 7, 1), sent as
  float32;
* ``inv = qmax / amax`` if ``amax > 0`` and that quotient is finite, else 0
  (NaN or Inf blocks, and blocks so tiny that the quotient overflows: they
  send zeros and keep everything in the residual);
* ``q = 0`` if ``inv == 0``, else ``clamp(round(c * inv), -qmax, qmax)``, where
  ``round`` is round-half-to-even, or, with a seed (stochastic rounding),
  ``floor(c * inv + u)`` with ``u = quant_uniform(seed, i)`` in [0, 1) and
  ``i`` the element's index in the tensor;
* decoded ``= q * scale``, new residual ``= c - decoded``.

At 2 bits the levels are TernGrad's -1/0/+1 times the block's absmax.
A block holding NaN or Inf sends ``q = 0`` with a non-finite scale, so it
decodes to NaN (never to a silently finite value). Every step is one float32
operation, rounded once: the impls agree bit for bit.

Wire: ``data`` (uint8) holds ``per = 8 / bits`` levels a byte, two's
complement in ``bits`` bits, element ``i`` at bit ``(i % per) * bits`` of byte
``i // per`` (missing last levels are 0); ``scales`` holds one float32 per
block. ``block_size`` must be a multiple of ``per`` so that no byte straddles
two blocks. The width is data: every function here takes ``bits``, and a
row of the method table with a new width needs nothing else.

The rules are defined once in ``kernels/include/pycomm/compress_math.h``
(section "quant") and ``pycomm/wire.py``; the reference functions below
mirror them line by line and are the oracle of every test.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import _ext
from ..wire import MASK32, MAX_BLOCK_SIZE, QUANT_BITS, quant_hash, quant_num_bytes, quant_per_byte, quant_qmax
from .base import Compressor, check_positive_int, family_impls

#: Largest finite float32 (FLT_MAX): quant_inv's bound for a finite amax.
FLOAT32_MAX = 3.4028234663852886e38
_TWO_POW_M24 = 5.9604644775390625e-08  # 2^-24: 24 random bits -> [0, 1)
_ROUNDINGS = ("nearest", "stochastic")


@dataclass
class QuantPayload:
    """Quantized levels and per-block scales of one compressed tensor."""

    data: torch.Tensor  # uint8 [quant_num_bytes(numel, bits)]
    scales: torch.Tensor  # float32 [ceil(numel / block_size)]
    numel: int
    shape: Tuple[int, ...]
    block_size: int
    bits: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 4


def check_block_size(bits: int, block_size: object) -> int:
    """block_size: a positive int up to MAX_BLOCK_SIZE, a multiple of the
    levels a byte holds."""
    check_positive_int("block_size", block_size, MAX_BLOCK_SIZE)
    per = quant_per_byte(bits)
    if block_size % per:
        raise ValueError(
            f"block_size must be a multiple of {per} for {bits}-bit levels (a byte holds {per}), got {block_size}"
        )
    return block_size


# --------------------------------------------------------------- reference ---
def _mul32(x: torch.Tensor, k: int) -> torch.Tensor:
    """(x * k) mod 2^32 for int64 x in [0, 2^32), without int64 overflow:
    k's high and low 16 bits are multiplied separately (each product < 2^48)."""
    hi = ((x * (k >> 16)) & 0xFFFF) << 16
    return (hi + x * (k & 0xFFFF)) & MASK32


def hash_reference(x: torch.Tensor) -> torch.Tensor:
    """quant_hash (lowbias32) elementwise on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_reference(seed: int, n: int, device=None) -> torch.Tensor:
    """quant_uniform(seed, i) for i in [0, n): float32 in [0, 1), 24 random bits.

    The element index is taken mod 2^32 (the kernels' uint32_t i)."""
    i = torch.arange(n, dtype=torch.int64, device=device) & MASK32
    h = hash_reference(i ^ quant_hash(seed & MASK32))
    # (h >> 8) < 2^24 converts exactly; the product by 2^-24 is exact too.
    return (h >> 8).to(torch.float32) * _TWO_POW_M24


def _block_index(n: int, block_size: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) // block_size


def levels_reference(
    c: torch.Tensor, bits: int, block_size: int, seed: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): the level of every element of flat float32 ``c`` (int32)
    and the float32 scale of every block (quant_inv / quant_level)."""
    n = c.numel()
    qmax = quant_qmax(bits)
    blocks = -(-n // block_size)
    idx = _block_index(n, block_size, c.device)
    # amax by scatter (not by padding to blocks * block_size: a block may be
    # far longer than the tensor). max is exact in any order; NaN is tracked
    # apart because a max reduction may drop it.
    nan = c.isnan()
    mag = torch.where(nan, torch.zeros_like(c), c.abs())
    amax = torch.zeros(blocks, dtype=torch.float32, device=c.device).scatter_reduce_(
        0, idx, mag, "amax", include_self=True
    )
    block_nan = torch.zeros(blocks, dtype=torch.float32, device=c.device).scatter_reduce_(
        0, idx, nan.float(), "amax", include_self=True
    )
    amax = torch.where(block_nan > 0, torch.full_like(amax, math.nan), amax)
    # Tensor / tensor: a true float32 division (a Python-scalar divisor may be
    # turned into a multiplication by its reciprocal, on CUDA).
    qmax_t = torch.full_like(amax, float(qmax))
    scales = amax / qmax_t
    pos = amax > 0  # False for NaN
    inv = qmax_t / torch.where(pos, amax, qmax_t)
    inv = torch.where(pos & (inv <= FLOAT32_MAX), inv, torch.zeros_like(amax))  # Inf amax: 0 already

    inv_e = inv[idx]
    x = c * inv_e
    if seed < 0:
        v = torch.round(x)  # half to even, like rintf
    else:
        v = torch.floor(x + uniform_reference(seed, n, c.device))
    v = torch.clamp(v, -qmax, qmax)  # NaN stays NaN
    # inv == 0: q = 0 (x is NaN there for a NaN or Inf element).
    v = torch.where(inv_e == 0, torch.zeros_like(v), v)
    return v.to(torch.int32), scales


def pack_reference(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 levels -> the wire bytes (uint8): ``per`` levels a byte, level
    ``k`` of a byte at bit ``k * bits``."""
    per = quant_per_byte(bits)
    fields = q & ((1 << bits) - 1)
    pad = -q.numel() % per
    if pad:
        fields = torch.cat([fields, fields.new_zeros(pad)])  # missing last levels are 0
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    return (fields.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def unpack_reference(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The wire bytes -> int32 levels of n elements (sign-extended)."""
    per = quant_per_byte(bits)
    shifts = torch.arange(per, dtype=torch.int32, device=data.device) * bits
    fields = ((data.to(torch.int32).view(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
    half = 1 << (bits - 1)
    return torch.where(fields >= half, fields - (half << 1), fields)


def compress_reference(
    grad: torch.Tensor, residual: Optional[torch.Tensor], bits: int, block_size: int, seed: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch compress of a flat contiguous tensor to ``bits``-bit levels -> (data, scales).

    ``seed < 0`` rounds to nearest; ``seed >= 0`` rounds stochastically with
    ``quant_uniform(seed mod 2^32, i)``. Updates ``residual`` in place."""
    c = grad.float() + residual if residual is not None else grad.float()
    q, scales = levels_reference(c, bits, block_size, seed)
    if residual is not None:
        decoded = q.to(torch.float32) * scales[_block_index(c.numel(), block_size, c.device)]
        residual.copy_(c - decoded)
    return pack_reference(q, bits), scales


def decompress_reference(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, out: torch.Tensor, accumulate: bool
) -> None:
    """out = (or +=, if accumulate) q * scale, element by element."""
    n = out.numel()
    q = unpack_reference(data, bits, n)
    decoded = q.to(torch.float32) * scales[_block_index(n, block_size, data.device)]
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)


# ------------------------------------------------------- other impls -------
def _why_no_quant_ops(why_no_ops):
    # An extension built before the quant ops existed loads, but lacks them.
    def why() -> Optional[str]:
        reason = why_no_ops()
        if reason is None and not hasattr(torch.ops.pycomm, "quant_compress"):
            return "the C++ extension pycomm._C was built without the quant ops; rebuild it"
        return reason

    return why


# The C++ ops pycomm::quant_compress / quant_decompress and their Triton
# twins (pycomm/triton/quant.py).
IMPLS = family_impls(
    "quant", compress_reference, decompress_reference,
    why_no_cpu_ops=_why_no_quant_ops(_ext.why_no_cpu_ops), why_no_cuda_ops=_why_no_quant_ops(_ext.why_no_cuda_ops),
)


class QuantCompressor(Compressor):
    """Block quantization to ``bits``-bit levels with a float32 absmax scale
    per block; the class of each width is :func:`quant_class` (a row of the
    method table whose family is "quant").

    ``rounding="nearest"`` rounds half to even (deterministic).
    ``rounding="stochastic"`` rounds up with probability equal to the
    fraction (unbiased): call number k of :meth:`compress` on this object
    (counting from 0) draws its random numbers from seed
    ``(seed + k) mod 2**32``, element i from ``quant_uniform(that seed, i)``.
    Two compressors built with the same seed and called in the same order
    therefore produce the same payloads.

    About ``n * bits / 8 + 4 n / block_size`` bytes on the wire.

    Example::

        >>> import torch, pycomm
        >>> c = pycomm.get_compressor("int8", block_size=4)
        >>> g = torch.tensor([1.0, -2.0, 0.5, 254.0, 3.0])
        >>> r = torch.zeros(5)
        >>> p = c.compress(g, r)            # r now holds what was not sent
        >>> p.data.view(torch.int8).tolist(), p.scales.tolist()
        ([0, -1, 0, 127, 127], [2.0, 0.023622047156095505])
        >>> out = c.decompress(p)
        >>> torch.equal(out + r, g)         # exact here: nothing lost, only deferred
        True
        >>> c.payload_nbytes(5)             # 5 levels + 2 scales
        13
        >>> c4 = pycomm.get_compressor("int4", block_size=4)
        >>> p = c4.compress(torch.tensor([7.0, -3.0, 1.0, 0.5, 14.0]))
        >>> p.data.tolist()                 # (7, -3) -> 0xd7, (1, 0) -> 0x01, (7, pad 0)
        [215, 1, 7]
        >>> c4.decompress(p).tolist()
        [7.0, -3.0, 1.0, 0.0, 14.0]
    """

    bits: int  # set by quant_class
    impls = IMPLS

    def __init__(
        self, block_size: int = 256, rounding: str = "nearest", seed: int = 0, impl: str = "auto"
    ) -> None:
        check_block_size(self.bits, block_size)
        if rounding not in _ROUNDINGS:
            raise ValueError(f"rounding must be one of {list(_ROUNDINGS)}, got {rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        super().__init__(impl)
        self.block_size = block_size
        self.rounding = rounding
        self.seed = seed
        self.calls = 0  # compress() calls so far: the stochastic seed's offset

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, rounding={self.rounding!r}, "
            f"seed={self.seed}, impl={self.impl!r})"
        )

    def payload_nbytes(self, numel: int) -> int:
        """Exact bytes the payload of a ``numel``-element tensor puts on the wire."""
        check_positive_int("numel", numel)
        return quant_num_bytes(numel, self.bits) + 4 * (-(-numel // self.block_size))

    def next_seed(self) -> int:
        """The seed the next :meth:`compress` call passes to the kernel (-1: round to nearest)."""
        return (self.seed + self.calls) & MASK32 if self.rounding == "stochastic" else -1

    def compress(self, grad: torch.Tensor, residual: Optional[torch.Tensor] = None) -> QuantPayload:
        """Compress ``grad + residual``; ``residual`` (if given) becomes the new error."""
        payload = self.compress_seeded(grad, residual, self.next_seed())
        self.calls += 1
        return payload

    def compress_seeded(self, grad: torch.Tensor, residual: Optional[torch.Tensor], seed: int) -> QuantPayload:
        """:meth:`compress` with the kernel seed ``seed`` (-1: round to
        nearest), outside the call count: what the engine runs with the
        seeds of ``spec.rounding_seed``."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed <= MASK32:
            raise ValueError(f"seed must be -1 or an integer in [0, 2**32), got {seed!r}")
        impl, flat, res = self._flat_inputs(grad, residual)
        data, scales = impl.compress(flat, res, self.bits, self.block_size, seed)
        return QuantPayload(data, scales, grad.numel(), tuple(grad.shape), self.block_size, self.bits)

    def decompress(
        self, payload: QuantPayload, out: Optional[torch.Tensor] = None, accumulate: bool = False
    ) -> torch.Tensor:
        """Decode to float32 (``payload.shape``); with ``out``, write (or add) in place."""
        self._check_payload_type(payload, QuantPayload, "bits", "block_size")
        return self._decode(
            payload, payload.data.device, out, accumulate, payload.data, payload.scales, self.bits, self.block_size
        )


@functools.lru_cache(maxsize=None)
def quant_class(bits: int) -> type:
    """The :class:`QuantCompressor` of ``bits``-bit levels (one class per
    width, ``Int<bits>Compressor``); the method table registers one under
    each of its quant rows' names (pycomm.distributed.spec).

    >>> quant_class(4).__name__, quant_class(4)().bits
    ('Int4Compressor', 4)
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {list(QUANT_BITS)}, got {bits!r}")
    name = f"Int{bits}Compressor"
    # A module attribute too, so that instances pickle by reference.
    globals()[name] = cls = type(name, (QuantCompressor,), {
        "bits": bits, "__module__": __name__, "__qualname__": name,
        "__doc__": f"Block quantization to {bits}-bit levels (-{quant_qmax(bits)}..{quant_qmax(bits)}), "
                   "one float32 scale per block: :class:`QuantCompressor`."})
    return cls


#: The classes pycomm exported by name before the widths were data.
Int8Compressor, Int4Compressor = quant_class(8), quant_class(4)


# Shapes of the op outputs without running the kernel (torch.compile, meta
# tensors, opcheck).
if _ext.has_ops():

    def _quant_payload_fake(grad, bits, block_size):
        n = grad.numel()
        return (
            grad.new_empty((quant_num_bytes(n, bits),), dtype=torch.uint8),
            grad.new_empty((-(-n // block_size),), dtype=torch.float32),
        )

    @torch.library.register_fake("pycomm::quant_compress")
    def _quant_compress_fake(grad, residual, bits, block_size, seed):
        return _quant_payload_fake(grad, bits, block_size)

    @torch.library.register_fake("pycomm::quant_compress_into")
    def _quant_compress_into_fake(grad, residual, residual_out, bits, block_size, seed):
        return _quant_payload_fake(grad, bits, block_size)

    @torch.library.register_fake("pycomm::quant_decompress")
    def _quant_decompress_fake(out, data, scales, bits, block_size, accumulate):
        return None
