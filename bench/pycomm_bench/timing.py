"""Timing and statistics shared by every benchmark: contenders timed
interleaved (round-robin, order rotated every round), medians and p10/p90.

The machines here are shared and noisy: a contender timed alone drifts with
the load of the moment, while contenders measured in the same rounds see the
same noise, so only their ratios are quoted.

Example::

    >>> import torch
    >>> x, y = torch.randn(1 << 16), torch.empty(1 << 16)
    >>> times = time_interleaved({"copy": (lambda: y.copy_(x), None)}, repeats=5, warmup=1)
    >>> sorted(summarize(times["copy"]))
    ['median_s', 'p10_s', 'p90_s']
"""

from __future__ import annotations

import gc
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
    place, or a barrier). CPU uses ``time.perf_counter``; CUDA uses events
    around the call and synchronizes after it. ``on_call(name)`` is called
    after every call, warm-up ones included, untimed (progress bars, byte
    counters).

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
    """Median and p10/p90 (linear interpolation) of a list of seconds.

    >>> summarize([1.0, 2.0, 3.0])["median_s"]
    2.0
    """
    p10, p50, p90 = np.percentile(np.asarray(times, dtype=np.float64), [10, 50, 90])
    return {"median_s": float(p50), "p10_s": float(p10), "p90_s": float(p90)}


def median(times: Sequence[float]) -> float:
    """The median of a list of seconds (the mean of the middle two for an even count).

    >>> median([4.0, 1.0, 3.0, 2.0])
    2.5
    """
    return summarize(times)["median_s"]
