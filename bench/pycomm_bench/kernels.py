"""Kernel benchmark: each compressor implementation against the unfused torch
pipeline a peer library would run, side by side in the same run.

Cases (:data:`CASES`, from the method table): each block codec at its
default block size (``spec.DEFAULT_BLOCK_SIZE``, e.g. onebit b=2048: compress
with error feedback, decompress, decompress-accumulate), topk approximate (density
0.01 and 0.001) and topk exact (density 0.01), compress with error
feedback. onebit and topk have an unfused peer; :func:`register_peer` adds
more. Every implementation that
can run on the device (``pycomm.available_impls``; Triton on CPU is the
interpreter and is left out) and every peer is first checked against the
pure-torch reference on a smaller, odd-sized tensor (bits and indices equal,
scales and values close); one that fails is reported and not timed. Then all
contenders of one operation are timed interleaved on ``numel`` float32
elements: median and p10/p90 of ``repeats`` calls after ``warmup`` calls.

Each row reports effective GB/s from the bytes the operation must move (see
:func:`onebit_bytes`, :func:`topk_bytes`), that as a percentage of the copy
bandwidth (``dst.copy_(src)`` on ``numel`` float32, 8 bytes/element) timed
interleaved with the same operation, and the speedup over the unfused peer
(and, for topk, over ``torch.topk`` alone). A shared machine's bandwidth
drifts by 2x within minutes: only figures measured side by side are compared.

Example::

    $ pycomm-bench kernels --quick
    >>> from pycomm_bench.kernels import run_kernels, make_args
    >>> doc = run_kernels(make_args(numel=65536, repeats=2, warmup=1))  # doctest: +SKIP
    >>> sorted({r["compressor"] for r in doc["rows"]})                  # doctest: +SKIP
    ['int4 b=256', 'int8 b=256', 'onebit b=2048', 'topk approx d=0.001', 'topk approx d=0.01', 'topk exact d=0.01']
"""

from __future__ import annotations

import argparse
import datetime as _dt
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import pycomm
from pycomm.compressors import onebit as onebit_ref
from pycomm.compressors import quant as quant_ref
from pycomm.compressors import topk as topk_ref
from pycomm.compressors.base import compressor_class
from pycomm.distributed import spec
from pycomm.wire import quant_num_bytes

from .methods import ONEBIT, SPARSE

from .report import (default_json_path, finish, fmt_number, loadavg, machine_info, ms, progress_bar, spread_ms,
                     status_note, table)
from .timing import Timed, summarize, time_interleaved

HELP = "time every compressor kernel against an unfused torch pipeline (verified first)"

DEFAULT_NUMEL = 1 << 24
DEFAULT_REPEATS = 15
DEFAULT_WARMUP = 3
QUICK_NUMEL = 1 << 20
QUICK_REPEATS = 5
QUICK_WARMUP = 1
#: Verification size: small enough for the reference to be quick, and odd so
#: that the last word and the last block are partial (where kernels go wrong).
VERIFY_MAX_NUMEL = (1 << 18) - 31
#: The residual starts as a small randn, not zeros, so error feedback does
#: real work (an all-zero residual could be special-cased by a kernel).
RESIDUAL_SCALE = 0.1
SEED = 1234

PEER = "unfused"
TOPK_BASELINE = "torch.topk"
COPY = "(copy)"  # the copy timed next to every operation (not a row)
COPY_PER_ROUND = 3

#: Warn when the copy bandwidth of two operations differs by more than this.
DRIFT_WARN = 1.5

OK, VERIFY_FAILED, ERROR, UNAVAILABLE = "ok", "verify_failed", "error", "unavailable"


@dataclass(frozen=True)
class Case:
    """One compressor configuration and the operations timed for it."""

    label: str
    family: str
    params: Dict[str, object]
    ops: Tuple[str, ...]


#: What is timed per block codec; topk has a compress only.
BLOCK_OPS = ("compress", "decompress", "decompress_acc")
#: topk's cases: (density, approximate).
TOPK_SETTINGS = ((0.01, True), (0.001, True), (0.01, False))


def _cases() -> Tuple[Case, ...]:
    """One case per block codec of the method table at its default block
    size, and topk's settings, in table order."""
    cases: List[Case] = []
    for row in spec.METHOD_TABLE:
        if row.kind == "block":
            cases.append(Case(f"{row.name} b={row.block_size}", row.name, {"block_size": row.block_size},
                              BLOCK_OPS))
        elif row.kind == "sparse":
            cases += [Case(f"{row.name} {'approx' if approx else 'exact'} d={density:g}", row.name,
                           {"density": density, "approx": approx}, ("compress",))
                      for density, approx in TOPK_SETTINGS]
    return tuple(cases)


CASES: Tuple[Case, ...] = _cases()


# ------------------------------------------------------------- byte models ---
def onebit_bytes(numel: int, block_size: int, op: str, ef: bool = True) -> int:
    """Bytes a onebit operation must move at least.

    compress: read g (4) [+ read r (4) + write r (4) with EF] + the payload
    (1/8 per element in 32-bit words, 4 per block of scales); decompress: write
    out (4) [+ read out (4) when accumulating] + read the payload.

    Example::

        >>> onebit_bytes(2048, 2048, "compress") / 2048   # 12 + 1/8 + 4/2048
        12.126953125
    """
    payload = 4 * -(-numel // onebit_ref.WORD_BITS) + 4 * -(-numel // block_size)
    return _dense_bytes(op, ef) * numel + payload


def quant_bytes(numel: int, bits: int, block_size: int, op: str, ef: bool = True) -> int:
    """Bytes an operation of a quant row (``bits``-bit levels) must move at least: as
    :func:`onebit_bytes`, with ``bits / 8`` bytes of levels per element.

    Example::

        >>> quant_bytes(256, 8, 256, "compress") / 256     # 12 + 1 + 4/256
        13.015625
    """
    payload = quant_num_bytes(numel, bits) + 4 * -(-numel // block_size)
    return _dense_bytes(op, ef) * numel + payload


def _dense_bytes(op: str, ef: bool) -> int:
    """float32 bytes per element: compress reads g [and reads and writes r];
    decompress writes out [and reads it when accumulating]."""
    return {"compress": 12 if ef else 4, "decompress": 4, "decompress_acc": 8}[op]


def topk_bytes(numel: int, count: int, ef: bool = True) -> int:
    """Bytes a topk compress must move at least: read g [+ read r + write r]
    (4 or 12 per element) + int32 index and float32 value per selected entry.

    Example::

        >>> topk_bytes(1000, 10)
        12080
    """
    return (12 if ef else 4) * numel + 8 * count


def torch_topk_bytes(numel: int, k: int) -> int:
    """``torch.topk`` alone: read |c| (4 per element), write k float32 values
    and k int64 indices."""
    return 4 * numel + 12 * k


# ------------------------------------------------------------ unfused peers ---
# What a peer library (DeepSpeed's 1-bit Adam compressor, GRACE) does with
# stock torch/numpy ops: one full pass over memory per op, temporaries
# allocated each call. Each is verified against the reference like the
# implementations, so the speedup compares equal work.


def _packbits(signs: torch.Tensor) -> torch.Tensor:
    """bool [n] -> int32 words, bit i of word w = element 32w + i."""
    if signs.device.type != "cpu":
        return _packbits_torch(signs)  # numpy cannot see device memory
    packed = np.packbits(signs.numpy(), bitorder="little")
    pad = (-packed.size) % 4  # whole 32-bit words
    if pad:
        packed = np.concatenate([packed, np.zeros(pad, dtype=np.uint8)])
    words = torch.from_numpy(packed.view("<u4"))
    return words.view(torch.int32)  # the payload's dtype; same bits


def _packbits_torch(signs: torch.Tensor) -> torch.Tensor:
    """What a GPU peer does instead of numpy.packbits: weight 8 flags, sum to a byte."""
    n = signs.numel()
    padded = torch.zeros(-(-n // 32) * 32, dtype=torch.uint8, device=signs.device)
    padded[:n] = signs
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=signs.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8).view(torch.int32)


def _unpackbits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """int32 words -> bool [numel] (inverse of :func:`_packbits`)."""
    if bits.device.type != "cpu":
        return _unpackbits_torch(bits, numel)
    flags = np.unpackbits(bits.numpy().view(np.uint8), count=numel, bitorder="little")
    return torch.from_numpy(flags).view(torch.bool)


def _unpackbits_torch(bits: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    flags = (bits.view(torch.uint8).unsqueeze(1) >> shifts) & 1
    return flags.view(-1)[:numel].bool()


def unfused_onebit_compress(
    grad: torch.Tensor, residual: torch.Tensor, block_size: int,
    pack: Callable[[torch.Tensor], torch.Tensor] = _packbits,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Onebit EF compress as separate torch passes (+ numpy.packbits, or
    ``pack``: bool [n] -> int32 words); the baseline of the onebit compress
    rows. Updates ``residual``.

    Example::

        >>> import torch
        >>> g, r = torch.randn(100), torch.zeros(100)
        >>> bits, scales = unfused_onebit_compress(g, r, 64)
        >>> bits.shape, scales.shape
        (torch.Size([4]), torch.Size([2]))
    """
    n = grad.numel()
    c = grad + residual
    a = c.abs()
    full = n - n % block_size
    scales = a[:full].view(-1, block_size).mean(dim=1)
    if full < n:  # a partial last block uses its own length
        scales = torch.cat([scales, a[full:].mean().view(1)])
    signs = c >= 0
    bits = pack(signs)
    per_elem = scales.repeat_interleave(block_size)[:n]
    decoded = torch.where(signs, per_elem, -per_elem)
    torch.sub(c, decoded, out=residual)
    return bits, scales


def unfused_onebit_decompress(
    bits: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool,
    unpack: Callable[[torch.Tensor, int], torch.Tensor] = _unpackbits,
) -> None:
    """Onebit decode with numpy.unpackbits (or ``unpack``) + where + multiply
    (the baseline of the decompress rows)."""
    n = out.numel()
    positive = unpack(bits, n)
    sign = torch.where(positive, 1.0, -1.0)
    decoded = sign * scales.repeat_interleave(block_size)[:n]
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)


def unfused_topk_compress(
    grad: torch.Tensor, residual: torch.Tensor, k: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k EF compress with torch.topk (the baseline of every topk row;
    a peer has no approximate mode). Indices come back unsorted, int64.

    Example::

        >>> import torch
        >>> g, r = torch.tensor([0.1, -3.0, 2.0, 0.5]), torch.zeros(4)
        >>> idx, vals = unfused_topk_compress(g, r, 2)
        >>> sorted(idx.tolist()), r.tolist()
        ([1, 2], [0.10000000149011612, 0.0, 0.0, 0.5])
    """
    c = residual.add_(grad)  # c = g + r, kept in the residual buffer (r = c)
    idx = torch.topk(c.abs(), k, sorted=False).indices
    values = c[idx]
    c[idx] = 0.0  # what was sent leaves the residual
    return idx, values


# ------------------------------------------------------------ verification ---
class VerifyError(AssertionError):
    """An implementation's result differs from the reference."""


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        raise VerifyError(f"{what}: shape {tuple(got.shape)}, reference {tuple(want.shape)}")
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = int(bad[0])
        raise VerifyError(
            f"{what}: {bad.numel()} of {got.numel()} differ from the reference "
            f"(first at {i}: {got[i].item()} vs {want[i].item()})"
        )


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise VerifyError(f"{what}: " + "; ".join(lines[:4])) from None


# Scales are sums of 2048 floats in some order: close, not bit-equal.
SCALE_TOL = dict(rtol=1e-5, atol=1e-7)
# Residuals and decoded values follow from the scales by one add/sub.
VALUE_TOL = dict(rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- the harness ---
@dataclass
class Contender:
    """One implementation (or peer) of one operation.

    ``verify()`` raises :class:`VerifyError` on a wrong result (None: nothing
    to verify). ``prepare()`` builds the full-size state, runs the operation
    once, and returns the call to time, the bytes it moves and extra row
    fields (count, recall).
    """

    impl: str
    kind: str  # "impl", "peer" (unfused pipeline) or "baseline" (torch.topk alone)
    verify: Optional[Callable[[], None]]
    prepare: Callable[[], Tuple[Timed, int, Dict[str, object]]]


@dataclass
class _Ctx:
    numel: int
    repeats: int
    warmup: int
    device: torch.device
    impls: Optional[List[str]]
    g: torch.Tensor
    r0: torch.Tensor
    gv: torch.Tensor  # verification inputs, on CPU (the oracle runs there)
    rv0: torch.Tensor
    base_v: torch.Tensor  # what decompress-accumulate adds onto, verification size
    bar: object = None
    copy_dst: Optional[torch.Tensor] = None
    copy_samples: List[float] = field(default_factory=list)
    copy_by_op: List[Dict[str, object]] = field(default_factory=list)
    cache: Dict[object, object] = field(default_factory=dict)

    @property
    def calls_per_contender(self) -> int:
        return self.repeats + self.warmup

    def tick(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)


def _randn(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    return x.mul_(scale) if scale != 1.0 else x


def _make_ctx(args: argparse.Namespace) -> _Ctx:
    gen = torch.Generator().manual_seed(SEED)
    n, dev = args.numel, args.device
    nv = min(n, VERIFY_MAX_NUMEL)
    g = _randn(n, gen).to(dev)
    r0 = _randn(n, gen, RESIDUAL_SCALE).to(dev)
    gv, rv0, base_v = _randn(nv, gen), _randn(nv, gen, RESIDUAL_SCALE), _randn(nv, gen)
    return _Ctx(n, args.repeats, args.warmup, dev, args.impls, g, r0, gv, rv0, base_v)


def _row(ctx: _Ctx, case: Case, op: str, c: Contender) -> Dict[str, object]:
    return {
        "compressor": case.label,
        "family": case.family,
        "params": dict(case.params),
        "op": op,
        "impl": c.impl,
        "kind": c.kind,
        "numel": ctx.numel,
        "ef": op == "compress",
        "status": OK,
        "error": None,
        "verified": None,
        "verify_numel": ctx.gv.numel(),
        "median_s": None,
        "p10_s": None,
        "p90_s": None,
        "times_s": None,
        "elements_per_s": None,
        "bytes_moved": None,
        "bytes_per_element": None,
        "gbps": None,
        "pct_copy": None,
        "copy_gbps": None,  # copy bandwidth timed interleaved with this operation
        "speedup_vs_unfused": None,
        "speedup_vs_torch_topk": None,  # topk rows only
        "k": None,  # topk: entries exact mode sends
        "count": None,  # topk: entries this contender sent
        "recall": None,  # topk: share of the exact top-k among them
    }


def _bench_op(ctx: _Ctx, case: Case, op: str, contenders: Sequence[Contender]) -> List[Dict[str, object]]:
    """Verify, prepare, then time all contenders of one operation interleaved."""
    rows: List[Dict[str, object]] = []
    timed: Dict[str, Timed] = {}
    live: Dict[str, Dict[str, object]] = {}
    for c in contenders:
        row = _row(ctx, case, op, c)
        rows.append(row)
        try:
            if c.verify is not None:
                ctx.say(f"verify {case.label} {op} {c.impl}")
                try:
                    c.verify()
                except VerifyError as exc:
                    row.update(status=VERIFY_FAILED, verified=False, error=str(exc))
                    ctx.tick(ctx.calls_per_contender)
                    continue
                row["verified"] = True
            ctx.say(f"prepare {case.label} {op} {c.impl}")
            fn_setup, nbytes, extra = c.prepare()
        except Exception as exc:  # an impl that crashes is reported, not fatal
            row.update(status=ERROR, error=f"{type(exc).__name__}: {exc}")
            ctx.tick(ctx.calls_per_contender)
            continue
        row.update(extra)
        row["bytes_moved"] = int(nbytes)
        row["bytes_per_element"] = nbytes / ctx.numel
        timed[c.impl] = fn_setup
        live[c.impl] = row

    if not timed:
        ctx.tick(COPY_PER_ROUND * ctx.calls_per_contender)  # no copy timed alone
        return rows
    # The copy runs in the same rounds as the kernels: its bandwidth is the
    # limit each row is quoted against, under the same noise. It is cheap, so
    # it runs COPY_PER_ROUND times a round (spread by the rotation): a
    # 10 ms scheduler stall of a shared machine then moves its median less.
    dst, src = ctx.copy_dst, ctx.g
    copy_names = [f"{COPY}{i}" for i in range(COPY_PER_ROUND)]
    for name in copy_names:
        timed[name] = (lambda: dst.copy_(src), None)
    ctx.say(f"time {case.label} {op}")
    try:
        samples = time_interleaved(
            timed, ctx.repeats, ctx.warmup, ctx.device, on_call=lambda _name: ctx.tick()
        )
    except Exception as exc:
        for row in live.values():
            row.update(status=ERROR, error=f"while timing: {type(exc).__name__}: {exc}")
        return rows

    copy_times = [t for name in copy_names for t in samples[name]]
    ctx.copy_samples.extend(copy_times)
    copy_stats = summarize(copy_times)
    copy_gbps = 8 * ctx.numel / copy_stats["median_s"] / 1e9
    ctx.copy_by_op.append({"compressor": case.label, "op": op, **copy_stats, "gbps": copy_gbps})
    for name, row in live.items():
        stats = summarize(samples[name])
        gbps = row["bytes_moved"] / stats["median_s"] / 1e9
        row.update(stats)
        row["times_s"] = samples[name]
        row["elements_per_s"] = ctx.numel / stats["median_s"]
        row["gbps"] = gbps
        row["copy_gbps"] = copy_gbps
        row["pct_copy"] = 100.0 * gbps / copy_gbps
    peer, baseline = live.get(PEER), live.get(TOPK_BASELINE)
    for row in rows:
        if row["median_s"] is None:
            continue
        if peer is not None:
            row["speedup_vs_unfused"] = peer["median_s"] / row["median_s"]
        if baseline is not None:
            row["speedup_vs_torch_topk"] = baseline["median_s"] / row["median_s"]
    return rows


def _timed_with_residual(ctx: _Ctx, call: Callable[[torch.Tensor, torch.Tensor], object]):
    """(fn, setup) running ``call(g, r)`` with r restored to r0 before each call,
    so every sample does the same work; the first result is returned too."""
    r = ctx.r0.clone()
    g = ctx.g

    def setup() -> None:
        r.copy_(ctx.r0)

    def fn():
        return call(g, r)

    setup()
    first = fn()
    return (fn, setup), first


# ------------------------------------------------------------- extra peers ---
#: family -> peer name -> runners factory, registered with :func:`register_peer`.
EXTRA_PEERS: Dict[str, Dict[str, Callable]] = {}


def register_peer(family: str, name: str, runners: Callable) -> None:
    """Time ``name`` as one more peer of every ``family`` case, verified and
    reported like the unfused one (kind "peer"). ``runners`` takes what
    the family's runners take after the implementation and returns what
    they return: a block codec's ``runners(block) -> (compress,
    decompress)`` (:func:`block_runners`), topk ``runners(density, approx) -> compress``
    (:func:`topk_runner`, always exact like the unfused peer). A later
    registration of the same name replaces it; :func:`unregister_peer`
    removes it.

    Example::

        >>> register_peer("onebit", "unfused-again", lambda block: block_runners("onebit", PEER, block))
        >>> block_runners("onebit", "unfused-again", 64)[0] is not None
        True
        >>> unregister_peer("onebit", "unfused-again")
    """
    if family not in (c.family for c in CASES):
        raise ValueError(f"no kernel cases of {family!r}; choose from {sorted({c.family for c in CASES})}")
    EXTRA_PEERS.setdefault(family, {})[name] = runners


def unregister_peer(family: str, name: str) -> None:
    """Remove a peer :func:`register_peer` added (nothing if there is none)."""
    EXTRA_PEERS.get(family, {}).pop(name, None)


def peers(family: str) -> List[str]:
    """The peers timed in every case of ``family``: the unfused pipeline
    (onebit and topk have one) and the registered ones.

    >>> peers("onebit"), peers("int8")
    (['unfused'], [])
    """
    own = [] if spec.method_spec(family).family == "quant" else [PEER]  # the quant kernels have no unfused peer
    return own + list(EXTRA_PEERS.get(family, {}))


# ------------------------------------------------------------ block codecs ---
@dataclass
class _Codec:
    """What the block-codec contenders need of onebit or a quant width beside
    :func:`block_runners`: the pure-torch reference, the bytes an operation
    moves, and the name of the payload's data."""

    reference: Tuple[Callable, Callable]
    nbytes: Callable[[int, str], int]
    data: str


def _codec(family: str, block: int) -> _Codec:
    bits = spec.method_spec(family).bits
    if spec.method_spec(family).family == "onebit":
        return _Codec(
            (lambda g, r: onebit_ref.compress_reference(g, r, block),
             lambda data, scales, out, acc: onebit_ref.decompress_reference(data, scales, block, out, acc)),
            lambda n, op: onebit_bytes(n, block, op), "bits")
    return _Codec(
        (lambda g, r: quant_ref.compress_reference(g, r, bits, block, -1),
         lambda data, scales, out, acc: quant_ref.decompress_reference(data, scales, bits, block, out, acc)),
        lambda n, op: quant_bytes(n, bits, block, op), "levels")


def _block_oracle(ctx: _Ctx, family: str, codec: _Codec, block: int) -> Dict[str, torch.Tensor]:
    key = ("block-oracle", family, block)
    if key not in ctx.cache:
        compress, decompress = codec.reference
        r = ctx.rv0.clone()
        data, scales = compress(ctx.gv, r)
        dec = torch.empty_like(ctx.gv)
        decompress(data, scales, dec, False)
        acc = ctx.base_v.clone()
        decompress(data, scales, acc, True)
        ctx.cache[key] = dict(data=data, scales=scales, residual=r, dec=dec, acc=acc)
    return ctx.cache[key]


def _block_payload(ctx: _Ctx, family: str, codec: _Codec, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-size payload the decompress rows decode (made once, by the reference)."""
    key = ("block-payload", family, block)
    if key not in ctx.cache:
        ctx.cache[key] = codec.reference[0](ctx.g, ctx.r0.clone())
    return ctx.cache[key]


def block_runners(family: str, impl: str, block: int):
    """``(compress(g, r) -> (data, scales), decompress(data, scales, out,
    acc))`` of a block codec (``family``: onebit's sign bits, a quant row's
    levels rounded to nearest) for an implementation (through the public
    API), the unfused peer (``PEER``, onebit) or a registered peer
    (:func:`register_peer`).

    Example::

        >>> import torch
        >>> compress, decompress = block_runners("int4", "reference", 64)
        >>> levels, scales = compress(torch.randn(100), torch.zeros(100))
        >>> levels.numel(), scales.numel()
        (50, 2)
        >>> out = torch.empty(100)
        >>> decompress(levels, scales, out, False)
    """
    if impl == PEER and family == ONEBIT:
        return (
            lambda g, r: unfused_onebit_compress(g, r, block),
            lambda bits, scales, out, acc: unfused_onebit_decompress(bits, scales, block, out, acc),
        )
    extra = EXTRA_PEERS.get(family, {})
    if impl in extra:
        return extra[impl](block)
    comp = pycomm.get_compressor(family, block_size=block, impl=impl)
    signs = spec.method_spec(family).family == "onebit"

    def compress(g, r):
        p = comp.compress(g, r)
        return (p.bits if signs else p.data), p.scales

    def decompress(data, scales, out, acc):
        fields = (data, scales, out.numel(), tuple(out.shape), block)
        payload = pycomm.OneBitPayload(*fields) if signs else quant_ref.QuantPayload(*fields, comp.bits)
        comp.decompress(payload, out=out, accumulate=acc)

    return compress, decompress


def _block_contenders(ctx: _Ctx, case: Case, op: str, impls: Sequence[str]) -> List[Contender]:
    block = int(case.params["block_size"])
    codec = _codec(case.family, block)
    dev = ctx.device
    peers_ = peers(case.family)
    out: List[Contender] = []
    for impl in list(impls) + peers_:
        kind = "peer" if impl in peers_ else "impl"

        if op == "compress":

            def verify(impl=impl):
                compress, _ = block_runners(case.family, impl, block)
                want = _block_oracle(ctx, case.family, codec, block)
                r = ctx.rv0.to(dev, copy=True)  # updated in place
                data, scales = compress(ctx.gv.to(dev), r)
                check_equal(codec.data, data.view(want["data"].dtype), want["data"])
                check_close("scales", scales, want["scales"], **SCALE_TOL)
                check_close("residual", r, want["residual"], **VALUE_TOL)

            def prepare(impl=impl):
                compress, _ = block_runners(case.family, impl, block)
                timed, _first = _timed_with_residual(ctx, compress)
                return timed, codec.nbytes(ctx.numel, op), {}

        else:
            acc = op == "decompress_acc"

            def verify(impl=impl, acc=acc):
                _, decompress = block_runners(case.family, impl, block)
                want = _block_oracle(ctx, case.family, codec, block)
                if acc:
                    buf = ctx.base_v.to(dev, copy=True)
                else:  # NaN everywhere: an element the kernel skips shows up
                    buf = torch.full_like(ctx.gv, float("nan"), device=dev)
                decompress(want["data"].to(dev), want["scales"].to(dev), buf, acc)
                check_close("decoded", buf, want["acc" if acc else "dec"], **VALUE_TOL)

            def prepare(impl=impl, acc=acc):
                _, decompress = block_runners(case.family, impl, block)
                data, scales = _block_payload(ctx, case.family, codec, block)
                buf = torch.zeros_like(ctx.g)

                def fn():
                    decompress(data, scales, buf, acc)

                fn()
                return (fn, None), codec.nbytes(ctx.numel, op), {}

        out.append(Contender(impl, kind, verify, prepare))
    return out


# -------------------------------------------------------------------- topk ---
def _topk_oracle(ctx: _Ctx, k: int, approx: bool) -> Dict[str, torch.Tensor]:
    key = ("topk-oracle", k, approx)
    if key not in ctx.cache:
        r = ctx.rv0.clone()
        idx, vals = topk_ref.compress_reference(ctx.gv, r, k, approx)
        ctx.cache[key] = dict(indices=idx.long(), values=vals, residual=r)
    return ctx.cache[key]


def _exact_mask(ctx: _Ctx, k: int) -> torch.Tensor:
    """Full size: True at the exact top-k of |g + r0| (for recall; made once)."""
    key = ("topk-exact-mask", k)
    if key not in ctx.cache:
        c = ctx.g + ctx.r0
        idx = torch.topk(c.abs(), k, sorted=False).indices
        mask = torch.zeros(ctx.numel, dtype=torch.bool, device=ctx.device)
        mask[idx] = True
        ctx.cache[key] = mask
    return ctx.cache[key]


def topk_runner(impl: str, density: float, approx: bool):
    """``compress(g, r) -> (indices, values)`` for an implementation (public
    API), the unfused peer (``PEER``, always exact, indices unsorted) or a
    registered peer (:func:`register_peer`).

    Example::

        >>> import torch
        >>> idx, vals = topk_runner("reference", 0.1, True)(torch.randn(1000), torch.zeros(1000))
        >>> 100 <= idx.numel() <= 125
        True
    """
    if impl == PEER:
        return lambda g, r: unfused_topk_compress(g, r, topk_ref.topk_k(g.numel(), density))
    extra = EXTRA_PEERS.get(SPARSE, {})
    if impl in extra:
        return extra[impl](density, approx)
    comp = pycomm.get_compressor(SPARSE, density=density, approx=approx, impl=impl)

    def compress(g, r):
        p = comp.compress(g, r)
        return p.indices, p.values

    return compress


def _topk_contenders(ctx: _Ctx, case: Case, op: str, impls: Sequence[str]) -> List[Contender]:
    density = float(case.params["density"])
    approx = bool(case.params["approx"])
    dev = ctx.device
    k_full = topk_ref.topk_k(ctx.numel, density)
    k_v = topk_ref.topk_k(ctx.gv.numel(), density)
    out: List[Contender] = []
    peers_ = peers(case.family)

    for impl in list(impls) + peers_:
        kind = "peer" if impl in peers_ else "impl"

        def verify(impl=impl, kind=kind):
            compress = topk_runner(impl, density, approx)
            # A peer is always exact top-k, whatever mode the case is in.
            want = _topk_oracle(ctx, k_v, approx and kind != "peer")
            r = ctx.rv0.to(dev, copy=True)
            idx, vals = compress(ctx.gv.to(dev), r)
            idx, vals = idx.long().cpu(), vals.cpu()
            if kind == "peer":  # torch.topk returns them in no particular order
                idx, order = idx.sort()
                vals = vals[order]
            check_equal("indices", idx, want["indices"])
            check_close("values", vals, want["values"], **VALUE_TOL)
            check_close("residual", r, want["residual"], **VALUE_TOL)

        def prepare(impl=impl):
            compress = topk_runner(impl, density, approx)
            timed, (idx, _vals) = _timed_with_residual(ctx, compress)
            count = int(idx.numel())
            recall = int(_exact_mask(ctx, k_full)[idx.long()].sum()) / k_full
            extra = {"k": k_full, "count": count, "recall": recall}
            return timed, topk_bytes(ctx.numel, count), extra

        out.append(Contender(impl, kind, verify, prepare))

    def prepare_baseline():
        # torch.topk alone on a precomputed |g + r|: the ">= 10x" target's yardstick.
        mags = (ctx.g + ctx.r0).abs()

        def fn():
            return torch.topk(mags, k_full, sorted=False)

        fn()
        return (fn, None), torch_topk_bytes(ctx.numel, k_full), {"k": k_full, "count": k_full}

    out.append(Contender(TOPK_BASELINE, "baseline", None, prepare_baseline))
    return out


def _contenders(ctx: _Ctx, case: Case, op: str, impls: Sequence[str]) -> List[Contender]:
    """The contenders of one operation of ``case``, by its method's kind."""
    if spec.method_spec(case.family).kind == "sparse":
        return _topk_contenders(ctx, case, op, impls)
    return _block_contenders(ctx, case, op, impls)


# ------------------------------------------------------------------- setup ---
def known_impls() -> List[str]:
    """Every implementation name any benchmarked compressor has."""
    names: List[str] = []
    for case in CASES:
        for name in compressor_class(case.family).impls:
            if name not in names:
                names.append(name)
    return names


def benchmarkable_impls(family: str, device: torch.device) -> List[str]:
    """Impls of ``family`` that run on ``device``, minus Triton on CPU (the
    interpreter: correct, but ~1000x slower than a kernel, not a benchmark)."""
    impls = pycomm.available_impls(family, device=device)
    if torch.device(device).type == "cpu":
        impls = [i for i in impls if i != "triton"]
    return impls


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with defaults filled in (``--quick`` sizes, impl
    list, JSON path); raises ValueError naming the bad option."""
    from .cli import fill_defaults, split_list

    a = argparse.Namespace(**vars(args))
    quick = bool(getattr(a, "quick", False))
    fill_defaults(a, quick, numel=(DEFAULT_NUMEL, QUICK_NUMEL), repeats=(DEFAULT_REPEATS, QUICK_REPEATS),
                  warmup=(DEFAULT_WARMUP, QUICK_WARMUP))
    a.device = torch.device(getattr(a, "device", None) or "cpu")
    a.progress = bool(getattr(a, "progress", True))
    a.threads = getattr(a, "threads", None)

    impls = getattr(a, "impls", None)
    if impls is not None:
        wanted = split_list(impls)
        if not wanted:
            raise ValueError("argument --impls: empty list")
        known = known_impls()
        for name in wanted:
            if name not in known:
                raise ValueError(
                    f"argument --impls: unknown implementation {name!r}; choose from {', '.join(known)}"
                )
            if name == "triton" and a.device.type == "cpu":
                raise ValueError(
                    "argument --impls: triton on cpu is the Triton interpreter, not a benchmark"
                )
            if not any(name in benchmarkable_impls(c.family, a.device) for c in CASES):
                cls = compressor_class(CASES[0].family)
                why = cls.impls[name].why_unavailable() or f"it does not run on {a.device.type} tensors"
                raise ValueError(f"argument --impls: {name!r} cannot run here: {why}")
        impls = list(dict.fromkeys(wanted))
    a.impls = impls
    if getattr(a, "json", None) is None:
        a.json = default_json_path("kernels", a.device, quick=quick)
    return a


def make_args(**overrides) -> argparse.Namespace:
    """Arguments for :func:`run_kernels` without the command line (tests).

    Example::

        >>> make_args(numel=4096, repeats=2).numel
        4096
    """
    base = dict(numel=None, repeats=None, warmup=None, device="cpu", impls=None,
                json=None, quick=False, threads=None, progress=False)
    base.update(overrides)
    return resolve_args(argparse.Namespace(**base))


# --------------------------------------------------------------------- run ---
def run_kernels(args: argparse.Namespace) -> Dict[str, object]:
    """Run the kernel benchmark and return the JSON document (rows included);
    prints nothing but the progress bar (stderr).

    Example::

        >>> doc = run_kernels(make_args(numel=65536, repeats=2, warmup=1))  # doctest: +SKIP
        >>> doc["rows"][0]["median_s"] > 0                                  # doctest: +SKIP
        True
    """
    args = resolve_args(args)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    machine = machine_info(args.device)  # before the run: its load average is the others'
    plan: List[Tuple[Case, str, List[str], List[str]]] = []  # case, op, impls, unavailable
    for case in CASES:
        available = benchmarkable_impls(case.family, args.device)
        wanted = args.impls if args.impls is not None else available
        impls = [i for i in wanted if i in available]
        missing = [i for i in wanted if i not in available]
        for op in case.ops:
            plan.append((case, op, impls, missing))

    ctx = _make_ctx(args)
    contender_lists = [_contenders(ctx, case, op, impls) for case, op, impls, _ in plan]
    # One tick per timed or warm-up call (every contender, plus the copy in each operation).
    total = sum(len(c) + COPY_PER_ROUND for c in contender_lists) * ctx.calls_per_contender
    bar = progress_bar(total, "call", args.progress)
    ctx.bar = bar
    try:
        ctx.copy_dst = torch.empty_like(ctx.g)
        rows: List[Dict[str, object]] = []
        for (case, op, _impls, missing), contenders in zip(plan, contender_lists):
            rows.extend(_bench_op(ctx, case, op, contenders))
            for impl in missing:
                cls = compressor_class(case.family)
                why = cls.impls[impl].why_unavailable() if impl in cls.impls else "not implemented"
                row = _row(ctx, case, op, Contender(impl, "impl", None, lambda: None))
                row.update(status=UNAVAILABLE, error=why or f"does not run on {ctx.device.type}")
                rows.append(row)
    finally:
        bar.close()

    copy_all = summarize(ctx.copy_samples) if ctx.copy_samples else None
    per_op = [r["copy_gbps"] for r in rows if r["copy_gbps"] is not None]
    return {
        "benchmark": "kernels",
        "date": started,
        "machine": machine,
        "device": str(args.device),
        "numel": args.numel,
        "dtype": "float32",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": bool(getattr(args, "quick", False)),
        # Median over every copy sample of the run; each row's % copy uses the
        # copy timed in its own operation (row["copy_gbps"]), whose spread over
        # the run (min/max) shows how much the machine drifted.
        "copy_gbps": None if copy_all is None else 8 * args.numel / copy_all["median_s"] / 1e9,
        "copy_gbps_min": min(per_op, default=None),
        "copy_gbps_max": max(per_op, default=None),
        "copy": None if copy_all is None else {**copy_all, "bytes_per_element": 8},
        "copy_by_op": ctx.copy_by_op,
        "loadavg_end": loadavg(),
        "rows": rows,
    }


# ------------------------------------------------------------------ output ---


def format_table(doc: Dict[str, object]) -> str:
    """The results as a text table (tabulate)."""
    rows = []
    for r in doc["rows"]:
        notes = [status_note(r)] if r["status"] != OK else []
        if r.get("count") is not None and r["kind"] != "baseline":
            notes.append(f"count={r['count']} (k={r['k']})")
        if r.get("recall") is not None:
            notes.append(f"recall={r['recall']:.4f}")
        rows.append([
            r["compressor"], r["op"], r["impl"], fmt_number(ms(r["median_s"])), spread_ms(r), fmt_number(r["gbps"]),
            fmt_number(r["pct_copy"], 2), fmt_number(r["speedup_vs_unfused"]),
            fmt_number(r.get("speedup_vs_torch_topk")), " ".join(notes),
        ])
    headers = ["compressor", "op", "impl", "median ms", "p10-p90 ms", "GB/s", "% copy",
               "x vs unfused", "x vs torch.topk", "notes"]
    m = doc["machine"]
    load = m.get("loadavg")
    head = (
        f"pycomm kernels: numel={doc['numel']} float32, device={doc['device']}, "
        f"threads={m['threads']}, {doc['repeats']} repeats after {doc['warmup']} warmup"
        + (f", load average {load[0]:.2f} at start on {m['cpu_count']} CPUs" if load else "")
        + "\n"
        f"cpu: {m.get('cpu_model') or m.get('processor')}, torch {m['torch']}"
        + (f", gpu: {m['gpu']}" if m.get("gpu") else "")
        + f"\ncopy bandwidth (dst.copy_(src), 8 B/elem, timed in every operation): "
        f"median {fmt_number(doc['copy_gbps'])} GB/s, per operation "
        f"{fmt_number(doc['copy_gbps_min'])}-{fmt_number(doc['copy_gbps_max'])} GB/s\n"
    )
    lo, hi = doc["copy_gbps_min"], doc["copy_gbps_max"]
    if lo and hi and hi > DRIFT_WARN * lo:
        head += (
            f"WARNING: the copy bandwidth varied {hi / lo:.1f}x between operations: the machine "
            "was busy (with few cores, try --threads 1); compare rows within one operation "
            "only, or run again\n"
        )
    return head + table(rows, headers)


def failed_rows(doc: Dict[str, object]) -> List[Dict[str, object]]:
    """Rows whose implementation gave a wrong result or crashed."""
    return [r for r in doc["rows"] if r["status"] in (VERIFY_FAILED, ERROR)]


# --------------------------------------------------------------------- cli ---
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import positive_int

    g = parser.add_argument_group("kernels options")
    g.add_argument("--numel", type=positive_int, default=None,
                   help=f"float32 elements per tensor (default: 16M = {DEFAULT_NUMEL}; "
                        f"{QUICK_NUMEL} with --quick); accepts k/M/G suffixes (powers of 2)")
    g.add_argument("--impls", nargs="+", metavar="IMPL", default=None,
                   help="implementations to time, space or comma separated "
                        f"(of {', '.join(known_impls())}; default: every one that runs on the "
                        "device, except triton on cpu). The unfused peer and torch.topk always run.")




def run(args: argparse.Namespace) -> int:
    """``pycomm-bench kernels``: run, print the table, write the JSON.
    Exit status 1 if an implementation failed verification or crashed."""
    t0 = time.monotonic()
    doc = run_kernels(args)
    return finish(doc, args.json, format_table(doc),
                  [f"{r['compressor']} {r['op']} {r['impl']}: {r['error']}" for r in failed_rows(doc)], t0)
