"""Optional dependencies: pycomm itself needs torch alone; its text reports
(``pycomm plan``'s table, ``compressor="auto"``'s report) import their
libraries through :func:`require`, which names the extra to install when one
is missing. (The benchmark harness, ``pycomm-bench``, is a package of its
own, ``bench/`` of the source tree, with its own dependencies.)

>>> require("math").sqrt(4.0)
2.0
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str = "report") -> ModuleType:
    """Import ``module``, or raise ImportError saying which pycomm extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is needed here but not installed: pip install 'pycomm[{extra}]' (or pip install {module})"
        ) from exc
