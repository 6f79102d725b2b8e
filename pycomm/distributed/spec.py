"""The spec of pycomm's compressed collectives, defined once (docs/allreduce.md).

Method names and their codes, the chunk layout, onebit's segment layout, the
wire sizes and the fields of the cross-rank call check. The C++ engine
(csrc/distributed/spec.h) mirrors these; ``pycomm._C.spec()`` returns its
copy and tests/test_spec.py compares the two, so neither can drift.

Example::

    >>> from pycomm.distributed import spec
    >>> spec.METHODS
    ('onebit', 'topk', 'fp16', 'bf16', 'none', 'int8', 'int4')
    >>> spec.chunk_bounds(2_500_000, 1 << 20)   # round(2.38) = 2 chunks
    [(0, 1250000), (1250000, 2500000)]
    >>> spec.block_segments(1000, 4, 64)        # 4 segments of 256 (4 blocks)
    (256, [(0, 256), (256, 512), (512, 768), (768, 1000)])
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch.distributed as dist

from ..wire import WORD_BITS, quant_num_bytes, topk_capacity, topk_k

#: What a compressed call can run; the index is the method's code on the wire
#: of the call check. "none" is the exact all-reduce of the inner backend.
METHODS = ("onebit", "topk", "fp16", "bf16", "none", "int8", "int4")
#: What a group can be configured with: a method, or "auto" (one per size,
#: from a calibration: docs/auto.md).
GROUP_METHODS = METHODS + ("auto",)
#: The block codecs: a scale per block, all-reduced in two phases (segment
#: ``j`` of each chunk reduced by rank ``j``, then all-gathered); the value is
#: the bits per element of the codec's data (0: onebit's sign bits).
BLOCK_BITS = {"onebit": 0, "int8": 8, "int4": 4}
BLOCK_METHODS = tuple(BLOCK_BITS)
#: block_size when none is given: onebit's scale is a mean; int8/int4's an
#: absmax, which needs shorter blocks to keep its levels fine.
DEFAULT_BLOCK_SIZE = {"onebit": 2048, "int8": 256, "int4": 256}
#: The methods that keep error-feedback residuals.
EF_METHODS = ("onebit", "topk", "int8", "int4")
#: Chunk length (elements) of the engine's pipeline when none is given: 1 Mi
#: elements (4 MiB of float32), chunk i+1 compressed while chunk i is on the
#: wire. Results depend on it (segment and block starts), so every party
#: that must agree uses the same value: the one a group reports
#: (``pd.options_of(group)["chunk_numel"]``).
DEFAULT_CHUNK_NUMEL = 1 << 20
#: The default by the wrapped backend. Over NCCL 64 Mi elements: a GPU
#: compresses a 1 Mi chunk in microseconds, so overlapping it with the wire
#: saves next to nothing, while each chunk costs the engine's thread a
#: quarter of a millisecond of launches and collectives (measured on an
#: H200: a 64 Mi-element onebit all-reduce took 18.2 ms in 1 Mi chunks, 1.4
#: ms in one; docs/performance.md, "The engine on a GPU").
DEFAULT_CHUNK_NUMEL_BY_INNER = {"gloo": DEFAULT_CHUNK_NUMEL, "nccl": 1 << 26}
#: When the ranks compare their compressed calls: never, at the first use of
#: each key and keyless (numel, dtype, op), or every call. The index is the
#: engine's code. ``PYCOMM_DEBUG=detail`` in the environment means "every".
CHECK_MODES = ("off", "first", "every")
#: int32 words of the tag that ends every compressed payload a rank
#: all-gathers or sends to every rank in an all_to_all: a hash of the call
#: (collective, key, size, dtype, op). Every rank receives every rank's tag
#: in the same exchange, so ranks that ran different calls at one position
#: (calls submitted from several threads in a different order on each rank)
#: all raise (docs/allreduce.md, "Call tags").
TAG_WORDS = 2
#: The fields of the call descriptor the ranks compare, in wire order.
CALL_FIELDS = ("numel", "dtype", "op", "key", "compressor", "chunk_numel", "block_size", "density",
               "approx", "device type", "collective", "rounding seed")
#: How a group's int8/int4 calls round: to nearest (half to even), or
#: stochastically (unbiased) with seeds from :func:`rounding_seed`.
ROUNDINGS = ("nearest", "stochastic")
#: The compressed collectives; the index is the code in the call check.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
#: A reduce-scatter's and an all-gather's residuals are kept under the
#: method's name with these suffixes (worker residual only), never mixed
#: with an all-reduce's.
REDUCE_SCATTER_SUFFIX = "/reduce_scatter"
ALL_GATHER_SUFFIX = "/all_gather"


def rounding_seed(seed: int, stream: int, call: int, collective: int, rank: int, chunk: int,
                  part: int) -> int:
    """The kernel seed of one int8/int4 compress of a stochastically rounded
    call: a 32-bit hash (FNV-1a) of the group's ``seed``, the call's
    ``stream`` (its key, or -1 for a keyless call), its number ``call`` on
    that stream (a key's count is saved with its residuals; keyless calls
    count from the group's creation), the ``collective`` (index in
    :data:`COLLECTIVES`), the global ``rank``, the ``chunk`` and the
    ``part`` (all-reduce: 0 for the worker compress, 1 for the server
    compress; reduce-scatter: the destination shard; all-gather: 0).

    >>> rounding_seed(0, 3, 0, 0, 1, 0, 0) != rounding_seed(0, 3, 1, 0, 1, 0, 0)
    True
    """
    h = 1469598103934665603
    for v in (seed, stream, call, collective, rank, chunk, part):
        v &= (1 << 64) - 1
        for b in range(8):
            h = ((h ^ ((v >> (8 * b)) & 0xFF)) * 1099511628211) & ((1 << 64) - 1)
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def method_code(method: str) -> int:
    """The code of ``method`` (its index in :data:`METHODS`).

    >>> method_code("topk")
    1
    """
    try:
        return METHODS.index(method)
    except ValueError:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}") from None


def check_mode(mode: str = "first", name: str = "check_calls") -> str:
    """``mode``, or "every" when the environment says ``PYCOMM_DEBUG=detail``
    (``name``: the argument's name in the error for a bad ``mode``)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"{name} must be one of {list(CHECK_MODES)}, got {mode!r}")
    if os.environ.get("PYCOMM_DEBUG", "").lower() == "detail":
        return "every"
    return mode


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_length(numel: int, chunk_numel: int) -> int:
    """The length of the chunks a ``numel``-element tensor is cut into:
    ``round(numel / chunk_numel)`` chunks (at least one) of equal length but
    the last. Never a small tail chunk: a bucket slightly over
    ``chunk_numel`` is one chunk, not a chunk and a sliver that costs as many
    collectives as a full one.

    >>> chunk_length(1_050_000, 1 << 20), chunk_length(1_600_000, 1 << 20), chunk_length(0, 8)
    (1050000, 800000, 1)
    """
    count = max(1, (2 * numel + chunk_numel) // (2 * chunk_numel))
    return max(1, -(-numel // count))


def chunk_bounds(numel: int, chunk_numel: int) -> List[Tuple[int, int]]:
    """``[(start, end), ...]`` of the chunks of a ``numel``-element tensor,
    each :func:`chunk_length` long but the last; ``[]`` for an empty tensor."""
    c = chunk_length(numel, chunk_numel)
    return [(s, min(numel, s + c)) for s in range(0, numel, c)]


def block_size_for(method: str, block_size: "int | None") -> int:
    """The block length ``method`` runs with: ``block_size``, or the method's
    default when it is None (0 for a method without blocks).

    >>> block_size_for("int4", None), block_size_for("onebit", None), block_size_for("int8", 64)
    (256, 2048, 64)
    """
    if block_size:
        return int(block_size)
    return DEFAULT_BLOCK_SIZE.get(method, 0)


def block_segments(m: int, world_size: int, block_size: int) -> Tuple[int, List[Tuple[int, int]]]:
    """``(seg, [(start, end) of segment j for j in 0..W-1])`` for a chunk of
    ``m`` elements of a block codec: ``seg`` is a whole number of blocks;
    segment ``j`` is ``[j*seg, min(m, (j+1)*seg))`` clipped to ``m``
    (possibly empty). Rank ``j`` reduces segment ``j`` (the reduce-scatter
    phase)."""
    seg = _cdiv(_cdiv(m, world_size), block_size) * block_size
    bounds = [(min(m, j * seg), min(m, (j + 1) * seg)) for j in range(world_size)]
    return seg, bounds


def block_wire_numel(length: int, block_size: int, bits: int = 0) -> int:
    """int32 elements of a block codec's segment payload of ``length``
    elements: the data (onebit: ``ceil(L/32)`` sign words; int8/int4: the
    level bytes zero-padded to a multiple of 4), then ``ceil(L/B)`` scales;
    0 for an empty segment.

    >>> block_wire_numel(100, 64), block_wire_numel(100, 64, 8), block_wire_numel(99, 64, 4)
    (6, 27, 15)
    """
    if length == 0:
        return 0
    data = _cdiv(length, WORD_BITS) if bits == 0 else _cdiv(quant_num_bytes(length, bits), 4)
    return data + _cdiv(length, block_size)


def topk_wire_numel(m: int, density: float, approx: bool) -> int:
    """int32 elements of a topk chunk payload ``[count, indices, values]``
    padded to ``1 + 2 * cap``, then the call's tag (:data:`TAG_WORDS`)."""
    k = topk_k(m, density)
    cap = topk_capacity(k) if approx else k
    return 1 + 2 * cap + TAG_WORDS


def normalize_op(op: Any) -> str:
    """``"sum"`` or ``"avg"`` from a string (any case) or a ``dist.ReduceOp``.

    >>> normalize_op("AVG"), normalize_op(dist.ReduceOp.SUM)
    ('avg', 'sum')
    """
    if isinstance(op, str):
        low = op.lower()
        if low in ("sum", "avg"):
            return low
    else:
        try:
            if op == dist.ReduceOp.SUM:
                return "sum"
            if op == dist.ReduceOp.AVG:
                return "avg"
        except TypeError:
            pass
    raise ValueError(f"op must be 'sum' or 'avg' (or ReduceOp.SUM / ReduceOp.AVG), got {op!r}")
