"""Loads the compiled extension and says which implementations can run here."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch  # the extension links against torch: import it first

try:
    from . import _C  # noqa: F401  (loading it registers torch.ops.pycomm.*)

    _LOAD_ERROR: Optional[str] = None
except ImportError as exc:  # a source checkout that was never built
    _C = None
    _LOAD_ERROR = str(exc)


def has_ops() -> bool:
    """True when torch.ops.pycomm.* are registered (the extension loaded)."""
    return _C is not None


def why_no_cpu_ops() -> Optional[str]:
    if _C is None:
        return (
            f"the C++ extension pycomm._C did not load ({_LOAD_ERROR}); "
            "build it with `pip install --no-build-isolation .`"
        )
    return None


def why_no_cuda_ops() -> Optional[str]:
    if _C is None:
        return why_no_cpu_ops()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("pycomm::onebit_compress", "CUDA"):
        return "pycomm was built without CUDA (the torch it was built against has no CUDA)"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_no_triton() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if torch.cuda.is_available() or triton_interpreted():
        return None
    return "Triton needs a CUDA device (or TRITON_INTERPRET=1 to run its interpreter on CPU tensors)"


def triton_devices() -> Tuple[str, ...]:
    return ("cuda", "cpu") if triton_interpreted() else ("cuda",)
