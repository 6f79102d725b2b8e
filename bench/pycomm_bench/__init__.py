"""pycomm benchmarks: the ``pycomm-bench`` console script and the one harness
its subcommands are built on.

A package of its own, beside the library (``bench/`` of the source tree:
``pip install --no-build-isolation -e bench`` after pycomm, which
scripts/setup_env.sh does); the ``pycomm`` wheel holds the library alone.

The harness:

* :mod:`~pycomm_bench.launch`: W rank processes, local or in emulated
  network namespaces (:mod:`~pycomm_bench.netem`), bounded in time, a failed
  rank ending the run with its stderr; how to add a benchmark is in its
  docstring;
* :mod:`~pycomm_bench.timing`: contenders timed interleaved, median and p10/p90;
* :mod:`~pycomm_bench.methods`: the method names (``onebit``, ``topk-0.01-noef``, ...),
  derived from the method table (:data:`pycomm.distributed.spec.METHOD_TABLE`);
* :mod:`~pycomm_bench.sweep`: what the training sweeps (ddp, fsdp) share;
* :mod:`~pycomm_bench.links`: a cluster's bus bandwidth, measured with ranks;
* :mod:`~pycomm_bench.report`: machine description, tables, JSON files, exit status;
* :mod:`~pycomm_bench.records`: where the records go (``benchmarks/results/<benchmark>/``),
  each folder's generated ``INDEX.md``, and the doc tables drawn from records;
* :mod:`~pycomm_bench.models`: the models and data the DDP benchmark trains.

The benchmarks, one module each (:data:`pycomm_bench.cli.SUBCOMMANDS`):
``kernels``, ``allreduce``, ``ddp``, ``fsdp``, ``hierarchy``, ``all``, ``index`` (the
records' indexes and the doc tables); and
``gpu-check``, the GPU check (``tools/gpu_check.py`` of the source tree). Every benchmark verifies results
before timing them, reports the median and the p10/p90 spread of repeated
runs, and measures the contenders it compares interleaved in the same run,
because the machines here are shared and noisy: only ratios measured side by
side mean anything.

Example::

    $ pycomm-bench kernels --quick            # or: python -m pycomm_bench kernels --quick
    >>> from pycomm_bench import time_interleaved, summarize
    >>> import torch
    >>> x, y = torch.randn(1 << 16), torch.empty(1 << 16)
    >>> times = time_interleaved({"copy": (lambda: y.copy_(x), None)}, repeats=5, warmup=1)
    >>> sorted(summarize(times["copy"]))
    ['median_s', 'p10_s', 'p90_s']
"""

from __future__ import annotations

from .report import default_json_path, finish, fmt_number, machine_info, table, write_json
from .timing import Timed, median, summarize, time_interleaved

__all__ = [
    "Timed",
    "default_json_path",
    "finish",
    "fmt_number",
    "machine_info",
    "median",
    "summarize",
    "table",
    "time_interleaved",
    "write_json",
]
