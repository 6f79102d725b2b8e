"""The spec of pycomm's compressed collectives, defined once (docs/allreduce.md).

The method table (:data:`METHOD_TABLE`, one row per method, from which every
list of methods derives), the chunk layout, the block codecs' segment
layout, the wire sizes (:func:`wire_bytes`) and the fields of the cross-rank
call check. The C++ engine (csrc/distributed/spec.h) mirrors these;
``pycomm._C.spec()`` returns its copy and tests/test_spec.py compares the
two, so neither can drift.

Example::

    >>> from pycomm.distributed import spec
    >>> spec.METHODS[:5]
    ('onebit', 'topk', 'fp16', 'bf16', 'none')
    >>> spec.chunk_bounds(2_500_000, 1 << 20)   # round(2.38) = 2 chunks
    [(0, 1250000), (1250000, 2500000)]
    >>> spec.block_segments(1000, 4, 64)        # 4 segments of 256 (4 blocks)
    (256, [(0, 256), (256, 512), (512, 768), (768, 1000)])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compressors.base import compressor_names, register
from ..compressors.quant import quant_class
from ..wire import WORD_BITS, topk_capacity, topk_k


@dataclass(frozen=True)
class MethodSpec:
    """One row of :data:`METHOD_TABLE`: what pycomm knows about a method.

    - ``name``: what users pass (``compressor="int8"``); its index in the
      table is its code on the wire of the call check.
    - ``kind``: ``"block"`` (a scale per block, all-reduced in two phases:
      segment ``j`` of each chunk reduced by rank ``j``, then all-gathered;
      gathered whole on a small tensor, :func:`all_reduce_gathers`),
      ``"sparse"`` (top-k entries all-gathered), ``"cast"`` (a ring
      all-reduce of a narrower float) or ``"exact"`` (the inner backend's
      all-reduce). A registered compressor has kind ``"plugin"``
      (:func:`method_spec`).
    - ``family``: the kernel family that codes it (the name of its files in
      every layer: ``kernels/cpu/<family>.cpp``, ``pycomm/compressors/<family>.py``,
      ...): ``"onebit"``, ``"quant"`` (block quantization to ``bits``-bit
      levels), ``"topk"``; None for a cast or the exact all-reduce.
    - ``bits``: bits per element of the data on the wire (0: top-k, whose
      payload is per kept entry, not per element). A quant row's kernels take
      it as data: a new width is a new row.
    - ``block_size``: the block length when none is given (0: no blocks).
      onebit's scale is a mean; int8/int4's an absmax, which needs shorter
      blocks to keep its levels fine.
    - ``rounds``: takes ``rounding="stochastic"``.
    - ``residuals``: can keep error-feedback residuals.
    - ``error_feedback``: error feedback is on by default where a user does
      not choose, in every entry point (the DDP hook, FSDP, DiLoCo): the
      methods biased enough to need it (onebit, topk, the 2-bit levels).
    - ``dtype``: the wire dtype of a cast, else None.
    - ``auto_candidate``: measured by ``compressor="auto"`` (docs/auto.md).
      bf16 is not: it costs what fp16 costs and keeps fewer mantissa bits.

    >>> method_spec("int4").bits, method_spec("onebit").block_size, method_spec("bf16").dtype
    (4, 2048, torch.bfloat16)
    """

    name: str
    kind: str
    family: Optional[str]
    bits: int
    block_size: int = 0
    rounds: bool = False
    residuals: bool = False
    error_feedback: bool = False
    dtype: Optional[torch.dtype] = None
    auto_candidate: bool = True


#: Every method a compressed call can run, once. The row's index is the
#: method's code on the wire of the call check. csrc/distributed/spec.h
#: mirrors the table (tests/test_spec.py compares the two field by field),
#: and every list of methods in pycomm derives from it
#: (tests/test_method_table.py fails on a literal one anywhere else). Adding
#: a block codec: its kernels, a row here and in spec.h, its tests
#: (docs/architecture.md).
METHOD_TABLE = (
    MethodSpec("onebit", "block", "onebit", 1, block_size=2048, residuals=True, error_feedback=True),
    MethodSpec("topk", "sparse", "topk", 0, residuals=True, error_feedback=True),
    MethodSpec("fp16", "cast", None, 16, dtype=torch.float16),
    MethodSpec("bf16", "cast", None, 16, dtype=torch.bfloat16, auto_candidate=False),
    MethodSpec("none", "exact", None, 32),
    MethodSpec("int8", "block", "quant", 8, block_size=256, rounds=True, residuals=True),
    MethodSpec("int4", "block", "quant", 4, block_size=256, rounds=True, residuals=True),
    # TernGrad's levels -1/0/+1 (scaled by the block's absmax): biased enough
    # to need error feedback; not a candidate of "auto", which chooses by
    # speed alone.
    MethodSpec("int2", "block", "quant", 2, block_size=256, rounds=True, residuals=True, error_feedback=True,
               auto_candidate=False),
)


# Every quant row is the compressor of its width under the row's name
# (``pycomm.get_compressor(name)``): a new width is a new row, nothing else.
for _row in METHOD_TABLE:
    if _row.family == "quant":
        register(_row.name)(quant_class(_row.bits))


def methods(**where: Any) -> Tuple[str, ...]:
    """The names of the table's rows whose fields equal ``where``, in code
    order.

    >>> methods(kind="block"), methods(rounds=True), methods(kind="cast")
    (('onebit', 'int8', 'int4', 'int2'), ('int8', 'int4', 'int2'), ('fp16', 'bf16'))
    """
    bad = set(where) - {f.name for f in fields(MethodSpec)}
    if bad:
        raise TypeError(f"MethodSpec has no field {sorted(bad)[0]!r}")
    return tuple(m.name for m in METHOD_TABLE if all(getattr(m, k) == v for k, v in where.items()))


#: What a compressed call can run, in code order. "none" is the exact
#: all-reduce of the inner backend.
METHODS = methods()
#: The exact all-reduce of the inner backend: what every tensor below a
#: group's ``min_compress_numel`` runs.
EXACT_METHOD = methods(kind="exact")[0]
#: A group setting, not a method: each all-reduce runs the method a
#: calibration predicts fastest for its size (docs/auto.md).
AUTO_METHOD = "auto"
#: What a group can be configured with: a method, or "auto".
GROUP_METHODS = METHODS + (AUTO_METHOD,)


def is_plugin(name: str) -> bool:
    """True when ``name`` is a registered compressor
    (:func:`pycomm.register_compressor`), which the engine runs through the
    ops of :mod:`pycomm.compressors.plugin`; False for pycomm's own methods
    (and "auto"), which it runs natively, and for unknown names.

    >>> is_plugin("onebit"), is_plugin("no-such-compressor")
    (False, False)
    """
    return isinstance(name, str) and name not in GROUP_METHODS and name in compressor_names()
#: The methods "auto" measures and chooses from, most bits first: of two
#: methods predicted equally fast, the more exact one wins (the exact
#: all-reduce first).
AUTO_METHODS = tuple(m.name for m in sorted(METHOD_TABLE, key=lambda m: -m.bits) if m.auto_candidate)
#: The block codecs.
BLOCK_METHODS = methods(kind="block")
#: block_size when none is given.
DEFAULT_BLOCK_SIZE = {m.name: m.block_size for m in METHOD_TABLE if m.block_size}
#: The methods that keep error-feedback residuals.
EF_METHODS = methods(residuals=True)
#: The methods that take ``rounding="stochastic"``.
ROUNDING_METHODS = methods(rounds=True)
#: The ring all-reduces of a narrower float, and the exact one.
CAST_METHODS = methods(kind="cast")
UNCOMPRESSED_METHODS = CAST_METHODS + methods(kind="exact")


def method_spec(name: str) -> MethodSpec:
    """The table's row of ``name``; a registered compressor
    (``pycomm.register_compressor``) gets a ``"plugin"`` row that keeps
    residuals.

    >>> method_spec("topk").kind
    'sparse'
    >>> method_spec("int3")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown method 'int3'; choose one of [...] or a registered compressor
    """
    for m in METHOD_TABLE:
        if m.name == name:
            return m
    if is_plugin(name):
        return MethodSpec(name, "plugin", None, 0, residuals=True, error_feedback=True, auto_candidate=False)
    raise ValueError(f"unknown method {name!r}; choose one of {list(METHODS)} or a registered compressor")


def error_feedback_for(method: str, error_feedback: Optional[bool]) -> bool:
    """The one error-feedback rule of every entry point (the DDP hook, FSDP,
    DiLoCo): ``error_feedback`` as given, or None for the method's default
    (its row's ``error_feedback``; "auto" keeps residuals for the buckets it
    sends by a method that keeps them). True needs a method that keeps
    residuals.

    >>> error_feedback_for("onebit", None), error_feedback_for("int8", None), error_feedback_for("int8", True)
    (True, False, True)
    >>> error_feedback_for("fp16", True)
    Traceback (most recent call last):
    ...
    ValueError: error_feedback=True: compressor 'fp16' keeps no residuals; pass error_feedback=False (or None)
    """
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be a bool or None, got {error_feedback!r}")
    if method == AUTO_METHOD:
        return True if error_feedback is None else error_feedback
    row = method_spec(method)
    if error_feedback is None:
        return row.error_feedback
    if error_feedback and not row.residuals:
        raise ValueError(f"error_feedback=True: compressor {method!r} keeps no residuals; "
                         f"pass error_feedback=False (or None)")
    return error_feedback


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


#: A block codec's all-reduce of ``n`` elements over ``W`` ranks runs the
#: gathered algorithm when ``n * W <= GATHER_NUMEL``: one all-gather of every
#: rank's payload, which every rank decodes and adds in rank order (one
#: compression, no server residual), in place of the two-phase one's two
#: dependent exchanges. Such a call is bound by latency, not bytes: it waits
#: for one collective instead of two (docs/allreduce.md, "Small tensors").
GATHER_NUMEL = 1 << 14


def all_reduce_gathers(method: str, numel: int, world_size: int) -> bool:
    """Whether the engine's all-reduce of ``numel`` elements by ``method``
    over ``world_size`` ranks runs the gathered algorithm: top-k's and a
    registered compressor's always, a block codec's at ``numel * world_size
    <= GATHER_NUMEL`` (above, the two-phase one); a cast's or the exact
    all-reduce never. The one rule: the engine (spec.h), the simulation and
    :func:`wire_bytes` follow it.

    >>> all_reduce_gathers("onebit", 1024, 1), all_reduce_gathers("onebit", 1 << 14, 2)
    (True, False)
    >>> all_reduce_gathers("topk", 1 << 20, 8), all_reduce_gathers("fp16", 1024, 2)
    (True, False)
    """
    kind = method_spec(method).kind
    if kind == "block":
        return numel <= GATHER_NUMEL // max(1, world_size)
    return kind in ("sparse", "plugin")


def default_chunk_numel(device_type: str, inner: Optional[str] = None) -> int:
    """The engine's chunk when none is given, for tensors on ``device_type``
    over ``inner`` (None: what a group there wraps, NCCL on cuda, Gloo
    elsewhere): the one place the optimizers, DiLoCo and ``pycomm plan``
    take it from before an engine group exists (docs/allreduce.md, "Chunks").

    >>> default_chunk_numel("cuda"), default_chunk_numel("cpu"), default_chunk_numel("cuda", "gloo")
    (67108864, 1048576, 1048576)
    """
    return DEFAULT_CHUNK_NUMEL_BY_INNER[inner or ("nccl" if device_type == "cuda" else "gloo")]


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


def check_key(key: Any) -> None:
    """Refuse a key the engine cannot hold: keys are int64, non-negative
    (None: a keyless call).

    >>> check_key(2**63)
    Traceback (most recent call last):
    ...
    ValueError: key must be an int in [0, 2**63) (the engine's keys are int64) or None, got 9223372036854775808
    """
    if key is not None and (isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**63):
        raise ValueError(f"key must be an int in [0, 2**63) (the engine's keys are int64) or None, got {key!r}")


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


def block_wire_numel(length: int, block_size: int, bits: int) -> int:
    """int32 elements of a block codec's segment payload of ``length``
    elements of ``bits`` bits: the data (``ceil(L * bits / 32)`` words: onebit's
    sign words, a quant codec's level bytes zero-padded to a multiple of 4),
    then ``ceil(L/B)`` scales; 0 for an empty segment.

    >>> block_wire_numel(100, 64, 1), block_wire_numel(100, 64, 8), block_wire_numel(99, 64, 4)
    (6, 27, 15)
    """
    if length == 0:
        return 0
    return _cdiv(length * bits, WORD_BITS) + _cdiv(length, block_size)


def topk_wire_numel(m: int, density: float, approx: bool) -> int:
    """int32 elements of a topk chunk payload ``[count, indices, values]``
    padded to ``1 + 2 * cap``, then the call's tag (:data:`TAG_WORDS`)."""
    k = topk_k(m, density)
    cap = topk_capacity(k) if approx else k
    return 1 + 2 * cap + TAG_WORDS


def wire_bytes(method: str, numel: int, world_size: int, *, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
               block_size: Optional[int] = None, density: float = 0.01, approx: bool = True,
               itemsize: int = 4, payload_nbytes: Optional[Callable[[int], int]] = None) -> int:
    """Bytes one rank puts on the wire per all-reduce of ``numel`` elements
    by ``method`` over ``world_size`` ranks: the most any rank sends, where
    ranks differ. The one byte formula of pycomm (the optimizers, the
    benchmarks and ``pycomm plan`` use it; docs/allreduce.md, "Bytes").

    - ``none``: a ring all-reduce, 2 (W-1) steps of n/W elements of
      ``itemsize`` bytes; a cast the same ring on its dtype's width. (The
      engine's keyed calls of these add one element per row, their call
      check: not counted.)
    - a block codec at ``n W <= GATHER_NUMEL`` (:func:`all_reduce_gathers`),
      per chunk: its payload of the chunk and the tag to each of the W-1 peers.
    - a block codec above, per chunk: the all_to_all sends segment j's payload to
      rank j for every j != r ((W-1)/W of one compressed copy), the
      all_gather this rank's server payload, padded to segment 0's, and the
      call's tag to each of the W-1 peers.
    - ``topk``, per chunk: the padded ``1 + 2 cap`` int32 buffer and the tag
      to each of the W-1 peers.
    - a registered compressor, per chunk: its payload
      (``payload_nbytes(chunk length)``) and the tag to each of the W-1 peers.

    The piece a rank "sends" to itself never reaches the wire.

    >>> wire_bytes("none", 1 << 20, 4)          # 1.5 * 4 MiB
    6291456
    >>> wire_bytes("onebit", 1 << 20, 4)        # 2 (W-1) payloads of 8192 words + 128 scales, 3 tags
    199704
    >>> wire_bytes("bf16", 1 << 20, 4), wire_bytes("int8", 1000, 1)
    (3145728, 0)
    """
    spec_ = method_spec(method)
    if world_size < 2 or numel == 0:
        return 0
    if spec_.kind in ("exact", "cast"):
        width = itemsize if spec_.kind == "exact" else spec_.dtype.itemsize
        return 2 * (world_size - 1) * width * numel // world_size
    if spec_.kind == "plugin" and payload_nbytes is None:
        raise ValueError(f"wire_bytes of the registered compressor {method!r} needs payload_nbytes")
    block = block_size_for(method, block_size)
    total = [0] * world_size
    for begin, end in chunk_bounds(numel, chunk_numel):
        m = end - begin
        if spec_.kind == "block" and all_reduce_gathers(method, numel, world_size):
            per_peer = 4 * (block_wire_numel(m, block, spec_.bits) + TAG_WORDS)
            total = [t + (world_size - 1) * per_peer for t in total]
        elif spec_.kind == "block":
            _, segs = block_segments(m, world_size, block)
            sizes = [block_wire_numel(e - b, block, spec_.bits) for b, e in segs]
            for r in range(world_size):
                total[r] += 4 * (sum(sizes[j] for j in range(world_size) if j != r)
                                 + (world_size - 1) * (sizes[0] + TAG_WORDS))
        elif spec_.kind == "sparse":
            per_peer = 4 * topk_wire_numel(m, density, approx)
            total = [t + (world_size - 1) * per_peer for t in total]
        else:
            per_peer = int(payload_nbytes(m)) + 4 * TAG_WORDS
            total = [t + (world_size - 1) * per_peer for t in total]
    return max(total)


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
