"""Single-process simulation of the compressed all-reduce of ``docs/allreduce.md``.

The oracle of the multi-process tests of both implementations (the Python
algorithms in :mod:`pycomm.distributed.algorithms` and the C++ ``"pycomm"``
backend): every rank's input goes in, every rank's result comes out, computed
with the reference compressors (``impl="reference"``) and written directly
from the spec, without wire formats or collectives. It shares with the real
implementations only :class:`ErrorFeedback` (the state container, so that
residuals can be compared after each step).

Where an implementation differs from the simulation:

* onebit / topk over ``impl="reference"``: never; the results and the
  residuals are equal bit for bit.
* onebit with a compiled compressor (``impl="auto"``): block scales are sums
  in another order, so results and residuals agree to float32 rounding
  relative to the scale (and, rarely, a sign of a near-zero element flips).
* topk with a compiled compressor: equal bit for bit (selection and values
  are exact, the scatter-add happens in rank order).
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
from typing import Any, List, Optional, Sequence

import torch

from .. import get_compressor
from .algorithms import DEFAULT_CHUNK_NUMEL, ErrorFeedback, chunk_bounds, normalize_op

__all__ = ["simulate_allreduce", "simulate_hierarchical_allreduce"]


def simulate_allreduce(
    inputs: Sequence[torch.Tensor],
    method: str,
    op: Any = "sum",
    chunk_numel: Optional[int] = None,
    efs: Optional[Sequence[ErrorFeedback]] = None,
    **compressor_kwargs: Any,
) -> List[torch.Tensor]:
    """Results of a compressed all-reduce of ``inputs[r]`` (one per rank).

    Returns one new tensor per rank (dtype and shape of the inputs); the
    inputs are not modified. ``efs`` (one :class:`ErrorFeedback` per rank,
    rank ``r``'s at index ``r``) are used and updated as the ranks' own
    would be: left as they were when the result is not finite.
    ``compressor_kwargs`` as in
    :func:`pycomm.distributed.algorithms.allreduce_compressed`; ``impl``
    defaults to "reference".
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

    if method in ("fp16", "bf16"):
        if efs is not None:
            raise ValueError(f"method {method!r} has no error feedback: pass efs=None")
        if compressor_kwargs:
            raise TypeError(f"method {method!r} takes no compressor arguments")
        out = _simulate_cast(xs, torch.float16 if method == "fp16" else torch.bfloat16, avg)
    elif method in ("onebit", "topk"):
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
        out = torch.empty(n, dtype=torch.float32, device=xs[0].device)
        for ci, (start, end) in enumerate(chunk_bounds(n, chunk_numel)):
            chunk = [x[start:end] for x in xs]
            workers = [efs[r].worker[start:end] for r in range(world)] if efs is not None else None
            if method == "onebit":
                servers = [efs[r].server_segment(ci) for r in range(world)] if efs is not None else None
                out[start:end] = _simulate_onebit_chunk(chunk, comp, avg, workers, servers)
            else:
                out[start:end] = _simulate_topk_chunk(chunk, comp, avg, workers)
        # A non-finite result (in the inputs' dtype) leaves every residual
        # as it was before the call (docs/allreduce.md, "Non-finite results").
        if efs is not None and not bool(torch.isfinite(out.to(dtype)).all()):
            for ef in efs:
                ef.rollback()
    else:
        raise ValueError(f"unknown method {method!r}; choose one of ['onebit', 'topk', 'fp16', 'bf16']")

    return [out.view(shape).to(dtype).clone() for _ in range(world)]


def _simulate_onebit_chunk(chunk, comp, avg, workers, servers) -> torch.Tensor:
    world, m, bsz = len(chunk), chunk[0].numel(), comp.block_size
    # Segments: a whole number of blocks each, the last ones possibly short or empty.
    seg = math.ceil(math.ceil(m / world) / bsz) * bsz
    # Every rank compresses its whole chunk with its worker residual; decoding
    # the whole payload and slicing it is what decoding a segment's slice gives.
    decoded = []
    for r in range(world):
        p = comp.compress(chunk[r], workers[r] if workers is not None else None)
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
        q = comp.compress(acc, es)
        out[lo:hi] = comp.decompress(q)
    return out


def _simulate_topk_chunk(chunk, comp, avg, workers) -> torch.Tensor:
    world, m = len(chunk), chunk[0].numel()
    out = torch.zeros(m, dtype=torch.float32, device=chunk[0].device)
    for r in range(world):  # rank order
        p = comp.compress(chunk[r], workers[r] if workers is not None else None)
        out.index_add_(0, p.indices.long(), p.values)
    if avg:
        out = out / world
    return out


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
    if method in ("fp16", "bf16", "none"):
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
                                 group_efs, **compressor_kwargs)[0]
        out[lo:hi] = res / L if avg else res
        if group_efs is not None and bool(torch.isfinite(res).all()):
            kept.extend(group_efs)
    # A non-finite result leaves every residual as it was: shard groups with
    # a finite shard roll back too, as the backend decides on the whole result.
    if not bool(torch.isfinite(out.to(dtype)).all()):
        for ef in kept:
            ef.rollback()
    return [out.view(shape).to(dtype).clone() for _ in range(world)]
