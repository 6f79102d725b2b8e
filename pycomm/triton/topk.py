"""Triton topk: keep the k largest-magnitude entries of ``c = grad + residual``.

Importing this module registers the ops

* ``torch.ops.pycomm.topk_compress_triton(grad, residual?, k, approx) -> (indices, values)``
* ``torch.ops.pycomm.topk_decompress_triton(out, indices, values, accumulate)``

with the schemas and semantics of the C++ ops ``pycomm::topk_compress`` and
``topk_decompress`` (``csrc/ops/topk.cpp``).

Follows ``pycomm.compressors.topk.select_reference`` step by step (same
sample, same ranks, same accept / retry / exact-fallback decisions), so the
selected indices are identical to the reference's. The rules those decisions
use are pycomm/wire.py's, shared with the reference (compress_math.h in C++).

Every full-size pass recomputes ``c = float(grad) + residual`` from the inputs
instead of staging it (float32 addition is exact-rounded, so every pass, and
the torch-computed sample, see the same c bit for bit) and leaves the residual
untouched until the final compaction, the one pass that writes it:

* count: per program, how many keys are > T and == T;
* compaction: per program, an exclusive prefix sum of those counts gives the
  output offset, an in-program cumsum the slot, so indices come out ascending
  with no sort and no atomics;
* exact threshold: an MSB-first radix select over the 31-bit keys, 8 bits per
  pass (a Triton histogram pass + a one-program pick kernel), with the
  threshold and remaining rank kept on the device: no host sync.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from ._common import check, check_compress_inputs, check_out, device_guard, load_c, register_op

TILE = 2048
NUM_WARPS = 8
# 8-bit digits (the kernels spell out 256 / 0xFF); keys are < 2^31 (sign bit
# cleared), so four digits cover them.
RADIX_BINS = 256
RADIX_SHIFTS = (24, 16, 8, 0)
SCATTER_TILE = 1024


# ------------------------------------------------ rules (compress_math.h) ---
# The references' own rules (pycomm/wire.py, which imports nothing of pycomm):
# the kernels depend on the rules, not on the oracle they are tested against.
from ..wire import INF_KEY, NAN_KEY, accept, retry_rank, sample_rank, sample_stride, topk_capacity  # noqa: E402,F401


def keys(c: Tensor) -> Tensor:
    """int32 magnitude keys of float32 ``c``: sign cleared, every NaN -> NAN_KEY."""
    key = c.view(torch.int32) & 0x7FFFFFFF
    return torch.where(key > INF_KEY, NAN_KEY, key)


@triton.jit
def _key(c):
    # Sign cleared: for non-negative floats the integer order is the numeric
    # order. Every NaN gets one canonical key above +Inf (compress_math.h).
    key = c.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(key > 0x7F800000, 0x7FC00000, key)


@triton.jit
def _radix_hist_kernel(
    grad_ptr,
    res_ptr,
    n,
    state_ptr,
    hist_ptr,
    SHIFT: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Persistent programs, each looping over tiles: the global histogram then
    # takes 256 atomics per program, not per tile (all programs hit the same
    # 256 addresses, so per-tile atomics would serialize on large tensors).
    # An int64 start makes the loop counter int64, so tile * BLOCK cannot
    # wrap near n = 2^31.
    pid = tl.program_id(0).to(tl.int64)
    num_tiles = tl.cdiv(n, BLOCK)
    if SHIFT + 8 < 32:
        prefix = tl.load(state_ptr)
    hist = tl.zeros([256], dtype=tl.int32)
    for tile in tl.range(pid, num_tiles, tl.num_programs(0)):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = _key(load_c(grad_ptr, res_ptr, offs, mask, HAS_RES))
        if SHIFT + 8 < 32:
            # Only keys whose higher digits equal the prefix chosen so far.
            mask = mask & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram((key >> SHIFT) & 0xFF, 256, mask=mask)
    # Integer atomics commute, so the totals are deterministic; skipping empty
    # bins keeps the later (narrow) passes almost atomic-free.
    tl.atomic_add(hist_ptr + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _radix_pick_kernel(state_ptr, hist_ptr, SHIFT: tl.constexpr):
    # state = [prefix, rank]: the digits of the k-th largest key fixed so far,
    # and its 1-based rank among the keys that share them.
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + bins)
    prefix = tl.load(state_ptr)
    rank = tl.load(state_ptr + 1)
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    # at_or_above is non-increasing: the digit is the last bin still >= rank.
    digit = tl.sum((at_or_above >= rank).to(tl.int32)) - 1
    above = tl.sum(tl.where(bins > digit, hist, 0))
    tl.store(state_ptr, prefix | (digit << SHIFT))
    tl.store(state_ptr + 1, rank - above)
    tl.store(hist_ptr + bins, tl.zeros_like(hist))  # ready for the next pass


@triton.jit
def _count_kernel(
    grad_ptr,
    res_ptr,
    n,
    thr_ptr,
    above_ptr,
    equal_ptr,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _key(load_c(grad_ptr, res_ptr, offs, mask, HAS_RES))
    thr = tl.load(thr_ptr)
    tl.store(above_ptr + pid, tl.sum(((key > thr) & mask).to(tl.int32)))
    tl.store(equal_ptr + pid, tl.sum(((key == thr) & mask).to(tl.int32)))


@triton.jit
def _compact_kernel(
    grad_ptr,
    res_ptr,
    n,
    thr_ptr,
    offsets_ptr,
    eq_before_ptr,
    budget_ptr,
    idx_ptr,
    val_ptr,
    HAS_RES: tl.constexpr,
    LIMIT_EQ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_c(grad_ptr, res_ptr, offs, mask, HAS_RES)
    key = _key(c)
    thr = tl.load(thr_ptr)
    above = (key > thr) & mask
    equal = (key == thr) & mask
    if LIMIT_EQ:
        # Ties at the threshold are taken in index order until the budget is
        # spent: global rank among the ties = ties in earlier programs + local.
        eq_rank = tl.load(eq_before_ptr + pid) + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        equal = equal & (eq_rank < tl.load(budget_ptr))
    sel = above | equal
    pos = tl.load(offsets_ptr + pid) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + pos, offs.to(tl.int32), mask=sel)
    tl.store(val_ptr + pos, c, mask=sel)
    if HAS_RES:
        tl.store(res_ptr + offs, tl.where(sel, 0.0, c), mask=mask)


@triton.jit
def _scatter_kernel(
    idx_ptr, val_ptr, out_ptr, count, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < count
    idx = tl.load(idx_ptr + i, mask=mask, other=0).to(tl.int64)
    val = tl.load(val_ptr + i, mask=mask, other=0.0)
    if ACCUMULATE:
        # Indices are unique, so a plain read-add-write cannot race.
        val = tl.load(out_ptr + idx, mask=mask, other=0.0) + val
    tl.store(out_ptr + idx, val, mask=mask)


@functools.lru_cache(maxsize=None)
def _persistent_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # the interpreter: any number works


class _Pass:
    """The inputs of one compress call, shared by all its full-size passes."""

    def __init__(self, grad: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        self.grad = grad
        self.res = residual if residual is not None else grad  # unread without HAS_RES
        self.has_res = residual is not None
        self.n = grad.numel()
        self.programs = triton.cdiv(self.n, TILE)
        self.device = grad.device

    def count(self, thr: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-program counts of keys > thr and == thr (int32 [programs])."""
        above = torch.empty(self.programs, dtype=torch.int32, device=self.device)
        equal = torch.empty_like(above)
        wrap_triton(_count_kernel)[(self.programs,)](
            self.grad, self.res, self.n, thr, above, equal,
            HAS_RES=self.has_res, BLOCK=TILE, num_warps=NUM_WARPS,
        )
        return above, equal

    def kth_largest_key(self, k: int) -> torch.Tensor:
        """state int32 [2] on the device: [k-th largest key, k - #(keys > it)]."""
        # Filled in place rather than built from a list: no host-to-device copy.
        state = torch.zeros(2, dtype=torch.int32, device=self.device)
        state[1] = k
        hist = torch.zeros(RADIX_BINS, dtype=torch.int32, device=self.device)
        grid = (min(self.programs, _persistent_programs(self.device)),)
        for shift in RADIX_SHIFTS:
            wrap_triton(_radix_hist_kernel)[grid](
                self.grad, self.res, self.n, state, hist,
                SHIFT=shift, HAS_RES=self.has_res, BLOCK=TILE, num_warps=NUM_WARPS,
            )
            wrap_triton(_radix_pick_kernel)[(1,)](state, hist, SHIFT=shift, num_warps=1)
        return state

    def compact(
        self,
        thr: torch.Tensor,
        above: torch.Tensor,
        equal: torch.Tensor,
        total: int,
        budget: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the ``total`` selected entries (ascending): every key > thr
        and the first ``budget`` (all, if None) keys == thr; update the
        residual."""
        above = above.to(torch.int64)
        equal = equal.to(torch.int64)
        eq_before = torch.cumsum(equal, 0) - equal
        if budget is None:
            taken = above + equal
        else:
            taken = above + torch.minimum((budget - eq_before).clamp_(min=0), equal)
        offsets = torch.cumsum(taken, 0) - taken
        indices = torch.empty(total, dtype=torch.int32, device=self.device)
        values = torch.empty(total, dtype=torch.float32, device=self.device)
        wrap_triton(_compact_kernel)[(self.programs,)](
            self.grad, self.res, self.n, thr, offsets, eq_before,
            budget if budget is not None else offsets,  # unread without LIMIT_EQ
            indices, values,
            HAS_RES=self.has_res, LIMIT_EQ=budget is not None, BLOCK=TILE, num_warps=NUM_WARPS,
        )
        return indices, values


def _sample_threshold(grad, residual, positions, rank) -> Tensor:
    # The sample is small (~256 n / k elements): torch ops are fine here.
    c = grad[positions].float()
    if residual is not None:
        c = c + residual[positions]
    return torch.topk(keys(c), rank, sorted=True).values[-1:]


def _select_and_compact(grad, residual, k, approx):
    # select_reference's control flow, step for step.
    n = grad.numel()
    p = _Pass(grad, residual)
    if approx:
        stride = sample_stride(n, k)
        s = n // stride
        positions = torch.arange(s, device=grad.device) * stride + stride // 2
        rank = sample_rank(n, k, s)
        for attempt in range(2):
            thr = _sample_threshold(grad, residual, positions, rank)
            above, equal = p.count(thr)
            # The one host sync of approximate mode: the control flow and the
            # output size depend on the count.
            count = int(above.sum(dtype=torch.int64) + equal.sum(dtype=torch.int64))
            if accept(count, k):
                return p.compact(thr, above, equal, count, None)
            if attempt == 0:
                new_rank = retry_rank(rank, k, count, s)
                if new_rank == rank:
                    break
                rank = new_rank

    state = p.kth_largest_key(k)
    thr = state[0:1]
    budget = state[1:2].to(torch.int64)  # = k - #(keys > thr), from the select
    above, equal = p.count(thr)
    return p.compact(thr, above, equal, k, budget)


# ------------------------------------------------------------------- ops ---
# Both ops stay opaque under torch.compile (traceable=False): compress syncs
# with the host in approximate mode and returns a data-dependent number of
# entries, and decompress takes such a payload, whose size a traced body
# could not branch on.
def _compress_fake(grad, residual, k, approx):
    # Between k and the capacity in approximate mode, as the C++ op's fake.
    count = torch.library.get_ctx().new_dynamic_size(min=k, max=topk_capacity(k)) if approx else k
    return grad.new_empty((count,), dtype=torch.int32), grad.new_empty((count,), dtype=torch.float32)


@register_op(
    "pycomm::topk_compress_triton", mutates_args=("residual",), fake=_compress_fake, traceable=False
)
def topk_compress_triton(
    grad: Tensor, residual: Optional[Tensor], k: int, approx: bool
) -> Tuple[Tensor, Tensor]:
    """pycomm::topk_compress on Triton kernels (see :func:`compress`)."""
    check_compress_inputs(grad, residual)
    n = grad.numel()
    check(1 <= k <= n, f"k must be in [1, numel={n}], got {k}")
    with device_guard(grad):
        return _select_and_compact(grad, residual, k, approx)


def _decompress_fake(out, indices, values, accumulate):
    return None


@register_op(
    "pycomm::topk_decompress_triton", mutates_args=("out",), fake=_decompress_fake, traceable=False
)
def topk_decompress_triton(out: Tensor, indices: Tensor, values: Tensor, accumulate: bool) -> None:
    """pycomm::topk_decompress on Triton kernels (see :func:`decompress`)."""
    check_out(out, values.device)
    check(
        indices.dtype == torch.int32 and indices.is_contiguous() and indices.dim() == 1,
        "indices must be a contiguous 1-D int32 tensor",
    )
    check(
        values.dtype == torch.float32 and values.is_contiguous() and values.dim() == 1,
        "values must be a contiguous 1-D float32 tensor",
    )
    count = indices.numel()
    check(count == values.numel(), f"indices has {count} entries but values has {values.numel()}")
    check(indices.device == values.device, "indices and values are on different devices")
    if not out.is_cuda and count:
        # As the C++ CPU op. Interpreted, a stray index would write outside
        # out; on a GPU the check would cost a host sync (the CUDA op skips it too).
        ok = bool(indices[0] >= 0) and bool(indices[-1] < out.numel()) and bool((indices[1:] > indices[:-1]).all())
        check(ok, f"indices must be strictly ascending and lie in [0, {out.numel()})")
    if not accumulate:
        out.zero_()  # a memset; no kernel of ours beats it
    if count == 0:
        return
    with device_guard(out):
        wrap_triton(_scatter_kernel)[(triton.cdiv(count, SCATTER_TILE),)](
            indices, values, out, count, ACCUMULATE=accumulate, BLOCK=SCATTER_TILE, num_warps=4
        )


# ------------------------------------------------------------ python API ---
def compress(grad: Tensor, residual: Optional[Tensor], k: int, approx: bool) -> Tuple[Tensor, Tensor]:
    """Top-k of ``c = grad + residual`` by magnitude key.

    ``grad``: contiguous float32/float16/bfloat16 of n elements;
    ``residual``: contiguous float32 of n elements, or None. Returns
    ``(indices, values)``: int32 ascending indices and float32 ``c`` at them;
    exactly k entries in exact mode (ties by lowest index), between k and
    ``topk_capacity(k)`` in approximate mode. ``residual`` becomes ``c`` with
    the selected entries set to 0. Runs ``torch.ops.pycomm.topk_compress_triton``.

    Example (on CPU tensors under TRITON_INTERPRET=1, or on a GPU)::

        >>> idx, val = compress(torch.tensor([0.5, -4.0, 1.0, 3.0]), None, 2, False)
        >>> idx.tolist(), val.tolist()
        ([1, 3], [-4.0, 3.0])
    """
    return torch.ops.pycomm.topk_compress_triton(grad, residual, k, approx)


def decompress(indices: Tensor, values: Tensor, out: Tensor, accumulate: bool) -> None:
    """Scatter a topk payload into ``out`` (contiguous float32).

    Without ``accumulate``: ``out`` = 0 except ``out[indices] = values``;
    with it: ``out[indices] += values``. ``indices`` must be unique (as
    compress produces them). Runs ``torch.ops.pycomm.topk_decompress_triton``.

    Example::

        >>> out = torch.ones(4)
        >>> decompress(torch.tensor([1, 3], dtype=torch.int32), torch.tensor([-4.0, 3.0]), out, True)
        >>> out.tolist()
        [1.0, -3.0, 1.0, 4.0]
    """
    torch.ops.pycomm.topk_decompress_triton(out, indices, values, accumulate)
