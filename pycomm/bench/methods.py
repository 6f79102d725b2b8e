"""Method names, the same in every benchmark, its command line and its JSON.

Grammar: ``<base>[-sr][-noef][-backend]``, base one of

* ``plain`` / ``allreduce``: torch's own float32 all-reduce (no compression);
* ``fp16``, ``bf16``: a cast to 16 bits and back;
* ``powersgd-<rank>``: PyTorch's PowerSGD hook of that rank;
* ``onebit``, ``topk-<density>``, ``int8``, ``int4``, ``auto``: pycomm's
  compressors (``int8``/``int4``: block quantization with an absmax scale
  per block; ``auto``: the method a calibration predicts fastest per size);
* ``optim-<compressor>`` (``optim-onebit``, ``optim-int8``, ``optim-int4``):
  no gradient compression at all, but pycomm's compressed-momentum optimizer
  (:mod:`pycomm.optim`: OneBitAdam for AdamW, OneBitSGD for momentum SGD)
  all-reducing its momentum with that compressor after an exact warm-up
  (``optim-<compressor>-overlap``: sent from DDP's hook per bucket while
  backward runs, ``attach(model, overlap=True)``; ``-v<K>`` after them:
  OneBitAdam updates its variance from an exact average every K steps,
  ``variance_update_every=K``, 0 for never);

``-sr`` rounds int8/int4 stochastically (``rounding="stochastic"``; for
``int8``, ``int4``, ``optim-int8`` and ``optim-int4``), ``-noef`` turns
error feedback off and ``-backend`` runs the compression in
a ``"pycomm"`` process group instead of the hook (both for onebit, topk,
int8, int4 and auto; not for ``optim-*``). Each benchmark accepts the part
of it that it can run (:data:`ALLREDUCE_BASES`, :data:`DDP_BASES`).

Example::

    >>> parse_method("topk-0.01-noef")
    Method(name='topk-0.01-noef', entry='hook', compressor='topk', error_feedback=False, density=0.01, rank=None, overlap=False, rounding='nearest', variance_every=None)
    >>> parse_method("plain").compressed, parse_method("onebit", bases=ALLREDUCE_BASES).density
    (False, None)
    >>> parse_method("int4-noef"), parse_method("optim-onebit").entry
    (Method(name='int4-noef', entry='hook', compressor='int4', error_feedback=False, density=None, rank=None, overlap=False, rounding='nearest', variance_every=None), 'optim')
    >>> parse_method("int4-sr-noef").rounding, parse_method("optim-int4-overlap-sr").rounding
    ('stochastic', 'stochastic')
    >>> parse_method("optim-onebit-v16").variance_every, parse_method("optim-onebit").variance_every
    (16, None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

#: Every base name (``powersgd`` and ``topk`` stand for ``powersgd-<rank>``, ``topk-<density>``).
ALL_BASES = ("plain", "allreduce", "fp16", "bf16", "powersgd", "onebit", "topk", "int8", "int4", "auto", "optim")
#: What ``pycomm-bench allreduce`` times (a pycomm group per compressor, no suffixes).
ALLREDUCE_BASES = ("plain", "fp16", "bf16", "onebit", "topk")
#: What ``pycomm-bench ddp`` trains with.
DDP_BASES = ("allreduce", "fp16", "bf16", "powersgd", "onebit", "topk", "int8", "int4", "auto", "optim")
#: Bases that take ``-noef`` / ``-backend``.
SUFFIX_BASES = ("onebit", "topk", "int8", "int4", "auto")
#: What ``optim-<compressor>`` may name: the momentum's compressor.
OPTIM_COMPRESSORS = ("onebit", "int8", "int4")

_PARAM = {"powersgd": "powersgd-<rank>", "topk": "topk-<density>",
          "optim": "optim-<onebit|int8|int4>[-overlap][-v<K>]"}
_METHOD_RE = re.compile(
    r"^(?P<base>plain|allreduce|fp16|bf16|auto|int8|int4|powersgd-(?P<rank>[0-9]+)|onebit"
    r"|topk-(?P<density>[0-9.eE+-]+?)|optim-(?P<optim>[a-z0-9]+?)(?P<overlap>-overlap)?(?:-v(?P<variance>[0-9]+))?)"
    r"(?P<sr>-sr)?(?P<noef>-noef)?(?P<backend>-backend)?$"
)


@dataclass(frozen=True)
class Method:
    """One way of all-reducing gradients, parsed from its name."""

    name: str
    #: "ddp" (no hook: torch's own all-reduce), "torch" (PyTorch's hooks),
    #: "hook" (pycomm's hook over the Gloo group), "backend" (a "pycomm"
    #: group), "optim" (pycomm's compressed-momentum optimizer)
    entry: str
    #: "none", "fp16", "bf16", "powersgd", "onebit", "topk", "int8", "int4"
    #: or "auto" (for "optim": the momentum's compressor)
    compressor: str = "none"
    error_feedback: bool = False
    density: Optional[float] = None
    rank: Optional[int] = None
    #: "optim" only: the momenta sent from DDP's hook, per bucket, during
    #: backward (``attach(model, overlap=True)``)
    overlap: bool = False
    #: int8/int4: "nearest" or "stochastic" (``-sr``)
    rounding: str = "nearest"
    #: "optim" with AdamW only: OneBitAdam's ``variance_update_every``
    #: (``-v<K>``); None: the optimizer's default
    variance_every: Optional[int] = None

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
        text += "; " + ", ".join(b for b in SUFFIX_BASES if b in bases) + " optionally followed by -noef and/or -backend"
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
    rounding = "stochastic" if m.group("sr") else "nearest"
    if m.group("sr") and base not in ("int8", "int4") and not (base == "optim" and m.group("optim") in ("int8", "int4")):
        raise ValueError(f"method {name!r}: -sr (stochastic rounding) applies to int8 and int4 only")
    if has_suffix and base not in SUFFIX_BASES:
        raise ValueError(f"method {name!r}: -noef and -backend apply to onebit and topk only "
                         f"(and int8, int4, auto)")
    if base in ("plain", "allreduce"):
        return Method(name, "ddp", "none")
    if base in ("fp16", "bf16"):
        return Method(name, "torch", base)
    if base == "powersgd":
        rank = int(m.group("rank"))
        if rank < 1:
            raise ValueError(f"method {name!r}: the PowerSGD rank must be >= 1")
        return Method(name, "torch", "powersgd", True, rank=rank)
    if base == "optim":
        comp = m.group("optim")
        if comp not in OPTIM_COMPRESSORS:
            raise ValueError(f"method {name!r}: the optimizer's compressor must be one of "
                             f"{', '.join(OPTIM_COMPRESSORS)}")
        every = None if m.group("variance") is None else int(m.group("variance"))
        return Method(name, "optim", comp, True, overlap=bool(m.group("overlap")), rounding=rounding,
                      variance_every=every)
    entry = "backend" if m.group("backend") or base == "auto" else "hook"
    ef = not m.group("noef")
    if base != "topk":
        return Method(name, entry, base, ef, rounding=rounding)
    try:
        density = float(m.group("density"))
    except ValueError:
        raise ValueError(f"method {name!r}: bad density {m.group('density')!r}") from None
    if not 0.0 < density <= 1.0:
        raise ValueError(f"method {name!r}: density must be in (0, 1], got {density}")
    return Method(name, entry, "topk", ef, density=density)
