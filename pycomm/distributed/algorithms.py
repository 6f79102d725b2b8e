"""The compressed all-reduce algorithms of ``docs/allreduce.md``, in Python,
over any torch.distributed process group (plain Gloo or NCCL).

This is the path the DDP hook takes over an ordinary process group; the
``"pycomm"`` backend runs the same algorithms in C++. Both follow the spec to
the letter (chunking, segment layout, wire formats, accumulation order, AVG
division), so that :func:`pycomm.distributed.simulate.simulate_allreduce`, a
single-process simulation built from the reference compressors, is the
oracle of both.

Example (on every rank of an initialized process group)::

    import torch
    from pycomm.distributed.algorithms import ErrorFeedback, allreduce_compressed

    grad = torch.randn(1_000_000)
    ef = ErrorFeedback()                   # one per tensor, kept across steps
    allreduce_compressed(grad, method="onebit", op="avg", ef=ef, block_size=2048)
    # grad now holds the (compressed) average, identical on every rank

Wire formats (int32 buffers, so that every backend can move them):

* onebit segment payload: ``ceil(L/32)`` packed words, then ``ceil(L/B)``
  scales as float32 bits; sent with one uneven ``all_to_all_single`` (worker
  stage) and one ``all_gather`` padded to the largest segment (server stage).
* topk payload: ``[count, indices (count), values as float32 bits (count)]``,
  zero-padded to ``1 + 2 * cap`` elements; one ``all_gather``.
* fp16 / bf16: a plain SUM all-reduce of the cast tensor.
"""

from __future__ import annotations

import os
import struct
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import get_compressor
from ..compressors.onebit import WORD_BITS, OneBitPayload
from ..compressors.topk import TopKPayload, topk_capacity, topk_k

__all__ = [
    "CHECK_MODES",
    "DEFAULT_CHUNK_NUMEL",
    "METHODS",
    "ErrorFeedback",
    "allreduce_cast",
    "allreduce_compressed",
    "allreduce_onebit",
    "allreduce_topk",
    "check_mode",
    "chunk_bounds",
    "chunk_length",
    "describe_call",
    "normalize_op",
    "onebit_segments",
    "onebit_wire_numel",
    "topk_wire_numel",
]

#: Methods understood by :func:`allreduce_compressed`.
METHODS = ("onebit", "topk", "fp16", "bf16")

#: Chunk length (elements) when the caller gives none: 1 Mi elements (4 MiB
#: of float32). Results depend on it (segment and block starts), so every
#: implementation that must agree uses the same value.
DEFAULT_CHUNK_NUMEL = 1 << 20

_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------ layout ---
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_length(numel: int, chunk_numel: int) -> int:
    """The length of the chunks a ``numel``-element tensor is cut into
    (docs/allreduce.md, "Chunks"): ``round(numel / chunk_numel)`` chunks (at
    least one) of equal length but the last. Never a small tail chunk: a
    bucket slightly over ``chunk_numel`` is one chunk, not a chunk and a
    sliver that costs as many collectives as a full one.

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


def onebit_segments(m: int, world_size: int, block_size: int) -> Tuple[int, List[Tuple[int, int]]]:
    """Spec step 1: ``(seg, [(start, end) of segment j for j in 0..W-1])`` for
    a chunk of ``m`` elements. ``seg`` is a whole number of blocks; segment
    ``j`` is ``[j*seg, min(m, (j+1)*seg))`` clipped to ``m`` (possibly empty)."""
    seg = _cdiv(_cdiv(m, world_size), block_size) * block_size
    bounds = [(min(m, j * seg), min(m, (j + 1) * seg)) for j in range(world_size)]
    return seg, bounds


def onebit_wire_numel(length: int, block_size: int) -> int:
    """``S``: int32 elements of a segment payload of ``length`` elements
    (words then scales; 0 for an empty segment)."""
    if length == 0:
        return 0
    return _cdiv(length, WORD_BITS) + _cdiv(length, block_size)


def topk_wire_numel(m: int, density: float, approx: bool) -> int:
    """int32 elements of a topk chunk payload: ``1 + 2 * cap``."""
    k = topk_k(m, density)
    cap = topk_capacity(k) if approx else k
    return 1 + 2 * cap


def normalize_op(op: Any) -> str:
    """``"sum"`` or ``"avg"`` from a string (any case) or a ``dist.ReduceOp``."""
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


def _check_chunk_numel(chunk_numel: Optional[int]) -> int:
    if chunk_numel is None:
        return DEFAULT_CHUNK_NUMEL
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be a positive integer, got {chunk_numel!r}")
    return chunk_numel


def _check_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"compressed all-reduce needs a float32, float16 or bfloat16 tensor, got {tensor.dtype}"
        )


# ----------------------------------------------------------- error feedback ---
class ErrorFeedback:
    """Error-feedback residuals of one tensor on one rank, kept across steps.

    * ``worker``: float32, one element per tensor element (onebit and topk);
      ``c = x + worker`` is what gets compressed, and ``worker`` keeps what
      was not sent.
    * ``server`` (onebit only): float32, the concatenation over chunks, in
      chunk order, of this rank's segment of each chunk (spec step 1), i.e.
      ``sum over chunks of L_rank``; :meth:`server_segment` gives chunk
      ``i``'s part. ``None`` for topk.

    The buffers are created (zeros) on first use and bound to a layout:
    method, numel, world size, rank, chunk_numel and (onebit) block_size.
    Using the object with any other layout raises ``ValueError`` (a residual
    of another tensor or world size would silently corrupt the gradient);
    :meth:`reset` starts over.

    Example::

        >>> from pycomm.distributed.algorithms import ErrorFeedback
        >>> ef = ErrorFeedback()
        >>> ef.bind(method="onebit", numel=7000, world_size=4, rank=3,
        ...         chunk_numel=4096, block_size=256)
        >>> # round(7000 / 4096) = 2 chunks of 3500 elements, segments of 1024:
        >>> # rank 3 holds [3072, 3500) of each
        >>> ef.worker.numel(), ef.server_segment(0).numel(), ef.server_segment(1).numel()
        (7000, 428, 428)
        >>> sd = ef.state_dict(); ef2 = ErrorFeedback(); ef2.load_state_dict(sd)
    """

    def __init__(self) -> None:
        self.layout: Optional[Dict[str, Any]] = None
        self.worker: Optional[torch.Tensor] = None
        self.server: Optional[torch.Tensor] = None
        self._server_offsets: List[int] = []
        self._backup: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self._checked = False  # the ranks' calls were compared at first use

    # -- layout ----------------------------------------------------------------
    @staticmethod
    def make_layout(
        *, method: str, numel: int, world_size: int, rank: int, chunk_numel: int,
        block_size: Optional[int] = None,
    ) -> Dict[str, Any]:
        """The layout dict that :meth:`bind` checks (block_size only for onebit)."""
        if method not in ("onebit", "topk"):
            raise ValueError(f"error feedback exists for onebit and topk only, not {method!r}")
        return {
            "method": method,
            "numel": int(numel),
            "world_size": int(world_size),
            "rank": int(rank),
            "chunk_numel": int(chunk_numel),
            "block_size": int(block_size) if method == "onebit" else None,
        }

    @staticmethod
    def _server_offsets_for(layout: Dict[str, Any]) -> List[int]:
        offsets = [0]
        if layout["method"] == "onebit":
            for b, e in chunk_bounds(layout["numel"], layout["chunk_numel"]):
                _, segs = onebit_segments(e - b, layout["world_size"], layout["block_size"])
                sb, se = segs[layout["rank"]]
                offsets.append(offsets[-1] + se - sb)
        return offsets

    def bind(self, *, device: torch.device | str = "cpu", **layout_kwargs: Any) -> None:
        """Create the buffers for this layout, or check that they match it.

        Keyword arguments as :meth:`make_layout`. Raises ``ValueError`` on a
        mismatch; moves the buffers to ``device`` if they live elsewhere."""
        layout = self.make_layout(**layout_kwargs)
        if self.layout is None:
            self.layout = layout
            self._server_offsets = self._server_offsets_for(layout)
            self.worker = torch.zeros(layout["numel"], dtype=torch.float32, device=device)
            self.server = (
                torch.zeros(self._server_offsets[-1], dtype=torch.float32, device=device)
                if layout["method"] == "onebit" else None
            )
            return
        if layout != self.layout:
            diffs = ", ".join(
                f"{k} {self.layout[k]!r} -> {layout[k]!r}" for k in layout if layout[k] != self.layout[k]
            )
            raise ValueError(
                f"error feedback residuals were built for {self._describe(self.layout)} and cannot "
                f"be used for {self._describe(layout)} ({diffs}); call reset() (or load the state "
                f"with reset_error_feedback=True) to start the residuals over"
            )
        dev = torch.device(device)
        if self.worker.device != dev:
            self.worker = self.worker.to(dev)
            if self.server is not None:
                self.server = self.server.to(dev)
            self._backup = None

    @staticmethod
    def _describe(layout: Dict[str, Any]) -> str:
        s = (
            f"{layout['method']} on {layout['numel']} elements, world size {layout['world_size']}, "
            f"rank {layout['rank']}, chunk_numel {layout['chunk_numel']}"
        )
        if layout["block_size"] is not None:
            s += f", block_size {layout['block_size']}"
        return s

    @property
    def bound(self) -> bool:
        """Whether buffers exist (after the first use or a load)."""
        return self.layout is not None

    def server_segment(self, chunk_index: int) -> torch.Tensor:
        """View of the server residual of chunk ``chunk_index`` (this rank's segment)."""
        if self.server is None:
            raise ValueError("no server residual: onebit error feedback that has been bound has one")
        a, b = self._server_offsets[chunk_index], self._server_offsets[chunk_index + 1]
        return self.server[a:b]

    def reset(self) -> None:
        """Forget the residuals and the layout (the next use starts from zeros)."""
        self.layout = None
        self.worker = None
        self.server = None
        self._server_offsets = []
        self._backup = None
        self._checked = False

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Layout and residuals (cloned tensors); each rank saves its own."""
        return {
            "layout": dict(self.layout) if self.layout is not None else None,
            "worker": self.worker.detach().clone() if self.worker is not None else None,
            "server": self.server.detach().clone() if self.server is not None else None,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checks buffer sizes)."""
        layout = state.get("layout")
        if layout is None:
            self.reset()
            return
        layout = self.make_layout(**layout)
        offsets = self._server_offsets_for(layout)
        worker, server = state["worker"], state["server"]
        if worker is None or worker.numel() != layout["numel"]:
            raise ValueError("error feedback state: the worker residual does not match its layout")
        want_server = offsets[-1] if layout["method"] == "onebit" else None
        if (server is None) != (want_server is None) or (
            server is not None and server.numel() != want_server
        ):
            raise ValueError("error feedback state: the server residual does not match its layout")
        self.layout = layout
        self._server_offsets = offsets
        self.worker = worker.detach().to(torch.float32).reshape(-1).clone()
        self.server = server.detach().to(torch.float32).reshape(-1).clone() if server is not None else None
        self._backup = None

    # -- non-finite steps (docs/allreduce.md, "Non-finite results") -------------
    def snapshot(self) -> None:
        """Copy the residuals aside before a step (into buffers kept from
        the previous step, so nothing is allocated after the first)."""
        if self.worker is None:
            return
        if self._backup is None:
            self._backup = (
                torch.empty_like(self.worker),
                torch.empty_like(self.server) if self.server is not None else None,
            )
        self._backup[0].copy_(self.worker)
        if self.server is not None:
            self._backup[1].copy_(self.server)

    def rollback(self) -> None:
        """Make the residuals what they were at the last :meth:`snapshot`
        (by swapping buffers, not copying)."""
        if self._backup is None:
            raise RuntimeError("rollback() without a snapshot()")
        old_worker, old_server = self._backup
        self._backup = (self.worker, self.server)
        self.worker, self.server = old_worker, old_server

    def __getstate__(self) -> Dict[str, Any]:
        # The backup and the check are about this process's calls, not state.
        return {k: v for k, v in self.__dict__.items() if k not in ("_backup", "_checked")}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._backup = None
        self._checked = False

    def __repr__(self) -> str:
        if self.layout is None:
            return "ErrorFeedback(unbound)"
        return f"ErrorFeedback({self._describe(self.layout)})"


# ------------------------------------------------------------- plumbing -------
def _group_info(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return world, rank


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # all_gather_single is the new name (2.13 deprecates all_gather_into_tensor).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class _Work:
    """A float32, flat, contiguous view of the tensor to reduce (the tensor
    itself when it already is one, else a copy written back at the end)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.inplace = tensor.dtype == torch.float32 and tensor.is_contiguous()
        if self.inplace:
            self.flat = tensor.view(-1)
        else:
            self.flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
            if self.flat.data_ptr() == tensor.data_ptr():  # never write the input early
                self.flat = self.flat.clone()

    def finish(self) -> None:
        if not self.inplace:
            self.tensor.copy_(self.flat.view(self.tensor.shape))


# ---------------------------------------------------------------- onebit -----
def _onebit_chunk(xc, comp, group, world, rank, avg, ew, es) -> Optional[torch.Tensor]:
    """Reduces one chunk in place; with error feedback, returns the sum of
    the gathered server scales: the result is +-scale, so it is finite if
    that sum is (the same on every rank)."""
    m = xc.numel()
    bsz = comp.block_size
    _, bounds = onebit_segments(m, world, bsz)
    lengths = [e - b for b, e in bounds]
    sizes = [onebit_wire_numel(n, bsz) for n in lengths]

    # 2. worker compress of the whole chunk (segments start on block and word
    #    boundaries, so each segment's payload is a slice of this one).
    p = comp.compress(xc, ew)
    # 3. segment payloads: words then scales (float32 bits), segment by segment.
    parts = []
    for (b, _), n in zip(bounds, lengths):
        if n == 0:
            continue
        w0, s0 = b // WORD_BITS, b // bsz
        parts.append(p.bits[w0 : w0 + _cdiv(n, WORD_BITS)])
        parts.append(p.scales[s0 : s0 + _cdiv(n, bsz)].view(torch.int32))
    send = torch.cat(parts)
    # 4. all_to_all: segment j to rank j; from every rank i, its segment `rank`.
    s_r = sizes[rank]
    recv = torch.empty(world * s_r, dtype=torch.int32, device=xc.device)
    dist.all_to_all_single(
        recv, send, output_split_sizes=[s_r] * world, input_split_sizes=sizes, group=group
    )

    # 5. server stage: decode and accumulate in rank order, AVG, re-compress.
    s_0 = sizes[0]  # segment 0 is never shorter than another
    server = torch.zeros(s_0, dtype=torch.int32, device=xc.device)
    l_r = lengths[rank]
    if l_r > 0:
        nw, ns = _cdiv(l_r, WORD_BITS), _cdiv(l_r, bsz)
        acc = torch.zeros(l_r, dtype=torch.float32, device=xc.device)
        for i in range(world):
            buf = recv[i * s_r : (i + 1) * s_r]
            payload = OneBitPayload(buf[:nw], buf[nw:].view(torch.float32), l_r, (l_r,), bsz)
            comp.decompress(payload, out=acc, accumulate=True)
        if avg:
            acc.div_(world)
        q = comp.compress(acc, es)
        server[:nw] = q.bits
        server[nw : nw + ns] = q.scales.view(torch.int32)

    # 6. all_gather of the server payloads, each padded to S_0.
    gathered = torch.empty(world * s_0, dtype=torch.int32, device=xc.device)
    _all_gather(gathered, server, group)

    # 7. every rank decodes every segment from the same bytes.
    finite = []
    for j, ((b, e), n) in enumerate(zip(bounds, lengths)):
        if n == 0:
            continue
        nw = _cdiv(n, WORD_BITS)
        buf = gathered[j * s_0 : j * s_0 + sizes[j]]
        payload = OneBitPayload(buf[:nw], buf[nw:].view(torch.float32), n, (n,), bsz)
        comp.decompress(payload, out=xc[b:e], accumulate=False)
        if ew is not None:
            finite.append(payload.scales.sum())
    return torch.stack(finite).sum() if finite else None


def _all_finite(t: torch.Tensor, sums: List[torch.Tensor]) -> bool:
    """Whether every element of ``t`` is finite, from ``sums`` taken on the
    way (of parts of ``t``, or of the scales it was decoded from: a sum is
    finite only if every term is); the exact check only when one of them
    is not (a sum of finite terms may overflow)."""
    if all(bool(torch.isfinite(s).all()) for s in sums):
        return True
    return bool(torch.isfinite(t).all())


def _finish_with_error_feedback(work: "_Work", ef: Optional[ErrorFeedback], finite: List) -> None:
    """Writes the result back and, when it is not finite, gives the residuals
    back their values from before the step: every rank holds the same result,
    so every rank decides alike, and a step that GradScaler skips leaves no
    trace in the residuals (docs/allreduce.md, "Non-finite results")."""
    work.finish()
    if ef is None:
        return
    ok = _all_finite(work.flat, [f for f in finite if f is not None])
    if ok and not work.inplace:  # a float32 result can overflow a 16-bit dtype
        ok = _all_finite(work.tensor, [work.tensor.sum(dtype=torch.float32)])
    if not ok:
        ef.rollback()


def allreduce_onebit(
    tensor: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    ef: Optional[ErrorFeedback] = None,
    block_size: int = 2048,
    impl: str = "auto",
) -> None:
    """Two-phase onebit all-reduce of ``tensor`` in place (spec "onebit").

    With ``ef`` the worker and server residuals are used and updated;
    without, nothing is remembered between calls."""
    _check_tensor(tensor)
    avg = normalize_op(op) == "avg"
    chunk_numel = _check_chunk_numel(chunk_numel)
    comp = get_compressor("onebit", block_size=block_size, impl=impl)
    world, rank = _group_info(group)
    n = tensor.numel()
    if ef is not None:
        ef.bind(
            method="onebit", numel=n, world_size=world, rank=rank, chunk_numel=chunk_numel,
            block_size=block_size, device=tensor.device,
        )
    if n == 0:
        return
    with torch.no_grad():
        work = _Work(tensor)
        if ef is not None:
            ef.snapshot()
        finite = []
        for ci, (b, e) in enumerate(chunk_bounds(n, chunk_numel)):
            ew = ef.worker[b:e] if ef is not None else None
            es = ef.server_segment(ci) if ef is not None else None
            finite.append(_onebit_chunk(work.flat[b:e], comp, group, world, rank, avg, ew, es))
        _finish_with_error_feedback(work, ef, finite)


# ------------------------------------------------------------------ topk -----
def _topk_chunk(xc, comp, group, world, avg, ew) -> Optional[torch.Tensor]:
    """Reduces one chunk in place; with error feedback, returns the sum of
    the result (finite only if the result is: sums of finite values can
    overflow, so the output itself is what counts)."""
    m = xc.numel()
    k = topk_k(m, comp.density)
    cap = topk_capacity(k) if comp.approx else k
    width = 1 + 2 * cap

    p = comp.compress(xc, ew)
    count = p.indices.numel()
    if not 0 < count <= cap:  # the compressor's contract; never silently truncate
        raise RuntimeError(f"topk returned {count} entries for k={k}, capacity {cap}")
    buf = torch.zeros(width, dtype=torch.int32, device=xc.device)
    buf[0] = count
    buf[1 : 1 + count] = p.indices
    buf[1 + count : 1 + 2 * count] = p.values.view(torch.int32)

    gathered = torch.empty(world * width, dtype=torch.int32, device=xc.device)
    _all_gather(gathered, buf, group)
    rows = gathered.view(world, width)
    counts = rows[:, 0].tolist()

    out = torch.zeros(m, dtype=torch.float32, device=xc.device)
    for i, c in enumerate(counts):  # accumulate in rank order
        if not 0 < c <= cap:
            raise RuntimeError(f"rank {i} sent a topk payload with count {c} (capacity {cap})")
        payload = TopKPayload(rows[i, 1 : 1 + c], rows[i, 1 + c : 1 + 2 * c].view(torch.float32), m, (m,))
        comp.decompress(payload, out=out, accumulate=True)
    if avg:
        out.div_(world)
    xc.copy_(out)
    return out.sum() if ew is not None else None


def allreduce_topk(
    tensor: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    ef: Optional[ErrorFeedback] = None,
    density: float = 0.01,
    approx: bool = True,
    impl: str = "auto",
) -> None:
    """Top-k all-reduce of ``tensor`` in place: all_gather of sparse payloads,
    scatter-add in rank order (spec "topk"). ``ef`` holds the worker residual."""
    _check_tensor(tensor)
    avg = normalize_op(op) == "avg"
    chunk_numel = _check_chunk_numel(chunk_numel)
    comp = get_compressor("topk", density=density, approx=approx, impl=impl)
    world, rank = _group_info(group)
    n = tensor.numel()
    if ef is not None:
        ef.bind(
            method="topk", numel=n, world_size=world, rank=rank, chunk_numel=chunk_numel,
            device=tensor.device,
        )
    if n == 0:
        return
    with torch.no_grad():
        work = _Work(tensor)
        if ef is not None:
            ef.snapshot()
        finite = []
        for b, e in chunk_bounds(n, chunk_numel):
            ew = ef.worker[b:e] if ef is not None else None
            finite.append(_topk_chunk(work.flat[b:e], comp, group, world, avg, ew))
        _finish_with_error_feedback(work, ef, finite)


# ------------------------------------------------------------- fp16 / bf16 ---
def allreduce_cast(
    tensor: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Cast baseline (spec "fp16 / bf16"): ``y = (x / W if AVG else x)`` cast to
    ``dtype`` (float16 or bfloat16), SUM all-reduce of ``y``, ``x = y``."""
    _check_tensor(tensor)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    avg = normalize_op(op) == "avg"
    chunk_numel = _check_chunk_numel(chunk_numel)
    world, _ = _group_info(group)
    n = tensor.numel()
    if n == 0:
        return
    with torch.no_grad():
        work = _Work(tensor)
        for b, e in chunk_bounds(n, chunk_numel):
            xc = work.flat[b:e]
            y = (xc / world if avg else xc).to(dtype)
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
            xc.copy_(y)
        work.finish()


# ------------------------------------------------------ cross-rank check ---
#: When :func:`allreduce_compressed` compares the ranks' calls: "off",
#: "first" (first use of each ErrorFeedback, i.e. of each key, and of each
#: keyless signature) or "every". ``PYCOMM_DEBUG=detail`` forces "every".
CHECK_MODES = ("off", "first", "every")

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_METHOD_CODES = {m: i for i, m in enumerate(METHODS)}
_FIELDS = ("numel", "dtype", "op", "key", "method", "chunk_numel", "block_size", "density", "approx",
           "error_feedback")
# Keyless signatures already compared, per group (weakly: a destroyed group's go too).
_CHECKED: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def check_mode(mode: str = "first", name: str = "check") -> str:
    """``mode``, or "every" when the environment says ``PYCOMM_DEBUG=detail``
    (``name``: the argument's name in the error for a bad ``mode``)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"{name} must be one of {list(CHECK_MODES)}, got {mode!r}")
    if os.environ.get("PYCOMM_DEBUG", "").lower() == "detail":
        return "every"
    return mode


def _field_text(field: str, v: int) -> str:
    if field == "dtype":
        return {c: str(d).replace("torch.", "") for d, c in _DTYPE_CODES.items()}.get(v, str(v))
    if field == "op":
        return "avg" if v else "sum"
    if field == "key":
        return "None" if v < 0 else str(v)
    if field == "method":
        return METHODS[v] if 0 <= v < len(METHODS) else "?"
    if field == "density":
        return repr(struct.unpack("<d", struct.pack("<q", v))[0])
    if field in ("approx", "error_feedback"):
        return str(bool(v))
    return str(v)


def _check_call(tensor, group, method, avg, chunk_numel, key, ef, comp, mode) -> None:
    """Allgathers a fixed-size descriptor of this call and raises, on every
    rank, naming each field in which the ranks differ. Collective: it must
    run at the same point on every rank, hence a rule every rank applies to
    its own calls identically (first use of a key / signature)."""
    mode = check_mode(mode)
    if mode == "off":
        return
    # The settings in effect (defaults resolved), only those of this method.
    block = comp.block_size if method == "onebit" else 0
    density, approx = (comp.density, comp.approx) if method == "topk" else (0.0, False)
    desc = [
        tensor.numel(), _DTYPE_CODES[tensor.dtype], int(avg), -1 if key is None else int(key),
        _METHOD_CODES[method], chunk_numel, block, struct.unpack("<q", struct.pack("<d", density))[0],
        int(approx), int(ef is not None),
    ]
    g = group if group is not None else dist.group.WORLD
    if mode == "first":
        if ef is not None:
            if ef._checked:
                return
        elif tuple(desc) in _CHECKED.get(g, ()):
            return
    world = dist.get_world_size(group)
    mine = torch.tensor(desc, dtype=torch.int64, device=tensor.device)
    everyone = torch.empty(world * len(desc), dtype=torch.int64, device=tensor.device)
    _all_gather(everyone, mine, group)
    rows = everyone.view(world, len(desc)).tolist()
    diffs = []
    # Another method has other settings anyway: then name the method alone.
    fields = ["method"] if any(row[4] != rows[0][4] for row in rows) else _FIELDS
    for f, name in enumerate(_FIELDS):
        if name in fields and any(row[f] != rows[0][f] for row in rows):
            values = ", ".join(f"rank {r}: {_field_text(name, row[f])}" for r, row in enumerate(rows))
            diffs.append(f"{name} ({values})")
    if diffs:
        raise RuntimeError(
            "ranks called the compressed all-reduce with different arguments: " + "; ".join(diffs)
            + ". Every rank must make the same compressed calls in the same order with the same "
            "settings (checked at the first use of each key and of each keyless signature; "
            "PYCOMM_DEBUG=detail checks every call)"
        )
    if ef is not None:
        ef._checked = True
    else:
        _CHECKED.setdefault(g, set()).add(tuple(desc))


def describe_call(tensor: torch.Tensor, method: str, op: str, key: Any = None) -> str:
    """``"all_reduce key=3 4194304 float32 onebit avg"``: the call, in errors."""
    dtype = str(tensor.dtype).replace("torch.", "")
    return f"all_reduce key={key!r} {tensor.numel()} {dtype} {method} {op}"


def _with_context(exc: RuntimeError, tensor, group, method, op, key) -> RuntimeError:
    """The same kind of error, its message prefixed with who failed doing what."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    peer = f" (peer: rank {1 - rank})" if world == 2 else ""
    msg = f"pycomm rank {rank} of {world}{peer}: {describe_call(tensor, method, op, key)} failed: {exc}"
    try:
        return type(exc)(msg)
    except TypeError:  # an exception type with another constructor
        return RuntimeError(msg)


# -------------------------------------------------------------- dispatcher ---
def allreduce_compressed(
    tensor: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    method: str,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    ef: Optional[ErrorFeedback] = None,
    key: Any = None,
    check: str = "first",
    **compressor_kwargs: Any,
) -> None:
    """Compressed all-reduce of ``tensor`` in place, identical on every rank.

    ``method``: "onebit" (kwargs ``block_size``, ``impl``), "topk" (``density``,
    ``approx``, ``impl``), "fp16" or "bf16" (no kwargs, no error feedback).
    ``op``: "sum" or "avg" (or the ``dist.ReduceOp``). ``chunk_numel``: chunk
    length, default :data:`DEFAULT_CHUNK_NUMEL`. ``ef``: an
    :class:`ErrorFeedback` kept by the caller for this tensor, or None.
    ``tensor``: float32 / float16 / bfloat16, any shape, on a device the
    group's backend supports. Blocks until the result is in ``tensor``.

    Every rank must call it with the same method, op, chunking and kwargs,
    on a tensor of the same size (as for any collective). ``check`` (one of
    :data:`CHECK_MODES`) says when the ranks compare their calls first
    (``PYCOMM_DEBUG=detail`` forces "every"); a difference raises on every
    rank instead of hanging or returning garbage. ``key`` names the call in
    that check and in error messages (the hook passes the bucket index).
    A failure of a collective raises the backend's error, its message
    prefixed with this rank, the call and, with two ranks, the peer.

    Example::

        >>> allreduce_compressed(t, method="topk", op="avg", density=0.01, ef=ef)  # doctest: +SKIP
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if method in _CAST_DTYPES:
        if ef is not None:
            raise ValueError(f"method {method!r} has no error feedback: pass ef=None")
        if compressor_kwargs:
            raise TypeError(f"method {method!r} takes no compressor arguments, got {sorted(compressor_kwargs)}")
    _check_tensor(tensor)
    op_name = normalize_op(op)
    chunk = _check_chunk_numel(chunk_numel)
    if ef is not None and not isinstance(ef, ErrorFeedback):
        raise TypeError(f"ef must be an ErrorFeedback or None, got {type(ef).__name__}")
    if key is not None and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
        raise ValueError(f"key must be a non-negative int or None, got {key!r}")
    check_mode(check)
    _group_info(group)
    # Validates the compressor kwargs before any collective.
    comp = get_compressor(method, **compressor_kwargs) if method in ("onebit", "topk") else None
    try:
        if tensor.numel() > 0:
            _check_call(tensor, group, method, op_name == "avg", chunk, key, ef, comp, check)
        if method in ("onebit", "topk"):
            fn = allreduce_onebit if method == "onebit" else allreduce_topk
            fn(tensor, group=group, op=op, chunk_numel=chunk_numel, ef=ef, **compressor_kwargs)
        else:
            allreduce_cast(tensor, group=group, op=op, chunk_numel=chunk_numel, dtype=_CAST_DTYPES[method])
    except RuntimeError as exc:
        raise _with_context(exc, tensor, group, method, op_name, key) from exc
