"""pycomm's DiLoCo inside torchft's fault tolerance: replicas that leave and
rejoin (docs/across_sites.md, "Replicas that leave and rejoin (torchft)").

torchft (``pip install "pycomm[torchft]"``) runs every replica as a job of
its own with a ``torchft.Manager``. Its lighthouse decides which replicas
form the quorum of each step; its ``ProcessGroupGloo`` makes a new Gloo group
among them whenever the quorum changes; a replica that (re)joins behind the
others is healed from a live peer through the state functions registered
with the Manager; ``manager.should_commit()`` says whether a step may be
applied. :class:`FaultTolerantDiLoCo` is :class:`pycomm.optim.DiLoCo` whose
outer sync runs there, torchft owning membership, quorum and healing:

* every outer sync starts with the Manager's quorum (``start_quorum``);
* when torchft has made a new inner group, the pycomm engine group is made
  anew over it (:func:`pycomm.distributed.wrap_backend`: the same
  connections) and the old one released; the replicas first compare their
  settings and model over the new group, so that a replica of another model
  or other settings is refused, naming the difference, before any call;
* the pseudo-gradient is averaged by pycomm's engine, compressed, over the
  quorum's replicas; one that does not take part (healing, or a spare)
  sends zeros and is not counted, torchft's own rule (``Manager.allreduce``);
* an error of that call (a peer died) is reported to the Manager, and
  ``should_commit()`` decides: when it says no, nothing of the sync is
  applied (anchor, outer momentum, residuals, counters), and the next sync
  runs over the quorum torchft forms then;
* a healing replica receives from a live peer the anchor, the outer
  momentum, the step count, the inner optimizer's state and the model's
  state, its parameters set to the anchor (a sync boundary); its
  error-feedback residuals start over (they are its own compression error,
  not a peer's), and so do everyone's at each change of the quorum (the
  engine's residuals are laid out for one group: its world size and each
  rank's place in it) and in a sync where a replica does not take part
  (it must send exactly zeros, and the engine starts a key over on every
  rank alike).

Example (each replica, a process of its own; the lighthouse runs
``torchft_lighthouse --min_replicas 2``, its address in ``TORCHFT_LIGHTHOUSE``)::

    from datetime import timedelta
    import torch
    from torchft import Manager, ProcessGroupGloo
    from pycomm.integrations.torchft import FaultTolerantDiLoCo

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None,
                      state_dict=None, min_replica_size=2, replica_id=f"replica_{i}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      timeout=timedelta(seconds=10))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = FaultTolerantDiLoCo(manager, model, inner, sync_every=16, compressor="int4")
    while manager.current_step() < outer_steps:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # inner step; every 16th also syncs with the quorum

A replica sharded with FSDP2 has one Manager per shard rank and passes its
``("shard",)`` mesh (``mesh=``; docs/across_sites.md, "Sharded replicas
under torchft"). :class:`LocalRun` starts a lighthouse and replica
processes on one machine (the example's and the benchmark's launcher).

Importing this module needs no torchft; building a FaultTolerantDiLoCo does.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .. import distributed as pd
from .._optional import require
from ..distributed.checks import all_reduce_max, gather_json, settings_digest
from ..optim._checks import _all_finite
from ..optim.diloco import DILOCO_KEY_BASE, DiLoCo, _is_dtensor

__all__ = ["FaultTolerantDiLoCo", "LocalRun", "STATE_KEY", "replica_mesh"]

#: The key of :class:`FaultTolerantDiLoCo`'s state functions in the Manager
#: (``manager.register_state_dict_fn``): what a healing replica receives.
STATE_KEY = "pycomm.FaultTolerantDiLoCo"

#: DiLoCo's arguments that have no meaning here, and why.
_NOT_HERE = {
    "fragments": "it syncs the whole model at each outer step (one quorum, one commit per sync)",
    "delay": "a sync is committed or dropped before the next inner step (torchft's should_commit)",
    "process_group": "the group is the quorum's, made by the Manager's ProcessGroupGloo",
    "inner": "the engine wraps the Manager's own Gloo (or NCCL) group",
    "hierarchy": "the engine wraps the quorum's group flat",
}


class _PeerRefused(RuntimeError):
    """A peer that joined with other settings was refused: this sync is
    dropped on the live replicas (reported to the Manager), never raised."""


class FaultTolerantDiLoCo(DiLoCo):
    """:class:`pycomm.optim.DiLoCo` over a torchft Manager's quorum.

    Args:
        manager: this process's ``torchft.Manager``, built over torchft's
            ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) with torchft's
            async quorum (its default: a replica healing in a sync sends
            zeros and is not counted); its ``timeout`` bounds each outer
            sync's all-reduce and commit, its ``quorum_timeout`` the wait for
            a quorum. One process per replica (``world_size=1``), or, for a
            replica sharded over ``mesh``, one Manager per shard rank
            (``rank=mesh.get_local_rank("shard")``, ``world_size=mesh.size()``):
            torchft's group of each then holds the ranks of one shard in
            every replica, and a replica commits a sync only when all of its
            shard ranks do.
        model: the replica's ``torch.nn.Module`` (its parameters trained,
            its whole state sent to a healing peer); for a sharded replica,
            every module ``fully_shard``-ed over ``mesh``.
        inner: the inner optimizer over ``model.parameters()``.
        sync_every: inner steps between two outer syncs (H).
        mesh: for a replica sharded with FSDP2, its 1-D DeviceMesh
            ``("shard",)`` (``init_device_mesh(device, (shards,),
            mesh_dim_names=("shard",))`` within the replica's own job): each
            rank syncs and keeps its local shards only, and a healing rank
            receives the shards of the live peer of its own shard rank.
        outer_lr, outer_momentum, nesterov, compressor, error_feedback,
            key_base, **compressor_settings: as :class:`~pycomm.optim.DiLoCo`'s
            (the whole model is synced at each outer step: no ``fragments``,
            no ``delay``, no ``process_group``).

    Every replica calls :meth:`step` once per inner step. The first step of
    a process, before its inner step, joins the quorum (a sync whose
    pseudo-gradient is zero, or, for a replica behind the others, its
    healing); every ``sync_every``-th step then syncs with the quorum of
    that moment. ``last_sync`` describes the latest sync (quorum id,
    replicas, participants, healed, committed, the Manager's step, its
    time); ``committed_syncs``, ``dropped_syncs``, ``heals`` and
    ``groups_made`` count.

    Example (with ``manager`` a torchft Manager)::

        opt = FaultTolerantDiLoCo(manager, model, torch.optim.AdamW(model.parameters()),
                                  sync_every=8, compressor="int4", error_feedback=True)
        while manager.current_step() < 100:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    Without torchft's Manager, it refuses at once:

    >>> net = torch.nn.Linear(4, 2)
    >>> FaultTolerantDiLoCo(object(), net, torch.optim.SGD(net.parameters(), lr=0.1))
    Traceback (most recent call last):
    ...
    TypeError: manager must be a torchft.Manager, got object
    """

    _MESH_DIMS = ("shard",)  # the replicas meet in torchft's groups, not in a mesh

    def __init__(self, manager: Any, model: torch.nn.Module, inner: Optimizer, sync_every: int = 16, *,
                 mesh: Any = None, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compressor: str = pd.spec.EXACT_METHOD, error_feedback: Optional[bool] = None,
                 key_base: int = DILOCO_KEY_BASE, **compressor_settings: Any) -> None:
        for name in sorted(set(compressor_settings) & set(_NOT_HERE)):
            raise TypeError(f"FaultTolerantDiLoCo takes no {name}: {_NOT_HERE[name]}")
        require("torchft", "torchft")
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if not isinstance(manager, Manager):
            raise TypeError(f"manager must be a torchft.Manager, got {type(manager).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (its state is what a healing replica receives), "
                            f"got {type(model).__name__}")
        # torchft keeps these as attributes only (no accessor): the group
        # the Manager reconfigures, and the ranks of one replica.
        tf_group = manager._pg
        if not isinstance(tf_group, (ProcessGroupGloo, ProcessGroupNCCL)):
            raise TypeError(f"manager: its process group must be torchft's ProcessGroupGloo (or ProcessGroupNCCL), "
                            f"whose inner group the engine wraps; got {type(tf_group).__name__}")
        if not manager._use_async_quorum:
            raise ValueError("manager: FaultTolerantDiLoCo needs torchft's async quorum (Manager("
                             "use_async_quorum=True), its default): a replica healing in a sync then sends zeros, "
                             "is not counted in its average, and receives the peer's state at should_commit")
        super().__init__(model, inner, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                         nesterov=nesterov, compressor=compressor, error_feedback=error_feedback,
                         key_base=key_base, mesh=mesh, **compressor_settings)
        got = (manager._group_rank, manager._group_world_size)
        if mesh is None and got[1] != 1:
            raise ValueError(f"manager: each replica must be one process (Manager(world_size=1)), or sharded over "
                             f"mesh= (one Manager per shard rank); got world_size={got[1]} and no mesh")
        if mesh is not None and got != (mesh.get_local_rank("shard"), mesh.size()):
            raise ValueError(f"manager: a replica sharded over mesh ({mesh.size()} ranks) needs one Manager per shard "
                             f"rank, Manager(rank=mesh.get_local_rank('shard'), world_size={mesh.size()}): this rank "
                             f"is shard {mesh.get_local_rank('shard')}, its Manager has rank={got[0]}, "
                             f"world_size={got[1]}")
        self.manager = manager
        self._tf_group = tf_group
        self._device = self.params[0].device
        # The inner group the engine group was made over (torchft makes a
        # new one at each change of the quorum).
        self._inner: Optional[dist.ProcessGroup] = None
        #: The latest outer sync (see the class docstring), or None.
        self.last_sync: Optional[Dict[str, Any]] = None
        self.committed_syncs = 0
        self.dropped_syncs = 0
        self.heals = 0
        self.groups_made = 0
        self._healed = self._joining = False
        try:
            manager.register_state_dict_fn(STATE_KEY, self._load_from_peer, self._state_for_peer)
        except AssertionError:  # torchft's refusal of a key registered twice
            raise ValueError(f"manager: a FaultTolerantDiLoCo is registered with it already ({STATE_KEY!r}); one "
                             f"per Manager") from None

    # -- the sync with the quorum ------------------------------------------------
    def _check_ranks(self) -> None:
        """At the first step of this process (and the first after a load),
        before its inner step: join the quorum, in a sync of its own (every
        replica's pseudo-gradient is zero at a fresh start; a replica behind
        the others heals from a live peer in it, while they sync)."""
        self._joining = True
        try:
            self._send(0)
            self._apply()
        finally:
            self._joining = False
        self._checked = True

    def _send(self, f: int) -> None:
        """One outer sync up to its commit: the Manager's quorum, the
        engine group following it, the compressed average over it, and
        ``manager.should_commit()``. Leaves the average to :meth:`_apply`
        when committed; drops it (residuals put back) when not. Errors of
        the group or the call are reported to the Manager, not raised."""
        m = self.manager
        start, self._healed = time.time(), False
        m.start_quorum()
        m.wait_quorum()  # the quorum formed, the inner group made, a healing replica's state fetched
        new_group = self._follow_quorum() if m.errored() is None else False
        participating, counted = m.is_participating(), m.num_participants()
        replicas = self._session.group.size() if m.errored() is None else 0
        finite = False
        if m.errored() is None:
            try:
                finite = self._average(f, participating, counted, replicas)
            except (RuntimeError, dist.DistError) as exc:  # refused by the engine at once: reported as well
                m.report_error(exc)
                self._pending = None
        pending = self._pending if m.errored() is None else None
        committed = m.should_commit()  # a healing replica loads its peer's state here
        if committed and pending is None:
            raise RuntimeError("FaultTolerantDiLoCo: the Manager committed a sync whose all-reduce did not run")
        if committed:
            self._pending = pending  # for _apply (a healing replica's load dropped it)
            self.committed_syncs += 1
        else:
            # Nothing of this sync is applied: a finite call kept new
            # residuals, which go back (a failed or non-finite call kept
            # the old ones itself).
            self._pending = None
            self.dropped_syncs += 1
            if finite and self.error_feedback:
                self._session.undo([f])
        error = m.errored()
        self.last_sync = {
            "step": self.step_count, "join": self._joining,
            # torchft keeps the quorum's id as an attribute only (for the record).
            "quorum_id": getattr(m, "_quorum_id", None), "replicas": replicas, "participants": counted,
            "participating": participating, "healed": self._healed, "new_group": new_group,
            "committed": committed, "manager_step": m.current_step(),
            "error": None if error is None else str(error.original_exception), "start": start, "time": time.time(),
        }

    def _average(self, f: int, participating: bool, counted: int, replicas: int) -> bool:
        """The compressed average of fragment ``f``'s pseudo-gradient over
        the quorum's ``replicas``, ``counted`` of them taking part (this one
        if ``participating``); True when it arrived, finite."""
        if counted != replicas and self.error_feedback:
            # A replica sends zeros in this sync (torchft's rule for one that
            # does not take part): it must hold no residual, and the engine
            # starts a key over on every rank alike (it compares the key's
            # next call again), so every replica starts its residuals over;
            # all know it from the quorum.
            self._session.reset_residuals()
        if not participating:
            # Zeros: the parameters at the anchor (this replica's progress
            # is replaced by the healed state, or by the new anchor).
            for p, a in zip(self._shards(), self.anchor):
                p.copy_(a)
        super()._send(f, zeros=not participating)
        if not self._wait(self._pending.pop("work")):
            return False
        self._received(f)
        avg = self._buf[:self.fragment_sizes()[f]]
        if 0 < counted != replicas:
            # The engine divided by the group's size; torchft's average is
            # over its participants.
            avg.mul_(replicas / counted)
        return _all_finite(avg)

    def _apply(self) -> None:
        """The outer step of a committed sync (:meth:`DiLoCo._apply`);
        nothing for a dropped one."""
        if self._pending is not None:
            super()._apply()

    def _wait(self, work: Any) -> bool:
        """Wait for the engine's call within the Manager's timeout; an
        error is reported to the Manager (``should_commit`` then says no).
        True when it succeeded."""
        self.manager.wrap_future(work.get_future(), None).wait()
        if self.manager.errored() is None:
            return True
        # Past the Manager's timeout the call may still be running: it ends
        # within the inner group's own timeout, and must have ended before
        # the buffer it writes is used again.
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - already reported to the Manager
            pass
        return False

    # -- the engine group follows torchft's inner group ------------------------------
    def _follow_quorum(self) -> bool:
        """Make the engine group anew when torchft made a new inner group
        (a new quorum); True when it did. The old engine group (its thread
        and residuals) is released first: the residuals start over with the
        new group, as its layout (world size, this rank's place) is new.
        A refused peer or a lost one is reported to the Manager (this sync
        is then dropped); this replica's own refusal raises."""
        inner = self._tf_group.parent
        if inner is self._inner:
            return False
        self._release_group()
        try:
            self._agree_with_peers(inner)
            group = pd.wrap_backend(inner, self.compressor, self._device, **self.compressor_settings)
        except _PeerRefused as exc:
            warnings.warn(str(exc), RuntimeWarning, stacklevel=5)
            self.manager.report_error(exc)
            return False
        except (RuntimeError, dist.DistError) as exc:  # a peer lost while the group was made
            self.manager.report_error(exc)
            return False
        self._session.adopt(group, self._device)
        self._inner = inner
        self.groups_made += 1
        return True

    def _release_group(self) -> None:
        self._session.detach()  # drops this reference to the engine group: it goes with the last one
        self._inner = None

    def _engine_group(self) -> dist.ProcessGroup:
        if self._session.group is None:
            raise RuntimeError("FaultTolerantDiLoCo: no quorum yet (its group is made at the first step)")
        return self._session.group

    def _plain_group(self) -> dist.ProcessGroup:
        return self._engine_group()

    def _fingerprint(self) -> Dict[str, Any]:
        """What every replica of a quorum must share, by the names users
        know: DiLoCo's settings and the model's layout (as JSON makes them:
        compared with what the peers send)."""
        mine = dict(self._settings())
        mine["parameter shapes"] = [list(p.shape) for p in self.params]
        mine["parameter dtypes"] = [str(p.dtype) for p in self.params]
        mine["model state"] = [[k, list(v.shape), str(v.dtype)] for k, v in self._model.state_dict().items()]
        if self.mesh is not None:
            mine["shard"] = [self.mesh.get_local_rank("shard"), self.mesh.size()]
            mine["local shard shapes"] = [list(t.shape) for t in self._shards()]
        return json.loads(json.dumps(mine, default=repr))

    def _agree_with_peers(self, inner: dist.ProcessGroup) -> None:
        """Over the quorum's new group, before any other call: every
        replica's settings and model layout (one int64 digest; the whole
        only when they differ). A replica that differs from the live ones
        (those taking part: the others are joining) raises, naming each
        difference, with nothing changed; the live ones drop this sync
        (:class:`_PeerRefused`) and go on. Live replicas that differ among
        themselves all raise."""
        backend = inner._get_backend(self._device)
        if inner.size() < 2:
            return
        mine = self._fingerprint()
        digest = settings_digest(mine)
        both = all_reduce_max(backend, torch.tensor([digest, -digest], dtype=torch.int64, device=self._device))
        if int(both[0]) == -int(both[1]):
            return
        everyone = gather_json(backend, {"live": self.manager.is_participating(), "settings": mine}, self._device)
        live = [r for r, e in enumerate(everyone) if e["live"]] or list(range(len(everyone)))
        reference = everyone[live[0]]["settings"]
        split = sorted({k for r in live for k in reference if everyone[r]["settings"].get(k) != reference[k]})
        if split:
            raise ValueError("FaultTolerantDiLoCo: the live replicas of the quorum differ in " + "; ".join(
                f"{k} (" + ", ".join(f"replica rank {r}: {everyone[r]['settings'].get(k)!r}" for r in live) + ")"
                for k in split) + ". Every replica must run one model with one set of settings.")
        me = inner.rank()
        differ = lambda s: [k for k in reference if s.get(k) != reference[k]]  # noqa: E731
        if differ(mine):
            raise ValueError(
                "FaultTolerantDiLoCo: this replica cannot join the quorum: it differs from the live replicas in "
                + "; ".join(f"{k} (here {mine.get(k)!r}, live replicas {reference[k]!r})" for k in differ(mine))
                + ". Nothing was changed: restart it with the live replicas' model and settings.")
        refused = [r for r, e in enumerate(everyone) if r != me and differ(e["settings"])]
        if refused:
            raise _PeerRefused(
                f"FaultTolerantDiLoCo: replica rank(s) {refused} of the quorum joined with another model or other "
                f"settings ({', '.join(sorted({k for r in refused for k in differ(everyone[r]['settings'])}))}) "
                f"and were refused; this sync is dropped, the next quorum goes on without them")

    # -- healing: the state a live peer sends ------------------------------------------
    def _state_for_peer(self) -> Dict[str, Any]:
        """What a healing replica receives (on torchft's quorum thread, while
        this replica waits for the quorum: nothing moves meanwhile): the
        DiLoCo state without this replica's residuals, the model's state,
        and the fingerprint the receiver checks first. Of a sharded replica,
        this rank's local shards as plain tensors (``dtensors`` names the
        inner state's entries to make DTensors again)."""
        state = self._local_state()
        state["pycomm"]["engine"] = dict(state["pycomm"]["engine"], world_size=None, rank=None, residuals={})
        # New dicts: torch's state_dict() holds the optimizer's own entries.
        inner = state["inner"]["state"]
        dtensors = [[i, k] for i, entry in inner.items() for k, v in entry.items() if _is_dtensor(v)]
        state["inner"] = dict(state["inner"], state={i: {k: _local(v) if isinstance(v, torch.Tensor) else v
                                                         for k, v in entry.items()} for i, entry in inner.items()})
        return {"fingerprint": self._fingerprint(), "diloco": state, "dtensors": dtensors,
                "model": {k: _local(v) for k, v in self._model.state_dict().items()}}

    def _load_from_peer(self, state: Dict[str, Any]) -> None:
        """Heal from a live peer's :meth:`_state_for_peer` (called by the
        Manager in ``should_commit``, after this sync's all-reduce, to which
        this replica sent zeros). Refused, before anything changes, if the
        peer runs another model or other settings."""
        mine, theirs = self._fingerprint(), state["fingerprint"]
        differ = [k for k in theirs if mine.get(k) != theirs[k]]
        if differ:
            raise ValueError("FaultTolerantDiLoCo: cannot heal from this peer: it differs in " + "; ".join(
                f"{k} (here {mine.get(k)!r}, the peer {theirs[k]!r})" for k in differ) + ". Nothing was changed.")
        pending = self._pending  # this sync's average, in flight through the load
        # Loaded with the engine group set aside: a reset of its residuals
        # here, on this replica alone, would make its next call differ from
        # its peers' (the engine compares a key's call again after a reset,
        # on every rank alike). Every replica started them over for this
        # sync already, as a replica heals in it (:meth:`_send`).
        group = self._session.group
        self._session.detach()
        try:
            self._load_local(state["diloco"], lambda inner: self.inner.load_state_dict(
                self._spread_inner(inner, state["dtensors"])), reset_error_feedback=True)
        finally:
            if group is not None:
                self._session.adopt(group, self._device)
        with torch.no_grad():
            # In place: the model's tensors (of a sharded replica, its local
            # shards) are the ones its modules and optimizers hold.
            for k, v in self._model.state_dict().items():
                _local(v).copy_(state["model"][k])
            # A sync boundary: the peer's progress since its anchor is the
            # peer's to send, not this replica's.
            for p, a in zip(self._shards(), self.anchor):
                p.copy_(a)
        self._pending, self._checked = pending, True
        self.heals += 1
        self._healed = True

    def _spread_inner(self, inner: Dict[str, Any], dtensors: Any) -> Dict[str, Any]:
        """The inner state of :meth:`_state_for_peer`, its ``dtensors``
        entries made DTensors again over their parameters' shards."""
        from torch.distributed.tensor import DTensor

        order = [p for g in self.inner.param_groups for p in g["params"]]
        for i, k in dtensors:
            p, t = order[i], inner["state"][i][k]
            inner["state"][i][k] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())
        return inner

    def load_state_dict(self, state_dict: Dict[str, Any], reset_error_feedback: bool = True) -> None:
        """:meth:`DiLoCo.load_state_dict`, the residuals always started over
        (they belong to the quorum that saved them); the next step joins
        the quorum again."""
        if reset_error_feedback is not True:
            raise ValueError("reset_error_feedback must be True: a FaultTolerantDiLoCo's residuals belong to the "
                             "quorum they were saved in, and start over at a load")
        super().load_state_dict(state_dict, reset_error_feedback=True)

    def bytes_per_sync(self, world_size: Optional[int] = None) -> int:
        """:meth:`DiLoCo.bytes_per_sync` in the current quorum (or ``world_size``)."""
        return super().bytes_per_sync(world_size if world_size is not None else self._engine_group().size())



def replica_mesh(store: Any, shard: int, shards: int, timeout: timedelta) -> Any:
    """The 1-D ``("shard",)`` DeviceMesh of one process of a replica sharded
    over ``shards`` processes, this one ``shard``: the replica's own default
    (Gloo) group, made over ``store`` (the replica's store, where its
    Managers keep their keys too, under a prefix of its own). FSDP2
    shards over it; :class:`FaultTolerantDiLoCo` takes it as ``mesh``.

    Example (in each of the replica's processes)::

        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=shard == 0, wait_for_workers=False)
        mesh = replica_mesh(store, shard, shards, timedelta(seconds=10))
        fully_shard(model, mesh=mesh)
    """
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.PrefixStore("replica", store), rank=shard, world_size=shards,
                            timeout=timeout)
    return init_device_mesh("cpu", (shards,), mesh_dim_names=FaultTolerantDiLoCo._MESH_DIMS)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), a plain tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


class LocalRun:
    """The processes of a fault-tolerant run on one machine: torchft's
    lighthouse (its ``torchft_lighthouse`` console script) and replica
    processes, every stdout line of theirs an event ``(tag, line)`` on one
    queue (``(tag, None)`` when its output ends), their stderr in
    ``<logs>/<tag>.log``; every process is killed when the run closes.

    Example (a replica script that prints a line once ready, then waits
    for one on stdin)::

        with LocalRun() as run:
            address = run.lighthouse(min_replicas=2)
            procs = [run.start([sys.executable, "replica.py", "--replica", str(r), "--lighthouse", address],
                               f"replica{r}", stdin=True) for r in range(3)]
            run.ready([f"replica{r}" for r in range(3)])
            for p in procs:
                run.send(p, "go")
            tag, line = run.next_event()
    """

    def __init__(self, logs: Optional[str] = None, timeout: float = 120.0) -> None:
        self.logs = logs or tempfile.mkdtemp(prefix="pycomm_torchft_")
        self.timeout = timeout
        self.events: "queue.Queue[Tuple[str, Optional[str]]]" = queue.Queue()
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "LocalRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, cmd: Sequence[str], tag: str, stdin: bool = False) -> subprocess.Popen:
        """Start ``cmd``; its stdout lines become events tagged ``tag``."""
        err = open(os.path.join(self.logs, f"{tag}.log"), "w")  # torchft's own log lines
        p = subprocess.Popen(list(cmd), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()  # the child holds its own descriptor

        def read() -> None:
            for line in p.stdout:
                self.events.put((tag, line.rstrip()))
            self.events.put((tag, None))
        threading.Thread(target=read, daemon=True).start()
        self.procs.append(p)
        return p

    def lighthouse(self, min_replicas: int, join_timeout_ms: int = 3000, heartbeat_timeout_ms: int = 3000) -> str:
        """Start torchft's lighthouse on a free port of 127.0.0.1 and return
        its address once it listens. It waits ``join_timeout_ms`` for a
        replica that is heartbeating but has not asked for the quorum, and
        counts one whose heartbeat stopped as gone after
        ``heartbeat_timeout_ms``."""
        found = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        binary = found if os.path.exists(found) else shutil.which("torchft_lighthouse") or "torchft_lighthouse"
        log = os.path.join(self.logs, "lighthouse.log")
        with open(log, "w") as out:  # it logs to stderr, a line per quorum tick: to a file, not a pipe
            self.procs.append(subprocess.Popen(
                [binary, "--min_replicas", str(min_replicas), "--bind", "127.0.0.1:0", "--join_timeout_ms",
                 str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            with open(log) as fh:
                port = re.search(r"listening on: \S+:(\d+)", fh.read())
            if port:
                return f"http://127.0.0.1:{port.group(1)}"
            if self.procs[-1].poll() is not None:
                raise RuntimeError(f"the lighthouse ended before it listened; its log: {log}")
            time.sleep(0.05)
        raise RuntimeError(f"the lighthouse did not listen within {self.timeout} s; its log: {log}")

    def next_event(self, timeout: Optional[float] = None) -> Tuple[str, Optional[str]]:
        """The next ``(tag, line)``; raises after ``timeout`` (default: the run's) without one."""
        wait = self.timeout if timeout is None else timeout
        try:
            return self.events.get(timeout=wait)
        except queue.Empty:
            raise RuntimeError(f"nothing happened for {wait} s; logs in {self.logs}") from None

    def ready(self, tags: Sequence[str]) -> None:
        """Wait for a first line of each of ``tags`` (a process that ends first raises)."""
        waiting = set(tags)
        while waiting:
            tag, line = self.next_event()
            if line is None and tag in waiting:
                raise RuntimeError(f"{tag} ended before it was ready; logs in {self.logs}")
            waiting.discard(tag)

    @staticmethod
    def send(p: subprocess.Popen, line: str) -> None:
        """Write ``line`` to ``p``'s stdin (a process standing by waits for it)."""
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def close(self) -> None:
        """Kill every process still running and reap them all."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
