"""The wire format's constants and top-k's selection rules, for every Python
implementation (the pure-torch references and the Triton kernels alike); the
C++ and CUDA kernels read the same rules from
``kernels/include/pycomm/compress_math.h``. This module imports nothing of
pycomm, so the kernels and the references both depend on it and never on
each other.

>>> topk_k(1000, 0.01), topk_capacity(10), accept(12, 10)
(10, 12, True)
"""

from __future__ import annotations

import math

#: onebit: sign bits per packed word (one 32-lane row of the kernels).
WORD_BITS = 32

#: topk selects on integer magnitude keys: the float's bits, sign cleared,
#: every NaN mapped to one key above +Inf (so NaN/Inf are always sent).
NAN_KEY = 0x7FC00000
INF_KEY = 0x7F800000
#: Approximate top-k samples about SAMPLE_HITS * n / k elements (at least
#: SAMPLE_MIN) to estimate its threshold.
SAMPLE_HITS = 256
SAMPLE_MIN = 4096


def topk_k(n: int, density: float) -> int:
    """Entries top-k sends for ``n`` elements: ``ceil(density * n)``, in [1, n]."""
    return min(n, max(1, math.ceil(density * n)))


def topk_capacity(k: int) -> int:
    """Most entries approximate top-k may return: ``floor(1.25 k)``."""
    return k + k // 4


def sample_stride(n: int, k: int) -> int:
    target = max(SAMPLE_MIN, SAMPLE_HITS * (-(-n // k)))
    return max(1, n // target)


def sample_rank(n: int, k: int, s: int) -> int:
    return min(s, max(1, math.ceil(1.125 * k * s / n)))


def retry_rank(rank: int, k: int, count: int, s: int) -> int:
    return min(s, max(1, math.ceil(rank * 1.125 * k / count)))


def accept(count: int, k: int) -> bool:
    return k <= count <= topk_capacity(k)


# Block quantization to ``bits``-bit levels, any ``bits`` dividing 8 from 2 up
# (rules: kernels/include/pycomm/compress_math.h, "quant").
#: Largest block_size of every block codec.
MAX_BLOCK_SIZE = 1 << 30
MASK32 = 0xFFFFFFFF
#: The bit widths the quant kernels take.
QUANT_BITS = (2, 4, 8)


def quant_qmax(bits: int) -> int:
    """Largest level, ``2**(bits-1) - 1`` (symmetric, -qmax..qmax).

    >>> [quant_qmax(b) for b in QUANT_BITS]
    [1, 7, 127]
    """
    return (1 << (bits - 1)) - 1


def quant_per_byte(bits: int) -> int:
    """Levels per data byte; a block holds a whole number of bytes."""
    return 8 // bits


def quant_num_bytes(n: int, bits: int) -> int:
    """Data bytes of ``n`` quantized elements.

    >>> quant_num_bytes(9, 8), quant_num_bytes(9, 4), quant_num_bytes(9, 2)
    (9, 5, 3)
    """
    return -(-n // quant_per_byte(bits))


def quant_hash(x: int) -> int:
    """lowbias32 on a Python int in [0, 2^32) (the kernels' ``quant_hash``).

    >>> hex(quant_hash(1))
    '0x688990c0'
    """
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x
