"""Record the calls pycomm.fsdp's collectives compress, from outside the library.

``record_calls(comp)`` returns a list that receives, for every compressed
call of ``comp``'s modules (the calls FSDP2 makes through them), its input
before and its output after: ``("reduce_scatter", key, input, op)``,
``("reduce_scatter_out", key, output, op)``, ``("all_gather", None, input,
None)`` and, for a synchronous all-gather, ``("all_gather_out", None,
output, None)``. Calls the engine does not compress (an unknown group or
dtype) are not recorded. The collectives' classes are wrapped once per
process; compressions without a record are untouched.
"""

from __future__ import annotations

from typing import Any, Dict, List

from pycomm.fsdp import COMPRESSED_DTYPES, CompressedAllGather, CompressedReduceScatter

_RECORDS: Dict[int, List[Any]] = {}


def _compressed(owner, group, role, tensor) -> bool:
    return owner._engine_group(group, role) is not None and tensor.dtype in COMPRESSED_DTYPES


def _wrap_classes() -> None:
    if getattr(CompressedReduceScatter, "_recorded", False):
        return
    reduce_scatter, all_gather = CompressedReduceScatter.__call__, CompressedAllGather.__call__

    def recorded_reduce_scatter(self, output_tensor, input_tensor, group, op, async_op=False):
        rec = _RECORDS.get(id(self.owner)) if _compressed(self.owner, group, "grad", input_tensor) else None
        if rec is not None:
            rec.append(("reduce_scatter", self.key, input_tensor.detach().clone(), op))
        work = reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)
        if rec is not None:
            rec.append(("reduce_scatter_out", self.key, output_tensor.detach().clone(), op))
        return work

    def recorded_all_gather(self, output_tensor, input_tensor, group, async_op=False):
        rec = _RECORDS.get(id(self.owner)) if _compressed(self.owner, group, "weight", input_tensor) else None
        if rec is not None:
            rec.append(("all_gather", None, input_tensor.detach().clone(), None))
        work = all_gather(self, output_tensor, input_tensor, group, async_op)
        if rec is not None and not async_op:
            rec.append(("all_gather_out", None, output_tensor.detach().clone(), None))
        return work

    CompressedReduceScatter.__call__ = recorded_reduce_scatter
    CompressedAllGather.__call__ = recorded_all_gather
    CompressedReduceScatter._recorded = True


def record_calls(comp) -> List[Any]:
    """A new list recording ``comp``'s compressed calls from now on."""
    _wrap_classes()
    _RECORDS[id(comp)] = []
    return _RECORDS[id(comp)]
