"""Optional dependencies: pycomm itself needs torch alone; reports, plots and
benchmarks import their libraries through :func:`require`, which names the
extra to install when one is missing.

>>> require("math").sqrt(4.0)
2.0
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str = "bench") -> ModuleType:
    """Import ``module``, or raise ImportError saying which pycomm extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is needed here but not installed: pip install 'pycomm[{extra}]' (or pip install {module})"
        ) from exc
