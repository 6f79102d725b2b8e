"""DiLoCo on torchft: 3 replicas sync rarely, compressed, and one of them is
killed and restarted; it rejoins and heals from a live peer, and every
replica ends with the same model.

    python examples/diloco_torchft.py                  # a lighthouse, 3 replicas, one killed at 40%
    python examples/diloco_torchft.py --compressor onebit --outer-steps 30
    python examples/diloco_torchft.py --shards 2       # 2 replicas, each FSDP2-sharded over 2 processes

What it launches, which you can also run by hand, each in a terminal of its own:

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --join_timeout_ms 3000 --heartbeat_timeout_ms 3000
    python examples/diloco_torchft.py --replica 0 --lighthouse http://127.0.0.1:29510 --outer-steps 1000
    python examples/diloco_torchft.py --replica 1 --lighthouse http://127.0.0.1:29510 --outer-steps 1000
    python examples/diloco_torchft.py --replica 2 --lighthouse http://127.0.0.1:29510 --outer-steps 1000
    # kill -9 one of the replicas, start it again with the same command: it rejoins and heals

torchft decides which replicas form each outer step's quorum and heals a
replica that comes back; pycomm averages the pseudo-gradients, compressed,
over that quorum (pycomm.integrations.torchft, docs/across_sites.md).
Every replica is a process of its own with its own TCPStore; here the
restarted process is started ahead and waits on its stdin until the kill,
so that the short run does not wait for Python's imports.

With ``--shards N`` each replica is N processes, the model sharded with
FSDP2 over them, and every process has a Manager of its own (its rank: its
shard); the lighthouse then needs one replica only (``--min_replicas 1``),
and the killed replica is killed and restarted whole, all N processes.
"""

import argparse
import hashlib
import os
import re
import signal
import socket
import sys
from datetime import timedelta

import torch

from _common import dataset, make_model

#: The lighthouse's join and heartbeat timeouts (ms): a quorum waits this
#: long for a replica that is starting, or that has just died.
LIGHTHOUSE_MS = 3000


def replica(args) -> None:
    """One replica: train until the Manager's step reaches --outer-steps."""
    from torchft import Manager, ProcessGroupGloo

    from pycomm.integrations.torchft import FaultTolerantDiLoCo

    torch.set_num_threads(1)  # the replicas share the machine's cores
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())  # torch's first optimizer imports its compiler
    if args.standby:
        print(f"replica {args.replica} standing by", flush=True)
        if not sys.stdin.readline():  # the launcher went away
            return
    model = make_model()  # the same start everywhere (seeded)
    timeout = timedelta(seconds=10)
    # The replica's store: its shard 0 serves it, on the port the launcher gave.
    store = torch.distributed.TCPStore("127.0.0.1", args.store_port, is_master=args.shard == 0,
                                       wait_for_workers=False, timeout=timedelta(seconds=60))
    mesh = None
    if args.shards > 1:
        from torch.distributed.fsdp import fully_shard

        from pycomm.integrations.torchft import replica_mesh

        mesh = replica_mesh(store, args.shard, args.shards, timeout)  # the replica's own group (FSDP's)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=1 if mesh is not None else 2, replica_id=f"replica_{args.replica}",
                      lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port,
                      rank=args.shard, world_size=args.shards, hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timedelta(seconds=60), connect_timeout=timeout,
                      init_sync=False)  # every replica starts from the same (seeded) model
    name = f"replica {args.replica}" + (f" shard {args.shard}" if mesh is not None else "")
    if args.standby:
        # The lighthouse forms a quorum as soon as every replica it has heard
        # from asks for one: the first waits until every Manager is up.
        print(f"{name}: manager up", flush=True)
        if not sys.stdin.readline():
            return
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = FaultTolerantDiLoCo(manager, model, inner, sync_every=args.sync_every, compressor=args.compressor,
                              error_feedback=True, outer_lr=1.0, outer_momentum=0.5, mesh=mesh)
    data, batch = dataset(), 16
    seed = args.replica * args.shards + args.shard  # each process its own rows
    while manager.current_step() < args.outer_steps:
        rows = (torch.arange(batch) + (opt.step_count * 7 + seed) * batch) % len(data)
        x, y = data[rows]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        last = opt.last_sync
        opt.step()
        s = opt.last_sync
        if s is last:
            continue
        if s["healed"]:
            print(f"{name}: healed from a live peer (outer step {s['manager_step']}, inner step {opt.step_count})",
                  flush=True)
        elif s["committed"]:
            print(f"{name}: outer step {s['manager_step']} committed, quorum {s['quorum_id']}: {s['replicas']} "
                  f"replicas, {s['participants']} taking part, loss {loss.item():.4f}", flush=True)
        else:
            print(f"{name}: sync dropped, nothing of it applied ({s['error'].splitlines()[0][:100]})", flush=True)
    # This process's parameters: of a sharded replica, its own shards.
    params = torch.cat([t.detach().reshape(-1) for t in opt._shards()])
    print(f"{name}: done at outer step {manager.current_step()}, {opt.heals} heal(s), parameters "
          f"{hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]}", flush=True)
    manager.shutdown(wait=False)
    if mesh is not None:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    """A port of 127.0.0.1 free now (for a replica's store, which its shard
    ranks must know before it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    """A lighthouse and 3 replicas (2 of ``--shards`` processes each); the
    last replica killed at 40% and restarted."""
    from pycomm.integrations.torchft import LocalRun

    here = os.path.abspath(__file__)
    shards = args.shards
    replicas = 3 if shards == 1 else 2
    victim = replicas - 1
    with LocalRun() as run:
        address = run.lighthouse(min_replicas=2 if shards == 1 else 1, join_timeout_ms=LIGHTHOUSE_MS,
                                 heartbeat_timeout_ms=LIGHTHOUSE_MS)
        print(f"lighthouse on {address}", flush=True)
        common = ["--lighthouse", address, "--outer-steps", str(args.outer_steps), "--sync-every",
                  str(args.sync_every), "--compressor", args.compressor, "--shards", str(shards), "--standby"]

        tags = {}

        def start(r: int, restarted: bool = False) -> list:
            """Replica ``r``'s processes (tagged in ``tags``), a store port of its own."""
            port, name = free_port(), f"replica{r}" + ("-restarted" if restarted else "")
            procs = []
            for s in range(shards):
                tag = name + (f"-shard{s}" if shards > 1 else "")
                procs.append(run.start([sys.executable, here, "--replica", str(r), "--shard", str(s),
                                        "--store-port", str(port), *common], tag, stdin=True))
                tags[id(procs[-1])] = tag
            return procs

        # Each process, and the restart of the victim, waits for a go once
        # its imports are done: the replicas then start together.
        starters = [start(r) for r in range(replicas)]
        standby = start(victim, restarted=True)
        run.ready(list(tags.values()))
        for p in sum(starters, []):
            run.send(p, "go")
        up = {tags[id(p)] for p in sum(starters, [])}
        while up:  # then every Manager, before the first quorum
            tag, line = run.next_event()
            if line is None and tag in up:
                raise RuntimeError(f"{tag} ended before its Manager was up; logs in {run.logs}")
            if line is not None and line.endswith(": manager up"):
                up.discard(tag)
        for p in sum(starters, []):
            run.send(p, "go")
        kill_at, killed, finished, done = max(2, round(0.4 * args.outer_steps)), False, set(), []
        live = {tags[id(p)] for p in [*sum(starters[:victim], []), *standby]}
        while not live <= finished:
            tag, line = run.next_event()
            if line is None:
                finished.add(tag)
                continue
            print(f"  [{tag}] {line}", flush=True)
            if ": done at outer step" in line:
                done.append((tag, line))
            step = re.search(r"outer step (\d+) committed", line)
            if tag == tags[id(starters[victim][0])] and not killed and step and int(step.group(1)) >= kill_at:
                for p in starters[victim]:
                    p.send_signal(signal.SIGKILL)
                    finished.add(tags[id(p)])
                killed = True
                print(f"killed replica {victim} (SIGKILL{', all its processes' if shards > 1 else ''}) after "
                      f"outer step {step.group(1)}; restarting it", flush=True)
                for p in standby:
                    run.send(p, "go\ngo")  # its start, then its first quorum
        # Every shard index ends the same in every replica (with one shard: the whole model).
        by_shard = {}
        for tag, line in done:
            by_shard.setdefault(tag.rsplit("-shard", 1)[1] if shards > 1 else "", set()).add(line.rsplit(" ", 1)[1])
        same = len(done) == replicas * shards and all(len(v) == 1 for v in by_shard.values())
        print(f"{len(done) // shards} replicas finished; their parameters are "
              f"{'identical' if same else 'NOT identical'}" + (" shard by shard" if shards > 1 else ""), flush=True)
        rcs = [p.wait(timeout=60) for p in [*sum(starters[:victim], []), *standby]]
        return 0 if same and killed and set(rcs) == {0} else 1



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outer-steps", type=int, default=12, help="outer steps to train (the Manager's step)")
    parser.add_argument("--sync-every", type=int, default=8, help="H: inner steps between outer syncs")
    parser.add_argument("--compressor", default="int4", help="method of the pseudo-gradient's all-reduce")
    parser.add_argument("--replica", type=int, help="run one replica (else: launch a lighthouse and 3 replicas)")
    parser.add_argument("--lighthouse", help="the lighthouse's address (with --replica)")
    parser.add_argument("--shards", type=int, default=1,
                        help="processes per replica, the model sharded with FSDP2 over them (2 replicas then)")
    parser.add_argument("--shard", type=int, default=0, help="this process's shard (with --replica)")
    parser.add_argument("--store-port", type=int, default=0,
                        help="the replica's store port, served by its shard 0 (with --replica; 0: any)")
    parser.add_argument("--standby", action="store_true", help="wait for a line on stdin before starting")
    args = parser.parse_args()
    if args.replica is None:
        return launch(args)
    if not args.lighthouse:
        parser.error("--replica needs --lighthouse")
    replica(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
