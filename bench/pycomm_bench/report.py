"""What every benchmark writes: the machine it ran on, a text table, a JSON
file under benchmarks/results/, FAILED lines and the exit status.

Only the standard library is imported at module level (torch, tabulate and
tqdm inside the functions that need them): the GPU check
(tools/gpu_check.py) loads this file by its path and uses :func:`fmt_number`
before pycomm or this package can be imported.

Example::

    >>> fmt_number(0.012345), size_label(1 << 20), status_note({"status": "ok"})
    ('0.0123', '1M', '')
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence


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


def ms(seconds: Optional[float]) -> Optional[float]:
    """Seconds to milliseconds, None kept.

    >>> ms(0.25), ms(None)
    (250.0, None)
    """
    return None if seconds is None else 1e3 * seconds


def spread_ms(rec: Mapping[str, object], prefix: str = "") -> str:
    """The ``p10-p90`` cell of a record holding ``<prefix>p10_s`` and ``<prefix>p90_s``.

    >>> spread_ms({"p10_s": 0.001, "p90_s": 0.0025}), spread_ms({"p10_s": None, "p90_s": None})
    ('1.00-2.50', '-')
    """
    lo, hi = rec[prefix + "p10_s"], rec[prefix + "p90_s"]
    return "-" if lo is None else f"{fmt_number(ms(lo))}-{fmt_number(ms(hi))}"  # type: ignore[arg-type]


def status_note(rec: Mapping[str, object], width: int = 100) -> str:
    """"" for a record with status ok, else ``"VERIFY FAILED: <error>"`` cut to ``width``.

    >>> status_note({"status": "verify_failed", "error": "bits differ"})
    'VERIFY FAILED: bits differ'
    """
    if rec["status"] == "ok":
        return ""
    return f"{str(rec['status']).upper().replace('_', ' ')}: {rec['error']}"[:width]


def size_label(n: int) -> str:
    """``1M``, ``64k``, ``1G`` for whole binary multiples, else the number.

    >>> size_label(65536), size_label(3 << 20), size_label(1000)
    ('64k', '3M', '1000')
    """
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def loadavg() -> Optional[List[float]]:
    """The 1/5/15-minute load averages, None where the OS has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(device: object = "cpu") -> Dict[str, object]:
    """What a result was measured on: host, CPU model, torch version, threads, GPU.

    >>> sorted(machine_info())[:3]   # doctest: +SKIP
    ['cpu_count', 'cpu_model', 'loadavg']
    """
    import numpy as np
    import torch

    import pycomm

    device = torch.device(device)  # type: ignore[arg-type]
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
        "loadavg": loadavg(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def default_json_path(bench: str, device: object, quick: bool = False, settings: str = "") -> str:
    """The record a benchmark writes when ``--json`` is not given:
    ``benchmarks/results/<folder>/<device type>[-<settings>][-quick].json``
    (relative to cwd; ``records.record_path``). A rerun with the same
    settings replaces the record; a ``--quick`` smoke run never overwrites a
    measurement.

    Example::

        >>> default_json_path("kernels", "cuda:0")
        'benchmarks/results/kernels/cuda.json'
        >>> default_json_path("ddp-mlp", "cpu", settings="4ranks-mlp")
        'benchmarks/results/ddp/cpu-4ranks-mlp.json'
    """
    from .records import record_path

    kind = str(device).split(":")[0] if isinstance(device, str) else device.type  # type: ignore[attr-defined]
    return record_path(bench, kind + (f"-{settings}" if settings else ""), quick=quick)


def clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON).

    >>> clean({"a": [1.0, float("nan")], "b": float("inf")})
    {'a': [1.0, None], 'b': None}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def write_json(path: str, doc: object) -> None:
    """Write ``doc`` as indented JSON, creating the folder; NaN/Inf are refused
    (strict JSON readers reject them: missing values are written as null).

    >>> write_json("/tmp/pycomm-doc.json", {"median_s": 0.5})   # doctest: +SKIP
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, allow_nan=False)
            fh.write("\n")
    except BaseException:
        os.remove(tmp)  # a refused document leaves nothing behind
        raise
    os.replace(tmp, path)  # a crash mid-write leaves no truncated result behind


def gloo_document(benchmark: str, started: str, machine: Dict[str, object], args: Any, t_start: float,
                  records: List[Any], failures: List[Any], **fields: Any) -> Dict[str, Any]:
    """The JSON document of a collective benchmark over Gloo ranks: its
    name, date and machine, the ranks, sizes, rounds and warm-up of
    ``args``, the benchmark's own ``fields``, the run's length (from
    ``t_start``, a ``time.monotonic()``) and the load at its end, the
    records and the failures."""
    return {"benchmark": benchmark, "date": started, "machine": machine, "backend": "gloo", "ranks": args.ranks,
            "sizes": args.sizes, **fields, "repeats": args.repeats, "warmup": args.warmup,
            "total_s": time.monotonic() - t_start, "loadavg_end": loadavg(), "records": records, "failures": failures}


def table(rows: Iterable[object], headers: object, tablefmt: str = "simple", numparse: bool = False) -> str:
    """``rows`` as a text table (tabulate). Cells are shown as given (already
    formatted strings are not re-parsed as numbers) unless ``numparse``.

    >>> print(table([["onebit", "1.50"]], ["method", "ms"]))   # doctest: +NORMALIZE_WHITESPACE
    method    ms
    --------  ----
    onebit    1.50
    """
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=not numparse)


def record_events(bar: Any, records: List[Any]) -> Callable[[Dict[str, Any]], None]:
    """The ``on_event`` of a benchmark's ranks: "tick" advances ``bar``,
    "say" sets its description, "records" extends ``records``."""

    def on_event(event: Dict[str, Any]) -> None:
        if event["event"] == "tick":
            bar.update(event["n"])
        elif event["event"] == "say":
            bar.set_description(event["text"])
        elif event["event"] == "records":
            records.extend(event["records"])

    return on_event


def progress_bar(total: int, unit: str, enabled: bool = True):
    """A tqdm bar on stderr (stdout holds the table), gone when closed.

    >>> with progress_bar(3, "call", enabled=False) as bar:
    ...     bar.update(3)
    """
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=not enabled, leave=False, dynamic_ncols=True, file=sys.stderr)


def fail(command: str, message: object, status: int = 1) -> int:
    """How a benchmark stops short: ``pycomm-bench <command>: <message>`` on
    stderr; returns ``status``, the exit status to return."""
    print(f"pycomm-bench {command}: {message}", file=sys.stderr)
    return status


def finish(doc: object, path: str, text: str, failures: Sequence[str] = (),
           started: Optional[float] = None) -> int:
    """The end of every benchmark: print ``text`` (its table), write ``doc``
    to ``path`` with the command that made it (and, under a results folder,
    rewrite the folder's ``INDEX.md``), say so (with the seconds since ``started``, a
    ``time.monotonic()``), print one ``FAILED`` line per failure on stderr;
    the exit status: 1 if anything failed, else 0.

    >>> finish({"records": []}, "/tmp/x.json", "table", ["onebit: wrong"])   # doctest: +SKIP
    1
    """
    from .records import stamp_command, update_index_of

    print(text)
    write_json(path, stamp_command(doc))
    update_index_of(path)
    took = f" ({time.monotonic() - started:.0f} s)" if started is not None else ""
    print(f"\nwrote {path}{took}", flush=True)
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failures else 0
