"""All-reduce benchmark: plain Gloo against the "pycomm" backend's
all-reduces (casts, block codecs, topk), on W local ranks over 127.0.0.1,
side by side.

For each world size W (``--ranks``, each a fresh set of local rank processes)
and tensor size (``--sizes``, float32), every method (``--methods``) is first
verified on its first call: the result must be bit-identical on all ranks,
and plain Gloo must give the exact sum (the inputs are on a 2^-14 grid, so
every float32 partial sum is exact in any order); fp16 must be close to it.
A method that fails is reported and not timed. Then, in the same rounds
(order rotated every round, so a burst of noise from other tenants hits all
alike), each contender runs ``repeats`` times after ``warmup``: a barrier
before each call, the call timed on every rank, and the max across ranks
taken per repeat (an all-reduce is done when its last rank is).

For every compressed method two more contenders are timed in the same rounds:

* compress: the compressor kernels alone on this rank's data, chunk by chunk
  as the backend runs them (a block codec, e.g. onebit: worker
  compress of the chunk, decode of the W payloads of this rank's segment,
  server compress of the segment, decode of the W segment payloads into the
  chunk; topk: compress, zero the chunk, decode-accumulate W payloads; a
  cast: the two casts);
* wire: the algorithm's collectives with payload-sized buffers and no
  compute, issued in the same order on the plain Gloo group (a block codec:
  uneven ``all_to_all_single`` + ``all_gather_into_tensor`` per chunk; topk:
  ``all_gather_into_tensor`` per chunk; a cast: an all-reduce of its dtype).

A compressed all-reduce cannot beat max(compress, wire); the pipelined
backend (chunk i+1 compressed while chunk i is on the wire) should come close
to it, and without overlap it takes compress + wire. The table shows both and
measured / max(compress, wire).

Example::

    $ pycomm-bench allreduce --quick
    $ pycomm-bench allreduce --ranks 2 --sizes 16M,64M --methods plain,onebit --repeats 20
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from pycomm.distributed import spec
from pycomm.distributed.spec import TAG_WORDS, block_segments, block_wire_numel, topk_wire_numel
from pycomm.wire import quant_num_bytes

from . import per_call
from .launch import Rank, run_each_world
from .methods import ALLREDUCE_BASES, PLAIN, Method, parse_method as _parse_method, vocabulary
from .report import (default_json_path, finish, fmt_number, gloo_document, machine_info, ms, progress_bar,
                     record_events, size_label, spread_ms, status_note, table)
from .timing import Timed, summarize, time_interleaved

HELP = (f"time plain Gloo against the pycomm backend's {', '.join(ALLREDUCE_BASES[1:])} all-reduces "
        "on local ranks (verified first)")

DEFAULT_RANKS = (2, 4)
DEFAULT_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
DEFAULT_METHODS = ("plain", "fp16", "onebit", "topk-0.01", "topk-0.001")
DEFAULT_REPEATS = 15  # as the common --repeats help says
DEFAULT_WARMUP = 3
QUICK_RANKS = (2,)
QUICK_SIZES = (1 << 20, 1 << 22)
QUICK_REPEATS = 3
QUICK_WARMUP = 1
#: Seconds any one collective may take before the process group gives up.
DEFAULT_TIMEOUT = 120.0
#: The exactness argument of the plain check (module docstring) holds for
#: |sum| < 8 W < 2^24 grid steps of 2^-14, i.e. W <= 64.
MAX_RANKS = 64
HOST = "127.0.0.1"
SEED = 20240601
#: Inputs are randn clamped to (-8, 8) and rounded to multiples of 2^-14: a
#: value needs <= 17 significant bits, a sum of W <= 64 of them <= 23, so
#: float32 adds them exactly whatever the order Gloo's ring uses.
GRID = 2.0 ** -14
CLAMP = 8.0 - GRID
#: Rank r's input is the window [r*SHIFT, r*SHIFT + n) of one shared random
#: tensor: different data on every rank (segments and blocks see unaligned
#: values), yet each rank gets the exact sum from W adds instead of
#: generating W tensors.
SHIFT = 1021
#: Error-feedback key of the timed all-reduces (as the DDP hook passes a
#: bucket index): EF is on, as in training.
EF_KEY = 0

OK, VERIFY_FAILED = "ok", "verify_failed"
PARTS = ("total", "compress", "wire")


# ----------------------------------------------------------------- methods ---
def parse_method(name: str) -> Method:
    """One of :data:`~pycomm_bench.methods.ALLREDUCE_BASES` (``plain``, a
    cast, a block codec or ``topk-<density>``, e.g. ``topk-0.01``), each but
    plain through a pycomm group; raises ValueError otherwise.

    Example::

        >>> parse_method("topk-0.001").density
        0.001
    """
    return _parse_method(name, bases=ALLREDUCE_BASES, suffixes=False)


def contender_names(method: Method) -> List[str]:
    """Timed contenders of a method: ``name`` (the all-reduce) and, for the
    compressed ones, ``name:compress`` and ``name:wire``."""
    if not method.compressed:
        return [method.name]
    return [method.name, f"{method.name}:compress", f"{method.name}:wire"]


# ------------------------------------------------------------- byte model ---
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_bounds(numel: int, chunk_numel: int) -> List[Tuple[int, int]]:
    """``[(begin, length), ...]`` of the chunks the backend cuts a tensor into."""
    from pycomm.distributed.spec import chunk_bounds as bounds

    return [(b, e - b) for b, e in bounds(numel, chunk_numel)]


@dataclass
class BlockLayout:
    """Segments of one chunk of ``m`` elements of a block codec
    (docs/allreduce.md step 1, as ``BlockLayout`` in csrc/distributed/spec.h):
    ``seg`` elements per segment (whole blocks), per segment its length, data
    words, blocks and wire size ``S`` in int32 elements. ``bits``: the
    codec's bits per element (``spec.method_spec(m).bits``; onebit's 1).

    >>> lay = BlockLayout(1000, 2, 256, bits=8)
    >>> lay.seg, lay.length, lay.words, lay.size
    (512, [512, 488], [128, 122], [130, 124])
    """

    m: int
    world: int
    block: int
    bits: int = 1
    seg: int = 0
    length: List[int] = field(default_factory=list)
    words: List[int] = field(default_factory=list)
    blocks: List[int] = field(default_factory=list)
    size: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seg, bounds = block_segments(self.m, self.world, self.block)
        for lo, hi in bounds:
            n = hi - lo
            self.length.append(n)
            self.blocks.append(_cdiv(n, self.block))
            self.size.append(block_wire_numel(n, self.block, self.bits))
            self.words.append(self.size[-1] - self.blocks[-1] if n else 0)


def bytes_sent(method: Method, numel: int, world: int, chunk_numel: int,
               block_size: Optional[int] = None, approx: bool = True) -> int:
    """Bytes one rank puts on the wire per all-reduce of ``numel`` float32
    elements (the most any rank sends, where ranks differ):
    :func:`pycomm.distributed.spec.wire_bytes`, which says how they are
    counted (docs/allreduce.md, "Bytes"). ``block_size`` None: the method's
    default.

    Example::

        >>> bytes_sent(parse_method("plain"), 1 << 20, 4, 1 << 20)   # 1.5 * 4 MiB
        6291456
        >>> # 2 (W-1) segment payloads of 8192 words + 128 scales, 4 bytes each, 3 tags
        >>> bytes_sent(parse_method("onebit"), 1 << 20, 4, 1 << 20)
        199704
    """
    density = 0.01 if method.density is None else float(method.density)
    return spec.wire_bytes(method.compressor, numel, world, chunk_numel=chunk_numel, block_size=block_size,
                           density=density, approx=approx)


def _block_kernels(method: str, block: int):
    """``(compress(x, residual) -> (data, scales), data_of(data, start, n),
    decompress(out, data, scales, accumulate))``: the kernels of a block
    codec, as the backend runs them; ``data_of`` cuts the data of elements
    ``[start, start + n)`` (``start`` a block boundary) out of a payload."""
    ops, bits = torch.ops.pycomm, spec.method_spec(method).bits
    if spec.method_spec(method).family == "onebit":  # sign bits in int32 words
        return (lambda x, r: ops.onebit_compress(x, r, block),
                lambda data, start, n: data.narrow(0, start // 32, _cdiv(n, 32)),
                lambda out, data, scales, acc: ops.onebit_decompress(out, data, scales, block, acc))
    # a quant width rounds to nearest, as the benchmark's groups do (no -sr here)
    return (lambda x, r: ops.quant_compress(x, r, bits, block, -1),
            lambda data, start, n: data.narrow(0, quant_num_bytes(start, bits), quant_num_bytes(n, bits)),
            lambda out, data, scales, acc: ops.quant_decompress(out, data, scales, bits, block, acc))


# ---------------------------------------------------- per-rank work (child) ---
def _grid_data(n: int, world: int, rank: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(this rank's input, the exact float32 sum over all ranks' inputs)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(n + SHIFT * (world - 1), generator=gen)
    shared.clamp_(-CLAMP, CLAMP).div_(GRID).round_().mul_(GRID)
    mine = shared[rank * SHIFT: rank * SHIFT + n].clone()
    exact = shared[0:n].clone()
    for r in range(1, world):
        exact.add_(shared[r * SHIFT: r * SHIFT + n])  # exact: see GRID
    return mine, exact


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero().flatten()
    i = int(bad[0])
    return (f"{bad.numel()} of {got.numel()} elements differ "
            f"(first at {i}: {got[i].item()!r} vs {want[i].item()!r})")


def _fp16_tolerance(world: int, dtype: torch.dtype) -> float:
    # Every input is rounded once to the cast dtype and the ring adds W-1
    # times in it, each rounding by at most half an ulp of |partial| <= 8 W.
    ulp = 2.0 ** (math.floor(math.log2(8 * world)) - (10 if dtype == torch.float16 else 7))
    return world * ulp


class _RankBench:
    """What one rank runs for one world size: groups, data, contenders."""

    def __init__(self, rank: Rank) -> None:
        import torch.distributed as dist

        import pycomm.distributed as pd

        self.me, self.rank, self.world, self.cfg = rank, rank.rank, rank.world, rank.cfg
        self.dist, self.pd = dist, pd
        cfg = self.cfg
        self.methods = [parse_method(m) for m in cfg["methods"]]
        self.groups: Dict[str, Any] = {}
        for m in self.methods:
            if m.compressed:
                settings: Dict[str, Any] = {} if m.density is None else {"density": m.density}
                if cfg["chunk_numel"] is not None:
                    settings["chunk_numel"] = cfg["chunk_numel"]
                self.groups[m.name] = pd.wrap(compressor=m.compressor, **settings)
        # The settings the backend really runs with (defaults included).
        self.options = {name: pd.options_of(g) for name, g in self.groups.items()}

    # -- messages to the parent (rank 0 only speaks for the group) ---------
    def tick(self, n: int = 1) -> None:
        if self.rank == 0:
            self.me.emit("tick", n=n)

    def say(self, text: str) -> None:
        if self.rank == 0:
            self.me.emit("say", text=text)

    # -- one (world, size) case -------------------------------------------
    def run_size(self, n: int) -> List[Dict[str, Any]]:
        dist, pd, W, r = self.dist, self.pd, self.world, self.rank
        self.say(f"W={W} n={size_label(n)}: data")
        orig, exact = _grid_data(n, W, r, self.cfg["seed"])
        buf = torch.empty_like(orig)
        scratch = torch.empty_like(orig)  # decode target of the compress contenders
        calls = self.cfg["warmup"] + self.cfg["repeats"]

        records: Dict[str, Dict[str, Any]] = {}
        timed: Dict[str, Timed] = {}

        def restore_and_barrier() -> None:
            buf.copy_(orig)
            dist.barrier()

        def barrier() -> None:
            dist.barrier()

        for m in self.methods:
            rec = self._record(m, n)
            records[m.name] = rec
            self.say(f"W={W} n={size_label(n)}: verify {m.name}")
            buf.copy_(orig)
            dist.barrier()
            if m.compressed:
                pd.all_reduce(buf, key=EF_KEY, group=self.groups[m.name])
            else:
                dist.all_reduce(buf)
            problem = self._verify(m, buf, exact)
            self.tick()
            if problem is not None:
                rec.update(status=VERIFY_FAILED, verified=False, error=problem)
                self.tick(calls * len(contender_names(m)))
                continue
            rec["verified"] = True
            if m.compressed:
                group = self.groups[m.name]
                timed[m.name] = (lambda g=group: pd.all_reduce(buf, key=EF_KEY, group=g), restore_and_barrier)
                timed[f"{m.name}:compress"] = (self._compute_fn(m, orig, scratch), barrier)
                timed[f"{m.name}:wire"] = (self._wire_fn(m, n), barrier)
            else:
                timed[m.name] = (lambda: dist.all_reduce(buf), restore_and_barrier)
        del exact

        if timed:
            self.say(f"W={W} n={size_label(n)}: time")
            samples = time_interleaved(timed, self.cfg["repeats"], self.cfg["warmup"],
                                       on_call=lambda _name: self.tick())
        else:
            samples = {}
        # An all-reduce is done when its last rank is: max across ranks per repeat.
        everyone: List[Optional[Dict[str, List[float]]]] = [None] * W
        dist.all_gather_object(everyone, samples)
        for g in self.groups.values():
            pd.reset_error_feedback(group=g)  # frees the n-float residuals before the next size
        worst = {name: [max(s[name][i] for s in everyone) for i in range(len(samples[name]))]
                 for name in samples}
        return [self._finish(records[m.name], m, worst) for m in self.methods]

    def _record(self, m: Method, n: int) -> Dict[str, Any]:
        opts = self.options.get(m.name, {})
        chunk = opts.get("chunk_numel")
        block = opts.get("block_size")
        approx = bool(opts.get("approx", True))
        sent = bytes_sent(m, n, self.world, chunk or n, block, approx)
        plain = bytes_sent(parse_method(PLAIN), n, self.world, n)
        rec: Dict[str, Any] = {
            "ranks": self.world,
            "numel": n,
            "dtype": "float32",
            "method": m.name,
            "compressor": m.compressor if m.compressed else None,
            "density": m.density,
            "block_size": spec.block_size_for(m.compressor, block) if m.kind == "block" else None,
            "approx": approx if m.kind == "sparse" else None,
            "chunk_numel": chunk,
            "error_feedback": m.error_feedback,
            "status": OK,
            "error": None,
            "verified": None,
            "bytes_sent": sent,
            "bytes_vs_plain": sent / plain if plain else None,
            "threads_per_rank": torch.get_num_threads(),
        }
        for part in PARTS:
            prefix = "" if part == "total" else f"{part}_"
            for key in ("median_s", "p10_s", "p90_s", "times_s"):
                rec[prefix + key] = None
        rec.update(algbw_gbps=None, speedup_vs_plain=None, max_compress_wire_s=None,
                   sum_compress_wire_s=None, measured_vs_max=None)
        return rec

    def _finish(self, rec: Dict[str, Any], m: Method, worst: Dict[str, List[float]]) -> Dict[str, Any]:
        for part, name in zip(PARTS, contender_names(m) if m.compressed else [m.name]):
            if name not in worst:
                continue
            prefix = "" if part == "total" else f"{part}_"
            for key, value in summarize(worst[name]).items():
                rec[prefix + key] = value
            rec[prefix + "times_s"] = worst[name]
        if rec["median_s"] is not None:
            rec["algbw_gbps"] = 4 * rec["numel"] / rec["median_s"] / 1e9
        if rec["compress_median_s"] is not None and rec["wire_median_s"] is not None:
            c, w = rec["compress_median_s"], rec["wire_median_s"]
            rec["max_compress_wire_s"] = max(c, w)
            rec["sum_compress_wire_s"] = c + w
            rec["measured_vs_max"] = rec["median_s"] / max(c, w)
        return rec

    def _verify(self, m: Method, result: torch.Tensor, exact: torch.Tensor) -> Optional[str]:
        """None when the first result is right on every rank, else why not
        (the same answer on every rank, so they skip the same methods)."""
        problem = None
        if not m.compressed:
            if not torch.equal(result, exact):
                problem = (f"rank {self.rank}: plain Gloo sum is not the exact sum: "
                           + _first_difference(result, exact))
        elif not bool(torch.isfinite(result).all()):
            problem = f"rank {self.rank}: {int((~torch.isfinite(result)).sum())} non-finite elements"
        elif m.kind == "cast":
            err = float((result - exact).abs().max())
            tol = _fp16_tolerance(self.world, spec.method_spec(m.compressor).dtype)
            if err > tol:
                problem = f"rank {self.rank}: {m.compressor} sum off by up to {err:g} (tolerance {tol:g})"
        verdicts: List[Optional[str]] = [None] * self.world
        self.dist.all_gather_object(verdicts, problem)
        problems = [p for p in verdicts if p is not None]
        if problems:
            return "; ".join(problems)
        if not self.me.identical(result):
            return "results differ between ranks"
        return None

    # -- compress: the per-rank compute of the algorithm, no communication ----
    def _compute_fn(self, m: Method, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        ops = torch.ops.pycomm
        W, r, n = self.world, self.rank, x.numel()
        opts = self.options[m.name]
        if m.kind == "cast":
            dtype = spec.method_spec(m.compressor).dtype

            def cast() -> None:
                out.copy_(x.to(dtype))  # in and back out, as the engine's 16-bit path does

            return cast

        chunks = chunk_bounds(n, opts["chunk_numel"])
        # Residuals of their own, updated every call like the backend's, so
        # the kernels see the same data the timed all-reduce compresses.
        worker = torch.zeros(n)
        if m.kind == "block":
            B = opts["block_size"]
            compress, data_of, decompress = _block_kernels(m.compressor, B)
            lays = [BlockLayout(mlen, W, B, spec.method_spec(m.compressor).bits) for _b, mlen in chunks]
            server = [torch.zeros(lay.length[r]) for lay in lays]
            # The server accumulator is allocated once and zeroed per chunk: a
            # fresh multi-MB torch.zeros per chunk costs page faults whose price
            # depends on the allocator's history (up to 1 ms per 4 MB here),
            # which is allocator noise, not compressor time.
            acc_buf = torch.empty(max(lay.length[r] for lay in lays))

            def block() -> None:
                for (b, mlen), lay, srv in zip(chunks, lays, server):
                    data, scales = compress(x.narrow(0, b, mlen), worker.narrow(0, b, mlen))
                    L = lay.length[r]
                    if L > 0:
                        # This rank's segment from each of the W ranks (its
                        # own payload stands in for the peers': same sizes).
                        md = data_of(data, r * lay.seg, L)
                        ms = scales.narrow(0, r * lay.seg // B, lay.blocks[r])
                        acc = acc_buf[:L].zero_()
                        for _src in range(W):
                            decompress(acc, md, ms, True)
                        compress(acc, srv)
                    for j in range(W):  # every segment's server payload into the chunk
                        if lay.length[j] == 0:
                            continue
                        sd = data_of(data, j * lay.seg, lay.length[j])
                        ss = scales.narrow(0, j * lay.seg // B, lay.blocks[j])
                        decompress(out.narrow(0, b + j * lay.seg, lay.length[j]), sd, ss, False)

            return block

        density, approx = float(opts["density"]), bool(opts["approx"])
        from pycomm.compressors.topk import topk_k

        def topk() -> None:
            for b, mlen in chunks:
                idx, vals = ops.topk_compress(x.narrow(0, b, mlen), worker.narrow(0, b, mlen),
                                              topk_k(mlen, density), approx)
                o = out.narrow(0, b, mlen)
                o.zero_()
                for _src in range(W):
                    ops.topk_decompress(o, idx, vals, True)

        return topk

    # -- wire: the algorithm's collectives on payload-sized buffers ----------
    def _wire_fn(self, m: Method, n: int) -> Callable[[], None]:
        dist, W, r = self.dist, self.world, self.rank
        # all_gather_into_tensor under its torch >= 2.13 name (the old one warns).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        opts = self.options[m.name]
        if m.kind == "cast":
            half = torch.zeros(n, dtype=spec.method_spec(m.compressor).dtype)
            return lambda: dist.all_reduce(half)

        chunks = chunk_bounds(n, opts["chunk_numel"])
        if m.kind == "block":
            bits = spec.method_spec(m.compressor).bits
            lays = [BlockLayout(mlen, W, opts["block_size"], bits) for _b, mlen in chunks]
            bufs = [
                (torch.zeros(sum(lay.size), dtype=torch.int32),  # all_to_all send
                 torch.empty(W * lay.size[r], dtype=torch.int32),  # all_to_all receive
                 torch.zeros(lay.size[0] + TAG_WORDS, dtype=torch.int32),  # server payload to S_0, tag
                 torch.empty(W * (lay.size[0] + TAG_WORDS), dtype=torch.int32))  # all_gather output
                for lay in lays
            ]

            def block() -> None:
                # Same issue order and waits as run_onebit with the compute removed:
                # a2a i, (wait a2a i-1, ag i-1), (wait ag i-2).
                a2a: List[Any] = []
                ag: List[Any] = []

                def issue_a2a(i: int) -> None:
                    lay, (send, recv, _s, _g) = lays[i], bufs[i]
                    a2a.append(dist.all_to_all_single(recv, send, [lay.size[r]] * W, list(lay.size),
                                                      async_op=True))

                def issue_ag(i: int) -> None:
                    a2a[i].wait()
                    _send, _recv, mine, gathered = bufs[i]
                    ag.append(gather(gathered, mine, async_op=True))

                for i in range(len(chunks)):
                    issue_a2a(i)
                    if i >= 1:
                        issue_ag(i - 1)
                    if i >= 2:
                        ag[i - 2].wait()
                issue_ag(len(chunks) - 1)
                for i in range(max(0, len(chunks) - 2), len(chunks)):
                    ag[i].wait()

            return block

        density, approx = float(opts["density"]), bool(opts["approx"])
        tbufs = []
        for _b, mlen in chunks:
            size = topk_wire_numel(mlen, density, approx)
            tbufs.append((torch.zeros(size, dtype=torch.int32), torch.empty(W * size, dtype=torch.int32)))

        def topk() -> None:
            # As the engine's gathered all-reduce: all_gather i issued, then chunk i-1 waited for.
            works: List[Any] = []
            for i, (mine, gathered) in enumerate(tbufs):
                works.append(gather(gathered, mine, async_op=True))
                if i >= 1:
                    works[i - 1].wait()
            works[-1].wait()

        return topk


def _rank_main(rank: Rank) -> None:
    """One rank (:func:`pycomm_bench.launch.run_ranks`): every size for this world size."""
    bench = _RankBench(rank)
    for n in rank.cfg["sizes"]:
        records = bench.run_size(n)
        if rank.rank == 0:
            rank.emit("records", records=records)
        gc.collect()
    bench.dist.barrier()


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with defaults filled in (``--quick``: 2 ranks, 1M and
    4M, few repeats) and lists parsed; raises ValueError naming the bad option."""
    from .cli import fill_defaults, list_option, positive_int

    if _on_cuda(args):
        # --device cuda: the engine on one GPU (pycomm_bench.engine_cuda).
        from . import engine_cuda

        return engine_cuda.resolve_args(args)
    a = argparse.Namespace(**vars(args))
    quick = bool(getattr(a, "quick", False))
    a.per_call = bool(getattr(a, "per_call", False))
    fill_defaults(a, quick, repeats=(DEFAULT_REPEATS, QUICK_REPEATS), warmup=(DEFAULT_WARMUP, QUICK_WARMUP),
                  calls=(per_call.DEFAULT_CALLS, per_call.DEFAULT_CALLS // 10))
    # --per-call: one rank is allowed (it isolates the engine's own cost).
    least = 1 if a.per_call else 2

    def world_size(text: str) -> int:
        try:
            w = int(text)
        except ValueError:
            raise ValueError(f"expected integers like 2,4, got {text!r}") from None
        if not least <= w <= MAX_RANKS:
            raise ValueError(f"a world size must be between {least} and {MAX_RANKS}, got {w}")
        return w

    def method_name(text: str) -> str:
        parse_method(text)
        return text

    ranks, sizes, methods = ((per_call.DEFAULT_RANKS, per_call.DEFAULT_SIZES, per_call.DEFAULT_METHODS)
                             if a.per_call else
                             (QUICK_RANKS if quick else DEFAULT_RANKS, QUICK_SIZES if quick else DEFAULT_SIZES,
                              DEFAULT_METHODS))
    a.ranks = list_option(getattr(a, "ranks", None), "ranks", ranks, world_size)
    a.sizes = list_option(getattr(a, "sizes", None), "sizes", sizes, positive_int)
    a.methods = list_option(getattr(a, "methods", None), "methods", methods, method_name)

    chunk = getattr(a, "chunk_numel", None)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"argument --chunk-numel: must be a positive integer, got {chunk!r}")
    a.chunk_numel = chunk
    timeout = getattr(a, "timeout", None)
    a.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise ValueError(f"argument --timeout: must be a positive number of seconds, got {timeout!r}")

    device = torch.device(getattr(a, "device", None) or "cpu")
    if device.type != "cpu":
        raise ValueError(f"argument --device: the all-reduce benchmark runs Gloo on cpu or the engine on cuda, "
                         f"got {device}")
    a.device = device
    a.progress = bool(getattr(a, "progress", True))
    a.threads = getattr(a, "threads", None)
    if getattr(a, "json", None) is None:
        ranks = "-".join(map(str, a.ranks)) + ("rank" if list(a.ranks) == [1] else "ranks")
        a.json = (default_json_path("allreduce-per-call", "cpu", quick=quick, settings=ranks) if a.per_call
                  else default_json_path("allreduce", "cpu", quick=quick))
    return a


def _on_cuda(args: argparse.Namespace) -> bool:
    """Whether ``--device`` names a CUDA device (the engine benchmark)."""
    return torch.device(getattr(args, "device", None) or "cpu").type == "cuda"


def _device_arg(text: str) -> torch.device:
    """argparse type of ``--device`` here: as every benchmark's, but a cuda
    device on a machine without one is refused saying what it is for."""
    from .cli import device_arg

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        from .engine_cuda import CUDA_NEEDED

        raise argparse.ArgumentTypeError(CUDA_NEEDED)
    return device_arg(text)


def _own_device_option(parser: argparse.ArgumentParser) -> None:
    """Give this subcommand a ``--device`` of its own (the common one is
    shared by every subcommand's parser): cuda runs the engine benchmark, and
    asking for it without a GPU says so."""
    import copy

    for i, action in enumerate(parser._actions):
        if "--device" not in action.option_strings:
            continue
        mine = copy.copy(action)
        mine.type = _device_arg
        mine.help = ("cpu: Gloo on local ranks (default); cuda[:N]: the engine on one GPU, one rank over NCCL "
                     "(pycomm_bench.engine_cuda)")
        parser._actions[i] = mine
        for option in action.option_strings:
            parser._option_string_actions[option] = mine
        for group in parser._action_groups:
            group._group_actions[:] = [mine if a is action else a for a in group._group_actions]


def make_args(**overrides: Any) -> argparse.Namespace:
    """Arguments for :func:`run_allreduce` without the command line (tests).

    Example::

        >>> make_args(ranks="2", sizes="64k", methods="plain,onebit").sizes
        [65536]
    """
    base = dict(ranks=None, sizes=None, methods=None, chunk_numel=None, timeout=None, repeats=None,
                warmup=None, calls=None, per_call=False, device="cpu", json=None, quick=False, threads=None,
                progress=False)
    base.update(overrides)
    return resolve_args(argparse.Namespace(**base))


def run_allreduce(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the benchmark and return the JSON document (``records`` included);
    prints nothing but the progress bar (stderr). A world size whose ranks
    fail is recorded in ``failures`` and the others still run.

    Example::

        >>> doc = run_allreduce(make_args(ranks="2", sizes="64k", repeats=2))  # doctest: +SKIP
        >>> sorted({r["method"] for r in doc["records"]})                       # doctest: +SKIP
        ['fp16', 'onebit', 'plain', 'topk-0.001', 'topk-0.01']
    """
    if _on_cuda(args):
        from . import engine_cuda

        return engine_cuda.run_from_args(args)
    args = resolve_args(args)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t_start = time.monotonic()
    machine = machine_info("cpu")  # before the run: its load average is the others'
    methods = [parse_method(m) for m in args.methods]
    calls = args.warmup + args.repeats
    per_size = sum(1 + calls * len(contender_names(m)) for m in methods)
    total = per_size * len(args.sizes) * len(args.ranks)
    records: List[Dict[str, Any]] = []
    failures: List[Dict[str, Any]] = []
    bar = progress_bar(total, "call", args.progress)

    on_event = record_events(bar, records)

    cfg = dict(methods=args.methods, sizes=args.sizes, repeats=args.repeats, warmup=args.warmup,
               chunk_numel=args.chunk_numel, seed=SEED)

    def skip_rest(added: int) -> None:  # the bar past what a failed world size will not run
        bar.update(max(0, per_size * (len(args.sizes) - added // max(1, len(methods)))))

    try:
        run_each_world(_rank_main, args, cfg, records, failures, on_event, skip_rest)
    finally:
        bar.close()

    # Speedups against plain Gloo of the same (ranks, size): measured in the same rounds.
    plain = {(r["ranks"], r["numel"]): r["median_s"] for r in records if r["method"] == "plain"}
    for r in records:
        base = plain.get((r["ranks"], r["numel"]))
        if base is not None and r["median_s"] is not None:
            r["speedup_vs_plain"] = base / r["median_s"]
    return gloo_document(
        "allreduce", started, machine, args, t_start, records, failures, host=HOST, dtype="float32", op="sum",
        methods=args.methods,
        chunk_numel=args.chunk_numel,  # None: the backend's default (each record has the value used)
        quick=bool(getattr(args, "quick", False)), timeout_s=args.timeout)


# ------------------------------------------------------------------ output ---


def format_table(doc: Dict[str, Any]) -> str:
    """The results as a text table (tabulate), times in milliseconds."""
    rows = []
    for r in doc["records"]:
        rows.append([
            r["ranks"], size_label(r["numel"]), r["method"], fmt_number(ms(r["median_s"])), spread_ms(r),
            fmt_number(r["algbw_gbps"]), fmt_number(r["bytes_sent"] / 2 ** 20), fmt_number(r["speedup_vs_plain"]),
            fmt_number(ms(r["compress_median_s"])), fmt_number(ms(r["wire_median_s"])),
            fmt_number(ms(r["max_compress_wire_s"])), fmt_number(ms(r["sum_compress_wire_s"])),
            fmt_number(r["measured_vs_max"]), status_note(r),
        ])
    headers = ["W", "numel", "method", "median ms", "p10-p90 ms", "GB/s", "MiB sent/rank", "x vs plain",
               "compress ms", "wire ms", "max(c,w) ms", "c+w ms", "meas/max", "notes"]
    m = doc["machine"]
    load = m.get("loadavg")
    chunks = sorted({r["chunk_numel"] for r in doc["records"] if r["chunk_numel"] is not None})
    head = (
        f"pycomm allreduce: Gloo on {doc['host']}, float32 SUM, {doc['repeats']} repeats after "
        f"{doc['warmup']} warmup (median, p10-p90 of the max over ranks), "
        f"chunk_numel {', '.join(map(str, chunks)) or '-'}"
        + (f", load average {load[0]:.2f} at start on {m['cpu_count']} CPUs" if load else "")
        + f"\ncpu: {m.get('cpu_model') or m.get('processor')}, torch {m['torch']}; "
        "GB/s = 4 n / time; compress = the rank's kernels alone, wire = the collectives alone "
        "(same rounds)\n"
    )
    out = head + table(rows, headers)
    for f in doc["failures"]:
        out += f"\nFAILED W={f['ranks']}: {f['error'].strip().splitlines()[-1]}"
    return out


def failed(doc: Dict[str, Any]) -> List[str]:
    """One line per verification failure, crashed record or failed world size."""
    lines = [f"{r['ranks']} ranks, {size_label(r['numel'])}, {r['method']}: {r['error']}"
             for r in doc["records"] if r["status"] != OK]
    lines += [f"{f['ranks']} ranks: {f['error']}" for f in doc["failures"]]
    return lines


# --------------------------------------------------------------------- cli ---
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``allreduce`` options (the common ones are already there)."""
    from .cli import positive_int

    _own_device_option(parser)
    g = parser.add_argument_group("allreduce options")
    g.add_argument("--ranks", nargs="+", metavar="W", default=None,
                   help="world sizes, comma or space separated, each run as that many local "
                        f"processes (default: {','.join(map(str, DEFAULT_RANKS))}; 2 with --quick); "
                        "each rank uses --threads threads, by default the CPU count / W (at least 1)")
    g.add_argument("--sizes", nargs="+", metavar="N", default=None,
                   help="float32 elements per tensor, comma or space separated, k/M/G suffixes "
                        f"(default: {','.join(map(size_label, DEFAULT_SIZES))}; "
                        f"{','.join(map(size_label, QUICK_SIZES))} with --quick)")
    g.add_argument("--methods", nargs="+", metavar="METHOD", default=None,
                   help=f"{vocabulary(ALLREDUCE_BASES)}, comma or space separated "
                        f"(default: {','.join(DEFAULT_METHODS)})")
    g.add_argument("--chunk-numel", type=positive_int, default=None,
                   help="pipelining chunk of the pycomm backend (default: the backend's)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds any one collective may take before the run fails "
                        f"(default: {DEFAULT_TIMEOUT:g})")
    g.add_argument("--per-call", action="store_true",
                   help="the engine's cost per call instead: back-to-back keyed calls against plain Gloo, "
                        f"on {','.join(map(str, per_call.DEFAULT_RANKS))} rank(s) (1 allowed), "
                        f"{','.join(map(size_label, per_call.DEFAULT_SIZES))} elements by default "
                        "(pycomm_bench.per_call)")
    g.add_argument("--calls", type=positive_int, default=None,
                   help=f"--per-call: back-to-back calls per round (default: {per_call.DEFAULT_CALLS}, "
                        "fewer for big tensors)")




def run(args: argparse.Namespace) -> int:
    """``pycomm-bench allreduce``: run, print the table, write the JSON.
    Exit status 1 if a method failed verification or a world size failed."""
    if _on_cuda(args):
        from . import engine_cuda

        return engine_cuda.run(args)
    t0 = time.monotonic()
    if getattr(args, "per_call", False):
        return per_call.run(resolve_args(args))
    doc = run_allreduce(args)
    return finish(doc, args.json, format_table(doc), failed(doc), t0)
