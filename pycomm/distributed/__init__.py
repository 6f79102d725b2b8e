"""pycomm.distributed: the ``"pycomm"`` torch.distributed backend.

The backend wraps a real one (Gloo on CPU, NCCL on CUDA) and compresses
float SUM/AVG all-reduces of at least ``min_compress_numel`` elements
(docs/allreduce.md); every other collective, and every small, integer or
MAX/MIN/PRODUCT all-reduce, goes to the inner backend unchanged.

Example (each of 2 processes)::

    import pycomm.distributed as pd
    pd.init_process_group(compressor="onebit", backend="gloo",
                          init_method="tcp://127.0.0.1:29500", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(model)  # buckets compressed
    pd.all_reduce(grad, key=0)        # compressed, error feedback kept under key 0
    dist.all_reduce(loss)             # a small tensor: exact, as always

Importing this module registers the backend, so
``dist.init_process_group("pycomm", pg_options=pd.PycommOptions(...))`` works
too.
"""

from __future__ import annotations

from datetime import timedelta

import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import _ext
from .checks import all_reduce_max, agree, check_residual_fields
from ..compressors.base import INT64_MAX, check_density, check_positive_int
from ..compressors.plugin import options_json
from ..wire import MAX_BLOCK_SIZE
from ..compressors.quant import MASK32
from .spec import (AUTO_METHOD, CHECK_MODES, DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_NUMEL_BY_INNER, GROUP_METHODS,
                   ROUNDING_METHODS, ROUNDINGS, check_key, check_mode, is_plugin)

BACKEND_NAME = "pycomm"
log = logging.getLogger(__name__)


@dataclass
class PycommOptions:
    """Configuration of a ``"pycomm"`` process group.

    ``compressor``: a method ("onebit", "int8", "int4", "topk", "fp16",
    "bf16", "none" (forward all): ``spec.METHODS``), "auto", or the name of a
    registered compressor (:func:`pycomm.register_compressor`), built with
    ``compressor_options``.
    ``inner``: the wrapped backend, "gloo" or "nccl" (default: nccl when CUDA
    is available, else gloo). ``chunk_numel``: pipelining granularity (a
    chunk is compressed while the previous one is on the wire); None: the
    inner backend's default (``spec.DEFAULT_CHUNK_NUMEL_BY_INNER``: 2^20
    over Gloo, 2^26 over NCCL), which ``options_of(group)`` reports.
    ``block_size``: elements per scale of the block codecs (onebit, int8,
    int4), a multiple of 32; None: each one's default
    (``spec.DEFAULT_BLOCK_SIZE``: 2048 for onebit, 256 for int8/int4).
    ``check_calls``: when the ranks compare their compressed calls (numel,
    dtype, op, key, settings), so that a mismatch raises on every rank
    instead of hanging: "first" (first use of each key and of each keyless
    (numel, dtype, op)), "every" (debugging; also what ``PYCOMM_DEBUG=detail``
    in the environment selects) or "off".
    ``hierarchy``: "auto" (nodes of ``LOCAL_WORLD_SIZE`` ranks, as torchrun
    sets it; flat when unset or one node), "flat", or the number of ranks per
    node (ranks ``[k L, (k+1) L)`` form node ``k``): docs/hierarchy.md.
    ``compressor="auto"`` picks a method per tensor size from a calibration
    (docs/auto.md), measured when the group is created or read from
    ``calibration`` (a JSON path; written there when measured).
    ``rounding``: how int8/int4 round, "nearest" (half to even) or
    "stochastic" (unbiased: up with probability equal to the fraction),
    the random numbers drawn from ``seed`` (in [0, 2**32)), the call's key
    and its count of calls (saved with the residuals), the rank and the
    chunk (``spec.rounding_seed``): a rerun or a resumed run draws the same
    ones. Only int8/int4 round: "stochastic" needs one of them or "auto".
    """

    compressor: str = "onebit"
    inner: Optional[str] = None
    min_compress_numel: int = 65536
    chunk_numel: Optional[int] = None
    block_size: Optional[int] = None
    density: float = 0.01
    approx: bool = True
    check_calls: str = "first"
    hierarchy: Union[str, int] = "auto"
    calibration: Optional[str] = None
    compressor_options: Optional[Dict[str, Any]] = None
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self) -> None:
        checked = check_options(**{f.name: getattr(self, f.name) for f in fields(self)})
        self.density = checked["density"]

    @property
    def rounding_seed(self) -> int:
        """The engine's rounding setting: -1 to nearest, else the seed."""
        return self.seed if self.rounding == "stochastic" else -1


def check_options(**settings: Any) -> Dict[str, Any]:
    """Check any of :class:`PycommOptions`' fields, as the group checks them
    (the one place they are checked: the DDP hook, the optimizers and DiLoCo
    call it on the settings they take): raises naming the first bad one;
    returns ``settings`` with ``density`` normalized. ``rounding`` is
    checked against ``compressor`` when both are given.

    >>> check_options(block_size=256, density=0.05)
    {'block_size': 256, 'density': 0.05}
    >>> check_options(block_size=100)
    Traceback (most recent call last):
    ...
    ValueError: block_size must be a multiple of 32, got 100
    """
    unknown = sorted(set(settings) - {f.name for f in fields(PycommOptions)})
    if unknown:
        raise TypeError(f"unknown options {unknown}; the options are {[f.name for f in fields(PycommOptions)]}")
    out = dict(settings)
    get = settings.get
    compressor = get("compressor")
    if "compressor" in settings:
        if not isinstance(compressor, str) or (compressor not in GROUP_METHODS and not is_plugin(compressor)):
            raise ValueError(f"compressor must be one of {list(GROUP_METHODS)} or a registered compressor "
                             f"(pycomm.register_compressor), got {compressor!r}")
        if is_plugin(compressor):
            options_json(compressor, get("compressor_options"))  # checks them, naming the compressor
        elif get("compressor_options"):
            raise ValueError(f"compressor_options are for registered compressors; {compressor!r} "
                             f"takes its settings as arguments (block_size, density, approx)")
    if get("inner") not in (None, "gloo", "nccl"):
        raise ValueError(f"inner must be 'gloo', 'nccl' or None, got {get('inner')!r}")
    # The engine holds these in int64: larger values would wrap.
    if "min_compress_numel" in settings:
        check_positive_int("min_compress_numel", settings["min_compress_numel"], INT64_MAX)
    if get("chunk_numel") is not None:
        check_positive_int("chunk_numel", settings["chunk_numel"], INT64_MAX)
    if get("block_size") is not None:
        check_positive_int("block_size", settings["block_size"], MAX_BLOCK_SIZE)
        if settings["block_size"] % 32:
            raise ValueError(f"block_size must be a multiple of 32, got {settings['block_size']}")
    if "density" in settings:
        out["density"] = check_density(settings["density"])
    if "approx" in settings and not isinstance(settings["approx"], bool):
        raise TypeError(f"approx must be a bool, got {settings['approx']!r}")
    if "check_calls" in settings and settings["check_calls"] not in CHECK_MODES:
        raise ValueError(f"check_calls must be one of {CHECK_MODES}, got {settings['check_calls']!r}")
    hierarchy = get("hierarchy", "auto")
    if isinstance(hierarchy, bool) or not (
        hierarchy in ("auto", "flat") or (isinstance(hierarchy, int) and hierarchy >= 1)
    ):
        raise ValueError(f"hierarchy must be 'auto', 'flat' or a positive int (ranks per node), got {hierarchy!r}")
    if get("calibration") is not None and not isinstance(settings["calibration"], (str, os.PathLike)):
        raise TypeError(f"calibration must be a path or None, got {settings['calibration']!r}")
    if "rounding" in settings:
        if settings["rounding"] not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {settings['rounding']!r}")
        # "auto" may choose a method that rounds.
        if (settings["rounding"] == "stochastic" and compressor is not None
                and compressor not in ROUNDING_METHODS + (AUTO_METHOD,)):
            raise ValueError(f"rounding='stochastic' is for the {', '.join(ROUNDING_METHODS)} methods "
                             f"(or 'auto'); {compressor!r} does not round")
    seed = get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    return out


def ranks_per_node(hierarchy: Union[str, int], world_size: int, env: Optional[Dict[str, str]] = None) -> int:
    """Ranks per node for ``hierarchy`` in a world of ``world_size``; 1 means flat.

    "auto" reads ``LOCAL_WORLD_SIZE`` (torchrun) and falls back to flat, with a
    warning, where it cannot form equal nodes; an explicit number that does
    not divide the world raises. One node (or one rank per node) is flat:
    there is no slow link to save.

    >>> ranks_per_node(2, 4), ranks_per_node("flat", 4), ranks_per_node("auto", 8, {"LOCAL_WORLD_SIZE": "4"})
    (2, 1, 4)
    """
    env = os.environ if env is None else env
    if hierarchy == "flat":
        return 1
    if hierarchy == "auto":
        text = env.get("LOCAL_WORLD_SIZE", "")
        if not text:
            return 1
        try:
            local = int(text)
        except ValueError:
            log.warning("LOCAL_WORLD_SIZE=%r is not a number: flat all-reduce", text)
            return 1
        if local < 1 or world_size % local:
            log.warning("LOCAL_WORLD_SIZE=%d does not divide the world size %d: flat all-reduce", local, world_size)
            return 1
    else:
        local = int(hierarchy)
        if world_size % local:
            raise ValueError(f"hierarchy={local} ranks per node does not divide the world size {world_size}")
    return 1 if local in (1, world_size) else local


def _create_backend(dist_opts: Any, options: Optional[PycommOptions]) -> Any:
    """Backend factory called by torch.distributed for the "pycomm" backend."""
    if _ext.why_no_cpu_ops() is not None:
        raise RuntimeError(_ext.why_no_cpu_ops())
    if options is None:
        options = PycommOptions()
    if not isinstance(options, PycommOptions):
        raise TypeError(
            f"pg_options of a pycomm group must be a pycomm.distributed.PycommOptions, got {type(options).__name__}"
        )
    inner_name = options.inner or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, size, store, timeout = dist_opts.group_rank, dist_opts.group_size, dist_opts.store, dist_opts.timeout

    def make(sub_store: Any, sub_rank: int, sub_size: int) -> Any:
        if inner_name == "gloo":
            return dist.ProcessGroupGloo(sub_store, sub_rank, sub_size, timeout)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub_store, sub_rank, sub_size, nccl_opts)

    inner, device = make(store, rank, size), "cuda" if inner_name == "nccl" else "cpu"
    _agree_options(inner, options, device)
    local = _agreed_ranks_per_node(inner, options.hierarchy, rank, size, device)
    intra = inter = None
    if local > 1:
        node, local_rank = divmod(rank, local)
        intra = make(dist.PrefixStore(f"pycomm-intra-{node}", store), local_rank, local)
        inter = make(dist.PrefixStore(f"pycomm-inter-{local_rank}", store), node, size // local)
    # The call check's descriptors travel in a Gloo group of their own: where
    # one rank checks its call and another skips the check (docs/reliability.md,
    # section 2), each then waits in its own group until the timeout, instead
    # of Gloo aborting the process that receives the other's larger message.
    check = make(dist.PrefixStore("pycomm-check", store), rank, size) if inner_name == "gloo" and size > 1 else None
    return _compressed_backend(inner, options, device, intra, inter, check)


def _agree_options(inner: Any, options: PycommOptions, device: str) -> None:
    """The settings the call check does not compare, compared over the
    inner backend (the group does not exist yet): a collective."""
    shared = {name: getattr(options, name) for name in _SHARED_OPTIONS}
    agree("the pycomm group", dict(shared, check_calls=check_mode(options.check_calls)), inner, device,
          fix="Every rank must create it with the same options")


def _compressed_backend(inner: Any, options: PycommOptions, device: str, intra: Any = None,
                        inter: Any = None, check: Any = None) -> Any:
    """The engine over ``inner`` (and the node groups of a hierarchy)."""
    backend = _ext._C.CompressedBackend(
        inner,
        options.compressor,
        options.min_compress_numel,
        options.chunk_numel or DEFAULT_CHUNK_NUMEL_BY_INNER["nccl" if device == "cuda" else "gloo"],
        options.block_size or 0,  # 0: each method's default
        options.density,
        options.approx,
        CHECK_MODES.index(check_mode(options.check_calls)),
        intra,
        inter,
        options_json(options.compressor, options.compressor_options) if is_plugin(options.compressor) else "{}",
        options.rounding_seed,
        check,
    )
    if options.compressor == AUTO_METHOD:
        from .auto import calibrate

        calibrate(backend, options, device)
    return backend


#: Settings every rank of a pycomm group must give alike that the call
#: check does not compare (it names the method, chunk, block size, density,
#: approx and rounding of each call): differing, they would hang the group
#: (one rank compresses or checks a call the other forwards) or show only as
#: two hashes (a registered compressor's options). Compared at creation,
#: over the inner backend (the group does not exist yet).
_SHARED_OPTIONS = ("inner", "min_compress_numel", "check_calls", "compressor_options")


def _agreed_ranks_per_node(inner: Any, hierarchy: Union[str, int], rank: int, size: int, device: str) -> int:
    """:func:`ranks_per_node`, the same on every rank: explicit settings that
    differ raise everywhere; "auto" with differing environments goes flat."""
    local = ranks_per_node(hierarchy, size)
    if size == 1:
        return 1
    # torchrun numbers the ranks of a node contiguously; anything else
    # (LOCAL_RANK that is not rank % L) is not a layout this can shard.
    local_rank = os.environ.get("LOCAL_RANK")
    contiguous = local == 1 or local_rank is None or hierarchy != "auto" or local_rank == str(rank % local)
    t = all_reduce_max(inner, torch.tensor([local, -local, 0 if contiguous else 1], dtype=torch.int64,
                                           device=device))
    hi, lo, bad = int(t[0]), -int(t[1]), int(t[2])
    if hi == lo and not bad:
        return local
    if hierarchy != "auto":
        raise ValueError(f"ranks disagree on hierarchy: ranks per node from {lo} to {hi}")
    if rank == 0:
        log.warning("ranks disagree on their node layout (LOCAL_WORLD_SIZE %d..%d%s): flat all-reduce",
                    lo, hi, ", LOCAL_RANK not rank % LOCAL_WORLD_SIZE" if bad else "")
    return 1


def register_backend() -> None:
    """Register "pycomm" with torch.distributed (done on import; idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


register_backend()


def init_process_group(
    compressor: str = "onebit",
    backend: Optional[str] = None,
    *,
    min_compress_numel: int = 65536,
    chunk_numel: Optional[int] = None,
    block_size: Optional[int] = None,
    density: float = 0.01,
    approx: bool = True,
    check_calls: str = "first",
    hierarchy: Union[str, int] = "auto",
    calibration: Optional[str] = None,
    compressor_options: Optional[Dict[str, Any]] = None,
    rounding: str = "nearest",
    seed: int = 0,
    **kwargs: Any,
) -> None:
    """Initialize the default process group as a compressing wrapper of
    ``backend`` ("gloo" or "nccl"; default by device). Other keyword
    arguments go to :func:`torch.distributed.init_process_group`. The
    settings are those of :class:`PycommOptions`.

    Example::

        pd.init_process_group(compressor="topk", density=0.01, backend="gloo",
                              init_method="env://")
        pd.init_process_group(compressor="auto", hierarchy=4, init_method="env://")
        pd.init_process_group(compressor="int4", rounding="stochastic", init_method="env://")
    """
    if "pg_options" in kwargs:
        raise TypeError("pass the compressor settings as arguments, not pg_options")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None (by device), got {backend!r}")
    options = PycommOptions(compressor, backend, min_compress_numel, chunk_numel, block_size, density, approx,
                            check_calls, hierarchy, calibration, compressor_options, rounding, seed)
    dist.init_process_group(backend=BACKEND_NAME, pg_options=options, **kwargs)


def wrap(group: Optional[dist.ProcessGroup] = None, compressor: str = "onebit", **settings: Any) -> dist.ProcessGroup:
    """A new compressing group over the same ranks as ``group`` (default: the
    world). As with ``dist.new_group``, every rank of the world must call
    it, in one order: for a subgroup, its ranks alone cannot (make its
    pycomm group up front instead, ``dist.new_group(ranks, backend="pycomm",
    pg_options=PycommOptions(...))``, on every rank, for every subgroup).

    Example::

        pg = pd.wrap(compressor="onebit", block_size=1024)
        pd.all_reduce(t, key=0, group=pg)
    """
    _check_group(group)
    allowed = [f.name for f in fields(PycommOptions) if f.name != "compressor"]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"wrap() got unknown settings {unknown}; allowed: {allowed}")
    group = group or dist.group.WORLD
    inner = settings.pop("inner", None) or dist.get_backend(group)
    if inner == BACKEND_NAME:
        # A pycomm group: the new one wraps the same kind of backend it does.
        wrapped = _backend_of(group, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        inner = wrapped.inner.name() if wrapped is not None else inner
    if inner not in ("gloo", "nccl"):
        raise ValueError(f"can wrap a gloo, nccl or pycomm group, this one is {inner!r}")
    options = PycommOptions(compressor=compressor, inner=inner, **settings)
    ranks = dist.get_process_group_ranks(group)
    # The user's timeout, not torch's default (30 minutes): a rank that
    # disagrees then fails the call when the user said it should.
    return dist.new_group(ranks=ranks, backend=BACKEND_NAME, pg_options=options, timeout=timeout_of(group))


def wrap_backend(group: dist.ProcessGroup, compressor: str = "onebit", device: str | torch.device = "cpu",
                 **settings: Any) -> dist.ProcessGroup:
    """A compressing group that runs over ``group``'s own backend on
    ``device`` (Gloo or NCCL) and its connections, for a group that
    torch.distributed's registry does not hold, so that :func:`wrap` (which
    makes new connections with ``dist.new_group`` among ranks of the default
    group) cannot: e.g. the inner group of torchft's ``ProcessGroupGloo``,
    which torchft replaces at every change of its quorum
    (:mod:`pycomm.integrations.torchft`). Every rank of ``group`` calls it,
    alike (the ranks compare the settings over ``group``: a collective).
    The new group lives as long as it is referenced; dropping it releases
    the engine (its thread and residuals), not ``group``. Flat only: a
    hierarchy's node groups need a store that such a group does not give.

    Example::

        inner = torchft_group.parent          # after torchft configured it
        pg = pd.wrap_backend(inner, compressor="int4")
        pd.all_reduce(t, key=0, group=pg, op="avg")
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    device = _device(device)
    allowed = [f.name for f in fields(PycommOptions) if f.name not in ("compressor", "inner", "hierarchy")]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"wrap_backend() got unknown settings {unknown}; allowed: {allowed} (it wraps the group's "
                        f"own backend, flat)")
    try:
        inner = group._get_backend(device)
    except RuntimeError:
        raise ValueError(f"group has no backend on {device.type}") from None
    if _ext._C is not None and isinstance(inner, _ext._C.CompressedBackend):
        raise ValueError("group is a pycomm group already: use it as it is")
    name = inner.name()
    if name not in ("gloo", "nccl"):
        raise ValueError(f"can wrap a gloo or nccl backend, this group's on {device.type} is {name!r}")
    if _ext.why_no_cpu_ops() is not None:
        raise RuntimeError(_ext.why_no_cpu_ops())
    options = PycommOptions(compressor=compressor, inner=name, hierarchy="flat", **settings)
    _agree_options(inner, options, device.type)
    backend = _compressed_backend(inner, options, device.type)
    out = dist.ProcessGroup(group.rank(), group.size())
    out._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, backend)
    return out


def timeout_of(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """The timeout ``group``'s collectives run with (the inner backend's for
    a pycomm group); None when torch does not say (its default applies).

    >>> timeout_of(None) is None or isinstance(timeout_of(None), timedelta)
    True
    """
    if not dist.is_initialized():
        return None
    group = group or dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:  # noqa: BLE001 - no backend for this device type
            continue
        backend = getattr(backend, "inner", backend)
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _check_group(group: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")


def _device(device: Any) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, e.g. 'cpu' or 'cuda', got {device!r}")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must name a device, e.g. 'cpu' or 'cuda:0', got {device!r}") from exc




def _span(t: torch.Tensor) -> tuple:
    """The bytes ``t`` can touch: (start, end) in its storage."""
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return start, start + (last + 1) * t.element_size()


def _own_shard(whole: torch.Tensor, n: int, group: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
    """This rank's ``n``-element shard of ``whole`` (None if it has none)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if not whole.is_contiguous() or whole.numel() < (rank + 1) * n:
        return None
    return whole.reshape(-1)[rank * n:(rank + 1) * n]


def _check_outside(output: torch.Tensor, input: torch.Tensor, allowed: Optional[torch.Tensor] = None) -> None:
    """Refuse an ``output`` whose memory overlaps ``input``'s, except when
    the smaller of the two is exactly ``allowed``, this rank's own shard of
    the larger (an in-place reduce-scatter or all-gather): the engine reads
    the input while it writes the output, so any other overlap gives a
    wrong result."""
    if output.numel() == 0 or input.numel() == 0 or output.device != input.device:
        return
    (a0, a1), (b0, b1) = _span(output), _span(input)
    if a0 < b1 and b0 < a1:
        small = output if output.numel() <= input.numel() else input
        if allowed is not None and _span(small) == _span(allowed) and small.stride() == allowed.stride():
            return
        raise ValueError("output overlaps input's memory outside this rank's own shard: the collective "
                         "reads the input while it writes the output; give output memory of its own")


def _backend_of(group: Optional[dist.ProcessGroup], device: torch.device) -> Any:
    _check_group(group)
    group = group or dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialized: call pycomm.distributed.init_process_group first")
    try:
        backend = group._get_backend(device)
    except RuntimeError:
        return None
    return backend if isinstance(backend, _ext._C.CompressedBackend) else None


def is_pycomm_group(group: Optional[dist.ProcessGroup] = None, device: str | torch.device = "cpu") -> bool:
    """True when ``group`` (default: the world) runs the pycomm backend on ``device``."""
    _check_group(group)
    device = _device(device)
    if _ext._C is None or not dist.is_initialized():
        return False
    return _backend_of(group, device) is not None


_META = torch.device("meta")


def _pycomm_backend(group: Optional[dist.ProcessGroup], device: torch.device) -> Any:
    # A comparison of devices, not of ``device.type``: building the type's
    # string costs a small call a fifth of a microsecond more.
    if device == _META:
        raise ValueError("the tensor is on the meta device (a shape without data): nothing to communicate; "
                         "materialize it on cpu or cuda first")
    backend = _backend_of(group, device)
    if backend is None:
        raise ValueError(
            "the group does not run the pycomm backend; create one with "
            "pycomm.distributed.init_process_group or pycomm.distributed.wrap"
        )
    return backend


def all_reduce(
    tensor: torch.Tensor,
    key: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    async_op: bool = False,
    compress: bool = True,
):
    """Compressed all-reduce of ``tensor`` in place, whatever its size.

    ``key`` names the error-feedback residual to use (the DDP hook passes the
    bucket index); without a key the call is compressed without error
    feedback, so it can never pick up another tensor's residual. ``op`` is
    "sum" or "avg". ``compress=False`` runs the inner backend's exact
    all-reduce instead (warm-up iterations), in the same order as the
    compressed calls. Returns a Work when ``async_op``.

    Example::

        pd.all_reduce(grad, key=3, op="avg")
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    check_key(key)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, got {async_op!r}")
    if not isinstance(compress, bool):
        raise TypeError(f"compress must be a bool, got {compress!r}")
    backend = _pycomm_backend(group, tensor.device)
    # `wait` by position: a keyword costs the binding a string intern per call.
    if compress:
        work = backend.allreduce_keyed(tensor, key, op == "avg", None, not async_op)
    else:
        if key is not None:
            raise ValueError("an uncompressed all-reduce has no error feedback: pass key=None")
        work = backend.allreduce_plain(tensor, op == "avg", not async_op)
    return work if async_op else None  # a synchronous call was waited for in the binding


def _check_pair(output: Any, input: Any, key: Any, async_op: Any) -> None:
    """The arguments a reduce-scatter and an all-gather share, checked."""
    check_key(key)
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, got {async_op!r}")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    key: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    async_op: bool = False,
):
    """Compressed reduce-scatter: ``output`` receives this rank's shard of
    the sum (or average) of every rank's ``input``, as
    ``dist.reduce_scatter_tensor`` (``input`` holds world size x
    ``output.numel()`` elements; shard ``j`` goes to rank ``j``).

    Each rank compresses the part of its input that goes to each other rank
    with the group's compressor (error feedback under ``key``, kept apart
    from the all-reduce's), and decodes what it receives in rank order
    (docs/allreduce.md, "Reduce-scatter"). Returns a Work when ``async_op``.

    Example::

        shard = torch.empty(grad.numel() // dist.get_world_size())
        pd.reduce_scatter(shard, grad, key=7, op="avg")
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    _check_pair(output, input, key, async_op)
    _check_outside(output, input, _own_shard(input, output.numel(), group))
    work = _pycomm_backend(group, input.device).reduce_scatter_keyed(output, input, key, op == "avg", not async_op)
    return work if async_op else None  # a synchronous call was waited for in the binding


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    key: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
):
    """Compressed all-gather: ``output`` (world size x ``input.numel()``
    elements) receives every rank's ``input``, rank ``j``'s at block ``j``,
    as ``dist.all_gather_into_tensor`` does, but each input crosses the
    wire compressed with the group's compressor and is decoded on arrival
    (docs/allreduce.md, "All-gather"): what an int8 weight all-gather
    (sharded training) sends. Every rank gets the same output. With ``key``,
    each rank's compression error is kept and added to its next input of
    that key (error feedback; kept apart from other collectives'). Returns a
    Work when ``async_op``.

    Example::

        pg = pd.wrap(compressor="int8")
        full = torch.empty(dist.get_world_size() * shard.numel())
        pd.all_gather(full, shard, group=pg)
    """
    _check_pair(output, input, key, async_op)
    _check_outside(output, input, _own_shard(output, input.numel(), group))
    work = _pycomm_backend(group, input.device).all_gather_keyed(output, input, key, not async_op)
    return work if async_op else None  # a synchronous call was waited for in the binding


def error_feedback_state(group: Optional[dist.ProcessGroup] = None, device: str = "cpu",
                         keys: Optional[Sequence[int]] = None) -> Dict[int, dict]:
    """The backend's error-feedback residuals, per key (copies), to save:
    every key's, or only those of ``keys`` (what one owner of keys saves
    when several share a group).

    Example::

        state = pd.error_feedback_state(pg, keys=[3, 4])
    """
    if keys is not None:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
            raise TypeError(f"keys must be a sequence of ints or None, got {keys!r}")
        keys = list(keys)
        for k in keys:
            check_key(k)
    return dict(_pycomm_backend(group, _device(device)).error_feedback_state(keys))


def load_error_feedback_state(state: Dict[int, dict], group: Optional[dist.ProcessGroup] = None, device: str = "cpu",
                              replace: bool = True) -> None:
    """Restore residuals saved with :func:`error_feedback_state`: they
    replace every key's (``replace=True``), or only the keys ``state`` holds
    (``replace=False``: other owners' keys on the group stay). A state that
    does not fit is refused whole, naming the key and field.

    Example::

        pd.load_error_feedback_state(saved, pg, replace=False)
    """
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {replace!r}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be the dict error_feedback_state() returned, got {type(state).__name__}")

    for key, value in state.items():
        check_key(key)
        check_residual_fields(f"state[{key!r}]", value)
    # The engine checks sizes against its layout, refuses non-finite
    # residuals and copies the tensors: nothing is replaced unless all is well.
    _pycomm_backend(group, _device(device)).load_error_feedback_state(dict(state), replace)


def undo_error_feedback(keys: Sequence[int], group: Optional[dist.ProcessGroup] = None, device: str = "cpu") -> None:
    """Put the residuals of ``keys`` back as they were before each key's
    last call, which must have kept new residuals (a finite all-reduce,
    reduce-scatter or all-gather since the last undo or load). For an owner
    of several keys whose calls make up one step: when one call of the step
    is not finite (the engine leaves that key's residuals as they were), it
    undoes the others, so that the skipped step changes no residual. Every
    key is checked before any is changed; a swap, no copy. Call it on every
    rank alike.

    Example::

        pd.undo_error_feedback([3, 4], pg)
    """
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise TypeError(f"keys must be a sequence of ints, got {keys!r}")
    keys = list(keys)
    for k in keys:
        if k is None:
            raise ValueError("keys: None is not a key")
        check_key(k)
    _pycomm_backend(group, _device(device)).undo_error_feedback(keys)


def reset_error_feedback(key: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, device: str = "cpu") -> None:
    """Forget the residuals of ``key`` (all keys when None)."""
    check_key(key)
    _pycomm_backend(group, _device(device)).reset_error_feedback(key)


def options_of(group: Optional[dist.ProcessGroup] = None, device: str = "cpu") -> Dict[str, Any]:
    """The compressor settings of a pycomm group, as a dict (``block_size``:
    the block length its method runs with; None for a method without blocks
    or for "auto", where each method uses its own default)."""
    d = dict(_pycomm_backend(group, _device(device)).config)
    if not d.get("block_size"):
        d["block_size"] = DEFAULT_BLOCK_SIZE.get(d.get("method"))
    seed = d.pop("rounding_seed")
    d["rounding"], d["seed"] = ("stochastic", seed) if seed >= 0 else ("nearest", 0)
    return d


#: The phases of :func:`profile` (seconds), in the order a call passes them.
PROFILE_PHASES = ("queued_s", "check_s", "encode_s", "wire_s", "decode_s", "sync_s", "other_s")


def profile(group: Optional[dist.ProcessGroup] = None, device: str = "cpu", reset: bool = False) -> Dict[str, Any]:
    """Where the engine's worker thread spent its time since the group was
    created or last reset (docs/performance.md): wall seconds summed over
    the calls, per phase, this rank only.

    ``calls``: compressed collectives run; ``collectives``: the inner
    collectives they waited for; ``queued_s``: submitted to started (the
    hand-off to the worker thread, and waiting behind earlier calls);
    ``run_s``: the compressed calls from start to end, split into
    ``check_s`` (the cross-rank call check), ``encode_s`` (compressing, the
    error feedback, building payloads, issuing collectives), ``wire_s``
    (waiting for the inner collectives: the link and the slowest peer),
    ``decode_s`` (decompressing, sums, finiteness), ``sync_s`` (reading the
    call's checks, its tags and finiteness, in one read: on an accelerator
    the wait for the call's kernels) and ``other_s`` (the rest:
    copies to and from other dtypes, allocation). ``forwarded`` /
    ``forwarded_s``: collectives passed to the inner backend unchanged. On an
    accelerator kernels are asynchronous: encode and decode then count
    launches, and the waits include the kernels before them.
    ``reset=True`` starts a new count after reading this one.

    Example::

        pd.profile(reset=True)
        train_a_few_steps()
        p = pd.profile()
        print(p["calls"], p["wire_s"] / p["run_s"])   # the share spent waiting
    """
    if not isinstance(reset, bool):
        raise TypeError(f"reset must be a bool, got {reset!r}")
    d = dict(_pycomm_backend(group, _device(device)).profile(reset))
    d["other_s"] = max(0.0, d["run_s"] - sum(d[p] for p in PROFILE_PHASES[1:-1]))
    return d


def kept_nbytes(group: Optional[dist.ProcessGroup] = None, device: str = "cpu") -> int:
    """Bytes the engine of ``group`` keeps between calls for itself, this
    rank only, not counting residuals (:func:`error_feedback_state`): the
    send buffer of its largest exact or 16-bit call on a CPU above 2^20
    elements (the tensor's size plus one element), and for a 16-bit average
    a 4 MB scratch, kept so that each call does not fault a new buffer's
    pages in (docs/performance.md). 0 until such a call.

    Example::

        pd.all_reduce(torch.ones(1 << 21), group=pg, op="avg")   # pg: compressor="fp16"
        pd.kept_nbytes(pg)   # 2 * (2**21 + 1) + 4 MiB
    """
    return int(_pycomm_backend(group, _device(device)).kept_nbytes())


def calibration(group: Optional[dist.ProcessGroup] = None, device: str = "cpu") -> "Calibration":
    """The calibration of a ``compressor="auto"`` group: what was measured,
    the model, and the method of each size (``print(calibration().format())``).

    Example::

        pd.init_process_group(compressor="auto", init_method="env://")
        print(pd.calibration().format())
        pd.calibration().choose(1 << 20)   # "onebit", "none", ...
    """
    import json

    from .auto import Calibration

    text = _pycomm_backend(group, _device(device)).config["calibration"]
    if not text:
        raise ValueError("this pycomm group is not compressor='auto': it has no calibration")
    return Calibration.from_dict(json.loads(text))


__all__ = [
    "PycommOptions",
    "all_gather",
    "check_options",
    "all_reduce",
    "calibration",
    "error_feedback_state",
    "init_process_group",
    "is_pycomm_group",
    "kept_nbytes",
    "load_error_feedback_state",
    "options_of",
    "profile",
    "reduce_scatter",
    "register_backend",
    "reset_error_feedback",
    "undo_error_feedback",
    "wrap",
    "wrap_backend",
]
