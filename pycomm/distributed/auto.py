"""``compressor="auto"``: each all-reduce runs the method predicted fastest for its size.

Compression pays only where the wire is slower than the compressor, and
which one is slower depends on the link, the device, the world size and the
tensor size. So a group created with ``compressor="auto"`` measures, once,
what every candidate costs *through the group itself* (same link, same
kernels, same CPU contention, the hierarchy if there is one): the exact
all-reduce ("none"), fp16, int8, int4, onebit and topk (the methods of
``spec.METHOD_TABLE`` with ``auto_candidate``), each at two tensor sizes, the
median of a few runs, then the maximum over ranks. Each method gets an
alpha-beta line ``t(n) = alpha + n / throughput`` through its two points, and
a tensor of ``n`` elements runs the method whose line is lowest at ``n``. A
lossy method must beat the exact all-reduce by ``min_gain`` (10%) to be
chosen: when they are close, exact wins.

Every rank decides from the same numbers (the maxima over ranks), so every
rank picks the same method for the same size; a hash of the decision is
compared across ranks anyway, and the per-call check (docs/reliability.md)
names the method too. The calibration can be saved and reused
(``calibration="path.json"``): it is measured only when the file is missing
or was made for another world size, hierarchy, device or settings.

Example::

    import pycomm.distributed as pd
    pd.init_process_group(compressor="auto", init_method="env://",
                          calibration="pycomm-calibration.json")
    print(pd.calibration().format())      # what was measured, and the decisions
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .spec import AUTO_METHODS, EXACT_METHOD

log = logging.getLogger(__name__)

#: The methods "auto" chooses from, the exact all-reduce first; of methods
#: predicted equally fast the earlier one wins.
CANDIDATES = AUTO_METHODS
#: Tensor sizes (elements) measured: a small DDP bucket and one chunk.
SIZES = (1 << 16, 1 << 20)
REPEATS = 3
#: A lossy method must be predicted this much faster than exact to be chosen.
MIN_GAIN = 0.10
#: Exclusive upper bound of the last size range (any tensor).
NO_BOUND = 1 << 62
#: 2: int8 and int4 measured too (a version-1 file is measured again). A
#: file that lacks a candidate is measured again too (_bad_measurements).
VERSION = 2

@dataclass
class Calibration:
    """Measured all-reduce times of each candidate method, and the decisions
    they imply. ``seconds[method][i]`` is the time at ``sizes[i]`` elements."""

    world_size: int
    ranks_per_node: int
    device: str
    settings: Dict[str, Any]
    sizes: List[int]
    seconds: Dict[str, List[float]]
    min_gain: float = MIN_GAIN
    measured_at: str = ""
    version: int = VERSION
    loaded_from: Optional[str] = field(default=None, compare=False)

    # ---- the model
    def fit(self) -> Dict[str, Tuple[float, float]]:
        """``{method: (alpha_s, seconds_per_element)}``: least squares through
        the measured points, neither term below zero."""
        out = {}
        for method, ts in self.seconds.items():
            ns = self.sizes
            mn, mt = statistics.fmean(ns), statistics.fmean(ts)
            var = sum((n - mn) ** 2 for n in ns)
            slope = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / var if var else 0.0
            slope = max(slope, 0.0)
            out[method] = (max(mt - slope * mn, 0.0), slope)
        return out

    def predict(self, method: str, numel: int) -> float:
        """Predicted seconds of an all-reduce of ``numel`` elements with ``method``.

        >>> cal = Calibration(2, 1, "cpu", {}, [10, 20], {"none": [1.0, 2.0], "onebit": [1.5, 1.6]})
        >>> cal.predict("none", 40), round(cal.predict("onebit", 40), 6)
        (4.0, 1.8)
        """
        alpha, per_element = self.fit()[method]
        return alpha + numel * per_element

    def _effective(self, fits: Dict[str, Tuple[float, float]], method: str, numel: float) -> float:
        # Lossy methods are charged min_gain: exact wins unless clearly slower.
        alpha, per_element = fits[method]
        t = alpha + numel * per_element
        return t if method == EXACT_METHOD else t * (1 + self.min_gain)

    def choose(self, numel: int) -> str:
        """The method run for a tensor of ``numel`` elements (exact below the
        group's ``min_compress_numel``, as with every compressor).

        >>> cal = Calibration(2, 1, "cpu", {}, [10, 20], {"none": [1.0, 2.0], "onebit": [1.5, 1.6]})
        >>> cal.choose(10), cal.choose(1000)
        ('none', 'onebit')
        """
        if numel < self.settings.get("min_compress_numel", 1):
            return EXACT_METHOD
        fits = self.fit()
        methods = [m for m in CANDIDATES if m in fits]
        return min(methods, key=lambda m: (self._effective(fits, m, numel), methods.index(m)))

    def size_methods(self) -> List[Tuple[int, str]]:
        """``[(bound, method), ...]``: sizes below ``bound`` (and not below the
        previous bound) run ``method``; the backend's table. The lines cross
        at most once per pair, so the choice is constant between crossings.

        >>> cal = Calibration(2, 1, "cpu", {"min_compress_numel": 5}, [10, 20],
        ...                   {"none": [1.0, 2.0], "onebit": [1.5, 1.6]})
        >>> cal.size_methods()
        [(18, 'none'), (4611686018427387904, 'onebit')]
        """
        min_numel = max(1, int(self.settings.get("min_compress_numel", 1)))
        fits = self.fit()
        cuts = {float(min_numel), float(NO_BOUND)}
        names = list(fits)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                for ga, gb in ((1.0, 1.0), (1.0, 1 + self.min_gain), (1 + self.min_gain, 1.0),
                               (1 + self.min_gain, 1 + self.min_gain)):
                    (aa, pa), (ab, pb) = fits[a], fits[b]
                    den = ga * pa - gb * pb
                    if den:
                        n = (gb * ab - ga * aa) / den
                        if min_numel < n < NO_BOUND:
                            cuts.add(float(n))
        edges = sorted(cuts)
        # One probe inside each interval between crossings, then each change
        # of method placed exactly where choose() changes (a binary search:
        # near a crossing, rounding decides, and the table must say what
        # choose() says).
        probes = [min_numel] + [max(min_numel, int(math.sqrt(lo * hi))) for lo, hi in zip(edges, edges[1:])]
        table: List[Tuple[int, str]] = []
        start, method = 1, self.choose(1)  # exact below min_numel
        for p in probes:
            if self.choose(p) == method or p <= start:
                continue
            lo, hi = start, p  # choose(lo) == method != choose(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.choose(mid) == method else (lo, mid)
            table.append((hi, method))
            start, method = hi, self.choose(hi)
        table.append((NO_BOUND, method))
        return table

    def link(self) -> Dict[str, float]:
        """The link as the exact all-reduce saw it (ring model: ``2(W-1)``
        messages and ``2(W-1)/W`` x 4 bytes per element per rank)."""
        alpha, per_element = self.fit()[EXACT_METHOD]
        w = self.world_size
        if w < 2:
            return {"alpha_s": 0.0, "bandwidth_bytes_per_s": math.inf}
        wire = 2 * (w - 1) / w * 4
        return {"alpha_s": alpha / (2 * (w - 1)),
                "bandwidth_bytes_per_s": wire / per_element if per_element else math.inf}

    # ---- reporting
    def rows(self, sizes: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
        """One row per tensor size: predicted ms of each method and the choice."""
        sizes = sizes or [1 << p for p in range(14, 29, 2)]
        out = []
        for n in sizes:
            row: Dict[str, Any] = {"numel": n, "MB": n * 4 / 1e6}
            for m in CANDIDATES:
                if m in self.seconds:
                    row[f"{m} ms"] = self.predict(m, n) * 1e3
            below = n < self.settings.get("min_compress_numel", 1)
            row["chosen"] = f"{EXACT_METHOD} (< min_compress_numel)" if below else self.choose(n)
            out.append(row)
        return out

    def format(self, sizes: Optional[Sequence[int]] = None) -> str:
        """The decision table, with what was measured and how."""
        from .._optional import require

        tabulate = require("tabulate").tabulate

        link = self.link()
        head = (f"compressor=auto: {self.world_size} ranks ({self.ranks_per_node} per node), {self.device}, "
                f"{'loaded from ' + self.loaded_from if self.loaded_from else 'measured'} {self.measured_at}\n"
                f"link as the exact all-reduce sees it: alpha {link['alpha_s'] * 1e6:.0f} us, "
                f"{link['bandwidth_bytes_per_s'] * 8 / 1e9:.3g} Gbit/s; lossy methods need a "
                f"{self.min_gain:.0%} predicted gain\n")
        measured = tabulate([[m, *(f"{t * 1e3:.2f}" for t in self.seconds[m])] for m in self.seconds],
                            headers=["measured ms", *(f"n={n}" for n in self.sizes)])
        return head + measured + "\n\n" + tabulate(self.rows(sizes), headers="keys", floatfmt=".3g")

    # ---- persistence
    def key(self) -> Dict[str, Any]:
        """What a saved calibration must match to be reused."""
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node, "device": self.device,
                "settings": self.settings, "sizes": list(self.sizes), "version": self.version}

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("loaded_from")
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Calibration":
        return cls(**d)

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)  # readers never see half a file

    def digest(self) -> int:
        """A hash of the decisions, compared across ranks."""
        text = json.dumps(self.size_methods(), separators=(",", ":"))
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _load(path: Optional[str], want: Dict[str, Any]) -> Optional[Calibration]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            cal = Calibration.from_dict(json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("calibration %s unreadable (%s): measuring again", path, exc)
        return None
    try:
        matches = cal.key() == want
    except (TypeError, ValueError) as exc:  # e.g. "sizes" is not a list
        log.warning("calibration %s unreadable (%s): measuring again", path, exc)
        return None
    if not matches:
        log.info("calibration %s was made for another setup: measuring again", path)
        return None
    bad = _bad_measurements(cal)
    if bad:
        log.warning("calibration %s has corrupt measurements (%s): measuring again", path, bad)
        return None
    cal.loaded_from = str(path)
    return cal


def _bad_measurements(cal: Calibration) -> Optional[str]:
    """What is wrong with a loaded calibration's measurements, or None."""
    if not isinstance(cal.seconds, dict):
        return "seconds is not a mapping"
    for m in CANDIDATES:
        ts = cal.seconds.get(m)
        if not isinstance(ts, list) or len(ts) != len(cal.sizes):
            return f"seconds[{m!r}] is not a list of {len(cal.sizes)} times"
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                   for t in ts):
            return f"seconds[{m!r}] holds a time that is not a positive number"
    return None


def _allreduce_max(backend: Any, values: List[float], device: str) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    backend.allreduce([t], opts).wait()  # forwarded (float64, MAX): exact
    return t.tolist()


def _time_call(backend: Any, base: torch.Tensor, work: torch.Tensor, method: str, device: str) -> float:
    work.copy_(base)
    backend.allreduce_plain(torch.zeros(1, device=device), False).wait()  # start together
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    backend.allreduce_keyed(work, None, False, method).wait()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(backend: Any, device: str, sizes: Sequence[int] = SIZES, repeats: int = REPEATS) -> Dict[str, List[float]]:
    """Seconds of each candidate through ``backend`` at each size (median of
    ``repeats`` after a warm-up; maximum over ranks). Every rank calls it."""
    gen = torch.Generator().manual_seed(1234)
    seconds: Dict[str, List[float]] = {m: [] for m in CANDIDATES}
    for n in sizes:
        base = torch.randn(n, generator=gen).to(device)
        work = torch.empty_like(base)
        for m in CANDIDATES:
            ts = [_time_call(backend, base, work, m, device) for _ in range(repeats + 1)][1:]
            seconds[m].append(statistics.median(ts))
    flat = _allreduce_max(backend, [t for m in CANDIDATES for t in seconds[m]], device)
    return {m: flat[i * len(sizes):(i + 1) * len(sizes)] for i, m in enumerate(CANDIDATES)}


def calibrate(backend: Any, options: Any, device: str) -> Calibration:
    """The calibration of a new ``compressor="auto"`` backend: loaded from
    ``options.calibration`` when every rank has a matching one, else measured
    (and saved there by rank 0). Every rank of the group calls it."""
    rank = backend.rank()
    settings = {"chunk_numel": dict(backend.config)["chunk_numel"], "block_size": options.block_size,
                "density": options.density, "approx": options.approx,
                "min_compress_numel": options.min_compress_numel, "min_gain": MIN_GAIN}
    want = Calibration(backend.size(), backend.ranks_per_node, device, settings, list(SIZES), {}).key()
    loaded = _load(options.calibration, want)
    everyone_loaded = _allreduce_max(backend, [0.0 if loaded else 1.0], device)[0] == 0.0
    if everyone_loaded:
        assert loaded is not None
        flat = _allreduce_max(backend, [t for m in CANDIDATES for t in loaded.seconds[m]], device)
        n = len(loaded.sizes)
        loaded.seconds = {m: flat[i * n:(i + 1) * n] for i, m in enumerate(CANDIDATES)}
        cal = loaded
    else:
        t0 = time.perf_counter()
        seconds = measure(backend, device)
        cal = Calibration(backend.size(), backend.ranks_per_node, device, settings, list(SIZES), seconds,
                          measured_at=datetime.datetime.now().isoformat(timespec="seconds"))
        failed = ""
        if rank == 0:
            log.info("compressor=auto calibrated in %.1f s", time.perf_counter() - t0)
            if options.calibration:
                try:
                    cal.save(str(options.calibration))
                except OSError as exc:
                    failed = f"{type(exc).__name__}: {exc}"
        # Every rank learns whether rank 0 could save, and all raise alike:
        # no rank is left waiting in a collective its peers never join.
        if _allreduce_max(backend, [1.0 if failed else 0.0], device)[0] > 0:
            raise ValueError(f"calibration={str(options.calibration)!r} cannot be written on rank 0"
                             + (f" ({failed})" if failed else "") + ": pass a writable file path, or None")
    digest = float(cal.digest())
    lo_hi = _allreduce_max(backend, [digest, -digest], device)
    if lo_hi[0] != -lo_hi[1]:
        raise RuntimeError("compressor=auto: ranks computed different decision tables from the same "
                           "calibration; every rank must run the same pycomm version")
    if rank == 0:
        log.info("%s", cal.format())
    backend.set_size_methods(cal.size_methods(), json.dumps({**cal.to_dict(), "loaded_from": cal.loaded_from}))
    return cal


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m pycomm.distributed.auto CALIBRATION.json``: print a saved
    calibration's decision table (what a group loading it would do)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pycomm.distributed.auto", description=main.__doc__)
    ap.add_argument("path", help="a calibration written by a compressor='auto' group (calibration=PATH)")
    args = ap.parse_args(argv)
    try:
        with open(args.path, encoding="utf-8") as f:
            cal = Calibration.from_dict(json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        ap.error(f"cannot read {args.path}: {exc}")
    cal.loaded_from = args.path
    print(cal.format())
    print("\nsize table:", ", ".join(f"< {b}: {m}" if b < NO_BOUND else f"rest: {m}" for b, m in cal.size_methods()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
