"""Single-process simulation of the compressed all-reduce of ``docs/allreduce.md``.

The one oracle of every entry point (the C++ engine behind the ``"pycomm"``
backend, reached from ``pd.all_reduce``, DDP and the DDP hook): every rank's
input goes in, every rank's result comes out, computed with the reference
compressors (``impl="reference"``) and written directly from the spec
(:mod:`pycomm.distributed.spec`), without wire formats or collectives.
:class:`ErrorFeedback` holds each simulated rank's residuals, laid out as the
engine's ``error_feedback_state()`` (worker: one float per element; server:
this rank's segment of each chunk), so they can be compared after each step.

Where an implementation differs from the simulation:

* a method with a compressor (``spec.EF_METHODS``: the block codecs and
  top-k) over ``impl="reference"``: never; the results and the residuals
  are equal bit for bit.
* onebit with a compiled compressor (``impl="auto"``): block scales are sums
  in another order, so results and residuals agree to float32 rounding
  relative to the scale (and, rarely, a sign of a near-zero element flips).
* topk with a compiled compressor: equal bit for bit (selection and values
  are exact, the scatter-add happens in rank order).
* a method that rounds (``spec.ROUNDING_METHODS``) with
  ``rounding="stochastic"`` (and ``seed``) among the compressor's
  settings: the engine's seeds (``spec.rounding_seed``) from ``key`` and
  the call's count: each rank's :attr:`ErrorFeedback.calls`
  with error feedback, else ``call`` (the group's count of keyless calls
  before this one).
* fp16 / bf16: the simulation sums the cast values in rank order, as one
  16-bit rounding per addition; a real all-reduce sums in its own order, so
  with W > 2 results differ by a few 16-bit ulps of the sum of magnitudes
  (with W <= 2 the order cannot matter).

Example::

    >>> import torch
    >>> from pycomm.distributed.simulate import simulate_allreduce
    >>> xs = [torch.randn(1000) for _ in range(4)]
    >>> outs = simulate_allreduce(xs, "onebit", op="avg", chunk_numel=512, block_size=64)
    >>> all(torch.equal(outs[0], o) for o in outs)
    True
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import get_compressor
from ..compressors.plugin import _instance as _plugin_instance
from ..compressors.plugin import options_json
from .spec import (
    ALL_GATHER_SUFFIX,
    BLOCK_METHODS,
    CAST_METHODS,
    COLLECTIVES,
    DEFAULT_CHUNK_NUMEL,
    EF_METHODS,
    EXACT_METHOD,
    METHODS,
    REDUCE_SCATTER_SUFFIX,
    UNCOMPRESSED_METHODS,
    all_reduce_gathers,
    block_segments,
    check_key,
    chunk_bounds,
    is_plugin,
    method_spec,
    normalize_op,
    rounding_seed,
)

__all__ = ["ErrorFeedback", "simulate_all_gather", "simulate_allreduce", "simulate_hierarchical_allreduce",
           "simulate_reduce_scatter"]


# ----------------------------------------------------------- error feedback ---
class ErrorFeedback:
    """Error-feedback residuals of one tensor on one rank, kept across steps.

    * ``worker``: float32, one element per tensor element (every method with
      error feedback);
      ``c = x + worker`` is what gets compressed, and ``worker`` keeps what
      was not sent.
    * ``server`` (block codecs, ``spec.BLOCK_METHODS``): float32, the concatenation over chunks, in
      chunk order, of this rank's segment of each chunk (spec step 1), i.e.
      ``sum over chunks of L_rank``; :meth:`server_segment` gives chunk
      ``i``'s part. ``None`` for topk.
    * ``calls``: the calls that kept new residuals (the stream of
      stochastic rounding's seeds), as the engine counts them per key; a
      rolled-back call does not count.

    The buffers are created (zeros) on first use and bound to a layout:
    method, numel, world size, rank, chunk_numel and (block codecs) block_size.
    Using the object with any other layout raises ``ValueError`` (a residual
    of another tensor or world size would silently corrupt the gradient);
    :meth:`reset` starts over.

    Example::

        >>> from pycomm.distributed.simulate import ErrorFeedback
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
        self.calls = 0
        self._calls_backup = 0

    # -- layout ----------------------------------------------------------------
    @staticmethod
    def make_layout(
        *, method: str, numel: int, world_size: int, rank: int, chunk_numel: int,
        block_size: Optional[int] = None,
    ) -> Dict[str, Any]:
        """The layout dict that :meth:`bind` checks (block_size only for block codecs)."""
        base = method.split("/")[0]  # a reduce-scatter's or all-gather's: method + "/collective"
        if base not in EF_METHODS and not is_plugin(base):
            raise ValueError(f"error feedback exists for {list(EF_METHODS)} and registered compressors, "
                             f"not {method!r}")
        return {
            "method": method,
            "numel": int(numel),
            "world_size": int(world_size),
            "rank": int(rank),
            "chunk_numel": int(chunk_numel),
            "block_size": int(block_size) if method in BLOCK_METHODS else None,
        }

    @staticmethod
    def _server_offsets_for(layout: Dict[str, Any]) -> List[int]:
        offsets = [0]
        if layout["method"] in BLOCK_METHODS:
            for b, e in chunk_bounds(layout["numel"], layout["chunk_numel"]):
                _, segs = block_segments(e - b, layout["world_size"], layout["block_size"])
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
                if layout["method"] in BLOCK_METHODS else None
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
            raise ValueError("no server residual: only a block codec's bound error feedback has one")
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
        self.calls = 0

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Layout and residuals (cloned tensors); each rank saves its own."""
        return {
            "layout": dict(self.layout) if self.layout is not None else None,
            "worker": self.worker.detach().clone() if self.worker is not None else None,
            "server": self.server.detach().clone() if self.server is not None else None,
            "calls": self.calls,
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
        want_server = offsets[-1] if layout["method"] in BLOCK_METHODS else None
        if (server is None) != (want_server is None) or (
            server is not None and server.numel() != want_server
        ):
            raise ValueError("error feedback state: the server residual does not match its layout")
        self.layout = layout
        self._server_offsets = offsets
        self.worker = worker.detach().to(torch.float32).reshape(-1).clone()
        self.server = server.detach().to(torch.float32).reshape(-1).clone() if server is not None else None
        self.calls = int(state.get("calls", 0))
        self._backup = None

    # -- non-finite steps (docs/allreduce.md, "Non-finite results") -------------
    def snapshot(self) -> None:
        """Copy the residuals aside before a step (into buffers kept from
        the previous step, so nothing is allocated after the first)."""
        self._calls_backup = self.calls
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
        """Make the residuals (and the call count) what they were at the last :meth:`snapshot`
        (by swapping buffers, not copying)."""
        if self._backup is None:
            raise RuntimeError("rollback() without a snapshot()")
        self.calls = self._calls_backup
        old_worker, old_server = self._backup
        self._backup = (self.worker, self.server)
        self.worker, self.server = old_worker, old_server

    def __getstate__(self) -> Dict[str, Any]:
        # The backup and the check are about this process's calls, not state.
        return {k: v for k, v in self.__dict__.items() if k not in ("_backup", "_checked", "_calls_backup")}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.calls = 0
        self.__dict__.update(d)
        self._calls_backup = self.calls
        self._backup = None
        self._checked = False

    def __repr__(self) -> str:
        if self.layout is None:
            return "ErrorFeedback(unbound)"
        return f"ErrorFeedback({self._describe(self.layout)})"


class _Seeds:
    """The engine's stochastic rounding seeds of one call, rank by rank
    (``spec.rounding_seed``): None everywhere when ``comp`` rounds to
    nearest. ``efs``: the ranks' residuals, whose counts number a keyed
    call (each is advanced, as the engine does, by :meth:`advance`); else
    ``call`` numbers it. ``ranks``: the global rank of each input."""

    def __init__(self, comp: Any, collective: str, key: Optional[int], call: int,
                 efs: Optional[Sequence[ErrorFeedback]], ranks: Sequence[int]) -> None:
        check_key(key)
        if isinstance(call, bool) or not isinstance(call, int) or call < 0:
            raise ValueError(f"call must be a non-negative int, got {call!r}")
        self.base = comp.seed if getattr(comp, "rounding", "nearest") == "stochastic" else -1
        self.stream = -1 if key is None else key
        self.calls = [ef.calls for ef in efs] if efs is not None else [call] * len(ranks)
        self.collective = COLLECTIVES.index(collective)
        self.ranks, self.efs = list(ranks), efs

    def at(self, r: int, chunk: int, part: int) -> Optional[int]:
        if self.base < 0:
            return None
        return rounding_seed(self.base, self.stream, self.calls[r], self.collective, self.ranks[r], chunk, part)

    def advance(self) -> None:
        for ef in self.efs or ():
            ef.calls += 1


def _compress(comp: Any, x: torch.Tensor, residual: Optional[torch.Tensor], seed: Optional[int]) -> Any:
    return comp.compress(x, residual) if seed is None else comp.compress_seeded(x, residual, seed)


def simulate_allreduce(
    inputs: Sequence[torch.Tensor],
    method: str,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    efs: Optional[Sequence[ErrorFeedback]] = None,
    *,
    key: Optional[int] = None,
    call: int = 0,
    _ranks: Optional[Sequence[int]] = None,
    **compressor_kwargs: Any,
) -> List[torch.Tensor]:
    """Results of a compressed all-reduce of ``inputs[r]`` (one per rank).

    Returns one new tensor per rank (dtype and shape of the inputs); the
    inputs are not modified. ``efs`` (one :class:`ErrorFeedback` per rank,
    rank ``r``'s at index ``r``) are used and updated as the ranks' own
    would be: left as they were when the result is not finite.
    ``compressor_kwargs``: the compressor's settings (``block_size``;
    ``density``, ``approx``; a rounding method's ``rounding`` and ``seed``) and
    ``impl`` ("reference" by default; "cpu" uses the engine's own kernels,
    so results match it bit for bit). ``key`` and ``call`` number the call
    for stochastic rounding's seeds, as the engine does (see above).
    """
    world = len(inputs)
    if world < 1:
        raise ValueError("inputs must hold one tensor per rank (at least one)")
    shape, dtype = inputs[0].shape, inputs[0].dtype
    for r, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"inputs[{r}] is not a tensor")
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(
                f"inputs[{r}] is {tuple(x.shape)} {x.dtype}, inputs[0] is {tuple(shape)} {dtype}"
            )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"inputs must be float32, float16 or bfloat16, got {dtype}")
    avg = normalize_op(op) == "avg"
    if chunk_numel is None:
        chunk_numel = DEFAULT_CHUNK_NUMEL
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be a positive integer, got {chunk_numel!r}")
    if efs is not None and len(efs) != world:
        raise ValueError(f"efs must hold one ErrorFeedback per rank ({world}), got {len(efs)}")

    n = inputs[0].numel()
    xs = [x.detach().reshape(-1).to(torch.float32) for x in inputs]  # read as float32

    if method in CAST_METHODS:
        if efs is not None:
            raise ValueError(f"method {method!r} has no error feedback: pass efs=None")
        if compressor_kwargs:
            raise TypeError(f"method {method!r} takes no compressor arguments")
        out = _simulate_cast(xs, method_spec(method).dtype, avg)
    elif method in EF_METHODS:
        compressor_kwargs.setdefault("impl", "reference")
        comp = get_compressor(method, **compressor_kwargs)
        if efs is not None:
            for r, ef in enumerate(efs):
                ef.bind(
                    method=method, numel=n, world_size=world, rank=r, chunk_numel=chunk_numel,
                    block_size=getattr(comp, "block_size", None), device=xs[r].device,
                )
        if efs is not None:
            for ef in efs:
                ef.snapshot()
        seeds = _Seeds(comp, "all_reduce", key, call, efs, _ranks if _ranks is not None else range(world))
        seeds.advance()
        out = torch.empty(n, dtype=torch.float32, device=xs[0].device)
        for ci, (start, end) in enumerate(chunk_bounds(n, chunk_numel)):
            chunk = [x[start:end] for x in xs]
            workers = [efs[r].worker[start:end] for r in range(world)] if efs is not None else None
            if method in BLOCK_METHODS and all_reduce_gathers(method, n, world):
                out[start:end] = _simulate_gathered_block_chunk(chunk, comp, avg, workers,
                                                                lambda r, ci=ci: seeds.at(r, ci, 0))
            elif method in BLOCK_METHODS:
                servers = [efs[r].server_segment(ci) for r in range(world)] if efs is not None else None
                out[start:end] = _simulate_block_chunk(chunk, comp, avg, workers, servers,
                                                       lambda r, part, ci=ci: seeds.at(r, ci, part))
            else:
                out[start:end] = _simulate_topk_chunk(chunk, comp, avg, workers)
        # A non-finite result (in the inputs' dtype) leaves every residual
        # as it was before the call (docs/allreduce.md, "Non-finite results").
        if efs is not None and not bool(torch.isfinite(out.to(dtype)).all()):
            for ef in efs:
                ef.rollback()
    elif is_plugin(method):
        # A registered compressor: every rank's payload decoded in rank order.
        comp = _plugin_instance(method, options_json(method, compressor_kwargs))
        if efs is not None:
            for r, ef in enumerate(efs):
                ef.bind(method=method, numel=n, world_size=world, rank=r, chunk_numel=chunk_numel,
                        device=xs[r].device)
                ef.snapshot()
                ef.calls += 1
        out = torch.empty(n, dtype=torch.float32, device=xs[0].device)
        for start, end in chunk_bounds(n, chunk_numel):
            payloads = [comp.compress(x[start:end], efs[r].worker[start:end] if efs is not None else None)
                        for r, x in enumerate(xs)]
            for r, p in enumerate(payloads):
                comp.decompress(p, out[start:end], r > 0)
            if avg:
                out[start:end].div_(world)
        if efs is not None and not bool(torch.isfinite(out.to(dtype)).all()):
            for ef in efs:
                ef.rollback()
    else:
        # The exact all-reduce is no compressed call: nothing to simulate.
        raise ValueError(f"unknown method {method!r}; choose one of "
                         f"{[m for m in METHODS if m != EXACT_METHOD]} or a registered compressor")

    return [out.view(shape).to(dtype).clone() for _ in range(world)]


def _simulate_block_chunk(chunk, comp, avg, workers, servers, seed) -> torch.Tensor:
    # seed(r, part): the kernel seed of rank r's worker (part 0) or server
    # (part 1) compress of this chunk, None to round as the compressor does.
    world, m, bsz = len(chunk), chunk[0].numel(), comp.block_size
    # Segments: a whole number of blocks each, the last ones possibly short or empty.
    seg = math.ceil(math.ceil(m / world) / bsz) * bsz
    # Every rank compresses its whole chunk with its worker residual; decoding
    # the whole payload and slicing it is what decoding a segment's slice gives.
    decoded = []
    for r in range(world):
        p = _compress(comp, chunk[r], workers[r] if workers is not None else None, seed(r, 0))
        decoded.append(comp.decompress(p))
    out = torch.empty(m, dtype=torch.float32, device=chunk[0].device)
    for j in range(world):  # the server of segment j is rank j
        lo, hi = min(m, j * seg), min(m, (j + 1) * seg)
        if hi == lo:
            continue
        acc = torch.zeros(hi - lo, dtype=torch.float32, device=out.device)
        for r in range(world):  # rank order
            acc.add_(decoded[r][lo:hi])
        if avg:
            acc = acc / world
        es = None
        if servers is not None:
            es = servers[j]
            if es.numel() != hi - lo:
                raise AssertionError(
                    f"ErrorFeedback server segment of rank {j} has {es.numel()} elements, the spec "
                    f"says {hi - lo}"
                )
        q = _compress(comp, acc, es, seed(j, 1))
        out[lo:hi] = comp.decompress(q)
    return out


def _simulate_gathered_block_chunk(chunk, comp, avg, workers, seed) -> torch.Tensor:
    # A small tensor's block codec (spec.all_reduce_gathers): every rank's
    # payload, compressed with its worker residual, decoded and added in
    # rank order; the server residuals are not used.
    out = torch.zeros(chunk[0].numel(), dtype=torch.float32, device=chunk[0].device)
    for r in range(len(chunk)):  # rank order
        out.add_(comp.decompress(_compress(comp, chunk[r], workers[r] if workers is not None else None,
                                           seed(r))))
    return out / len(chunk) if avg else out


def _simulate_topk_chunk(chunk, comp, avg, workers) -> torch.Tensor:
    world, m = len(chunk), chunk[0].numel()
    out = torch.zeros(m, dtype=torch.float32, device=chunk[0].device)
    for r in range(world):  # rank order
        p = comp.compress(chunk[r], workers[r] if workers is not None else None)
        out.index_add_(0, p.indices.long(), p.values)
    if avg:
        out = out / world
    return out


def _wire_dtype(method: str) -> torch.dtype:
    """The dtype an uncompressed method sends: a cast's, else float32 (the
    simulation reads every input as float32)."""
    return method_spec(method).dtype or torch.float32


def _simulate_cast(xs, dtype, avg) -> torch.Tensor:
    world = len(xs)
    ys = [(x / world if avg else x).to(dtype) for x in xs]
    total = ys[0].clone()
    for y in ys[1:]:
        total = total + y  # one rounding to `dtype` per addition, in rank order
    return total.to(torch.float32)


def simulate_hierarchical_allreduce(
    inputs: Sequence[torch.Tensor],
    method: str,
    ranks_per_node: int,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    efs: Optional[Sequence[Optional[ErrorFeedback]]] = None,
    *,
    key: Optional[int] = None,
    call: int = 0,
    **compressor_kwargs: Any,
) -> List[torch.Tensor]:
    """Results of the hierarchical compressed all-reduce (docs/hierarchy.md)
    of ``inputs[r]`` over nodes of ``ranks_per_node`` consecutive ranks.

    Each node's sum (in local-rank order) is cut into ``ranks_per_node``
    shards of ``ceil(n / ranks_per_node)`` elements (the last ones shorter or
    empty); shard ``l`` of every node is reduced by :func:`simulate_allreduce`
    over the nodes, with ``efs[r]`` as the residuals of rank ``r`` (which
    holds shard ``r % ranks_per_node``; None for a rank whose shard is
    empty); for "avg" the result is then divided by ``ranks_per_node``.

    >>> import torch
    >>> xs = [torch.full((10,), float(r)) for r in range(4)]
    >>> simulate_hierarchical_allreduce(xs, "topk", 2, op="avg", density=1.0)[3][:3]
    tensor([1.5000, 1.5000, 1.5000])
    """
    world, L = len(inputs), ranks_per_node
    if isinstance(L, bool) or not isinstance(L, int) or L < 1 or world % L:
        raise ValueError(f"ranks_per_node must be a positive divisor of the {world} inputs, got {L!r}")
    if method in UNCOMPRESSED_METHODS:
        raise ValueError(f"method {method!r} runs flat, not hierarchically")
    shape, dtype = inputs[0].shape, inputs[0].dtype
    avg = normalize_op(op) == "avg"
    n, nodes = inputs[0].numel(), world // L
    xs = [x.detach().reshape(-1).to(torch.float32) for x in inputs]
    sums = []
    for node in range(nodes):
        total = xs[node * L].clone()
        for local in range(1, L):
            total = total + xs[node * L + local]
        sums.append(total)
    S = math.ceil(n / L)
    out = torch.empty(n, dtype=torch.float32, device=xs[0].device)
    kept = []  # residuals of shard groups that committed their step
    for local in range(L):
        lo, hi = min(n, local * S), min(n, (local + 1) * S)
        if hi == lo:
            continue
        group_efs = [efs[node * L + local] for node in range(nodes)] if efs is not None else None
        res = simulate_allreduce([s[lo:hi] for s in sums], method, "avg" if avg else "sum", chunk_numel,
                                 group_efs, key=key, call=call,
                                 _ranks=[node * L + local for node in range(nodes)], **compressor_kwargs)[0]
        out[lo:hi] = res / L if avg else res
        if group_efs is not None and bool(torch.isfinite(res).all()):
            kept.extend(group_efs)
    # A non-finite result leaves every residual as it was: shard groups with
    # a finite shard roll back too, as the backend decides on the whole result.
    if not bool(torch.isfinite(out.to(dtype)).all()):
        for ef in kept:
            ef.rollback()
    return [out.view(shape).to(dtype).clone() for _ in range(world)]


def _rank_inputs(inputs: Sequence[torch.Tensor]) -> Tuple[int, torch.dtype, int]:
    """``(world, dtype, numel)`` of a reduce-scatter's or all-gather's
    ``inputs``: one tensor per rank, all of one dtype and element count (any
    shapes: the collectives read them flat)."""
    world = len(inputs)
    if world < 1:
        raise ValueError("inputs must hold one tensor per rank (at least one)")
    dtype, n = inputs[0].dtype, inputs[0].numel()
    if any(x.numel() != n or x.dtype != dtype for x in inputs):
        raise ValueError("inputs must all have the same number of elements and dtype")
    return world, dtype, n


def _bind_collective(efs: Optional[List[ErrorFeedback]], xs: List[torch.Tensor], comp: Any, method: str,
                     numel: int, chunk_numel: int) -> None:
    """Binds each rank's residuals (``efs``, or none) to a reduce-scatter's
    or all-gather's layout under ``method`` (with the collective's suffix),
    and keeps them to roll back to."""
    if efs is None:
        return
    if len(efs) != len(xs):
        raise ValueError(f"efs must hold one ErrorFeedback per rank ({len(xs)}), got {len(efs)}")
    for r, ef in enumerate(efs):
        ef.bind(method=method, numel=numel, world_size=len(xs), rank=r, chunk_numel=chunk_numel,
                block_size=getattr(comp, "block_size", None), device=xs[r].device)
        ef.snapshot()


def simulate_reduce_scatter(
    inputs: Sequence[torch.Tensor],
    method: str,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    efs: Optional[Sequence[ErrorFeedback]] = None,
    *,
    key: Optional[int] = None,
    call: int = 0,
    **compressor_kwargs: Any,
) -> List[torch.Tensor]:
    """Every rank's output of a compressed reduce-scatter of ``inputs[r]``
    (docs/allreduce.md, "Reduce-scatter"): rank ``j`` gets shard ``j`` (the
    ``j``-th of ``len(inputs)`` equal parts) of the sum or average.

    Per chunk of the shard, each rank compresses its part of every shard
    (error feedback: ``efs[r]``, laid out over the whole input), and rank
    ``j`` decodes the parts of shard ``j`` in rank order (the first written,
    the others added; top-k's scattered onto zeros). A non-finite output on
    any rank leaves every residual as it was. Other arguments as
    :func:`simulate_allreduce`.

    >>> xs = [torch.ones(8) * (r + 1) for r in range(2)]
    >>> [o.tolist() for o in simulate_reduce_scatter(xs, "none")]
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    world, dtype, n = _rank_inputs(inputs)
    if n % world or n == 0:
        raise ValueError(f"inputs must hold world size ({world}) x shard elements, got {n}")
    shard = n // world
    avg = normalize_op(op) == "avg"
    chunk_numel = DEFAULT_CHUNK_NUMEL if chunk_numel is None else chunk_numel
    xs = [x.detach().reshape(-1).to(torch.float32) for x in inputs]
    outs = [torch.empty(shard, dtype=torch.float32, device=xs[0].device) for _ in range(world)]

    if method in UNCOMPRESSED_METHODS:
        if efs is not None:
            raise ValueError(f"method {method!r} has no error feedback: pass efs=None")
        # A cast divides before it narrows (the sum must fit its range); the
        # exact reduce-scatter divides its float32 sum.
        cast = method in CAST_METHODS
        ys = [((x / world) if avg and cast else x).to(_wire_dtype(method)) for x in xs]
        for j in range(world):
            acc = ys[0][j * shard:(j + 1) * shard].clone()
            for y in ys[1:]:
                acc = acc + y[j * shard:(j + 1) * shard]
            outs[j] = acc.to(torch.float32)
            if avg and not cast:
                outs[j].div_(world)
        return [o.to(dtype) for o in outs]

    comp, encode, decode = _payload_codec(method, compressor_kwargs)
    _bind_collective(efs, xs, comp, method + REDUCE_SCATTER_SUFFIX, n, chunk_numel)
    seeds = _Seeds(comp, "reduce_scatter", key, call, efs, range(world))
    seeds.advance()
    for ci, (c0, c1) in enumerate(chunk_bounds(shard, chunk_numel)):
        for j in range(world):
            lo, hi = j * shard + c0, j * shard + c1
            payloads = [encode(xs[r][lo:hi], efs[r].worker[lo:hi] if efs is not None else None, seeds.at(r, ci, j))
                        for r in range(world)]
            dst = outs[j][c0:c1]
            for r, p in enumerate(payloads):  # rank order
                decode(p, dst, r > 0)
            if avg:
                dst.div_(world)
    if efs is not None and not all(bool(torch.isfinite(o.to(dtype)).all()) for o in outs):
        for ef in efs:
            ef.rollback()
    return [o.to(dtype) for o in outs]


def _payload_codec(method: str, compressor_kwargs: Dict[str, Any]):
    """``(compressor, encode(seg, residual), decode(payload, dst, accumulate))``
    of what the engine's reduce-scatter and all-gather send for ``method``."""
    if is_plugin(method):
        comp = _plugin_instance(method, options_json(method, compressor_kwargs))

        def decode(p, dst, accumulate):
            comp.decompress(p, dst, accumulate)
    elif method in EF_METHODS:
        compressor_kwargs.setdefault("impl", "reference")
        comp = get_compressor(method, **compressor_kwargs)

        sparse = method_spec(method).kind == "sparse"

        def decode(p, dst, accumulate):
            if sparse:  # scattered onto zeros, as the engine does
                if not accumulate:
                    dst.zero_()
                accumulate = True
            comp.decompress(p, out=dst, accumulate=accumulate)
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)} or a registered "
                         f"compressor")
    def encode(x, residual, seed=None):
        return _compress(comp, x, residual, seed)

    return comp, encode, decode


def simulate_all_gather(
    inputs: Sequence[torch.Tensor],
    method: str,
    chunk_numel: Optional[int] = None,
    efs: Optional[Sequence[ErrorFeedback]] = None,
    *,
    key: Optional[int] = None,
    call: int = 0,
    **compressor_kwargs: Any,
) -> List[torch.Tensor]:
    """Every rank's output of a compressed all-gather of ``inputs[r]``
    (docs/allreduce.md, "All-gather"): the concatenation, in rank order, of
    every rank's input as decoded from its compressed payload, chunk by
    chunk (error feedback: ``efs[r]``, over rank ``r``'s input). Identical on
    every rank; a non-finite output leaves every residual as it was. Other
    arguments as :func:`simulate_allreduce`.

    >>> xs = [torch.full((3,), float(r)) for r in range(2)]
    >>> simulate_all_gather(xs, "int8")[0].tolist()
    [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    """
    world, dtype, n = _rank_inputs(inputs)
    if n == 0:
        raise ValueError("inputs are empty")
    chunk_numel = DEFAULT_CHUNK_NUMEL if chunk_numel is None else chunk_numel
    xs = [x.detach().reshape(-1).to(torch.float32) for x in inputs]
    if method in UNCOMPRESSED_METHODS:
        if efs is not None:
            raise ValueError(f"method {method!r} has no error feedback: pass efs=None")
        out = torch.cat([x.to(_wire_dtype(method)).to(torch.float32) for x in xs])
        return [out.to(dtype) for _ in range(world)]
    comp, encode, decode = _payload_codec(method, compressor_kwargs)
    _bind_collective(efs, xs, comp, method + ALL_GATHER_SUFFIX, n, chunk_numel)
    seeds = _Seeds(comp, "all_gather", key, call, efs, range(world))
    seeds.advance()
    out = torch.empty(world * n, dtype=torch.float32, device=xs[0].device)
    for ci, (c0, c1) in enumerate(chunk_bounds(n, chunk_numel)):
        for r in range(world):
            p = encode(xs[r][c0:c1], efs[r].worker[c0:c1] if efs is not None else None, seeds.at(r, ci, 0))
            decode(p, out[r * n + c0:r * n + c1], False)
    if efs is not None and not bool(torch.isfinite(out.to(dtype)).all()):
        for ef in efs:
            ef.rollback()
    return [out.to(dtype) for _ in range(world)]
