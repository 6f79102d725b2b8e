"""pycomm benchmarks: the ``pycomm-bench`` console script and what its
subcommands share (timing, statistics, machine description, JSON output).

Each subcommand is one module of this package (``kernels`` now; ``ddp``,
``allreduce`` and ``all`` later) listed in :data:`pycomm.bench.cli.SUBCOMMANDS`.
Every benchmark verifies results before timing them, reports the median and
the p10/p90 spread of repeated runs, and measures the contenders it compares
interleaved in the same run, because the machines here are shared and noisy:
only ratios measured side by side mean anything.

Example::

    $ pycomm-bench kernels --quick            # or: python -m pycomm.bench kernels --quick
    >>> from pycomm.bench import time_interleaved, summarize
    >>> import torch
    >>> x, y = torch.randn(1 << 16), torch.empty(1 << 16)
    >>> times = time_interleaved({"copy": (lambda: y.copy_(x), None)}, repeats=5, warmup=1)
    >>> sorted(summarize(times["copy"]))
    ['median_s', 'p10_s', 'p90_s']
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

#: A timed contender: (the call to time, an untimed setup run before each call or None).
Timed = Tuple[Callable[[], object], Optional[Callable[[], object]]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    contenders: Mapping[str, Timed],
    repeats: int,
    warmup: int,
    device: torch.device | str = "cpu",
    on_call: Optional[Callable[[str], None]] = None,
) -> Dict[str, List[float]]:
    """Seconds per call of each contender, ``repeats`` samples each after ``warmup``.

    Contenders run round-robin (one call of each per round, order rotated every
    round) so that a burst of noise from other tenants hits all of them alike;
    their ratios are then meaningful even when absolute times drift. ``setup``
    runs before each call, untimed (e.g. to restore a residual updated in
    place). CPU uses ``time.perf_counter``; CUDA uses events around the call
    and synchronizes after it. ``on_call(name)`` is called after every call
    (progress bars).

    Example::

        >>> import torch
        >>> a, b = torch.randn(1000), torch.empty(1000)
        >>> t = time_interleaved({"copy": (lambda: b.copy_(a), None)}, repeats=3, warmup=1)
        >>> len(t["copy"])
        3
    """
    device = torch.device(device)
    names = list(contenders)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a timed call is noise, not kernel time
    try:
        for rnd in range(warmup + repeats):
            shift = rnd % len(names) if names else 0
            for name in names[shift:] + names[:shift]:
                fn, setup = contenders[name]
                if setup is not None:
                    setup()
                _sync(device)
                if device.type == "cuda":
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                else:
                    t0 = time.perf_counter()
                    fn()
                    seconds = time.perf_counter() - t0
                if rnd >= warmup:
                    samples[name].append(seconds)
                if on_call is not None:
                    on_call(name)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def summarize(times: Sequence[float]) -> Dict[str, float]:
    """Median and p10/p90 (linear interpolation) of a list of seconds."""
    p10, p50, p90 = np.percentile(np.asarray(times, dtype=np.float64), [10, 50, 90])
    return {"median_s": float(p50), "p10_s": float(p10), "p90_s": float(p90)}


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(device: torch.device | str = "cpu") -> Dict[str, object]:
    """What a result was measured on: host, CPU model, torch version, threads, GPU."""
    import pycomm

    device = torch.device(device)
    info: Dict[str, object] = {
        "node": platform.node(),
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pycomm": getattr(pycomm, "__version__", None),
        "threads": torch.get_num_threads(),
        # Other processes on a small machine make torch's threads wait for each
        # other (a 2-thread copy_ went from 0.1 ms to 8 ms beside one compiler).
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def default_json_path(
    bench: str, device: torch.device | str, today: Optional[_dt.date] = None, quick: bool = False
) -> str:
    """``benchmarks/results/<bench>-<device type>-<YYYY-MM-DD>[-quick].json``
    (relative to cwd); a ``--quick`` smoke run never overwrites a measurement.

    Example::

        >>> import datetime
        >>> default_json_path("kernels", "cuda:0", datetime.date(2025, 1, 2))
        'benchmarks/results/kernels-cuda-2025-01-02.json'
    """
    today = today or _dt.date.today()
    kind = torch.device(device).type
    suffix = "-quick" if quick else ""
    return os.path.join("benchmarks", "results", f"{bench}-{kind}-{today.isoformat()}{suffix}.json")


def write_json(path: str, doc: Mapping[str, object]) -> None:
    """Write ``doc`` as indented JSON, creating the folder; NaN/Inf are refused
    (strict JSON readers reject them: missing values are written as null)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)  # a crash mid-write leaves no truncated result behind


__all__ = [
    "default_json_path",
    "machine_info",
    "summarize",
    "time_interleaved",
    "write_json",
]


def fmt_number(x: Optional[float], digits: int = 3) -> str:
    """``digits`` significant digits for a table cell; "-" for None/NaN/Inf.

    >>> fmt_number(0.012345), fmt_number(123.4), fmt_number(None)
    ('0.0123', '123', '-')
    """
    if x is None or not math.isfinite(x):
        return "-"
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    return f"{x:.{max(0, digits - 1 - mag)}f}"
