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
error feedback off (the DDP hook's default is on; ``pycomm-bench fsdp``,
whose library default is off, takes ``-ef`` instead: one rule, a suffix
names the departure from the entry point's default, and the suffix that
restates it is refused by :func:`pycomm.bench.sweep.error_feedback_suffix`)
and ``-backend`` runs the compression in
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

from ..distributed import spec

#: The harness's own names, defined here once; every other base is a method
#: of the table (:data:`pycomm.distributed.spec.METHOD_TABLE`).
#: torch's float32 all-reduce, "plain" in the all-reduce benchmarks and
#: "allreduce" in the training ones (the names their JSON has always used).
PLAIN, ALLREDUCE = "plain", "allreduce"
#: PyTorch's PowerSGD hook, pycomm's per-size choice (a calibrated
#: ``compressor="auto"`` group) and the compressed-momentum optimizer.
POWERSGD, AUTO, OPTIM = "powersgd", spec.AUTO_METHOD, "optim"
#: The table's sparse method (``topk-<density>``), its block codec of sign
#: bits and its exact all-reduce.
SPARSE = spec.methods(kind="sparse")[0]
ONEBIT = spec.methods(kind="block", bits=1)[0]
EXACT = spec.EXACT_METHOD

#: Every base name (``powersgd``, the sparse method and ``optim`` stand for
#: ``powersgd-<rank>``, ``topk-<density>``, ``optim-<compressor>``).
ALL_BASES = (PLAIN, ALLREDUCE, *spec.CAST_METHODS, POWERSGD, *spec.EF_METHODS, AUTO, OPTIM)
#: What ``pycomm-bench allreduce`` times (a pycomm group per compressor, no suffixes).
ALLREDUCE_BASES = (PLAIN, *spec.CAST_METHODS, *spec.EF_METHODS)
#: What ``pycomm-bench ddp`` trains with.
DDP_BASES = (ALLREDUCE, *spec.CAST_METHODS, POWERSGD, *spec.EF_METHODS, AUTO, OPTIM)
#: Bases that take ``-noef`` / ``-backend``: the methods that keep residuals, and auto.
SUFFIX_BASES = (*spec.EF_METHODS, AUTO)
#: What ``optim-<compressor>`` may name: the momentum's compressor, a block codec.
OPTIM_COMPRESSORS = spec.BLOCK_METHODS

_PARAM = {POWERSGD: f"{POWERSGD}-<rank>", SPARSE: f"{SPARSE}-<density>",
          OPTIM: f"{OPTIM}-<{'|'.join(OPTIM_COMPRESSORS)}>[-overlap][-v<K>]"}
_BARE = "|".join(b for b in ALL_BASES if b not in _PARAM)
_METHOD_RE = re.compile(
    rf"^(?P<base>{_BARE}|{POWERSGD}-(?P<rank>[0-9]+)"
    rf"|{SPARSE}-(?P<density>[0-9.eE+-]+?)|{OPTIM}-(?P<optim>[a-z0-9]+?)(?P<overlap>-overlap)?(?:-v(?P<variance>[0-9]+))?)"
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
        return self.compressor != EXACT

    @property
    def kind(self) -> Optional[str]:
        """The method table's kind of :attr:`compressor` ("block", "sparse",
        "cast", "exact"); None for the harness's own (powersgd, auto).

        >>> parse_method("int4").kind, parse_method("plain").kind, parse_method("powersgd-1").kind
        ('block', 'exact', None)
        """
        return spec.method_spec(self.compressor).kind if self.compressor in spec.METHODS else None


def _or(names: Sequence[str]) -> str:
    """``a, b or c``."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def vocabulary(bases: Sequence[str], suffixes: bool = False) -> str:
    """The names ``bases`` allow, for help texts and errors.

    >>> vocabulary(ALLREDUCE_BASES)
    'plain, fp16, bf16, onebit, topk-<density>, int8 or int4'
    """
    text = _or([_PARAM.get(b, b) for b in bases])
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
        ValueError: unknown method 'onebit-noef': expected plain, fp16, bf16, onebit, topk-<density>, int8 or int4
    """
    name = name.strip()
    m = _METHOD_RE.match(name)
    base = None if m is None else m.group("base").split("-")[0]
    has_suffix = m is not None and bool(m.group("noef") or m.group("backend"))
    if m is None or base not in bases or (has_suffix and not suffixes):
        raise ValueError(f"unknown method {name!r}: expected {vocabulary(bases, suffixes)}")
    rounding = "stochastic" if m.group("sr") else "nearest"
    rounds = m.group("optim") if base == OPTIM else base
    if m.group("sr") and rounds not in spec.ROUNDING_METHODS:
        raise ValueError(f"method {name!r}: -sr (stochastic rounding) applies to "
                         f"{' and '.join(spec.ROUNDING_METHODS)} only")
    if has_suffix and base not in SUFFIX_BASES:
        raise ValueError(f"method {name!r}: -noef and -backend apply to {_or(SUFFIX_BASES)} only")
    if base in (PLAIN, ALLREDUCE):
        return Method(name, "ddp", EXACT)
    if base in spec.CAST_METHODS:
        return Method(name, "torch", base)
    if base == POWERSGD:
        rank = int(m.group("rank"))
        if rank < 1:
            raise ValueError(f"method {name!r}: the PowerSGD rank must be >= 1")
        return Method(name, "torch", POWERSGD, True, rank=rank)
    if base == OPTIM:
        comp = m.group("optim")
        if comp not in OPTIM_COMPRESSORS:
            raise ValueError(f"method {name!r}: the optimizer's compressor must be one of "
                             f"{', '.join(OPTIM_COMPRESSORS)}")
        every = None if m.group("variance") is None else int(m.group("variance"))
        return Method(name, "optim", comp, True, overlap=bool(m.group("overlap")), rounding=rounding,
                      variance_every=every)
    entry = "backend" if m.group("backend") or base == AUTO else "hook"
    ef = not m.group("noef")
    if base != SPARSE:
        return Method(name, entry, base, ef, rounding=rounding)
    try:
        density = float(m.group("density"))
    except ValueError:
        raise ValueError(f"method {name!r}: bad density {m.group('density')!r}") from None
    if not 0.0 < density <= 1.0:
        raise ValueError(f"method {name!r}: density must be in (0, 1], got {density}")
    return Method(name, entry, SPARSE, ef, density=density)
