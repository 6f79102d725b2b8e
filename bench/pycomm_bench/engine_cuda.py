"""The engine on a GPU: ``pycomm-bench allreduce --device cuda``.

One process, one rank over NCCL (world size 1: NCCL refuses two ranks on
one GPU), so what is timed is what the engine itself costs on the device,
next to what its kernels cost and what NCCL's own all-reduce costs:

* per method (:data:`METHODS`: every block codec, top-k and every cast of
  the method table, and plain NCCL as the baseline): the keyed all-reduce
  ``pd.all_reduce(x, key=0, op="avg")`` of a 64M-element float32 tensor at
  the group's default settings, the bare kernels on the same tensor (a
  block codec: compress with a residual, then decompress; top-k: compress,
  then decompress; a cast: the two casts), and the same all-reduce at ``chunk_numel`` 2^20 (Gloo's default,
  the setting of the first GPU measurements) and at the whole tensor;
  CUDA events, median of the repeats after the warm-up, all contenders
  interleaved round by round; ``engine_over_kernels`` is engine / kernels;
* a 25 MB bucket (6,553,600 float32) keyed all-reduce per method: the GPU
  time of one call (events), the host time per call when N calls are issued
  back to back (``async_op=True``) and then waited for, and the time for a
  call to return to its caller (synchronous and asynchronous);
* the DDP step time of the benchmark GPT (pycomm_bench.models: 4 layers,
  d_model 512, batch 16 x 128, AdamW) with plain NCCL and with the DDP hook
  (every block codec and top-k), and the overhead over plain.

Every group is verified before it is timed: one keyed call's result must be
finite and equal the single-process simulation
(``pycomm.distributed.simulate``, reference compressors, on the device):
bit for bit for every method of :data:`EXACT_METHODS`, to float32 rounding
of the block scales for onebit (the simulation's docstring). A group that fails is
reported (exit status 1) and not timed.

The core, :func:`run_engine`, takes a world of one rank that is already set
up and runs on any device (the CPU tests run it over Gloo with tiny sizes);
:func:`run` sets up NCCL in this process (an in-process HashStore) and
refuses to start without a CUDA device.

Example::

    $ pycomm-bench allreduce --device cuda            # about a minute on an H200
    $ pycomm-bench allreduce --device cuda --quick    # under 60 s
    $ pycomm-bench allreduce --device cuda --methods plain,onebit --sizes 16M --repeats 30
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import re
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pycomm.distributed import spec
from pycomm.distributed.spec import chunk_bounds

from .methods import PLAIN, SPARSE
from .report import clean, default_json_path, fail, finish, fmt_number, machine_info, size_label, table, write_json

HELP = "the engine on one GPU (one rank over NCCL): keyed all-reduce vs its kernels vs NCCL, buckets, DDP"

#: DDP step contenders: plain DDP and the hook with each method that keeps
#: residuals (block codecs first).
DDP_METHODS = (PLAIN, *spec.BLOCK_METHODS, SPARSE)
#: Timed methods; "plain" is NCCL's own all-reduce.
METHODS = (*DDP_METHODS, *spec.CAST_METHODS)
COMPRESSED = tuple(m for m in METHODS if m != PLAIN)
#: The methods whose engine result equals the reference simulation bit for
#: bit (pycomm/distributed/simulate.py); onebit, whose block scale is a mean
#: (a float sum whose order differs), agrees to float32 rounding.
EXACT_METHODS = tuple(m.name for m in spec.METHOD_TABLE if m.family != "onebit")
DEFAULT_NUMEL = 1 << 26
QUICK_NUMEL = 1 << 22
#: A 25 MB DDP bucket of float32 (DDP's default bucket_cap_mb).
BUCKET_NUMEL = 25 * (1 << 20) // 4
DEFAULT_BUCKET_CALLS = 20
QUICK_BUCKET_CALLS = 5
DEFAULT_REPEATS = 15
DEFAULT_WARMUP = 3
QUICK_REPEATS = 3
QUICK_WARMUP = 1
#: The benchmark GPT (pycomm_bench.models.GPTConfig fields): 12.9M parameters.
DDP_GPT = {"n_layers": 4, "d_model": 512, "n_heads": 8, "seq_len": 128}
DDP_BATCH = 16
#: The hook's exact iterations (bucket indices settle after the first).
DDP_START_ITER = 2
#: The chunkings timed besides the group's default: Gloo's default (2^20)
#: and one chunk for the whole tensor (None: the tensor's numel).
CHUNK_VARIANTS = (("1M", 1 << 20), ("whole", None))
KEY = 0
VERIFY_KEY = 1 << 30
SEED = 20261204
DEFAULT_TIMEOUT = 120.0
F32_EPS = float(torch.finfo(torch.float32).eps)
#: onebit: compiled block scales are sums in another order than the
#: reference's, so results and residuals agree to float32 rounding of the
#: largest magnitude involved (measured <= 14 ulps of a block's scale; 128
#: leaves room for the server stage's two scales and is still ~1e-5 of the
#: magnitude: any real error, a wrong block, chunk or residual, is O(1)).
ONEBIT_ULPS = 128
CUDA_NEEDED = ("the engine benchmark on cuda needs a CUDA device, and torch.cuda.is_available() is False "
               "here (run it on the GPU machine, or use --device cpu for the Gloo benchmark)")


# ------------------------------------------------------------ comparison ---
def magnitude(*tensors: Optional[torch.Tensor]) -> float:
    """The largest finite magnitude among ``tensors`` (None skipped): the
    scale onebit's rounding tolerance is relative to.

    >>> magnitude(torch.tensor([1.0, -3.0]), None, torch.tensor([float("inf"), 2.0]))
    3.0
    """
    best = 0.0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        a = t.detach().float().abs()
        a = a[torch.isfinite(a)]
        if a.numel():
            best = max(best, float(a.max()))
    return best


def max_flips(numel: int) -> int:
    """How many onebit sign flips of near-zero elements a comparison
    tolerates ("rarely, a sign of a near-zero element flips": the simulation's
    docstring): 2, or one in 10^4 elements of a large tensor.

    >>> max_flips(100), max_flips(1_000_000)
    (2, 100)
    """
    return max(2, numel // 10_000)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 values bit for bit (any NaN equals any NaN).

    >>> same_bits(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, float("nan")]))
    True
    >>> same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    False
    """
    a = a.detach().float().reshape(-1)
    b = b.detach().float().reshape(-1).to(a.device)
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def _at(t: torch.Tensor, i: int) -> float:
    return float(t[i])


def compare(method: str, got: torch.Tensor, want: torch.Tensor, scale: float, *, allow_flips: bool = False,
            allowed: Optional[torch.Tensor] = None, what: str = "result"
            ) -> Tuple[Optional[str], Optional[torch.Tensor]]:
    """``(problem, flips)``: ``problem`` is None when ``got`` (the engine's)
    matches ``want`` (the simulation's) as documented for ``method``, else
    what differs. Bit for bit except onebit, where every element must be
    within ``ONEBIT_ULPS`` float32 ulps of ``scale`` (:func:`magnitude` of
    the inputs, residuals and results), but with ``allow_flips`` up to
    :func:`max_flips` elements may have the opposite sign of the same
    magnitude (a near-zero value whose sign the rounding decided), and
    elements where ``allowed`` is True may differ by up to twice ``scale``
    (the residuals of flipped elements). ``flips``: the flipped elements
    (onebit), else None.

    >>> x = torch.tensor([1.0, -2.0, 0.5])
    >>> compare("int8", x, x.clone(), 2.0)
    (None, None)
    >>> compare("int8", x + 1, x, 2.0)[0]
    'result differs from the simulation in 3 of 3 elements (first at 0: 2.0 vs 1.0); int8 must match it bit for bit'
    >>> compare("onebit", x * (1 + 1e-7), x, 2.0)[0] is None
    True
    """
    g = got.detach().float().reshape(-1)
    w = want.detach().float().reshape(-1).to(g.device)
    n = g.numel()
    if n != w.numel():
        return f"{what} has {n} elements, the simulation {w.numel()}", None
    if method in EXACT_METHODS:
        if same_bits(g, w):
            return None, None
        diff = ~((g == w) | (g.isnan() & w.isnan()))
        if not bool(diff.any()):  # equal values, different bits (a signed zero)
            diff = g.view(torch.int32) != w.view(torch.int32)
        idx = diff.nonzero().reshape(-1)
        i = int(idx[0])
        return (f"{what} differs from the simulation in {idx.numel()} of {n} elements "
                f"(first at {i}: {_at(g, i)!r} vs {_at(w, i)!r}); {method} must match it bit for bit"), None
    tol = ONEBIT_ULPS * F32_EPS * scale
    err = (g - w).abs()
    bad = ~(err <= tol)  # NaN counts as bad
    flips = torch.zeros_like(bad)
    if not bool(bad.any()):
        return None, flips
    if allow_flips:
        flips = bad & ((g + w).abs() <= tol) & (w != 0)
    excused = flips
    if allowed is not None:
        excused = excused | (allowed.reshape(-1).to(bad.device) & (err <= 2 * scale + tol))
    rest = bad & ~excused
    nflips = int(flips.sum())
    if not bool(rest.any()) and nflips <= max_flips(n):
        return None, flips
    show = rest if bool(rest.any()) else flips
    worst = int(torch.where(show, err.nan_to_num(nan=math.inf), torch.zeros_like(err)).argmax())
    return (f"{what} differs from the simulation beyond float32 rounding ({ONEBIT_ULPS} ulps of {scale:.4g}, "
            f"{tol:.3g}) in {int(rest.sum())} of {n} elements, plus {nflips} sign flips (at most "
            f"{max_flips(n)} allowed); worst at {worst}: {_at(g, worst)!r} vs {_at(w, worst)!r}"), flips


# ------------------------------------------------------------- simulation ---
def sim_settings(method: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The simulation's compressor settings for a group's ``pd.options_of``.

    >>> sim_settings("topk", {"density": 0.01, "approx": True, "block_size": None})
    {'density': 0.01, 'approx': True}
    >>> sim_settings("int8", {"block_size": 256}), sim_settings("fp16", {})
    ({'block_size': 256}, {})
    """
    from pycomm.distributed.spec import BLOCK_METHODS, block_size_for

    if method in BLOCK_METHODS:
        return {"block_size": block_size_for(method, options.get("block_size"))}
    if method == SPARSE:
        return {"density": float(options["density"]), "approx": bool(options["approx"])}
    return {}


def verify_group(group: Any, method: str, x: torch.Tensor) -> Optional[str]:
    """One keyed all-reduce (average) of a copy of ``x`` through ``group``
    (a pycomm group of one rank) against the simulation on ``x``'s device;
    None when it matches, else why not. The key's residuals are dropped
    afterwards."""
    import pycomm.distributed as pd
    from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce
    from pycomm.distributed.spec import EF_METHODS

    device = x.device
    opts = pd.options_of(group, device.type)
    got = x.clone()
    pd.all_reduce(got, key=VERIFY_KEY, group=group, op="avg")
    try:
        finite = bool(torch.isfinite(got).all())
        if not finite:
            return f"{int((~torch.isfinite(got)).sum())} non-finite elements in the result of finite inputs"
        efs = [ErrorFeedback()] if method in EF_METHODS else None
        want = simulate_allreduce([x], method, op="avg", chunk_numel=int(opts["chunk_numel"]), efs=efs,
                                  key=VERIFY_KEY, **sim_settings(method, opts))[0]
        problem, _ = compare(method, got, want, magnitude(x, want))
        return problem
    finally:
        pd.reset_error_feedback(VERIFY_KEY, group=group, device=device.type)


# ----------------------------------------------------------------- timing ---
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: A timed contender: (the call, an untimed setup run before each call or None).
Timed = Tuple[Callable[[], object], Optional[Callable[[], object]]]


def time_rounds(contenders: Dict[str, Timed], repeats: int, warmup: int, device: torch.device,
                on_call: Optional[Callable[[str], None]] = None) -> Dict[str, Dict[str, List[float]]]:
    """Per contender, ``{"wall": [...], "gpu": [...]}`` seconds of each of
    ``repeats`` calls after ``warmup``: round by round, the order rotated
    every round. ``wall``: from before the call to after the device is idle
    again (synchronized); ``gpu``: CUDA events recorded on the current
    stream around the call (empty off CUDA). The device is synchronized
    before every call, after its setup. A contender that raises gets
    ``"error"`` (its message) and is not called again; the others go on.

    >>> t = time_rounds({"add": (lambda: torch.ones(4).add_(1), None)}, 2, 1, torch.device("cpu"))
    >>> len(t["add"]["wall"]), t["add"]["gpu"]
    (2, [])
    >>> time_rounds({"bad": (lambda: 1 / 0, None)}, 2, 1, torch.device("cpu"))["bad"]["error"]
    'ZeroDivisionError: division by zero'
    """
    cuda = device.type == "cuda"
    names = list(contenders)
    out: Dict[str, Dict[str, Any]] = {n: {"wall": [], "gpu": []} for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for rnd in range(warmup + repeats):
            shift = rnd % len(names) if names else 0
            for name in names[shift:] + names[:shift]:
                if "error" in out[name]:
                    continue
                fn, setup = contenders[name]
                start = end = None
                try:
                    if setup is not None:
                        setup()
                    sync(device)
                    if cuda:
                        start = torch.cuda.Event(enable_timing=True)
                        end = torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    if start is not None:
                        start.record()
                    fn()
                    if end is not None:
                        end.record()
                    sync(device)
                except Exception as exc:  # noqa: BLE001 - reported with the contender
                    out[name]["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                wall = time.perf_counter() - t0
                if rnd >= warmup:
                    out[name]["wall"].append(wall)
                    if start is not None:
                        out[name]["gpu"].append(start.elapsed_time(end) / 1e3)
                if on_call is not None:
                    on_call(name)
    finally:
        if was_enabled:
            gc.enable()
    return out


def stats_ms(seconds: Sequence[float]) -> Dict[str, Optional[float]]:
    """Median, p10 and p90 in milliseconds (None for no samples).

    >>> stats_ms([0.001, 0.002, 0.003])["median_ms"]
    2.0
    >>> stats_ms([])["median_ms"] is None
    True
    """
    if not seconds:
        return {"median_ms": None, "p10_ms": None, "p90_ms": None}
    from .timing import summarize

    s = summarize(seconds)
    return {"median_ms": 1e3 * s["median_s"], "p10_ms": 1e3 * s["p10_s"], "p90_ms": 1e3 * s["p90_s"]}


def timed_ms(sample: Dict[str, List[float]]) -> Dict[str, Optional[float]]:
    """:func:`stats_ms` of the events where there are any, else of the wall times."""
    return stats_ms(sample["gpu"] or sample["wall"])


def gbps(numel: int, ms: Optional[float]) -> Optional[float]:
    """GB/s of float32 input: 4 numel bytes in ``ms`` milliseconds.

    >>> gbps(1 << 20, 1.0)
    4.194304
    """
    if ms is None or ms <= 0:
        return None
    return 4 * numel / (ms * 1e-3) / 1e9


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, None when either is missing or b is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


# ---------------------------------------------------------------- kernels ---
def kernel_fn(method: str, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor,
              options: Dict[str, Any]) -> Callable[[], None]:
    """The bare kernels of ``method`` on all of ``x`` (no chunks): a block
    codec compresses ``x`` with ``residual`` then decompresses into
    ``out``; topk compresses (k of the whole tensor at the group's density)
    then decompresses; a cast goes to 16 bits and back into ``out``.

    >>> x, out = torch.randn(1000), torch.empty(1000)
    >>> kernel_fn("bf16", x, out, torch.zeros(1000), {})()
    >>> torch.equal(out, x.bfloat16().float())
    True
    """
    ops = torch.ops.pycomm
    if method in spec.CAST_METHODS:
        dtype = spec.method_spec(method).dtype

        def cast() -> None:
            out.copy_(x.to(dtype))

        return cast
    from pycomm.distributed.spec import block_size_for

    if spec.method_spec(method).family == "onebit":  # sign bits
        B = block_size_for(method, options.get("block_size"))

        def onebit() -> None:
            bits, scales = ops.onebit_compress(x, residual, B)
            ops.onebit_decompress(out, bits, scales, B, False)

        return onebit
    if method in spec.BLOCK_METHODS:
        B, nbits = block_size_for(method, options.get("block_size")), spec.method_spec(method).bits

        def quant() -> None:
            data, scales = ops.quant_compress(x, residual, nbits, B, -1)
            ops.quant_decompress(out, data, scales, nbits, B, False)

        return quant
    if method == SPARSE:
        from pycomm.wire import topk_k

        k, approx = topk_k(x.numel(), float(options["density"])), bool(options["approx"])

        def topk() -> None:
            idx, vals = ops.topk_compress(x, residual, k, approx)
            ops.topk_decompress(out, idx, vals, False)

        return topk
    raise ValueError(f"no kernels to time for method {method!r}")


# ------------------------------------------------------------------ parts ---
def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[engine] {text}", file=sys.stderr, flush=True)


def _plain_allreduce(dist: Any, t: torch.Tensor, async_op: bool = False) -> Any:
    """NCCL's own average (Gloo has no AVG: a sum, which is the average of
    the one rank :func:`run_engine` runs)."""
    if dist.get_backend() == "nccl":
        return dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op)
    return dist.all_reduce(t, async_op=async_op)


def _record(method: str, options: Optional[Dict[str, Any]], n: int) -> Dict[str, Any]:
    chunk = int(options["chunk_numel"]) if options else None
    return {
        "method": method,
        "numel": n,
        "chunk_numel": chunk,
        "chunks": (len(chunk_bounds(n, chunk)) if chunk else None),
        "block_size": options.get("block_size") if options else None,
        "status": "ok",
        "verified": None,
        "error": None,
        "engine_ms": None, "engine_p10_ms": None, "engine_p90_ms": None, "engine_wall_ms": None,
        "engine_gbps": None,
        "kernels_ms": None, "kernels_gbps": None, "engine_over_kernels": None, "kernels_error": None,
        "vs_plain": None,
        "variants": {},
    }


def _verify_or_why(group: Any, method: str, x: torch.Tensor) -> Optional[str]:
    try:
        return verify_group(group, method, x)
    except Exception as exc:  # noqa: BLE001 - the call or the simulation raised: reported, not timed
        return f"verification raised {type(exc).__name__}: {exc}"


def _guarded(name: str, fn: Callable[[], Dict[str, Any]], failures: List[str]) -> Dict[str, Any]:
    """``fn()``, or ``{"error": traceback}`` (and a failure line) when it raises."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the other parts' results are kept
        failures.append(f"{name}: {type(exc).__name__}: {exc}")
        return {"error": traceback.format_exc()}


def _per_call(profile: Dict[str, Any]) -> Dict[str, Any]:
    """``pd.profile`` of a group with each phase also in milliseconds per
    compressed call (where the engine's thread spends a call)."""
    out = dict(profile)
    calls = int(profile.get("calls") or 0)
    if calls:
        for k, v in profile.items():
            if k.endswith("_s") and isinstance(v, (int, float)) and not k.startswith("forwarded"):
                out[k[:-2] + "_ms_per_call"] = 1e3 * v / calls
    return out


def engine_part(cfg: Dict[str, Any], device: torch.device, progress: bool = False
                ) -> Tuple[Dict[str, Any], Optional[float], List[str]]:
    """The 64M-element part: ``(records by method, plain ms, failures)``."""
    import torch.distributed as dist

    import pycomm.distributed as pd

    n, methods = cfg["numel"], cfg["methods"]
    gen = torch.Generator().manual_seed(cfg["seed"])
    orig = torch.randn(n, generator=gen).to(device)
    buf, out, residual = torch.empty_like(orig), torch.empty_like(orig), torch.zeros_like(orig)
    failures: List[str] = []
    records: Dict[str, Dict[str, Any]] = {}
    contenders: Dict[str, Timed] = {}
    groups: List[Any] = []

    def restore() -> None:
        buf.copy_(orig)

    def engine(group: Any) -> Callable[[], None]:
        return lambda: pd.all_reduce(buf, key=KEY, group=group, op="avg")

    if PLAIN in methods:
        rec = records[PLAIN] = _record(PLAIN, None, n)
        buf.copy_(orig)
        _plain_allreduce(dist, buf)
        if not same_bits(buf, orig):  # one rank: the average is the input
            rec.update(status="verify_failed", verified=False, error="NCCL's average of one rank is not its input")
            failures.append(f"plain: {rec['error']}")
        else:
            rec["verified"] = True
            contenders[PLAIN] = (lambda: _plain_allreduce(dist, buf), restore)

    settings = {} if cfg.get("chunk_numel") is None else {"chunk_numel": cfg["chunk_numel"]}
    for m in methods:
        if m == PLAIN:
            continue
        try:
            group = pd.wrap(compressor=m, **settings)
            opts = pd.options_of(group, device.type)
        except Exception as exc:  # noqa: BLE001 - reported, the other methods go on
            rec = records[m] = _record(m, None, n)
            rec.update(status="error", error=f"creating the group raised {type(exc).__name__}: {exc}")
            failures.append(f"{m}: {rec['error']}")
            continue
        groups.append(group)
        rec = records[m] = _record(m, opts, n)
        _say(progress, f"verify {m} (chunk_numel {opts['chunk_numel']})")
        problem = _verify_or_why(group, m, orig)
        if problem is not None:
            rec.update(status="verify_failed", verified=False, error=problem)
            failures.append(f"{m}: {problem}")
            continue
        rec["verified"] = True
        contenders[m] = (engine(group), restore)
        rec["_group"] = id(group)
        try:  # once, untimed: a kernel that cannot run is reported, not fatal
            kernels = kernel_fn(m, orig, out, residual, opts)
            kernels()
            contenders[f"{m}:kernels"] = (kernels, None)
        except Exception as exc:  # noqa: BLE001
            rec["kernels_error"] = f"{type(exc).__name__}: {exc}"
            failures.append(f"{m} kernels: {rec['kernels_error']}")
        seen = {int(opts["chunk_numel"])}
        for label, chunk in CHUNK_VARIANTS:
            chunk = n if chunk is None else chunk
            variant = {"chunk_numel": chunk, "chunks": len(chunk_bounds(n, chunk)), "status": "ok", "error": None,
                       "engine_ms": None, "engine_gbps": None, "same_as_default": chunk in seen}
            rec["variants"][label] = variant
            if chunk in seen:
                continue
            seen.add(chunk)
            _say(progress, f"verify {m} at chunk_numel {chunk}")
            try:
                g = pd.wrap(compressor=m, chunk_numel=chunk)
                groups.append(g)
                problem = _verify_or_why(g, m, orig)
            except Exception as exc:  # noqa: BLE001
                problem = f"creating the group raised {type(exc).__name__}: {exc}"
            if problem is not None:
                variant.update(status="verify_failed", error=problem)
                failures.append(f"{m} chunk_numel={chunk}: {problem}")
                continue
            contenders[f"{m}@{label}"] = (engine(g), restore)

    _say(progress, f"time {len(contenders)} contenders, {cfg['warmup']} + {cfg['repeats']} rounds")
    for g in groups:  # count the timed calls only
        pd.profile(g, device.type, reset=True)
    times = time_rounds(contenders, cfg["repeats"], cfg["warmup"], device)
    profiles = {id(g): _per_call(pd.profile(g, device.type)) for g in groups}
    for g in groups:  # the n-element residuals of every group
        pd.reset_error_feedback(group=g, device=device.type)
    plain_ms = timed_ms(times[PLAIN])["median_ms"] if PLAIN in times else None
    for name, sample in times.items():
        if "error" in sample:
            failures.append(f"{name} (timed): {sample['error']}")
    for m, rec in records.items():
        rec["profile"] = profiles.get(rec.pop("_group", None))
        if m not in times:
            continue
        if "error" in times[m]:
            rec.update(status="error", error=f"raised while timed: {times[m]['error']}")
            continue
        t = timed_ms(times[m])
        rec.update(engine_ms=t["median_ms"], engine_p10_ms=t["p10_ms"], engine_p90_ms=t["p90_ms"],
                   engine_wall_ms=stats_ms(times[m]["wall"])["median_ms"], engine_gbps=gbps(n, t["median_ms"]))
        rec["vs_plain"] = ratio(rec["engine_ms"], plain_ms) if m != PLAIN else 1.0
        if f"{m}:kernels" in times and "error" in times[f"{m}:kernels"]:
            rec["kernels_error"] = times[f"{m}:kernels"]["error"]
        elif f"{m}:kernels" in times:
            k = timed_ms(times[f"{m}:kernels"])["median_ms"]
            rec.update(kernels_ms=k, kernels_gbps=gbps(n, k), engine_over_kernels=ratio(rec["engine_ms"], k))
        for label, variant in rec["variants"].items():
            name = f"{m}@{label}"
            if variant["same_as_default"]:
                variant.update(engine_ms=rec["engine_ms"], engine_gbps=rec["engine_gbps"])
            elif name in times and "error" in times[name]:
                variant.update(status="error", error=times[name]["error"])
            elif name in times:
                v = timed_ms(times[name])["median_ms"]
                variant.update(engine_ms=v, engine_gbps=gbps(n, v))
    return records, plain_ms, failures


def bucket_part(cfg: Dict[str, Any], device: torch.device, progress: bool = False) -> Dict[str, Any]:
    """Per-call times of a keyed all-reduce of a 25 MB bucket."""
    import torch.distributed as dist

    import pycomm.distributed as pd

    n, calls = cfg["bucket_numel"], cfg["bucket_calls"]
    settings = {} if cfg.get("chunk_numel") is None else {"chunk_numel": cfg["chunk_numel"]}
    x = torch.randn(n, generator=torch.Generator().manual_seed(cfg["seed"] + 1)).to(device)
    cuda = device.type == "cuda"
    result: Dict[str, Any] = {"numel": n, "calls": calls, "methods": {}}
    for m in cfg["methods"]:
        _say(progress, f"bucket {m}")
        if m == PLAIN:
            def call(async_op: bool = False) -> Any:
                return _plain_allreduce(dist, x, async_op=async_op)
            group = None
            chunk = None
        else:
            group = pd.wrap(compressor=m, **settings)
            chunk = int(pd.options_of(group, device.type)["chunk_numel"])

            def call(async_op: bool = False, group: Any = group) -> Any:
                return pd.all_reduce(x, key=KEY, group=group, op="avg", async_op=async_op)
        for _ in range(2):  # warm-up: the first call allocates the residuals
            call()
        sync(device)
        gpu, ret, issue = [], [], []
        for _ in range(calls):
            sync(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            call()
            ret.append(time.perf_counter() - t0)
            if cuda:
                end.record()
            sync(device)
            if cuda:
                gpu.append(start.elapsed_time(end) / 1e3)
        for _ in range(calls):
            sync(device)
            t0 = time.perf_counter()
            work = call(async_op=True)
            issue.append(time.perf_counter() - t0)
            if work is not None:
                work.wait()
            sync(device)
        sync(device)
        t0 = time.perf_counter()
        works = [call(async_op=True) for _ in range(calls)]
        for w in works:
            if w is not None:
                w.wait()
        sync(device)
        per_call = (time.perf_counter() - t0) / calls
        if not bool(torch.isfinite(x).all()):
            raise RuntimeError(f"bucket all-reduce of {m} left non-finite values")
        result["methods"][m] = {
            "chunk_numel": chunk,
            "gpu_ms": stats_ms(gpu)["median_ms"],
            "host_per_call_ms": 1e3 * per_call,
            "return_sync_ms": stats_ms(ret)["median_ms"],
            "return_async_ms": stats_ms(issue)["median_ms"],
        }
        if group is not None:
            pd.reset_error_feedback(KEY, group=group, device=device.type)
    return result


def ddp_part(cfg: Dict[str, Any], device: torch.device, progress: bool = False) -> Dict[str, Any]:
    """Step times of DDP on the benchmark GPT: plain and the hook per method."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook
    from .models import GPTConfig, char_lm

    gpt = GPTConfig(**cfg["gpt"])
    methods = cfg["ddp_methods"]
    runs: Dict[str, Any] = {}
    batches: List[Tuple[torch.Tensor, torch.Tensor]] = []
    params = 0
    for m in methods:
        model, batch_fn, loss_fn = char_lm(gpt, batch_size=cfg["batch"], seed=cfg["seed"])
        model.to(device)
        params = sum(p.numel() for p in model.parameters())
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if m != PLAIN:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the hook's onebit-with-momentum advice
                state = CompressionState(compressor=m, start_iter=DDP_START_ITER)
            ddp.register_comm_hook(state, compressed_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        runs[m] = [ddp, opt, loss_fn, 0, []]
        if not batches:
            batches = [tuple(t.to(device) for t in batch_fn(0, s)) for s in range(4)]

    def step(m: str) -> None:
        run = runs[m]
        ddp, opt, loss_fn, count, losses = run
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, batches[count % len(batches)])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        run[3] = count + 1

    warm = max(cfg["warmup"], DDP_START_ITER + 1)  # the timed steps are compressed ones
    _say(progress, f"DDP: {len(methods)} models of {params} parameters, {warm} + {cfg['repeats']} steps each")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the hook's onebit-with-momentum advice
        times = time_rounds({m: (lambda m=m: step(m), None) for m in methods}, cfg["repeats"], warm, device)
    broken = {m: t["error"] for m, t in times.items() if "error" in t}
    if broken:
        raise RuntimeError(f"DDP steps raised: {broken}")
    out: Dict[str, Any] = {"model": "CharGPT", "gpt": dict(cfg["gpt"]), "batch": cfg["batch"],
                           "parameters": params, "optimizer": "AdamW", "start_iter": DDP_START_ITER,
                           "warmup_steps": warm, "steps": cfg["repeats"], "methods": {}}
    plain = None
    for m in methods:
        wall = stats_ms(times[m]["wall"])
        losses = torch.stack(runs[m][4]).float().cpu()
        rec = {"step_ms": wall["median_ms"], "step_p10_ms": wall["p10_ms"], "step_p90_ms": wall["p90_ms"],
               "step_gpu_ms": stats_ms(times[m]["gpu"])["median_ms"], "final_loss": float(losses[-1]),
               "finite": bool(torch.isfinite(losses).all()), "overhead_pct": None}
        out["methods"][m] = rec
        if m == PLAIN:
            plain = rec["step_ms"]
    for m, rec in out["methods"].items():
        r = ratio(rec["step_ms"], plain)
        rec["overhead_pct"] = None if r is None else 100.0 * (r - 1.0)
    return out


def run_engine(cfg: Dict[str, Any], device: torch.device, progress: bool = False) -> Dict[str, Any]:
    """The whole benchmark in a process whose default group (one rank) is
    set up: the JSON document. ``cfg``: :func:`config_from_args`."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != 1:
        raise RuntimeError("run_engine needs an initialized default process group of one rank")
    device = torch.device(device)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t0 = time.monotonic()
    machine = machine_info(device)
    records, plain_ms, failures = engine_part(cfg, device, progress)
    gc.collect()
    bucket = ddp = None
    if cfg["bucket_calls"] > 0:
        bucket = _guarded("bucket", lambda: bucket_part(cfg, device, progress), failures)
    gc.collect()
    if cfg["ddp_methods"]:
        ddp = _guarded("DDP", lambda: ddp_part(cfg, device, progress), failures)
    if ddp is not None and "methods" in ddp:
        failures += [f"DDP {m}: non-finite loss" for m, r in ddp["methods"].items() if not r["finite"]]
    return clean({
        "benchmark": "allreduce-engine",
        "date": started,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": machine,
        "backend": dist.get_backend(),
        "ranks": 1,
        "numel": cfg["numel"],
        "dtype": "float32",
        "op": "avg",
        "key": KEY,
        "chunk_numel_setting": cfg.get("chunk_numel"),
        "repeats": cfg["repeats"],
        "warmup": cfg["warmup"],
        "quick": bool(cfg.get("quick")),
        "plain_ms": plain_ms,
        "plain_gbps": gbps(cfg["numel"], plain_ms),
        "records": list(records.values()),  # one per method, in the order asked
        "bucket": bucket,
        "ddp": ddp,
        "failures": failures,
        "total_s": time.monotonic() - t0,
    })


# ----------------------------------------------------------------- output ---
def format_table(doc: Dict[str, Any]) -> str:
    """The results as text tables (tabulate), times in milliseconds."""
    n = doc["numel"]
    rows = []
    for r in doc["records"]:
        m = r["method"]
        v1, vw = r["variants"].get("1M", {}), r["variants"].get("whole", {})
        spread = ("-" if r["engine_p10_ms"] is None
                  else f"{fmt_number(r['engine_p10_ms'])}-{fmt_number(r['engine_p90_ms'])}")
        note = "" if r["status"] == "ok" else f"{r['status'].upper()}: {r['error']}"[:100]
        if r.get("kernels_error"):
            note = (note + "; " if note else "") + f"kernels: {r['kernels_error']}"[:100]
        rows.append([m, r["chunk_numel"] or "-", fmt_number(r["engine_ms"]), spread, fmt_number(r["engine_gbps"]),
                     fmt_number(r["kernels_ms"]), fmt_number(r["kernels_gbps"]), fmt_number(r["engine_over_kernels"]),
                     fmt_number(v1.get("engine_ms")), fmt_number(vw.get("engine_ms")), fmt_number(r["vs_plain"]), note])
    head = (f"pycomm engine on {doc.get('gpu') or doc['device']}: keyed all-reduce (avg) of {size_label(n)} float32, "
            f"one rank over {doc['backend']}, {doc['repeats']} repeats after {doc['warmup']} warm-up "
            f"(median; events on CUDA); GB/s = 4 n / time; kernels = compress with residual + decompress "
            f"of the whole tensor (16-bit: the two casts)\n")
    out = head + table(rows, ["method", "chunk", "engine ms", "p10-p90", "GB/s", "kernels ms", "GB/s",
                              "engine/kernels", "chunk 1M ms", "one chunk ms", "x plain", "notes"])
    for name, part in (("bucket", doc.get("bucket")), ("DDP", doc.get("ddp"))):
        if part and "error" in part:
            out += f"\n\n{name}: FAILED: {part['error'].strip().splitlines()[-1]}"
    b = doc.get("bucket")
    if b and "error" not in b:
        rows = [[m, r["chunk_numel"] or "-", fmt_number(r["gpu_ms"]), fmt_number(r["host_per_call_ms"]),
                 fmt_number(r["return_sync_ms"]), fmt_number(r["return_async_ms"])] for m, r in b["methods"].items()]
        out += (f"\n\nbucket of {b['numel']} float32 ({4 * b['numel'] / 2 ** 20:g} MiB), keyed all-reduce: GPU time "
                f"of one call (events), host time per call of {b['calls']} calls issued back to back then waited "
                f"for, and the time a call takes to return (synchronous / async_op=True)\n")
        out += table(rows, ["method", "chunk", "GPU ms", "host ms/call", "sync return ms", "async return ms"])
    d = doc.get("ddp")
    if d and "error" not in d:
        rows = [[m, fmt_number(r["step_ms"]), f"{fmt_number(r['step_p10_ms'])}-{fmt_number(r['step_p90_ms'])}",
                 fmt_number(r["step_gpu_ms"]), "-" if m == PLAIN else fmt_number(r["overhead_pct"]),
                 fmt_number(r["final_loss"]), "" if r["finite"] else "NON-FINITE LOSS"]
                for m, r in d["methods"].items()]
        g = d["gpt"]
        out += (f"\n\nDDP step, {d['model']} {g['n_layers']} layers d={g['d_model']} ({d['parameters']} parameters), "
                f"batch {d['batch']}x{g['seq_len']}, {d['optimizer']}; hook start_iter {d['start_iter']}, "
                f"{d['steps']} timed steps after {d['warmup_steps']}\n")
        out += table(rows, ["method", "step ms", "p10-p90", "GPU ms", "overhead %", "loss", "notes"])
    return out


def failed(doc: Dict[str, Any]) -> List[str]:
    """One line per failed verification or non-finite DDP loss."""
    return list(doc.get("failures", []))


def gpu_slug(name: str) -> str:
    """A file-name-safe form of a GPU's name.

    >>> gpu_slug("NVIDIA H200"), gpu_slug("  Tesla V100-SXM2-16GB ")
    ('nvidia-h200', 'tesla-v100-sxm2-16gb')
    """
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def json_path(gpu_name: str, quick: bool = False) -> str:
    """``benchmarks/results/allreduce/cuda-<gpu>[-quick].json``.

    >>> json_path("NVIDIA H200")
    'benchmarks/results/allreduce/cuda-nvidia-h200.json'
    """
    return default_json_path("allreduce", "cuda", quick=quick, settings=gpu_slug(gpu_name))


# -------------------------------------------------------------------- cli ---
def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` (``pycomm-bench allreduce`` options) with the
    engine benchmark's defaults; ValueError naming the option otherwise, and
    when there is no CUDA device (:data:`CUDA_NEEDED`)."""
    from .cli import fill_defaults, list_option, positive_int

    a = argparse.Namespace(**vars(args))
    device = torch.device(getattr(a, "device", None) or "cuda")
    if device.type != "cuda":
        raise ValueError(f"argument --device: the engine benchmark runs on cuda, got {device}")
    if not torch.cuda.is_available():
        raise ValueError(f"argument --device: {CUDA_NEEDED}")
    a.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    quick = bool(getattr(a, "quick", False))
    fill_defaults(a, quick, repeats=(DEFAULT_REPEATS, QUICK_REPEATS), warmup=(DEFAULT_WARMUP, QUICK_WARMUP))

    def one_rank(text: str) -> int:
        if str(text).strip() != "1":
            raise ValueError("the engine benchmark on cuda runs one rank over NCCL (NCCL refuses two ranks on one "
                             f"GPU), got {text!r}")
        return 1

    def method(text: str) -> str:
        if text not in METHODS:
            raise ValueError(f"choose from {','.join(METHODS)}, got {text!r}")
        return text

    a.ranks = list_option(getattr(a, "ranks", None), "ranks", [1], one_rank)
    sizes = list_option(getattr(a, "sizes", None), "sizes", [QUICK_NUMEL if quick else DEFAULT_NUMEL], positive_int)
    if len(sizes) != 1:
        raise ValueError(f"argument --sizes: the engine benchmark on cuda takes one size, got {sizes}")
    a.sizes = sizes
    a.methods = list_option(getattr(a, "methods", None), "methods", METHODS, method)
    chunk = getattr(a, "chunk_numel", None)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"argument --chunk-numel: must be a positive integer, got {chunk!r}")
    timeout = getattr(a, "timeout", None)
    a.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise ValueError(f"argument --timeout: must be a positive number of seconds, got {timeout!r}")
    a.progress = bool(getattr(a, "progress", True))
    a.threads = getattr(a, "threads", None)
    a.quick = quick
    if getattr(a, "json", None) is None:
        a.json = json_path(torch.cuda.get_device_name(a.device), quick=quick)
    return a


def make_args(**overrides: Any) -> argparse.Namespace:
    """Arguments for :func:`run` without the command line (raises without CUDA)."""
    base = dict(ranks=None, sizes=None, methods=None, chunk_numel=None, timeout=None, repeats=None, warmup=None,
                device="cuda", json=None, quick=False, threads=None, progress=False)
    base.update(overrides)
    return resolve_args(argparse.Namespace(**base))


def config_from_args(a: argparse.Namespace) -> Dict[str, Any]:
    """The :func:`run_engine` configuration of resolved arguments."""
    methods = list(a.methods)
    return {
        "numel": a.sizes[0],
        "methods": methods,
        "chunk_numel": a.chunk_numel,
        "repeats": a.repeats,
        "warmup": a.warmup,
        "bucket_numel": BUCKET_NUMEL,
        "bucket_calls": QUICK_BUCKET_CALLS if a.quick else DEFAULT_BUCKET_CALLS,
        "ddp_methods": [m for m in DDP_METHODS if m in methods],
        "gpt": dict(DDP_GPT),
        "batch": DDP_BATCH,
        "seed": SEED,
        "quick": a.quick,
    }


def run_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """Set up one rank over NCCL in this process, run, tear down: the JSON document."""
    from datetime import timedelta

    import torch.distributed as dist

    a = resolve_args(args)
    torch.cuda.set_device(a.device)
    own = not dist.is_initialized()
    if own:
        # An in-process store: one rank needs no rendezvous, and no port.
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=a.timeout))
    try:
        return run_engine(config_from_args(a), a.device, a.progress)
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """``pycomm-bench allreduce --device cuda``: run, print the tables, write
    the JSON; exit status 1 if a verification failed, 2 without CUDA."""
    t0 = time.monotonic()
    try:
        a = resolve_args(args)
    except ValueError as exc:
        return fail("allreduce", f"error: {exc}", 2)
    doc = run_from_args(a)
    status = finish(doc, a.json, format_table(doc), failed(doc), t0)
    if status == 0 and not a.json.endswith("-quick.json"):
        ship(doc, a.json)
    return status


def ship(doc: dict, path: str) -> Optional[str]:
    """Copy a full engine result into the package's measurements
    (``pycomm.plan.MEASUREMENTS_DIR``, replacing the older one of the same
    device), so that ``pycomm plan`` from an installed wheel reads what the
    source tree's does; only from a source tree (a ``benchmarks/results``
    beside the package). Returns the file written, or None."""
    import glob

    from pycomm.plan import MEASUREMENTS_DIR

    if not os.path.isdir(os.path.join(os.path.dirname(MEASUREMENTS_DIR), os.pardir, "benchmarks", "results")):
        return None
    if doc.get("gpu"):  # wherever the record went (the GPU check writes engine.json): the device's name
        name = f"allreduce-cuda-{gpu_slug(str(doc['gpu']))}.json"
    else:
        name = os.path.basename(path)
        name = name if name.startswith("allreduce-") else "allreduce-" + name  # allreduce/cuda-<gpu>.json
    device = name.split("-")[1]
    for old in glob.glob(os.path.join(MEASUREMENTS_DIR, f"allreduce-{device}-*.json")):
        os.remove(old)
    out = os.path.join(MEASUREMENTS_DIR, name)
    write_json(out, doc)
    print(f"wrote {out} (shipped with the package: pycomm plan's measurements)", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pycomm_bench.engine_cuda [options]``: the same as
    ``pycomm-bench allreduce --device cuda [options]``."""
    from .cli import main as cli_main

    argv = sys.argv[1:] if argv is None else list(argv)
    return cli_main(["allreduce", "--device", "cuda", *argv])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
