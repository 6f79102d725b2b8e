"""pycomm benchmarks: the ``pycomm-bench`` console script and the one harness
its subcommands are built on.

The harness:

* :mod:`~pycomm.bench.launch`: W rank processes, local or in emulated
  network namespaces (:mod:`~pycomm.bench.netem`), bounded in time, a failed
  rank ending the run with its stderr; how to add a benchmark is in its
  docstring;
* :mod:`~pycomm.bench.timing`: contenders timed interleaved, median and p10/p90;
* :mod:`~pycomm.bench.methods`: the method names (``onebit``, ``topk-0.01-noef``, ...),
  derived from the method table (:data:`pycomm.distributed.spec.METHOD_TABLE`);
* :mod:`~pycomm.bench.sweep`: what the training sweeps (ddp, fsdp) share;
* :mod:`~pycomm.bench.links`: a cluster's bus bandwidth, measured with ranks;
* :mod:`~pycomm.bench.report`: machine description, tables, JSON files, exit status;
* :mod:`~pycomm.bench.models`: the models and data the DDP benchmark trains.

The benchmarks, one module each (:data:`pycomm.bench.cli.SUBCOMMANDS`):
``kernels``, ``allreduce``, ``ddp``, ``fsdp``, ``hierarchy``, ``all``; and
``gpu-check``, the GPU check (:mod:`pycomm.tools.gpu_check`). Every benchmark verifies results
before timing them, reports the median and the p10/p90 spread of repeated
runs, and measures the contenders it compares interleaved in the same run,
because the machines here are shared and noisy: only ratios measured side by
side mean anything.

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
