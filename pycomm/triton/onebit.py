"""Triton onebit: sign bits + per-block mean-magnitude scale, fused error feedback.

Importing this module registers the ops

* ``torch.ops.pycomm.onebit_compress_triton(grad, residual?, block_size) -> (bits, scales)``
* ``torch.ops.pycomm.onebit_compress_into_triton(grad, residual, residual_out, block_size)
  -> (bits, scales)``
* ``torch.ops.pycomm.onebit_decompress_triton(out, bits, scales, block_size, accumulate)``

with the schemas and semantics of the C++ ops ``pycomm::onebit_compress``,
``onebit_compress_into`` and ``onebit_decompress`` (``csrc/ops/onebit.cpp``).
Wire format and rules: ``kernels/include/pycomm/compress_math.h``; the oracle
is ``pycomm.compressors.onebit.compress_reference`` / ``decompress_reference``.
Bits match the reference exactly; scales match it up to float32 rounding
(the sum over a block is reduced in a different order).
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

# Bits per packed word: one 32-lane row packs into one uint32 (tl.arange(0, 32)).
from ..wire import MAX_BLOCK_SIZE, WORD_BITS  # noqa: E402

# Largest tile one program holds at once ([MAX_TILE // 32, 32] floats). Larger
# blocks loop over tiles inside the program instead of growing the tile, so
# register pressure does not depend on block_size.
MAX_TILE = 2048
DECOMPRESS_TILE = 2048


@triton.jit
def _compress_tile(
    grad_ptr, res_ptr, bits_ptr, tile_begin, end, HAS_RES: tl.constexpr, WORDS: tl.constexpr
):
    """Load c for one [WORDS, 32] tile, store its packed sign words, return c."""
    rows = tl.arange(0, WORDS)
    lanes = tl.arange(0, 32)
    offs = tile_begin + rows[:, None] * 32 + lanes[None, :]
    mask = offs < end
    c = load_c(grad_ptr, res_ptr, offs, mask, HAS_RES)
    # Comparison, not the sign bit: NaN -> 0, -0.0 -> 1. Lanes past n load
    # 0.0, which compares >= 0, so they are masked off explicitly.
    bit = ((c >= 0.0) & mask).to(tl.uint32)
    # uint32 so that bit 31 cannot overflow; the bits are disjoint, so the
    # sum is an OR.
    word = tl.sum(bit << lanes.to(tl.uint32)[None, :], axis=1)
    word_idx = tile_begin // 32 + rows
    tl.store(bits_ptr + word_idx, word.to(tl.int32, bitcast=True), mask=word_idx * 32 < end)
    return c


@triton.jit
def _store_residual(res_ptr, tile_begin, end, c, scale, WORDS: tl.constexpr):
    offs = tile_begin + tl.arange(0, WORDS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(res_ptr + offs, c - tl.where(c >= 0.0, scale, -scale), mask=offs < end)


@triton.jit
def _compress_kernel(
    grad_ptr,
    res_ptr,
    bits_ptr,
    scales_ptr,
    n,
    block_size,
    HAS_RES: tl.constexpr,
    WORDS: tl.constexpr,
    ONE_TILE: tl.constexpr,
):
    TILE: tl.constexpr = WORDS * 32
    # int64: n may exceed 2^31 elements even though the grid does not.
    block = tl.program_id(0).to(tl.int64)
    begin = block * block_size
    end = tl.minimum(begin + block_size, n)
    length = (end - begin).to(tl.float32)

    if ONE_TILE:
        c = _compress_tile(grad_ptr, res_ptr, bits_ptr, begin, end, HAS_RES, WORDS)
        scale = tl.sum(tl.abs(c)) / length  # lanes past the block hold 0.0
        tl.store(scales_ptr + block, scale)
        if HAS_RES:
            # c is still in registers: one read of grad/residual in all.
            _store_residual(res_ptr, begin, end, c, scale, WORDS)
    else:
        # Per-lane partial sums reduced once at the end: one tree reduction
        # per block keeps the rounding close to the reference's pairwise sum.
        acc = tl.zeros([WORDS, 32], dtype=tl.float32)
        for start in tl.range(0, block_size, TILE):
            c = _compress_tile(grad_ptr, res_ptr, bits_ptr, begin + start, end, HAS_RES, WORDS)
            acc += tl.abs(c)
        scale = tl.sum(acc) / length
        tl.store(scales_ptr + block, scale)
        if HAS_RES:
            # The scale needs the whole block first. Recomputing c (the block
            # was just read, so this mostly hits L2) costs the same bytes as
            # staging c in the residual for fp32 grads and fewer for fp16.
            rows = tl.arange(0, WORDS)
            lanes = tl.arange(0, 32)
            for start in tl.range(0, block_size, TILE):
                offs = begin + start + rows[:, None] * 32 + lanes[None, :]
                c = load_c(grad_ptr, res_ptr, offs, offs < end, HAS_RES)
                _store_residual(res_ptr, begin + start, end, c, scale, WORDS)


@triton.jit
def _decompress_kernel(
    bits_ptr,
    scales_ptr,
    out_ptr,
    n,
    block_size,
    ACCUMULATE: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, 32)
    word_idx = pid * WORDS + tl.arange(0, WORDS)
    word_mask = word_idx * 32 < n
    words = tl.load(bits_ptr + word_idx, mask=word_mask, other=0).to(tl.uint32, bitcast=True)
    # A word never straddles two blocks (block_size % 32 == 0): one scale
    # lookup (and one division) per word, not per element.
    scale = tl.load(scales_ptr + (word_idx * 32) // block_size, mask=word_mask, other=0.0)
    bit = (words[:, None] >> lanes.to(tl.uint32)[None, :]) & 1
    decoded = tl.where(bit != 0, scale[:, None], -scale[:, None])
    offs = word_idx[:, None] * 32 + lanes[None, :]
    mask = offs < n
    if ACCUMULATE:
        decoded = tl.load(out_ptr + offs, mask=mask, other=0.0) + decoded
    tl.store(out_ptr + offs, decoded, mask=mask)


# ------------------------------------------------------------------- ops ---
def _check_block_size(block_size: int) -> None:
    check(
        0 < block_size <= MAX_BLOCK_SIZE and block_size % WORD_BITS == 0,
        f"block_size must be a positive multiple of 32 up to 2^30, got {block_size}",
    )


def _launch_compress(grad: Tensor, residual: Optional[Tensor], block_size: int) -> Tuple[Tensor, Tensor]:
    n = grad.numel()
    blocks = triton.cdiv(n, block_size)
    bits = torch.empty(triton.cdiv(n, WORD_BITS), dtype=torch.int32, device=grad.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=grad.device)
    tile = min(triton.next_power_of_2(block_size), MAX_TILE)
    with device_guard(grad):
        wrap_triton(_compress_kernel)[(blocks,)](
            grad,
            residual if residual is not None else grad,  # never read when HAS_RES is False
            bits,
            scales,
            n,
            block_size,
            HAS_RES=residual is not None,
            WORDS=tile // WORD_BITS,
            ONE_TILE=block_size <= tile,
            # ~8 elements per thread: a 32-element block needs one warp, not four.
            num_warps=max(1, min(8, tile // 256)),
        )
    return bits, scales


def _compress_fake(grad, residual, block_size):
    n = grad.numel()
    words = -(-n // WORD_BITS)
    blocks = -(-n // block_size)
    return grad.new_empty((words,), dtype=torch.int32), grad.new_empty((blocks,), dtype=torch.float32)


@register_op("pycomm::onebit_compress_triton", mutates_args=("residual",), fake=_compress_fake)
def onebit_compress_triton(
    grad: Tensor, residual: Optional[Tensor], block_size: int
) -> Tuple[Tensor, Tensor]:
    """pycomm::onebit_compress on Triton kernels (see :func:`compress`)."""
    check_compress_inputs(grad, residual)
    _check_block_size(block_size)
    return _launch_compress(grad, residual, block_size)


def _compress_into_fake(grad, residual, residual_out, block_size):
    return _compress_fake(grad, residual, block_size)


# traceable=False: the overlap check reads data pointers, which FakeTensors
# do not have.
@register_op(
    "pycomm::onebit_compress_into_triton",
    mutates_args=("residual_out",),
    fake=_compress_into_fake,
    traceable=False,
)
def onebit_compress_into_triton(
    grad: Tensor, residual: Tensor, residual_out: Tensor, block_size: int
) -> Tuple[Tensor, Tensor]:
    """pycomm::onebit_compress_into on Triton kernels: ``grad + residual``
    compressed, the new residual written to ``residual_out``, ``residual``
    left as it was (unless it is ``residual_out``)."""
    check_compress_inputs(grad, residual)
    check_compress_inputs(grad, residual_out)
    _check_block_size(block_size)
    stage_residual_out(grad, residual, residual_out)
    return _launch_compress(grad, residual_out, block_size)


def _decompress_fake(out, bits, scales, block_size, accumulate):
    return None


@register_op("pycomm::onebit_decompress_triton", mutates_args=("out",), fake=_decompress_fake)
def onebit_decompress_triton(
    out: Tensor, bits: Tensor, scales: Tensor, block_size: int, accumulate: bool
) -> None:
    """pycomm::onebit_decompress on Triton kernels (see :func:`decompress`)."""
    _check_block_size(block_size)
    n = check_decompress_out(out, bits)
    check(bits.dtype == torch.int32 and bits.is_contiguous(), "bits must be a contiguous int32 tensor")
    check(
        scales.dtype == torch.float32 and scales.is_contiguous(),
        "scales must be a contiguous float32 tensor",
    )
    words = triton.cdiv(n, WORD_BITS)
    check(bits.numel() == words, f"bits has {bits.numel()} words; out of {n} elements needs {words}")
    check_scales(scales, n, block_size, bits, "bits")
    launch_decompress(
        _decompress_kernel, DECOMPRESS_TILE, bits, scales, out, block_size,
        ACCUMULATE=accumulate, WORDS=DECOMPRESS_TILE // WORD_BITS, num_warps=8,
    )


# ------------------------------------------------------------ python API ---
def compress(grad: Tensor, residual: Optional[Tensor], block_size: int) -> Tuple[Tensor, Tensor]:
    """Onebit-compress ``c = grad + residual`` in one fused kernel.

    ``grad``: contiguous float32/float16/bfloat16 of n elements;
    ``residual``: contiguous float32 of n elements, or None (no error
    feedback). Returns ``(bits, scales)``: int32 ``[ceil(n / 32)]`` packed
    sign bits (bit i of word w is element 32w + i, 1 = ``c >= 0``, padding
    bits 0) and float32 ``[ceil(n / block_size)]`` mean ``|c|`` per block.
    If ``residual`` is given it becomes ``c - decoded`` in place. Runs
    ``torch.ops.pycomm.onebit_compress_triton``.

    Example (on CPU tensors under TRITON_INTERPRET=1, or on a GPU)::

        >>> g = torch.tensor([1.0, -3.0] * 16 + [2.0])
        >>> bits, scales = compress(g, None, 32)
        >>> bits.tolist(), scales.tolist()   # signs 0b0101...01, then 1
        ([1431655765, 1], [2.0, 2.0])
    """
    return torch.ops.pycomm.onebit_compress_triton(grad, residual, block_size)


def decompress(bits: Tensor, scales: Tensor, block_size: int, out: Tensor, accumulate: bool) -> None:
    """Decode a onebit payload into ``out`` (contiguous float32, n elements).

    ``out`` becomes the decoded ``+-scale`` values, or has them added when
    ``accumulate`` is true. Runs ``torch.ops.pycomm.onebit_decompress_triton``.

    Example::

        >>> out = torch.empty(33)
        >>> decompress(*compress(torch.tensor([1.0, -3.0] * 16 + [2.0]), None, 32), 32, out, False)
        >>> out[:3].tolist(), out[-1].item()
        ([2.0, -2.0, 2.0], 2.0)
    """
    torch.ops.pycomm.onebit_decompress_triton(out, bits, scales, block_size, accumulate)
