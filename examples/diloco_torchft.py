"""DiLoCo on torchft: 3 replicas sync rarely, compressed, and one of them is
killed and restarted; it rejoins and heals from a live peer, and every
replica ends with the same model.

    python examples/diloco_torchft.py                  # a lighthouse, 3 replicas, one killed at 40%
    python examples/diloco_torchft.py --compressor onebit --outer-steps 30

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
"""

import argparse
import hashlib
import os
import re
import signal
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
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=2, replica_id=f"replica_{args.replica}", lighthouse_addr=args.lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timedelta(seconds=60), connect_timeout=timeout)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = FaultTolerantDiLoCo(manager, model, inner, sync_every=args.sync_every, compressor=args.compressor,
                              error_feedback=True, outer_lr=1.0, outer_momentum=0.5)
    data, batch = dataset(), 16
    name = f"replica {args.replica}"
    while manager.current_step() < args.outer_steps:
        rows = (torch.arange(batch) + (opt.step_count * 3 + args.replica) * batch) % len(data)
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
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"{name}: done at outer step {manager.current_step()}, {opt.heals} heal(s), parameters "
          f"{hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]}", flush=True)
    manager.shutdown(wait=False)


def launch(args) -> int:
    """A lighthouse and 3 replicas; replica 2 killed at 40% and restarted."""
    from pycomm.integrations.torchft import LocalRun

    here = os.path.abspath(__file__)
    with LocalRun() as run:
        address = run.lighthouse(min_replicas=2, join_timeout_ms=LIGHTHOUSE_MS, heartbeat_timeout_ms=LIGHTHOUSE_MS)
        print(f"lighthouse on {address}", flush=True)
        common = ["--lighthouse", address, "--outer-steps", str(args.outer_steps), "--sync-every",
                  str(args.sync_every), "--compressor", args.compressor, "--standby"]
        # Each replica, and the restart of replica 2, waits for a go once its
        # imports are done: the three then start together.
        starters = [run.start([sys.executable, here, "--replica", str(r), *common], f"replica{r}", stdin=True)
                    for r in range(3)]
        standby = run.start([sys.executable, here, "--replica", "2", *common], "replica2-restarted", stdin=True)
        run.ready(["replica0", "replica1", "replica2", "replica2-restarted"])
        for p in starters:
            run.send(p, "go")
        kill_at, killed, finished, done = max(2, round(0.4 * args.outer_steps)), False, set(), []
        while not {"replica0", "replica1", "replica2-restarted"} <= finished:
            tag, line = run.next_event()
            if line is None:
                finished.add(tag)
                continue
            print(f"  [{tag}] {line}", flush=True)
            if ": done at outer step" in line:
                done.append(line)
            step = re.search(r"outer step (\d+) committed", line)
            if tag == "replica2" and not killed and step and int(step.group(1)) >= kill_at:
                starters[2].send_signal(signal.SIGKILL)
                finished.add("replica2")
                killed = True
                print(f"killed replica 2 (SIGKILL) after outer step {step.group(1)}; restarting it", flush=True)
                run.send(standby, "go")
        shas = {line.rsplit(" ", 1)[1] for line in done}
        same = len(done) == 3 and len(shas) == 1
        print(f"{len(done)} replicas finished; their parameters are "
              f"{'identical' if same else 'NOT identical'}", flush=True)
        rcs = [p.wait(timeout=60) for p in starters[:2] + [standby]]
        return 0 if same and killed and rcs == [0, 0, 0] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outer-steps", type=int, default=12, help="outer steps to train (the Manager's step)")
    parser.add_argument("--sync-every", type=int, default=8, help="H: inner steps between outer syncs")
    parser.add_argument("--compressor", default="int4", help="method of the pseudo-gradient's all-reduce")
    parser.add_argument("--replica", type=int, help="run one replica (else: launch a lighthouse and 3 replicas)")
    parser.add_argument("--lighthouse", help="the lighthouse's address (with --replica)")
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
