"""DiLoCo on torchft, on the quality study's model and regime: 3 replicas
train with `pycomm.integrations.torchft.FaultTolerantDiLoCo`, and in one
run of each seed a replica is killed (SIGKILL) at 40% of the run and
started again (it rejoins and heals from a live peer); the same 3 replicas
run uninterrupted on the same seed beside it. The question: does the
interrupted run end where the uninterrupted ones do (its final held-out
loss within their spread over seeds), and how long do the survivors wait?

    python benchmarks/kill_rejoin.py                      # 3 seeds x {uninterrupted, killed}, resumable
    python benchmarks/kill_rejoin.py --seeds 1 --model tiny --steps 1600 --out /tmp/kr   # a smoke run

Each finished run is written at once to
benchmarks/results/quality/runs-kill-rejoin/<mode>-s<seed>.json (a run
whose file exists is not run again); the summary goes to
benchmarks/results/quality/kill-rejoin.json, listed in the folder's
INDEX.md. Every replica is a process of its own with its own Manager, the
lighthouse is torchft's console script. The restart is cold: a new
process started after the kill, as a user or a scheduler would restart it
(its imports, model and Manager built while the survivors go on); the
record says how long from the kill to its heal. The regime: quality.REGIME (512 tokens per replica per step,
AdamW with its warm-up and floored cosine, the held-out text), DiLoCo with
H=16, the inner lr of the study's rule for 3 replicas, outer 1.0/0.5,
int4 pseudo-gradients with error feedback; no exact start (the same in both
modes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

from pycomm_bench import models, quality, sweep  # noqa: E402
from pycomm_bench.records import stamp_command, update_index_of  # noqa: E402
from pycomm_bench.report import machine_info, write_json  # noqa: E402

REPLICAS = 3
SYNC_EVERY = 16
KILL_AT = 0.4
MODES = ("uninterrupted", "killed")
#: The lighthouse's join and heartbeat timeouts (ms): a quorum waits this
#: long for a replica that is starting, or that has just died.
LIGHTHOUSE_MS = 3000
#: The replicas' Gloo timeout (s): how long a sync waits for a peer that died.
PG_TIMEOUT_S = 10
#: Plain all-reduce's best lr at 4 ranks in the quality study; DiLoCo's inner
#: lr is the study's rule from it (quality.diloco_inner_lr).
PLAIN_LR = 4e-3
OUT = os.path.join(ROOT, "benchmarks", "results", "quality")


def regime(model: str, steps: int) -> Dict[str, Any]:
    r = dict(quality.regime_of(steps), model=model)
    if model == "tiny":  # the smoke run: the quick study's sizes
        r.update({k: quality.QUICK_REGIME[k] for k in ("seq_len", "batch_size", "eval_batches", "text_files",
                                                       "text_bytes")})
    return r


# ------------------------------------------------------------------ replica --
def replica(a: argparse.Namespace) -> None:
    """One replica: train until the Manager's step reaches the run's outer steps."""
    from torchft import Manager, ProcessGroupGloo

    from pycomm.integrations.torchft import FaultTolerantDiLoCo

    torch.set_num_threads(1)  # the replicas share the machine's cores
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())  # torch's first optimizer imports its compiler
    r = regime(a.model, a.steps)
    text = sweep.text_options(r)
    model, batch_fn, loss_fn = models.char_lm(r["model"], batch_size=r["batch_size"], seed=a.seed, text=text,
                                              seq_len=r["seq_len"])
    eval_fn = models.text_batch_fn(r["batch_size"], r["seq_len"], a.seed, split="heldout", **text)
    if a.standby:
        print("standing by", flush=True)
        if not sys.stdin.readline():  # the launcher went away
            return
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=2, replica_id=f"replica_{a.replica}", lighthouse_addr=a.lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timedelta(seconds=60), connect_timeout=timeout)
    lr = quality.diloco_inner_lr(PLAIN_LR, REPLICAS)
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    opt = FaultTolerantDiLoCo(manager, model, inner, sync_every=SYNC_EVERY, compressor=a.compressor,
                              error_feedback=True, outer_lr=1.0, outer_momentum=0.5)
    outer_steps = a.steps // SYNC_EVERY
    total = outer_steps * SYNC_EVERY
    while manager.current_step() < outer_steps:
        step = opt.step_count  # healed with the rest on a rejoin: the data and lr follow it
        for g in inner.param_groups:
            g["lr"] = sweep.lr_at(lr, min(step, total - 1), total, r["lr_schedule"], warmup=r["lr_warmup"])
        loss = loss_fn(model, batch_fn(a.replica, step))
        opt.zero_grad()
        loss.backward()
        last = opt.last_sync
        opt.step()
        s = opt.last_sync
        if s is not last:
            print(json.dumps({"event": "healed" if s["healed"] else "committed" if s["committed"] else "dropped",
                              "outer_step": s["manager_step"], "participants": s["participants"],
                              "time": time.time(), "loss": float(loss)}), flush=True)
    with torch.no_grad():
        heldout = statistics.fmean(float(loss_fn(model, eval_fn(sweep.EVAL_RANK + i, 0)))
                                   for i in range(r["eval_batches"]))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(json.dumps({"event": "done", "outer_step": manager.current_step(), "inner_steps": opt.step_count,
                      "heals": opt.heals, "dropped": opt.dropped_syncs, "heldout_loss": heldout,
                      "parameters": hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]}), flush=True)
    manager.shutdown(wait=False)


# ----------------------------------------------------------------- launcher --
def run_one(a: argparse.Namespace, mode: str, seed: int) -> Dict[str, Any]:
    """A lighthouse and 3 replicas over the run; in mode "killed" replica 2
    is killed at 40% of the outer steps and started again, a new process."""
    from pycomm.integrations.torchft import LocalRun

    outer_steps = a.steps // SYNC_EVERY
    kill_at = max(2, round(KILL_AT * outer_steps))
    t0 = time.time()
    with LocalRun(timeout=600) as run:
        address = run.lighthouse(min_replicas=2, join_timeout_ms=LIGHTHOUSE_MS, heartbeat_timeout_ms=LIGHTHOUSE_MS)
        common = ["--lighthouse", address, "--seed", str(seed), "--steps", str(a.steps), "--model", a.model,
                  "--compressor", a.compressor]
        here = os.path.abspath(__file__)
        # The first three start together: each stands by once its imports are done.
        starters = [run.start([sys.executable, here, "--replica", str(r), *common, "--standby"], f"replica{r}",
                              stdin=True) for r in range(REPLICAS)]
        run.ready([f"replica{r}" for r in range(REPLICAS)])
        for p in starters:
            run.send(p, "go")
        killing = mode == "killed"
        want = {"replica0", "replica1", "restarted" if killing else "replica2"}
        finished, done, commits, killed_at_time, rejoin_s = set(), {}, {}, None, None
        while not want <= finished:
            tag, line = run.next_event()
            if line is None:
                finished.add(tag)
                if tag in want and tag not in done:
                    # a restart that finds the survivors gone ends at its quorum timeout
                    hint = " (did the survivors finish before it rejoined? try more --steps)" if tag == "restarted" else ""
                    raise RuntimeError(f"{tag} ended without finishing{hint}; logs in {run.logs}")
                continue
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if e["event"] == "done":
                done[tag] = e
            elif e["event"] == "healed" and tag == "restarted" and rejoin_s is None:
                rejoin_s = e["time"] - killed_at_time
            elif e["event"] == "committed":
                commits.setdefault(tag, []).append((e["outer_step"], e["time"]))
                if killing and tag == "replica2" and killed_at_time is None and e["outer_step"] >= kill_at:
                    starters[2].send_signal(signal.SIGKILL)
                    killed_at_time = time.time()
                    finished.add("replica2")
                    run.start([sys.executable, here, "--replica", "2", *common], "restarted")  # cold
        for p in run.procs[1:]:
            p.wait(timeout=120)
    survivors = [commits.get(t, []) for t in ("replica0", "replica1")]
    gaps = [b[1] - a_[1] for c in survivors for a_, b in zip(c, c[1:])]
    losses = {t: d["heldout_loss"] for t, d in done.items()}
    return {"mode": mode, "seed": seed, "steps": a.steps, "model": a.model, "compressor": a.compressor,
            "replicas": REPLICAS, "sync_every": SYNC_EVERY, "outer_steps": outer_steps,
            "killed_after_outer_step": kill_at if killing else None, "restart": "cold" if killing else None,
            "kill_to_heal_s": rejoin_s,
            "heldout_loss": losses["replica0"], "heldout_loss_per_replica": losses,
            "replicas_identical": len({d["parameters"] for d in done.values()}) == 1 and len(done) == REPLICAS,
            "heals": {t: d["heals"] for t, d in done.items()}, "dropped_syncs": {t: d["dropped"] for t, d in done.items()},
            "survivor_sync_gap_median_s": statistics.median(gaps) if gaps else None,
            "survivor_sync_gap_max_s": max(gaps) if gaps else None, "lighthouse_timeout_s": LIGHTHOUSE_MS / 1e3,
            "pg_timeout_s": PG_TIMEOUT_S,
            "wall_s": time.time() - t0}


# ------------------------------------------------------------------ summary --
def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per mode: the seeds' held-out losses, their mean, min and max; the
    killed runs against the uninterrupted ones of the same seed; whether the
    killed mean lies within the uninterrupted seeds' min..max.

    >>> s = summarize([{"mode": "uninterrupted", "seed": 0, "heldout_loss": 2.0},
    ...                {"mode": "uninterrupted", "seed": 1, "heldout_loss": 2.2},
    ...                {"mode": "killed", "seed": 0, "heldout_loss": 2.1}])
    >>> s["killed"]["mean"], round(s["killed"]["vs_uninterrupted_mean"], 3), s["within_seed_spread"]
    (2.1, 1.05, True)
    """
    out: Dict[str, Any] = {}
    by = {m: {r["seed"]: r for r in runs if r["mode"] == m} for m in MODES}
    for m, rs in by.items():
        losses = [rs[s]["heldout_loss"] for s in sorted(rs)]
        out[m] = {"seeds": sorted(rs), "heldout_loss": losses,
                  "mean": statistics.fmean(losses) if losses else None,
                  "min": min(losses) if losses else None, "max": max(losses) if losses else None}
    both = sorted(set(by["killed"]) & set(by["uninterrupted"]))
    ratios = [by["killed"][s]["heldout_loss"] / by["uninterrupted"][s]["heldout_loss"] for s in both]
    out["killed"]["vs_uninterrupted_per_seed"] = ratios
    out["killed"]["vs_uninterrupted_mean"] = statistics.fmean(ratios) if ratios else None
    u, k = out["uninterrupted"], out["killed"]
    out["within_seed_spread"] = (None if k["mean"] is None or u["min"] is None
                                 else u["min"] <= k["mean"] <= u["max"])
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=quality.REGIME["steps"], help="inner steps (whole outer steps of 16)")
    ap.add_argument("--model", default=quality.REGIME["model"], choices=sorted(models.GPT_CONFIGS))
    ap.add_argument("--compressor", default="int4", help="the pseudo-gradient's method (error feedback on)")
    ap.add_argument("--out", default=OUT, help="folder of the summary (the runs go to its runs-kill-rejoin/)")
    ap.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.replica is not None:
        replica(a)
        return 0
    if a.steps < 2 * SYNC_EVERY:
        ap.error(f"--steps: at least {2 * SYNC_EVERY} (two outer steps of {SYNC_EVERY})")
    runs_dir = os.path.join(a.out, "runs-kill-rejoin")
    os.makedirs(runs_dir, exist_ok=True)
    runs = []
    for seed in range(a.seeds):
        for mode in MODES:
            path = os.path.join(runs_dir, f"{mode}-s{seed}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    runs.append(json.load(fh))
                continue
            print(f"[kill-rejoin] {mode}, seed {seed} ...", file=sys.stderr, flush=True)
            rec = run_one(a, mode, seed)
            write_json(path, rec)
            runs.append(rec)
            print(f"[kill-rejoin] {mode}, seed {seed}: held-out loss {rec['heldout_loss']:.4f}, replicas identical "
                  f"{rec['replicas_identical']}, survivors' longest wait between syncs "
                  f"{rec['survivor_sync_gap_max_s']:.1f} s (median {rec['survivor_sync_gap_median_s']:.1f} s), "
                  f"{rec['wall_s']:.0f} s", file=sys.stderr, flush=True)
    from importlib.metadata import version

    doc = {"benchmark": "kill-rejoin", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info("cpu"),
           "torchft_version": version("torchft"), "regime": regime(a.model, a.steps),
           "inner_lr": quality.diloco_inner_lr(PLAIN_LR, REPLICAS), "outer_lr": 1.0, "outer_momentum": 0.5,
           "runs": runs, "summary": summarize(runs)}
    out = os.path.join(a.out, "kill-rejoin.json")
    write_json(out, stamp_command(doc))
    update_index_of(out)
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
