"""One torchft replica for tests/test_torchft.py: a process of its own, with
its own TCPStore (started here) and Manager, training a tiny model with
pycomm's FaultTolerantDiLoCo until the Manager's step reaches
``--outer-steps``. With ``--shards N``, one shard rank (``--shard``) of a
replica sharded with FSDP2 over N processes: shard 0 starts the replica's
TCPStore on ``--store-port``, the others join it, and every rank has a
Manager of its own (rank = its shard).

It prints one JSON line per event on stdout (flushed): ``ready`` (imports
done; with ``--wait-for-go`` it then waits for a line on stdin: started
ahead, released by the test; with ``--hold-quorum``, ``manager`` once its
Manager is up, and it waits for another line before its first quorum),
``sync`` (each outer sync: ``last_sync`` and
hashes of the anchor, the outer momentum and the parameters),
``paused`` (``--pause-at K``: at the sync that would commit step K + 1,
after its quorum and before its all-reduce, it waits on stdin: the test
kills it there), ``refused`` (a step that raised ValueError: the message
and hashes of the whole state before and after it), and ``done``; then it
writes its report, ``--report`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
import weakref
from datetime import timedelta

import torch
from torchft import Manager, ProcessGroupGloo

from pycomm.integrations.torchft import FaultTolerantDiLoCo, replica_mesh


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


def sha(tensors) -> str:
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t  # a shard rank hashes its own shards
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_sha(opt: FaultTolerantDiLoCo) -> str:
    """Everything a refused step must leave as it was: parameters, anchor,
    outer momentum, inner state, counters."""
    inner = [v for s in opt.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    outer = [v for s in opt.outer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counters = torch.tensor([opt.step_count, opt.syncs, opt.heals], dtype=torch.int64)
    return sha([*opt._shards(), *opt.anchor, *outer, *inner, counters])


class PausingDiLoCo(FaultTolerantDiLoCo):
    """Waits on stdin at one sync, after its quorum and before its
    all-reduce (the test kills it there, while its peers are in the call)."""

    pause_at = -1

    def _follow_quorum(self) -> bool:
        made = super()._follow_quorum()
        if self.manager.current_step() == self.pause_at and not self._joining:
            emit("paused", step=self.step_count, manager_step=self.manager.current_step())
            sys.stdin.readline()
            raise SystemExit("released instead of killed")
        return made


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--outer-steps", type=int, default=12)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--compressor", default="int4")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--wait-for-go", action="store_true")
    p.add_argument("--hold-quorum", action="store_true")
    p.add_argument("--rotate", action="store_true")
    p.add_argument("--compress-update", action="store_true")
    p.add_argument("--report", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    # torch imports its compiler at the first optimizer it builds: before the go.
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    emit("ready", replica=args.replica)
    if args.wait_for_go and not sys.stdin.readline():
        raise SystemExit("stdin closed before the go")

    torch.manual_seed(0)  # every replica starts from the same model
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 4))
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    timeout = timedelta(seconds=args.timeout)
    store = torch.distributed.TCPStore("127.0.0.1", args.store_port, is_master=args.shard == 0,
                                       wait_for_workers=False, timeout=timedelta(seconds=60))
    mesh = None
    if args.shards > 1:
        from torch.distributed.fsdp import fully_shard

        mesh = replica_mesh(store, args.shard, args.shards, timeout)  # the replica's own group (FSDP's)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=args.min_replicas, replica_id=f"replica_{args.replica}",
                      lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port,
                      rank=args.shard, world_size=args.shards,
                      hostname="127.0.0.1", timeout=timeout, connect_timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout), init_sync=False)
    if args.hold_quorum:
        # The lighthouse forms a quorum at once when every replica it hears
        # from has asked for one: the first quorum waits for a line on
        # stdin, once every replica's Manager is up.
        emit("manager", replica=args.replica)
        sys.stdin.readline()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    PausingDiLoCo.pause_at = args.pause_at
    opt = PausingDiLoCo(manager, model, inner, sync_every=args.sync_every, compressor=args.compressor, mesh=mesh,
                        error_feedback=True, outer_lr=1.0, outer_momentum=0.5, block_size=32, rotate=args.rotate,
                        compress_update=args.compress_update)
    records, refused, groups = [], None, []  # weak references to every engine group it ran on
    while manager.current_step() < args.outer_steps:
        # Each replica its own data, drawn from its step (a healed replica
        # goes on with the step count it received).
        g = torch.Generator().manual_seed(1000 * args.replica + 100 * args.shard + opt.step_count)
        x = torch.randn(32, 16, generator=g)
        y = x @ target + 0.1 * torch.randn(32, 4, generator=g)
        before, last = state_sha(opt), opt.last_sync
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except ValueError as exc:
            refused = {"error": str(exc), "state_before": before, "state_after": state_sha(opt),
                       "step_count": opt.step_count}
            emit("refused", replica=args.replica, **refused)
            break
        if opt._session.group is not None and not any(g() is opt._session.group for g in groups):
            groups.append(weakref.ref(opt._session.group))
        if opt.last_sync is not last:
            momentum = [opt.outer.state[a]["momentum_buffer"] for a in opt.anchor]
            rec = dict(opt.last_sync, anchor_sha=sha(opt.anchor), momentum_sha=sha(momentum),
                       params_sha=sha(opt._shards()), syncs=opt.syncs)
            records.append(rec)
            emit("sync", replica=args.replica, **rec)
    gc.collect()  # the engine groups of earlier quorums must be gone: released at the change
    report = {"replica": args.replica, "shard": args.shard, "records": records, "refused": refused,
              "manager_step": manager.current_step(), "params_sha": sha(opt._shards()), "heals": opt.heals,
              "committed": opt.committed_syncs, "dropped": opt.dropped_syncs, "groups_made": opt.groups_made,
              "groups_seen": len(groups), "groups_alive": sum(g() is not None for g in groups)}
    with open(args.report, "w") as f:
        json.dump(report, f)
    emit("done", replica=args.replica)
    manager.shutdown(wait=False)
    if mesh is not None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
