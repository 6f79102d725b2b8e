"""Method names, the same in every benchmark, its command line and its JSON.

Grammar: ``<base>[-sr][-noef][-backend]``, base one of

* ``plain`` / ``allreduce``: torch's own float32 all-reduce (no compression);
* a cast of the method table (e.g. ``bf16``): a cast to 16 bits and back;
* ``powersgd-<rank>``: PyTorch's PowerSGD hook of that rank;
* a method of the table that keeps residuals (``spec.EF_METHODS``; the
  sparse one as ``topk-<density>``) and ``auto``: pycomm's compressors (a
  quant row such as ``int8``: block quantization with an absmax scale per
  block; ``auto``: the method a calibration predicts fastest per size);
* ``optim-<compressor>``, the compressor a block codec (e.g.
  ``optim-onebit``, ``optim-int8``): no gradient compression at all, but
  pycomm's compressed-momentum optimizer
  (:mod:`pycomm.optim`: OneBitAdam for AdamW, OneBitSGD for momentum SGD)
  all-reducing its momentum with that compressor after an exact warm-up
  (``optim-<compressor>-overlap``: sent from DDP's hook per bucket while
  backward runs, ``attach(model, overlap=True)``; ``-v<K>`` after them:
  OneBitAdam updates its variance from an exact average every K steps,
  ``variance_update_every=K``, 0 for never);
* ``diloco-H<H>[-F<F>][-d<tau>][-<codec>]`` (``diloco-H16``,
  ``diloco-H16-int4``, ``diloco-H32-F4-d1-int4``): no gradient
  communication at all, but :class:`pycomm.optim.DiLoCo` around the inner
  optimizer: every rank trains its own replica and the pseudo-gradients are
  averaged every H steps (F fragments, staggered; each applied tau steps
  after its send), exactly or with a block codec or a cast
  (:data:`DILOCO_CODECS`; error feedback on for the codecs that keep
  residuals, as for the DDP hook, where ``DiLoCo`` itself defaults to the
  method's own, ``spec.error_feedback_for``: off for int8, for one);
  ``-rot`` after the codec sends the pseudo-gradient in a randomized
  Hadamard basis (``rotate=True``), ``-upd`` sends the outer update of a
  per-replica momentum instead (``compress_update=True``);
* ``torchft-diloco-H<H>`` (``torchft-diloco-H16``): torchft's own DiLoCo
  (``torchft.local_sgd.DiLoCo``, a context manager around the inner
  optimizer) over one torchft replica per rank, its pseudo-gradients
  averaged exactly every H steps (torchft's quantized sync needs an
  accelerator: not offered);

``-sr`` rounds stochastically (``rounding="stochastic"``) where the
compressor rounds (``spec.ROUNDING_METHODS``, e.g. ``int8``, ``optim-int8``,
``diloco-...-int8``), ``-noef`` turns
error feedback off (the DDP hook's default is on; ``pycomm-bench fsdp``,
whose library default is off, takes ``-ef`` instead: one rule, a suffix
names the departure from the entry point's default, and the suffix that
restates it is refused by :func:`pycomm_bench.sweep.error_feedback_suffix`)
and ``-backend`` runs the compression in
a ``"pycomm"`` process group instead of the hook (both for
:data:`SUFFIX_BASES`: the methods that keep residuals, and auto; not for
``optim-*`` or ``diloco-*``; ``-noef`` also for a ``diloco-*`` codec that
keeps residuals). Each benchmark accepts the
part of it that it can run (:data:`ALLREDUCE_BASES`, :data:`DDP_BASES`).

Example::

    >>> parse_method("topk-0.01-noef")
    Method(name='topk-0.01-noef', entry='hook', compressor='topk', error_feedback=False, density=0.01, rank=None, overlap=False, rounding='nearest', variance_every=None, sync_every=None, fragments=None, delay=None, rotate=False, compress_update=False)
    >>> parse_method("plain").compressed, parse_method("onebit", bases=ALLREDUCE_BASES).density
    (False, None)
    >>> parse_method("int4-noef"), parse_method("optim-onebit").entry
    (Method(name='int4-noef', entry='hook', compressor='int4', error_feedback=False, density=None, rank=None, overlap=False, rounding='nearest', variance_every=None, sync_every=None, fragments=None, delay=None, rotate=False, compress_update=False), 'optim')
    >>> parse_method("int4-sr-noef").rounding, parse_method("optim-int4-overlap-sr").rounding
    ('stochastic', 'stochastic')
    >>> parse_method("optim-onebit-v16").variance_every, parse_method("optim-onebit").variance_every
    (16, None)
    >>> d = parse_method("diloco-H32-F4-d1-int4-sr-noef")
    >>> d.entry, d.compressor, d.sync_every, d.fragments, d.delay, d.rounding, d.error_feedback
    ('diloco', 'int4', 32, 4, 1, 'stochastic', False)
    >>> parse_method("diloco-H16").compressor, parse_method("diloco-H16").fragments
    ('none', 1)
    >>> u = parse_method("diloco-H16-onebit-rot-upd")
    >>> u.compressor, u.rotate, u.compress_update, parse_method("diloco-H16-rot").compressor
    ('onebit', True, True, 'none')
    >>> t = parse_method("torchft-diloco-H16")
    >>> t.entry, t.compressor, t.sync_every, t.fragments, t.delay
    ('torchft', 'none', 16, 1, 0)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from pycomm.distributed import spec

#: The harness's own names, defined here once; every other base is a method
#: of the table (:data:`pycomm.distributed.spec.METHOD_TABLE`).
#: torch's float32 all-reduce, "plain" in the all-reduce benchmarks and
#: "allreduce" in the training ones (the names their JSON has always used).
PLAIN, ALLREDUCE = "plain", "allreduce"
#: PyTorch's PowerSGD hook, pycomm's per-size choice (a calibrated
#: ``compressor="auto"`` group) and the compressed-momentum optimizer.
POWERSGD, AUTO, OPTIM = "powersgd", spec.AUTO_METHOD, "optim"
#: :class:`pycomm.optim.DiLoCo` (``diloco-H<H>[-F<F>][-d<tau>][-<codec>]``).
DILOCO = "diloco"
#: torchft's DiLoCo (``torchft-diloco-H<H>``), exact: one torchft replica per rank.
TORCHFT = "torchft"
#: The table's sparse method (``topk-<density>``), its block codec of sign
#: bits and its exact all-reduce.
SPARSE = spec.methods(kind="sparse")[0]
ONEBIT = spec.methods(kind="block", bits=1)[0]
EXACT = spec.EXACT_METHOD

#: Every base name (``powersgd``, the sparse method and ``optim`` stand for
#: ``powersgd-<rank>``, ``topk-<density>``, ``optim-<compressor>``).
ALL_BASES = (PLAIN, ALLREDUCE, *spec.CAST_METHODS, POWERSGD, *spec.EF_METHODS, AUTO, OPTIM, DILOCO, TORCHFT)
#: What ``pycomm-bench allreduce`` times (a pycomm group per compressor, no suffixes).
ALLREDUCE_BASES = (PLAIN, *spec.CAST_METHODS, *spec.EF_METHODS)
#: What ``pycomm-bench ddp`` trains with.
DDP_BASES = (ALLREDUCE, *spec.CAST_METHODS, POWERSGD, *spec.EF_METHODS, AUTO, OPTIM, DILOCO, TORCHFT)
#: Bases that take ``-noef`` / ``-backend``: the methods that keep residuals, and auto.
SUFFIX_BASES = (*spec.EF_METHODS, AUTO)
#: What ``optim-<compressor>`` may name: the momentum's compressor, a block codec.
OPTIM_COMPRESSORS = spec.BLOCK_METHODS
#: What a ``diloco-*`` name may end in (without one: the exact average):
#: a block codec, the sparse method with its density, or a cast.
DILOCO_CODECS = (*spec.BLOCK_METHODS, SPARSE, *spec.CAST_METHODS)

_PARAM_CODEC = {SPARSE: f"{SPARSE}-<density>"}
_PARAM = {POWERSGD: f"{POWERSGD}-<rank>", SPARSE: f"{SPARSE}-<density>",
          OPTIM: f"{OPTIM}-<{'|'.join(OPTIM_COMPRESSORS)}>[-overlap][-v<K>]",
          DILOCO: f"{DILOCO}-H<H>[-F<F>][-d<tau>][-<{'|'.join(_PARAM_CODEC.get(c, c) for c in DILOCO_CODECS)}>]"
                  "[-rot][-upd]",
          TORCHFT: f"{TORCHFT}-{DILOCO}-H<H>"}
_BARE = "|".join(b for b in ALL_BASES if b not in _PARAM)
_METHOD_RE = re.compile(
    rf"^(?P<base>{_BARE}|{POWERSGD}-(?P<rank>[0-9]+)"
    rf"|{SPARSE}-(?P<density>[0-9.eE+-]+?)|{OPTIM}-(?P<optim>[a-z0-9]+?)(?P<overlap>-overlap)?(?:-v(?P<variance>[0-9]+))?"
    # The codec is any word but a suffix, so that a wrong one gets its own error.
    rf"|{DILOCO}-H(?P<sync>[0-9]+)(?:-F(?P<fragments>[0-9]+))?(?:-d(?P<delay>[0-9]+))?"
    r"(?:-(?!(?:sr|noef|backend|rot|upd)(?:-|$))(?P<codec>[a-z0-9]+)(?:-(?P<cdensity>[0-9][0-9.eE+-]*?))?)?"
    r"(?P<rot>-rot)?(?P<upd>-upd)?"
    rf"|{TORCHFT}-{DILOCO}-H(?P<tsync>[0-9]+))"
    r"(?P<sr>-sr)?(?P<noef>-noef)?(?P<backend>-backend)?$"
)


@dataclass(frozen=True)
class Method:
    """One way of all-reducing gradients, parsed from its name."""

    name: str
    #: "ddp" (no hook: torch's own all-reduce), "torch" (PyTorch's hooks),
    #: "hook" (pycomm's hook over the Gloo group), "backend" (a "pycomm"
    #: group), "optim" (pycomm's compressed-momentum optimizer), "diloco"
    #: (:class:`pycomm.optim.DiLoCo`, no gradient communication), "torchft"
    #: (torchft's DiLoCo, exact, one torchft replica per rank)
    entry: str
    #: "none", a cast, "powersgd", a method that keeps residuals or "auto"
    #: (for "optim": the momentum's compressor; for "diloco": the
    #: pseudo-gradient's, "none" for the exact average)
    compressor: str = "none"
    error_feedback: bool = False
    density: Optional[float] = None
    rank: Optional[int] = None
    #: "optim" only: the momenta sent from DDP's hook, per bucket, during
    #: backward (``attach(model, overlap=True)``)
    overlap: bool = False
    #: a compressor that rounds (``spec.ROUNDING_METHODS``): "nearest" or
    #: "stochastic" (``-sr``)
    rounding: str = "nearest"
    #: "optim" with AdamW only: OneBitAdam's ``variance_update_every``
    #: (``-v<K>``); None: the optimizer's default
    variance_every: Optional[int] = None
    #: "diloco" and "torchft" only: H, F and tau of :class:`pycomm.optim.DiLoCo`
    #: (``sync_every``, ``fragments``, ``delay``)
    sync_every: Optional[int] = None
    fragments: Optional[int] = None
    delay: Optional[int] = None
    #: "diloco" only: :class:`pycomm.optim.DiLoCo`'s ``rotate`` (``-rot``)
    #: and ``compress_update`` (``-upd``)
    rotate: bool = False
    compress_update: bool = False

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

    >>> vocabulary(ALLREDUCE_BASES)  # doctest: +ELLIPSIS
    'plain, fp16, bf16, onebit, topk-<density>, int8, ...'
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
        >>> parse_method("onebit-noef", bases=ALLREDUCE_BASES, suffixes=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown method 'onebit-noef': expected plain, fp16, bf16, onebit, topk-<density>, ...
    """
    name = name.strip()
    m = _METHOD_RE.match(name)
    base = None if m is None else m.group("base").split("-")[0]
    has_suffix = m is not None and bool(m.group("noef") or m.group("backend"))
    if m is None or base not in bases or (has_suffix and not suffixes):
        raise ValueError(f"unknown method {name!r}: expected {vocabulary(bases, suffixes)}")
    rounding = "stochastic" if m.group("sr") else "nearest"
    if base == DILOCO:
        return _diloco(name, m)
    if base == TORCHFT:
        return _torchft(name, m)
    rounds = m.group("optim") if base == OPTIM else base
    if m.group("sr") and rounds not in spec.ROUNDING_METHODS:
        raise ValueError(f"method {name!r}: -sr (stochastic rounding) applies to "
                         f"{_or(spec.ROUNDING_METHODS)} only")
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
    return Method(name, entry, SPARSE, ef, density=_density(name, m.group("density")))


def _density(name: str, text: Optional[str]) -> float:
    """The top-k density of method ``name``, written ``text``; ValueError
    naming the method when it is missing, not a number or not in (0, 1].

    >>> _density("topk-0.01", "0.01"), parse_method("diloco-H16-topk-0.02").density
    (0.01, 0.02)
    """
    if text is None:
        raise ValueError(f"method {name!r}: {SPARSE} needs a density: {SPARSE}-<density>, e.g. {SPARSE}-0.01")
    try:
        density = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"method {name!r}: bad density {text!r}") from None
    if not 0.0 < density <= 1.0:
        raise ValueError(f"method {name!r}: density must be in (0, 1], got {density}")
    return density


def _diloco(name: str, m: "re.Match[str]") -> Method:
    """The :class:`Method` of a ``diloco-*`` name matched by ``m``, its
    settings checked as :class:`pycomm.optim.DiLoCo` checks them (here, at
    the command line, instead of inside every rank).

    >>> parse_method("diloco-H16-F3")
    Traceback (most recent call last):
    ...
    ValueError: method 'diloco-H16-F3': F=3 must divide H=16 (one fragment every H/F steps)
    >>> parse_method("diloco-H16-fp16-noef")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: method 'diloco-H16-fp16-noef': -noef applies to a codec that keeps residuals (onebit, int8, ...)
    """
    codec = m.group("codec") or EXACT
    if codec != EXACT and codec not in DILOCO_CODECS:
        raise ValueError(f"method {name!r}: the pseudo-gradient's codec must be one of "
                         f"{_or([_PARAM_CODEC.get(c, c) for c in DILOCO_CODECS])} "
                         f"(or none, for the exact average), got {codec!r}")
    density = _density(name, m.group("cdensity")) if codec == SPARSE else None
    if m.group("cdensity") is not None and codec != SPARSE:
        raise ValueError(f"method {name!r}: only {SPARSE} takes a density")
    sync, fragments = int(m.group("sync")), int(m.group("fragments") or 1)
    delay = int(m.group("delay") or 0)
    if sync < 1 or fragments < 1:
        raise ValueError(f"method {name!r}: H and F must be >= 1")
    if sync % fragments:
        raise ValueError(f"method {name!r}: F={fragments} must divide H={sync} (one fragment every H/F steps)")
    if delay >= sync // fragments:
        raise ValueError(f"method {name!r}: d={delay} must be less than H/F = {sync // fragments} "
                         f"(one sync in flight at a time)")
    if m.group("backend"):
        raise ValueError(f"method {name!r}: -backend does not apply to diloco (DiLoCo runs its own engine group)")
    if m.group("rot") and codec not in (EXACT, *spec.BLOCK_METHODS):
        raise ValueError(f"method {name!r}: -rot (rotate) applies to the exact average and the block codecs "
                         f"({_or(spec.BLOCK_METHODS)}) only")
    if m.group("sr") and codec not in spec.ROUNDING_METHODS:
        raise ValueError(f"method {name!r}: -sr (stochastic rounding) applies to "
                         f"{_or(spec.ROUNDING_METHODS)} only")
    keeps = codec in spec.EF_METHODS
    if m.group("noef") and not keeps:
        raise ValueError(f"method {name!r}: -noef applies to a codec that keeps residuals "
                         f"({_or([c for c in DILOCO_CODECS if c in spec.EF_METHODS])})")
    return Method(name, DILOCO, codec, keeps and not m.group("noef"), density=density,
                  rounding="stochastic" if m.group("sr") else "nearest",
                  sync_every=sync, fragments=fragments, delay=delay,
                  rotate=bool(m.group("rot")), compress_update=bool(m.group("upd")))


def _torchft(name: str, m: "re.Match[str]") -> Method:
    """The :class:`Method` of a ``torchft-diloco-H<H>`` name matched by ``m``:
    torchft's DiLoCo, exact (its quantized sync runs on an accelerator
    only), one fragment, no delay; no suffix applies.

    >>> parse_method("torchft-diloco-H16-noef")
    Traceback (most recent call last):
    ...
    ValueError: method 'torchft-diloco-H16-noef': torchft-diloco-H<H> takes no suffix (-sr, -noef, -backend): its sync is exact
    """
    if m.group("sr") or m.group("noef") or m.group("backend"):
        raise ValueError(f"method {name!r}: {_PARAM[TORCHFT]} takes no suffix (-sr, -noef, -backend): "
                         f"its sync is exact")
    sync = int(m.group("tsync"))
    if sync < 1:
        raise ValueError(f"method {name!r}: H must be >= 1")
    return Method(name, TORCHFT, EXACT, sync_every=sync, fragments=1, delay=0)
