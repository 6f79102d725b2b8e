"""Method names, the same in every benchmark, its command line and its JSON.

Grammar: ``<base>[-noef][-backend]``, base one of

* ``plain`` / ``allreduce``: torch's own float32 all-reduce (no compression);
* ``fp16``, ``bf16``: a cast to 16 bits and back;
* ``powersgd-<rank>``: PyTorch's PowerSGD hook of that rank;
* ``onebit``, ``topk-<density>``, ``auto``: pycomm's compressors
  (``auto``: the method a calibration predicts fastest per size);

``-noef`` turns error feedback off and ``-backend`` runs the compression in
a ``"pycomm"`` process group instead of the hook (both for onebit, topk and
auto). Each benchmark accepts the part of it that it can run
(:data:`ALLREDUCE_BASES`, :data:`DDP_BASES`).

Example::

    >>> parse_method("topk-0.01-noef")
    Method(name='topk-0.01-noef', entry='hook', compressor='topk', error_feedback=False, density=0.01, rank=None)
    >>> parse_method("plain").compressed, parse_method("onebit", bases=ALLREDUCE_BASES).density
    (False, None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

#: Every base name (``powersgd`` and ``topk`` stand for ``powersgd-<rank>``, ``topk-<density>``).
ALL_BASES = ("plain", "allreduce", "fp16", "bf16", "powersgd", "onebit", "topk", "auto")
#: What ``pycomm-bench allreduce`` times (a pycomm group per compressor, no suffixes).
ALLREDUCE_BASES = ("plain", "fp16", "bf16", "onebit", "topk")
#: What ``pycomm-bench ddp`` trains with.
DDP_BASES = ("allreduce", "fp16", "bf16", "powersgd", "onebit", "topk", "auto")

_PARAM = {"powersgd": "powersgd-<rank>", "topk": "topk-<density>"}
_METHOD_RE = re.compile(
    r"^(?P<base>plain|allreduce|fp16|bf16|auto|powersgd-(?P<rank>[0-9]+)|onebit|topk-(?P<density>[0-9.eE+-]+?))"
    r"(?P<noef>-noef)?(?P<backend>-backend)?$"
)


@dataclass(frozen=True)
class Method:
    """One way of all-reducing gradients, parsed from its name."""

    name: str
    #: "ddp" (no hook: torch's own all-reduce), "torch" (PyTorch's hooks),
    #: "hook" (pycomm's hook over the Gloo group), "backend" (a "pycomm" group)
    entry: str
    #: "none", "fp16", "bf16", "powersgd", "onebit", "topk" or "auto"
    compressor: str = "none"
    error_feedback: bool = False
    density: Optional[float] = None
    rank: Optional[int] = None

    @property
    def pycomm(self) -> bool:
        """Compressed by pycomm (hook or backend)."""
        return self.entry in ("hook", "backend")

    @property
    def compressed(self) -> bool:
        """Anything but the plain float32 all-reduce."""
        return self.compressor != "none"


def _vocabulary(bases: Sequence[str], suffixes: bool) -> str:
    names = [_PARAM.get(b, b) for b in bases]
    text = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
    if suffixes:
        text += "; onebit, topk and auto optionally followed by -noef and/or -backend"
    return text


def parse_method(name: str, bases: Sequence[str] = ALL_BASES, suffixes: bool = True) -> Method:
    """The :class:`Method` of ``name``; ValueError (naming it) if it is not
    one of ``bases``, or has a suffix where ``suffixes`` is False.

    Example::

        >>> parse_method("onebit-noef-backend").entry
        'backend'
        >>> parse_method("powersgd-4").rank
        4
        >>> parse_method("onebit-noef", bases=ALLREDUCE_BASES, suffixes=False)
        Traceback (most recent call last):
        ...
        ValueError: unknown method 'onebit-noef': expected plain, fp16, bf16, onebit or topk-<density>
    """
    name = name.strip()
    m = _METHOD_RE.match(name)
    base = None if m is None else m.group("base").split("-")[0]
    has_suffix = m is not None and bool(m.group("noef") or m.group("backend"))
    if m is None or base not in bases or (has_suffix and not suffixes):
        raise ValueError(f"unknown method {name!r}: expected {_vocabulary(bases, suffixes)}")
    if has_suffix and base not in ("onebit", "topk", "auto"):
        raise ValueError(f"method {name!r}: -noef and -backend apply to onebit and topk only (and auto)")
    if base in ("plain", "allreduce"):
        return Method(name, "ddp", "none")
    if base in ("fp16", "bf16"):
        return Method(name, "torch", base)
    if base == "powersgd":
        rank = int(m.group("rank"))
        if rank < 1:
            raise ValueError(f"method {name!r}: the PowerSGD rank must be >= 1")
        return Method(name, "torch", "powersgd", True, rank=rank)
    entry = "backend" if m.group("backend") or base == "auto" else "hook"
    ef = not m.group("noef")
    if base != "topk":
        return Method(name, entry, base, ef)
    try:
        density = float(m.group("density"))
    except ValueError:
        raise ValueError(f"method {name!r}: bad density {m.group('density')!r}") from None
    if not 0.0 < density <= 1.0:
        raise ValueError(f"method {name!r}: density must be in (0, 1], got {density}")
    return Method(name, entry, "topk", ef, density=density)
