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


# int8 / int4 block quantization (rules: kernels/include/pycomm/compress_math.h).
#: Largest block_size of every block codec (onebit, int8, int4).
MAX_BLOCK_SIZE = 1 << 30
MASK32 = 0xFFFFFFFF


def quant_qmax(bits: int) -> int:
    """Largest level: 127 for int8, 7 for int4 (symmetric, -qmax..qmax)."""
    return 127 if bits == 8 else 7


def quant_num_bytes(n: int, bits: int) -> int:
    """Data bytes of ``n`` quantized elements (int4: two per byte)."""
    return n if bits == 8 else (n + 1) // 2


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
