"""Triton quant: block quantization to ``bits``-bit levels
(``bits`` in :data:`pycomm.wire.QUANT_BITS`) with a per-block absmax scale,
fused error feedback.

Importing this module registers the ops

* ``torch.ops.pycomm.quant_compress_triton(grad, residual?, bits, block_size, seed) -> (data, scales)``
* ``torch.ops.pycomm.quant_compress_into_triton(grad, residual, residual_out, bits, block_size, seed)
  -> (data, scales)``
* ``torch.ops.pycomm.quant_decompress_triton(out, data, scales, bits, block_size, accumulate)``

with the schemas and semantics of the C++ ops ``pycomm::quant_compress``,
``quant_compress_into`` and ``quant_decompress`` (``csrc/ops/quant.cpp``).
Wire format and rules: ``kernels/include/pycomm/compress_math.h`` (section
"quant"); the oracle is ``pycomm.compressors.quant.compress_reference`` /
``decompress_reference``. Every output matches the reference bit for bit:
the block maximum is exact in any order, and every other step is one
float32 operation rounded once, which the kernels keep that way:

* divisions use ``tl.math.div_rn`` (plain ``/`` may be approximate on a GPU);
* round-half-to-even is ``(x + 1.5 * 2^23) - 1.5 * 2^23``, exact for
  ``|x| < 2^22`` (here ``|x| <= qmax`` or non-finite);
* kernels launch with ``enable_fp_fusion=False``: a fused multiply-add
  would skip the rounding of ``c * inv`` (stochastic rounding) and of
  ``q * scale`` (residual, accumulate);
* NaN is tracked explicitly: a GPU max reduction may drop it.

The kernels are generic in the width: ``BITS`` is a compile-time constant
and every width-dependent step (levels per byte, field shifts, sign
extension) is computed from it, so no code path names a width.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from ._common import (check, check_compress_inputs, check_decompress_out, check_scales, device_guard,
                      launch_decompress, load_c, register_op, stage_residual_out)

# The rules shared with the reference (pycomm/wire.py imports nothing of pycomm).
from ..wire import (  # noqa: E402
    MASK32,
    MAX_BLOCK_SIZE,
    QUANT_BITS,
    quant_hash,
    quant_num_bytes,
    quant_per_byte,
    quant_qmax,
)

# Elements one program holds at once. A tile is [ROWS, NBYTES, PER]: row r
# is a block, byte j of it holds elements PER * j + k, k < PER = 8 // BITS,
# at bit k * BITS (the wire's order), so packing is a reduction over the
# last axis and every byte is whole in one program (8 bits: PER = 1, the last
# axis has one element). Small blocks share a program (ROWS blocks, one per
# row); a block longer than a tile gets a program of its own that loops
# over tiles, so register pressure depends neither on block_size nor on the
# width.
MAX_TILE = 2048
DECOMPRESS_TILE = 2048


# ----------------------------------------------------------------- math ---
@triton.jit
def _hash(x):
    """quant_hash (lowbias32) on uint32, wrapping products."""
    x ^= x >> 16
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _level(c, inv, offs, seed_key, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """quant_level as float32 (an integer in [-QMAX, QMAX]).

    seed_key is quant_hash(seed) (uint32), so u = quant_uniform(seed, i)."""
    x = c * inv
    if STOCHASTIC:
        h = _hash(offs.to(tl.uint32) ^ seed_key)
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24: exact
        v = tl.floor(x + u)
    else:
        # 1.5 * 2^23: the sum lies in [2^23, 2^24), where floats are the
        # integers, so the addition rounds x half to even (rintf).
        v = (x + 12582912.0) - 12582912.0
    # Comparisons, not tl.minimum/maximum: NaN must stay NaN until the guard.
    v = tl.where(v > QMAX, QMAX, tl.where(v < -QMAX, -QMAX, v))
    # inv == 0: q = 0 by the rule (x is NaN there for a NaN or Inf element).
    return tl.where(inv == 0.0, 0.0, v)


@triton.jit
def _scale_inv(amax, has_nan, QMAX: tl.constexpr):
    """(scale, inv) of a block from max |c| (NaN-free) and its NaN flag."""
    amax = tl.where(has_nan, float("nan"), amax)
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    scale = tl.math.div_rn(amax, qmax)
    pos = amax > 0.0  # False for NaN
    inv = tl.math.div_rn(qmax, tl.where(pos, amax, qmax))
    # Finite only (<= FLT_MAX): a tiny amax overflows the quotient; Inf amax gives 0.
    inv = tl.where(pos & (inv <= 3.4028234663852886e38), inv, 0.0)
    return scale, inv


@triton.jit
def _offsets(base, NBYTES: tl.constexpr, PER: tl.constexpr):
    """Element offsets of the tile whose rows start at ``base`` ([ROWS, 1],
    multiples of PER since block_size is one): ``first`` [ROWS, NBYTES],
    each byte's first element, and ``offs`` [ROWS, NBYTES, PER], element
    PER * j + k of the row at byte j, field k."""
    first = base + PER * tl.arange(0, NBYTES).to(tl.int64)[None, :]
    offs = first[:, :, None] + tl.arange(0, PER).to(tl.int64)[None, None, :]
    return first, offs


@triton.jit
def _emit(
    c, first, offs, end, scale, inv, seed_key, res_ptr, data_ptr,
    HAS_RES: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, PER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Quantize one tile (c at ``offs``, from :func:`_offsets`; elements
    below ``end`` [ROWS, 1] in range): store the levels packed into bytes
    and, with error feedback, c - q * scale."""
    mask = offs < end[:, :, None]
    q = _level(c, inv, offs, seed_key, QMAX, STOCHASTIC)
    if HAS_RES:
        tl.store(res_ptr + offs, c - q * scale, mask=mask)
    # Two's complement in BITS bits at bit k * BITS; a missing last level
    # (past n) is 0. The fields are disjoint, so their sum is their OR.
    field = tl.where(mask, q.to(tl.int32), 0) & ((1 << BITS) - 1)
    shift = (BITS * tl.arange(0, PER))[None, None, :]
    byte = tl.sum(field << shift, axis=2)
    # A byte is the block's when its first element is (blocks start at
    # multiples of PER): past `end` it belongs to the next block (8 bits with
    # an odd block_size) or lies past the payload.
    tl.store(data_ptr + first // PER, byte.to(tl.uint8), mask=first < end)


@triton.jit
def _abs_no_nan(c):
    return tl.where(c != c, 0.0, tl.abs(c))


# The seed key is a value, never a compile-time constant (Triton would
# specialize an argument equal to 1).
@triton.jit(do_not_specialize=["seed_key_i32"])
def _compress_kernel(
    grad_ptr, res_ptr, data_ptr, scales_ptr, n, block_size, num_blocks, seed_key_i32,
    HAS_RES: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
    ROWS: tl.constexpr, NBYTES: tl.constexpr, ONE_TILE: tl.constexpr,
):  # fmt: skip
    PER: tl.constexpr = 8 // BITS
    seed_key = seed_key_i32.to(tl.uint32, bitcast=True)
    # int64: element offsets may pass 2^31 in intermediate products.
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    begin = blk[:, None] * block_size  # [ROWS, 1]
    end = tl.minimum(begin + block_size, n)  # < begin for rows past the last block: all masked

    if ONE_TILE:
        # Every block fits in a row: c stays in registers, one read in all.
        first, offs = _offsets(begin, NBYTES, PER)
        end3 = end[:, :, None]
        c = load_c(grad_ptr, res_ptr, offs, offs < end3, HAS_RES)
        # Lanes past the block load 0.0: no effect on the max.
        amax = tl.max(tl.max(_abs_no_nan(c), axis=2), axis=1)
        has_nan = tl.max(tl.max((c != c).to(tl.int32), axis=2), axis=1) > 0
        scale, inv = _scale_inv(amax, has_nan, QMAX)
        tl.store(scales_ptr + blk, scale, mask=blk < num_blocks)
        _emit(c, first, offs, end, scale[:, None, None], inv[:, None, None], seed_key, res_ptr, data_ptr,
              HAS_RES, BITS, QMAX, PER, STOCHASTIC)  # fmt: skip
    else:
        # One block (ROWS == 1) longer than a tile. The loop runs over the
        # block's actual length, which may be far below block_size (the last
        # or only block of a small tensor).
        length = tl.minimum(block_size, n - tl.program_id(0).to(tl.int64) * block_size)
        end3 = end[:, :, None]
        acc = tl.zeros([ROWS, NBYTES, PER], dtype=tl.float32)
        nan_acc = tl.zeros([ROWS, NBYTES, PER], dtype=tl.int32)
        for start in tl.range(0, length, NBYTES * PER):
            first, offs = _offsets(begin + start, NBYTES, PER)
            c = load_c(grad_ptr, res_ptr, offs, offs < end3, HAS_RES)
            acc = tl.maximum(acc, _abs_no_nan(c))
            nan_acc |= (c != c).to(tl.int32)
        amax = tl.max(tl.max(acc, axis=2), axis=1)
        has_nan = tl.max(tl.max(nan_acc, axis=2), axis=1) > 0
        scale, inv = _scale_inv(amax, has_nan, QMAX)
        tl.store(scales_ptr + blk, scale, mask=blk < num_blocks)
        # The scale needs the whole block first: c is recomputed (bit for bit;
        # the residual is not written before this pass reads it).
        for start in tl.range(0, length, NBYTES * PER):
            first, offs = _offsets(begin + start, NBYTES, PER)
            c = load_c(grad_ptr, res_ptr, offs, offs < end3, HAS_RES)
            _emit(c, first, offs, end, scale[:, None, None], inv[:, None, None], seed_key, res_ptr, data_ptr,
                  HAS_RES, BITS, QMAX, PER, STOCHASTIC)  # fmt: skip


@triton.jit
def _decompress_kernel(
    data_ptr, scales_ptr, out_ptr, n, block_size,
    BITS: tl.constexpr, ACCUMULATE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    PER: tl.constexpr = 8 // BITS
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    scale = tl.load(scales_ptr + offs // block_size, mask=mask, other=0.0)
    # Element i is the BITS-bit field at bit (i % PER) * BITS of byte i // PER.
    byte = tl.load(data_ptr + offs // PER, mask=mask, other=0).to(tl.int32)
    field = (byte >> ((offs % PER) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    q = tl.where(field >= (1 << (BITS - 1)), field - (1 << BITS), field)  # sign-extend the field
    decoded = q.to(tl.float32) * scale
    if ACCUMULATE:
        decoded = tl.load(out_ptr + offs, mask=mask, other=0.0) + decoded
    tl.store(out_ptr + offs, decoded, mask=mask)


# ------------------------------------------------------------------- ops ---
# The messages of csrc/ops/quant.cpp's checks.
def _check_args(bits: int, block_size: int, seed: int) -> None:
    check(bits in QUANT_BITS, f"bits must be one of {sorted(QUANT_BITS)}, got {bits}")
    check(0 < block_size <= MAX_BLOCK_SIZE, f"block_size must be in [1, 2^30], got {block_size}")
    # No byte may straddle two blocks: a block's bytes are written by its
    # own program (row) alone.
    per = quant_per_byte(bits)
    check(
        block_size % per == 0,
        f"block_size must be a multiple of {per} for {bits}-bit levels (a byte holds {per}), got {block_size}",
    )
    check(-1 <= seed <= MASK32, f"seed must be -1 (round to nearest) or in [0, 2^32), got {seed}")


def _tile(n: int, block_size: int, bits: int) -> Tuple[int, int, bool]:
    """(ROWS, NBYTES, ONE_TILE) of the compress kernel: a row of a tile is
    NBYTES bytes of PER elements (a power of two, at most MAX_TILE)."""
    per = quant_per_byte(bits)
    longest = min(block_size, n)  # the longest block actually present
    nbytes = min(triton.next_power_of_2(-(-longest // per)), MAX_TILE // per)
    width = nbytes * per  # elements per row
    one_tile = longest <= width
    rows = MAX_TILE // width if one_tile else 1
    # No more rows than blocks: a small tensor should not pay for a full tile.
    rows = min(rows, triton.next_power_of_2(-(-n // block_size)))
    return rows, nbytes, one_tile


def _launch_compress(
    grad: Tensor, residual: Optional[Tensor], bits: int, block_size: int, seed: int
) -> Tuple[Tensor, Tensor]:
    n = grad.numel()
    blocks = triton.cdiv(n, block_size)
    data = torch.empty(quant_num_bytes(n, bits), dtype=torch.uint8, device=grad.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=grad.device)
    rows, nbytes, one_tile = _tile(n, block_size, bits)
    # quant_hash(seed) once on the host, passed as int32 bits (a kernel int
    # argument >= 2^31 would change its type).
    key = quant_hash(seed & MASK32) if seed >= 0 else 0
    key_i32 = key - (1 << 32) if key >= 1 << 31 else key
    with device_guard(grad):
        wrap_triton(_compress_kernel)[(triton.cdiv(blocks, rows),)](
            grad,
            residual if residual is not None else grad,  # never read when HAS_RES is False
            data,
            scales,
            n,
            block_size,
            blocks,
            key_i32,
            HAS_RES=residual is not None,
            BITS=bits,
            QMAX=quant_qmax(bits),
            STOCHASTIC=seed >= 0,
            ROWS=rows,
            NBYTES=nbytes,
            ONE_TILE=one_tile,
            num_warps=max(1, min(8, rows * nbytes * quant_per_byte(bits) // 256)),
            enable_fp_fusion=False,
        )
    return data, scales


def _compress_fake(grad, residual, bits, block_size, seed):
    n = grad.numel()
    return (
        grad.new_empty((quant_num_bytes(n, bits),), dtype=torch.uint8),
        grad.new_empty((-(-n // block_size),), dtype=torch.float32),
    )


# traceable=False: inside a traced graph the launch option
# enable_fp_fusion=False would be taken for a kernel argument, and without
# it the results are no longer bit-exact.
@register_op(
    "pycomm::quant_compress_triton", mutates_args=("residual",), fake=_compress_fake, traceable=False
)
def quant_compress_triton(
    grad: Tensor, residual: Optional[Tensor], bits: int, block_size: int, seed: int
) -> Tuple[Tensor, Tensor]:
    """pycomm::quant_compress on Triton kernels (see :func:`compress`)."""
    check_compress_inputs(grad, residual)
    _check_args(bits, block_size, seed)
    return _launch_compress(grad, residual, bits, block_size, seed)


def _compress_into_fake(grad, residual, residual_out, bits, block_size, seed):
    return _compress_fake(grad, residual, bits, block_size, seed)


# traceable=False also because the overlap check reads data pointers, which
# FakeTensors do not have.
@register_op(
    "pycomm::quant_compress_into_triton",
    mutates_args=("residual_out",),
    fake=_compress_into_fake,
    traceable=False,
)
def quant_compress_into_triton(
    grad: Tensor, residual: Tensor, residual_out: Tensor, bits: int, block_size: int, seed: int
) -> Tuple[Tensor, Tensor]:
    """pycomm::quant_compress_into on Triton kernels: ``grad + residual``
    compressed, the new residual written to ``residual_out``, ``residual``
    left as it was (unless it is ``residual_out``)."""
    check_compress_inputs(grad, residual)
    check_compress_inputs(grad, residual_out)
    _check_args(bits, block_size, seed)
    stage_residual_out(grad, residual, residual_out)
    return _launch_compress(grad, residual_out, bits, block_size, seed)


def _decompress_fake(out, data, scales, bits, block_size, accumulate):
    return None


@register_op(
    "pycomm::quant_decompress_triton", mutates_args=("out",), fake=_decompress_fake, traceable=False
)
def quant_decompress_triton(
    out: Tensor, data: Tensor, scales: Tensor, bits: int, block_size: int, accumulate: bool
) -> None:
    """pycomm::quant_decompress on Triton kernels (see :func:`decompress`)."""
    _check_args(bits, block_size, -1)
    n = check_decompress_out(out, data)
    check(
        data.dtype == torch.uint8 and data.is_contiguous(),
        f"data must be a contiguous uint8 tensor, got {data.dtype}",
    )
    check(
        scales.dtype == torch.float32 and scales.is_contiguous(),
        f"scales must be a contiguous float32 tensor, got {scales.dtype}",
    )
    nbytes = quant_num_bytes(n, bits)
    check(data.numel() == nbytes, f"data has {data.numel()} bytes; {n} int{bits} elements need {nbytes}")
    check_scales(scales, n, block_size, data, "data")
    launch_decompress(
        _decompress_kernel, DECOMPRESS_TILE, data, scales, out, block_size,
        BITS=bits, ACCUMULATE=accumulate, TILE=DECOMPRESS_TILE, num_warps=8, enable_fp_fusion=False,
    )


# ------------------------------------------------------------ python API ---
def compress(
    grad: Tensor, residual: Optional[Tensor], bits: int, block_size: int, seed: int = -1
) -> Tuple[Tensor, Tensor]:
    """Quantize ``c = grad + residual`` to ``bits``-bit levels (``bits`` in
    :data:`pycomm.wire.QUANT_BITS`; ``block_size`` a multiple of ``8 // bits``).

    ``grad``: contiguous float32/float16/bfloat16 of n elements;
    ``residual``: contiguous float32 of n elements, or None (no error
    feedback). ``seed``: -1 rounds to nearest (half to even), ``seed`` in
    [0, 2^32) rounds stochastically. Returns ``(data, scales)``: uint8
    ``[quant_num_bytes(n, bits)]`` levels and float32
    ``[ceil(n / block_size)]`` scales (``max |c| / qmax`` per block). If
    ``residual`` is given it becomes ``c - q * scale`` in place. Runs
    ``torch.ops.pycomm.quant_compress_triton``.

    Example (on CPU tensors under TRITON_INTERPRET=1, or on a GPU)::

        >>> g = torch.tensor([7.0, -3.0, 1.0, 0.5, 14.0])
        >>> data, scales = compress(g, None, 4, 4)
        >>> data.tolist(), scales.tolist()   # (7, -3) -> 0xd7, (1, 0), (7, pad 0)
        ([215, 1, 7], [1.0, 2.0])
    """
    return torch.ops.pycomm.quant_compress_triton(grad, residual, bits, block_size, seed)


def decompress(
    data: Tensor, scales: Tensor, bits: int, block_size: int, out: Tensor, accumulate: bool
) -> None:
    """Decode a quant payload into ``out`` (contiguous float32, n elements):
    ``q * scale``, written or (``accumulate``) added. Runs
    ``torch.ops.pycomm.quant_decompress_triton``.

    Example::

        >>> out = torch.empty(5)
        >>> decompress(*compress(torch.tensor([7.0, -3.0, 1.0, 0.5, 14.0]), None, 4, 4), 4, 4, out, False)
        >>> out.tolist()
        [7.0, -3.0, 1.0, 0.0, 14.0]
    """
    torch.ops.pycomm.quant_decompress_triton(out, data, scales, bits, block_size, accumulate)
