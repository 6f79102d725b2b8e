"""pycomm.fsdp: compressed gradient reduce-scatter (and optionally an int8
weight all-gather) for models sharded with PyTorch FSDP2 (``fully_shard``).

One call, on every rank, after ``fully_shard`` and before the first step::

    from torch.distributed.fsdp import fully_shard
    import pycomm.fsdp

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    comp = pycomm.fsdp.compress(model, "int8", weights="int8")
    ...train as usual...

Every FSDP module gets a :class:`CompressedReduceScatter` (FSDP2's
``set_custom_reduce_scatter``) that runs the engine's keyed reduce-scatter
(``pycomm.distributed.reduce_scatter``, docs/allreduce.md) under a key of
its own, and, with ``weights=``, a :class:`CompressedAllGather` for the
parameter all-gather. Under HSDP (a 2-D mesh) the replicate-dimension
all-reduce runs on a pycomm group too (compressed, without error feedback),
and the shard dimension is compressed or exact (``shard="exact"``).

Error feedback (docs/fsdp.md): off by default for int8/int4/fp16/bf16 (no
residual memory at all), on by default for onebit and topk (which need it),
where the engine keeps, per module, a float32 residual of the module's whole
padded unsharded gradient (and a second one for non-finite rollback): 8
bytes per parameter of the model on every rank. The residuals belong in the
checkpoint: :meth:`FSDPCompression.state_dict` is a per-rank
``torch.distributed.checkpoint`` Stateful.
"""

from __future__ import annotations

import importlib
import io
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .distributed.spec import is_plugin
from .distributed import BACKEND_NAME, PycommOptions
from .distributed import all_gather as _pd_all_gather
from .distributed import reduce_scatter as _pd_reduce_scatter
from .distributed import spec
from .distributed.session import EngineSession, nest_legacy
from .distributed.spec import GROUP_METHODS

log = logging.getLogger(__name__)

#: dtypes the engine compresses; others are forwarded exactly.
COMPRESSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["CompressedAllGather", "CompressedReduceScatter", "FSDPCompression", "compress", "engine_op"]

# -- torch's private FSDP2 names ------------------------------------------------
# FSDP2's custom-collective plug point lives in private modules whose names move
# between torch releases: SymmMemAllGather / SymmMemReduceScatter are in 2.13,
# not in 2.11 (importing them raised ImportError there); per-parameter meshes
# (early 2026) turned a module's `_fsdp_param_group` into `_fsdp_param_groups`.
# So nothing private is imported by name: each class is looked up with getattr,
# and one this torch lacks is one nothing can be an instance of; attributes are
# read with a fallback; mesh infos are told apart by their process groups. Only
# the plug point itself (FSDPModule.set_custom_*, the AllGather/ReduceScatter
# interfaces, the Default* collectives) is required: compress() names what is
# missing. pyproject's torch floor (2.11) is the oldest release this ran on.
_FSDP = "torch.distributed.fsdp._fully_shard."


def _torch_classes(module: str, *names: str) -> tuple[type, ...]:
    """The classes among ``names`` that torch's private module ``_FSDP +
    module`` defines in this release (empty when none: ``isinstance(x, ())``
    is False, as it should be for a class this torch does not have).

    >>> _torch_classes("_fsdp_api", "ReduceScatter", "NoSuchClass")
    (<class 'torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter'>,)
    """
    try:
        mod = importlib.import_module(_FSDP + module)
    except ImportError:
        return ()
    return tuple(c for c in (getattr(mod, n, None) for n in names) if isinstance(c, type))


# The interfaces a custom collective implements (torch >= 2.11). Without them
# the classes below still define (on object) and compress() says why it cannot run.
_AllGatherBase = (_torch_classes("_fsdp_api", "AllGather") or (object,))[0]
_ReduceScatterBase = (_torch_classes("_fsdp_api", "ReduceScatter") or (object,))[0]


def _unsupported_torch() -> str | None:
    """Why this torch cannot take pycomm.fsdp's collectives, or None."""
    missing = [n for n in ("set_custom_reduce_scatter", "set_custom_all_gather", "_get_fsdp_state")
               if not hasattr(FSDPModule, n)]
    missing += [f"{_FSDP}{m}.{n}" for m, n in (("_fsdp_api", "AllGather"), ("_fsdp_api", "ReduceScatter"),
                                                ("_fsdp_collectives", "DefaultAllGather"),
                                                ("_fsdp_collectives", "DefaultReduceScatter"))
                if not _torch_classes(m, n)]
    if not missing:
        return None
    return (f"pycomm.fsdp needs FSDP2's custom collectives (FSDPModule.set_custom_reduce_scatter, torch >= 2.11); "
            f"this torch {torch.__version__} lacks {', '.join(missing)}")


def _param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of one FSDP module: ``_fsdp_param_groups``
    (torch with per-parameter meshes), else the one ``_fsdp_param_group``
    (or none) of earlier releases."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _shard_pg(mesh_info: Any) -> dist.ProcessGroup | None:
    """The shard-dimension group of a mesh info (FSDP or HSDP), else None."""
    return getattr(mesh_info, "shard_process_group", None)


def _replicate_pg(mesh_info: Any) -> dist.ProcessGroup | None:
    """The replicate-dimension group of a mesh info (HSDP or DDP-style), else None."""
    return getattr(mesh_info, "replicate_process_group", None)


def _is_hsdp(group: Any) -> bool:
    """Whether an FSDP parameter group shards and replicates (a 2-D mesh)."""
    flag = getattr(group, "_is_hsdp", None)
    if isinstance(flag, bool):
        return flag
    return _shard_pg(group.mesh_info) is not None and _replicate_pg(group.mesh_info) is not None


def engine_op(op: Any, world_size: int) -> tuple[str, float | None]:
    """Translate the reduce op FSDP2 passes (``ReduceOp.SUM``, ``AVG`` or
    ``PREMUL_SUM(f)``) to the engine's: ``(op, premul)`` where ``premul``
    (None when 1) multiplies the input before a "sum".

    >>> from torch.distributed import ReduceOp
    >>> engine_op(ReduceOp.AVG, 4), engine_op(ReduceOp.PREMUL_SUM(0.125), 4)
    (('avg', None), ('sum', 0.125))
    """
    if op == dist.ReduceOp.SUM:
        return "sum", None
    if op == dist.ReduceOp.AVG:
        return "avg", None
    factor = getattr(op, "factor", None)
    if factor is not None and getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        return "sum", float(factor)
    raise ValueError(f"pycomm.fsdp: reduce op {op!r} is not SUM, AVG or PREMUL_SUM")


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _state_key() -> str:
    """This rank's entry in :meth:`FSDPCompression.state_dict`."""
    return f"rank{dist.get_rank()}_of_{dist.get_world_size()}"


class CompressedReduceScatter(_ReduceScatterBase):
    """FSDP2 ReduceScatter running the engine's compressed reduce-scatter
    for one module, under its own error-feedback key.

    Built by :func:`compress`; to install one by hand::

        module.set_custom_reduce_scatter(CompressedReduceScatter(comp, key=0, fqn="layers.0"))
    """

    def __init__(self, owner: FSDPCompression, key: int, fqn: str) -> None:
        self.owner = owner
        self.key = key
        self.fqn = fqn or "<root>"

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False):
        owner = self.owner
        pg = owner._engine_group(group, "grad")
        if pg is None or input_tensor.dtype not in COMPRESSED_DTYPES:
            # Unknown group (an FSDP feature that builds its own) or a dtype
            # the engine does not compress: exact, as FSDP2 would.
            owner._note_exact(self.fqn, "reduce-scatter", pg is None, input_tensor.dtype)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        name, premul = engine_op(op, group.size())
        if premul is not None and premul != 1.0:
            input_tensor.mul_(premul)
        key = self.key if owner.error_feedback else None
        try:
            work = _pd_reduce_scatter(output_tensor, input_tensor, key=key, group=pg, op=name, async_op=async_op)
        except RuntimeError as exc:
            raise RuntimeError(f"pycomm.fsdp: reduce-scatter of module {self.fqn!r} (key {self.key}, "
                               f"{input_tensor.numel()} {input_tensor.dtype}) failed: {exc}") from exc
        owner.bytes_in += input_tensor.numel() * input_tensor.element_size()
        return work

    def __repr__(self) -> str:
        return f"CompressedReduceScatter(key={self.key}, module={self.fqn!r})"


class CompressedAllGather(_AllGatherBase):
    """FSDP2 AllGather running the engine's compressed all-gather (int8 by
    default) for one module's parameters, without error feedback: every rank
    decodes the same bytes, so the unsharded weights are identical on all
    ranks; the sharded (optimizer's) parameters stay exact.

    Example::

        module.set_custom_all_gather(CompressedAllGather(comp, fqn="layers.0"))
    """

    def __init__(self, owner: FSDPCompression, fqn: str) -> None:
        self.owner = owner
        self.fqn = fqn or "<root>"

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        owner = self.owner
        pg = owner._engine_group(group, "weight")
        if pg is None or input_tensor.dtype not in COMPRESSED_DTYPES:
            owner._note_exact(self.fqn, "all-gather", pg is None, input_tensor.dtype)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        try:
            work = _pd_all_gather(output_tensor, input_tensor, key=None, group=pg, async_op=async_op)
        except RuntimeError as exc:
            raise RuntimeError(f"pycomm.fsdp: all-gather of module {self.fqn!r} ({input_tensor.numel()} "
                               f"{input_tensor.dtype}) failed: {exc}") from exc
        return work

    def __repr__(self) -> str:
        return f"CompressedAllGather(module={self.fqn!r})"


class FSDPCompression:
    """What :func:`compress` installed on a model: the per-module keys, the
    pycomm groups, and the error-feedback residuals as a per-rank
    ``torch.distributed.checkpoint`` Stateful.

    Example (checkpoint with the model and optimizer)::

        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model_sd, "optim": optim_sd, "pycomm": comp}, checkpoint_id=path)
        dcp.load({"model": model_sd, "optim": optim_sd, "pycomm": comp}, checkpoint_id=path)
    """

    def __init__(self, compressor: str, error_feedback: bool, weights: str | None, shard: str,
                 replicate: str | None, settings: dict[str, Any]) -> None:
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.weights = weights
        self.shard = shard
        self.replicate = replicate
        self.settings = settings
        #: module FQN -> error-feedback key, in ``model.modules()`` order.
        self.keys: dict[str, int] = {}
        self.groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        #: bytes handed to the compressed reduce-scatter on this rank (before compression).
        self.bytes_in = 0
        self._warned: set = set()
        #: The engine client of the gradients' reduce-scatter: its group
        #: (made by compress()), the keys (one per module) and the residuals.
        self._session = EngineSession("pycomm.fsdp", compressor, settings, collective=spec.REDUCE_SCATTER_SUFFIX)

    # -- groups ----------------------------------------------------------------
    def _engine_group(self, group: dist.ProcessGroup, role: str) -> dist.ProcessGroup | None:
        return self.groups.get((role, _ranks(group)))

    def _note_exact(self, fqn: str, what: str, unknown_group: bool, dtype: torch.dtype) -> None:
        why = "a process group pycomm.fsdp did not wrap" if unknown_group else f"dtype {dtype}"
        if (fqn, what, why) not in self._warned:
            self._warned.add((fqn, what, why))
            log.warning("pycomm.fsdp: %s of module %r runs exact (%s)", what, fqn, why)

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, as one ``bytes`` value under
        ``rank<r>_of_<world size>``: a ``torch.distributed.checkpoint`` save
        then writes every rank's (a plain tensor would be taken as replicated
        and written once), and a load gives each rank its own, whatever
        residuals it holds yet. DCP refuses a checkpoint of another world
        size before this object sees it; the missing key it names then says
        both world sizes apart. Empty without error feedback."""
        if not self.error_feedback:
            return {}
        buf = io.BytesIO()
        torch.save({"keys": dict(self.keys), "engine": self._session.state_dict()}, buf)
        return {_state_key(): buf.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's residuals from :meth:`state_dict`'s value
        (refused whole, naming the key and field, when it does not fit)."""
        if not self.error_feedback:
            return
        name = _state_key()
        if name not in state:
            raise ValueError(f"pycomm.fsdp: the state holds no residuals for {name} (it holds {sorted(state)}): "
                             f"residuals are per rank, and resume at the world size they were saved at")
        saved = state[name]
        if isinstance(saved, (bytes, bytearray)):
            try:  # tensors, numbers, strings and containers only: a checkpoint runs no code
                saved = torch.load(io.BytesIO(saved), weights_only=True)
            except Exception as exc:  # noqa: BLE001 - torch.load raises pickle's, zipfile's or its own errors
                # torch's text advises weights_only=False; keep only its reason.
                why = (str(exc).partition("WeightsUnpickler error:")[2].strip().split("\n")[0].partition(". Please")[0]
                       or str(exc)[:200])
                raise ValueError(f"pycomm.fsdp: state[{name!r}] is not a pycomm.fsdp state_dict(): it holds other "
                                 f"than tensors, numbers, strings and containers, or is no torch.save data "
                                 f"({type(exc).__name__}: {why})") from None
        if isinstance(saved, dict) and "residuals" in saved:  # saved before the engine state had an entry
            saved = nest_legacy({"world_size": saved.get("world_size"), "rank": dist.get_rank(),
                                 "error_feedback": saved["residuals"], "keys": saved.get("keys")}, self.compressor)
        if not isinstance(saved, dict) or saved.get("keys") != self.keys:
            raise ValueError("pycomm.fsdp: the saved residuals belong to other FSDP modules "
                             f"({sorted(saved.get('keys') or {}) if isinstance(saved, dict) else saved!r} vs "
                             f"{sorted(self.keys)})")
        self._session.load_state(self._session.check_state(saved.get("engine"), f"state[{name!r}]['engine']",
                                                           span=len(self.keys)))

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank holds now (one buffer
        of each; the engine keeps a second of the same size for rollback)."""
        return self._session.residual_nbytes() if self.error_feedback else 0

    _device = "cpu"

    def __repr__(self) -> str:
        return (f"FSDPCompression(compressor={self.compressor!r}, error_feedback={self.error_feedback}, "
                f"weights={self.weights!r}, modules={len(self.keys)})")


def _check_param_group(module: FSDPModule, fqn: str) -> Any:
    # Looked up by name: the symmetric-memory collectives are absent from
    # torch 2.11 (nothing can then use them), the process-group allocating
    # ones may go the same way.
    defaults = _torch_classes("_fsdp_collectives", "DefaultReduceScatter", "DefaultAllGather")
    if len(defaults) != 2:
        raise RuntimeError(_unsupported_torch() or "pycomm.fsdp: this torch has no FSDP2 default collectives")
    symm_mem = _torch_classes("_fsdp_collectives", "SymmMemReduceScatter", "SymmMemAllGather")
    pg_alloc = _torch_classes("_fsdp_collectives", "ProcessGroupAllocReduceScatter", "ProcessGroupAllocAllGather")

    groups = _param_groups(module)
    name = fqn or "<root>"
    if len(groups) > 1:
        raise ValueError(f"pycomm.fsdp: module {name!r} has {len(groups)} FSDP parameter groups (per-parameter "
                         f"meshes from shard_placement_fn); FSDP2 takes one custom reduce-scatter per module only")
    for g in groups:
        for comm, what in ((getattr(g, "_reduce_scatter_comm", None), "reduce-scatter"),
                           (getattr(g, "_all_gather_comm", None), "all-gather")):
            if comm is None:
                continue  # a torch that keeps no such attribute: nothing installed to check
            if isinstance(comm, symm_mem):
                raise ValueError(f"pycomm.fsdp: module {name!r} uses symmetric memory for its {what} "
                                 f"(set_symm_mem_for_comm); compressed collectives cannot run on it")
            if isinstance(comm, pg_alloc):
                raise ValueError(f"pycomm.fsdp: module {name!r} allocates its {what} buffers from the process "
                                 f"group (set_allocate_memory_from_process_group_for_comm); turn that off")
            if not isinstance(comm, (*defaults, CompressedReduceScatter, CompressedAllGather)):
                raise ValueError(f"pycomm.fsdp: module {name!r} already has a custom {what} "
                                 f"({type(comm).__name__})")
    return groups[0] if groups else None


def _mesh_groups(param_groups: list[Any]) -> tuple[set, set]:
    """Every (shard ranks, replicate ranks) set of this rank's modules. Mesh
    infos are read by their process groups, not their (private) classes:
    FSDP has a shard group, DDP-style a replicate group, HSDP both."""
    shard, repl = set(), set()
    for g in param_groups:
        mi = g.mesh_info
        if _shard_pg(mi) is not None:
            shard.add(_ranks(_shard_pg(mi)))
            pf = getattr(g, "post_forward_mesh_info", None)
            if pf is not None and pf is not mi and _shard_pg(pf) is not None:
                shard.add(_ranks(_shard_pg(pf)))
        if _replicate_pg(mi) is not None:
            repl.add(_ranks(_replicate_pg(mi)))
    return shard, repl


def compress(
    model: torch.nn.Module,
    compressor: str = "int8",
    *,
    error_feedback: bool | None = None,
    weights: str | None = None,
    shard: str = "compressed",
    replicate: str | None = None,
    **settings: Any,
) -> FSDPCompression:
    """Turn on compressed communication for a model wrapped with FSDP2's
    ``fully_shard`` (every rank calls it, with the same arguments).

    ``compressor``: the gradient reduce-scatter's ("int8", "int4",
    "onebit", "topk", "fp16", "bf16", "none" or a registered one), built with
    ``settings`` (``block_size``, ``density``, ``chunk_numel``,
    ``min_compress_numel``, ``compressor_options``, ``check_calls``,
    ``rounding``, ``seed``: as :class:`pycomm.distributed.PycommOptions`;
    ``rounding="stochastic"`` applies to the int8/int4 ones among the
    gradient, weight and replicate compressors). ``error_feedback``: keep a
    residual per module (None: on for onebit/topk only; its memory cost is
    in docs/fsdp.md). ``weights``: compressor of the parameter all-gather
    ("int8", "int4", "bf16"...; None: exact). HSDP (2-D mesh): ``shard`` is
    "compressed" or "exact" for the shard-dimension reduce-scatter;
    ``replicate`` is the replicate-dimension all-reduce's compressor
    (default: ``compressor``; "none" keeps it exact), run without error
    feedback.

    Raises ValueError naming the module where FSDP2 cannot take a custom
    collective (several parameter groups, symmetric memory, buffers from the
    process group, another custom collective).

    Example::

        fully_shard(model.layer1); fully_shard(model)
        comp = pycomm.fsdp.compress(model, "int8", weights="int8", min_compress_numel=4096)
        loss.backward()                      # gradients reduce-scattered in int8
        print(comp.keys)                     # {'layer1': 0, '': 1}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    unsupported = _unsupported_torch()
    if unsupported is not None:
        raise RuntimeError(unsupported)
    if settings.get("rounding") == "stochastic" and not {compressor, weights, replicate} & set(spec.ROUNDING_METHODS):
        raise ValueError(f"rounding='stochastic' is for the {', '.join(spec.ROUNDING_METHODS)} compressors; "
                         "none of compressor, weights and replicate is one")
    for name, value in (("compressor", compressor), ("weights", weights), ("replicate", replicate)):
        if value is not None and value not in GROUP_METHODS and not is_plugin(value):
            raise ValueError(f"{name} must be one of {list(GROUP_METHODS)} or a registered compressor, got {value!r}")
    if spec.AUTO_METHOD in (compressor, weights, replicate):
        raise ValueError("compressor='auto' is for all-reduces; name a compressor for FSDP")
    if weights is not None and spec.method_spec(weights).kind != "plugin" and spec.method_spec(weights).bits < 4:
        # Weights are not corrected by error feedback: a forward pass on
        # sign bits or on a few percent of the entries is another model.
        raise ValueError(f"weights={weights!r} would run the forward pass on weights that keep "
                         f"{'their signs only' if spec.method_spec(weights).bits == 1 else 'a few entries'}; weights take a "
                         f"codec of 4 bits or more ({[m for m in spec.METHODS if spec.method_spec(m).bits >= 4]})")
    if getattr(model, "_pycomm_fsdp", None) is not None:
        raise ValueError("pycomm.fsdp.compress was already called on this model (its collectives are installed); "
                         "call it once, after fully_shard, with every setting")
    if not dist.is_initialized():
        raise RuntimeError("pycomm.fsdp.compress: torch.distributed is not initialized")
    if shard not in ("compressed", "exact"):
        raise ValueError(f"shard must be 'compressed' or 'exact', got {shard!r}")
    error_feedback = spec.error_feedback_for(compressor, error_feedback)
    allowed = {f for f in PycommOptions.__dataclass_fields__ if f not in ("compressor", "inner", "hierarchy",
                                                                          "calibration")}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise TypeError(f"compress() got unknown settings {unknown}; allowed: {sorted(allowed)}")

    modules = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("pycomm.fsdp.compress: the model has no FSDP module: call fully_shard on it first")
    param_groups = []
    for fqn, m in modules:
        g = _check_param_group(m, fqn)
        param_groups.append(g)
    if any(g is not None and _is_hsdp(g) for g in param_groups) and shard == "exact" and replicate == spec.EXACT_METHOD:
        log.warning("pycomm.fsdp: shard='exact' and replicate='none': nothing is compressed")
    replicate = compressor if replicate is None else replicate

    comp = FSDPCompression(compressor, error_feedback, weights, shard, replicate, dict(settings))
    live = [g for g in param_groups if g is not None]
    comp._device = str(live[0].device.type) if live else "cpu"
    # Every rank creates every pycomm group, in one order (dist.new_group
    # needs all ranks of the world): gather each rank's mesh groups first.
    shard_sets, repl_sets = _mesh_groups(live)
    inner = dist.get_backend(live[0].mesh_info.mesh.get_group(0)) if live else dist.get_backend()
    if inner == BACKEND_NAME:
        inner = "nccl" if comp._device == "cuda" else "gloo"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sorted(shard_sets), sorted(repl_sets)))
    all_shard = sorted({tuple(s) for ss, _ in gathered for s in ss})
    all_repl = sorted({tuple(s) for _, rs in gathered for s in rs})
    me = dist.get_rank()
    roles = []
    if shard == "compressed":
        roles.append(("grad", compressor, all_shard))
    if weights is not None:
        roles.append(("weight", weights, all_shard))
    if replicate != spec.EXACT_METHOD and all_repl:
        roles.append(("replicate", replicate, all_repl))
    for role, method, sets in roles:
        for ranks in sets:
            base = dict(settings)
            if role != "grad" and not is_plugin(method):
                base.pop("compressor_options", None)
            if method not in spec.ROUNDING_METHODS:
                base.pop("rounding", None)  # only these round
                base.pop("seed", None)
            opts = PycommOptions(compressor=method, inner=inner, hierarchy="flat", **base)
            pg = dist.new_group(ranks=list(ranks), backend=BACKEND_NAME, pg_options=opts)
            if me in ranks:
                comp.groups[(role, ranks)] = pg
                if role == "grad":
                    comp._session.adopt(pg, torch.device(comp._device))

    for key, ((fqn, m), g) in enumerate(zip(modules, param_groups)):
        comp.keys[fqn] = key
        if g is None:
            continue
        if shard == "compressed":
            m.set_custom_reduce_scatter(CompressedReduceScatter(comp, key, fqn))
        if weights is not None:
            m.set_custom_all_gather(CompressedAllGather(comp, fqn))
        if _is_hsdp(g) and ("replicate", _ranks(_replicate_pg(g.mesh_info))) in comp.groups:
            # FSDP2 all-reduces the replicate dimension with dist.all_reduce
            # on this group: a pycomm group compresses it (keyless: no EF).
            g.mesh_info.replicate_process_group = comp.groups[("replicate", _ranks(
                _replicate_pg(g.mesh_info)))]
    model._pycomm_fsdp = comp
    return comp
