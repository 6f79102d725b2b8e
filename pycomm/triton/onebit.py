"""Triton onebit: sign bits + per-block mean-magnitude scale, fused error feedback.

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

from ._common import device_guard, load_c

from ..compressors.onebit import WORD_BITS

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




def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous tensor, got shape {tuple(t.shape)}")


def compress(
    grad: torch.Tensor, residual: Optional[torch.Tensor], block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Onebit-compress ``c = grad + residual`` in one fused kernel.

    ``grad``: flat contiguous float32/float16/bfloat16 of n elements;
    ``residual``: flat contiguous float32 of n elements, or None (no error
    feedback). Returns ``(bits, scales)``: int32 ``[ceil(n / 32)]`` packed
    sign bits (bit i of word w is element 32w + i, 1 = ``c >= 0``, padding
    bits 0) and float32 ``[ceil(n / block_size)]`` mean ``|c|`` per block.
    If ``residual`` is given it becomes ``c - decoded`` in place.
    """
    _check_flat("grad", grad)
    if residual is not None:
        _check_flat("residual", residual)
        if residual.dtype != torch.float32 or residual.numel() != grad.numel():
            raise ValueError("residual must be float32 with as many elements as grad")
    if block_size <= 0 or block_size % WORD_BITS:
        raise ValueError(f"block_size must be a positive multiple of {WORD_BITS}, got {block_size}")
    n = grad.numel()
    if n == 0:
        raise ValueError("grad is empty: there is nothing to compress")
    words = triton.cdiv(n, WORD_BITS)
    blocks = triton.cdiv(n, block_size)
    bits = torch.empty(words, dtype=torch.int32, device=grad.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=grad.device)
    tile = min(triton.next_power_of_2(block_size), MAX_TILE)
    with device_guard(grad):
        _compress_kernel[(blocks,)](
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


def decompress(
    bits: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool
) -> None:
    """Decode a onebit payload into ``out`` (flat contiguous float32, n elements).

    ``out`` becomes the decoded ``+-scale`` values, or has them added when
    ``accumulate`` is true.
    """
    _check_flat("out", out)
    if out.dtype != torch.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")
    if block_size <= 0 or block_size % WORD_BITS:
        raise ValueError(f"block_size must be a positive multiple of {WORD_BITS}, got {block_size}")
    n = out.numel()
    if bits.numel() != triton.cdiv(n, WORD_BITS) or scales.numel() != triton.cdiv(n, block_size):
        raise ValueError(
            f"payload of {bits.numel()} words / {scales.numel()} scales does not describe "
            f"{n} elements with block_size={block_size}"
        )
    if n == 0:
        return
    words_per_prog = DECOMPRESS_TILE // WORD_BITS
    grid = (triton.cdiv(n, DECOMPRESS_TILE),)
    with device_guard(out):
        _decompress_kernel[grid](
            bits.contiguous(),
            scales.contiguous(),
            out,
            n,
            block_size,
            ACCUMULATE=bool(accumulate),
            WORDS=words_per_prog,
            num_warps=8,
        )
