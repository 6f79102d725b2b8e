"""pycomm's DiLoCo inside torchft's fault tolerance (pycomm.integrations.torchft,
docs/across_sites.md): replicas on loopback, one process each (its own
TCPStore and Manager, group world size 1), a lighthouse started from
torchft's ``torchft_lighthouse`` console script, nothing mocked.

* A replica killed with SIGKILL in the middle of an outer sync (after its
  quorum, while its peers are in the compressed all-reduce) and restarted:
  the survivors drop that sync whole and commit the next one, over the new
  quorum torchft forms, within one outer step plus the timeout; the
  restarted replica rejoins, heals from a live peer, and every replica
  ends with bit-identical parameters.
* Replicas that join with another model or other settings are refused,
  naming the difference, with their state unchanged; the live replicas go
  on.

Every process (replicas and lighthouse) runs in a process group of its own,
bounded by timeouts, and is killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _dist import free_port, refusal, run_ranks, subprocess_env

pytest.importorskip("torchft")

import torch  # noqa: E402

import pycomm.distributed as pd  # noqa: E402
from pycomm.integrations.torchft import FaultTolerantDiLoCo  # noqa: E402

HERE = Path(__file__).resolve().parent
REPLICA = HERE / "_torchft_replica.py"
#: The Manager's and the Gloo group's timeout in the replicas, seconds.
TIMEOUT = 5.0
#: The lighthouse's join and heartbeat timeouts, milliseconds: a quorum
#: waits this long for a replica that is starting (or that just died).
LIGHTHOUSE_MS = 3000
#: Every wait of the test, seconds (imports of torch and torchft on a shared machine included).
DEADLINE = 120.0


def _lighthouse_binary() -> str:
    found = Path(sys.executable).with_name("torchft_lighthouse")
    return str(found) if found.exists() else (shutil.which("torchft_lighthouse") or "torchft_lighthouse")


class Proc:
    """A child in a process group of its own; its stdout read by a thread
    (lines, and the JSON events among them), its stderr to a file."""

    def __init__(self, args, log: Path, stdin: bool = False, merge: bool = False) -> None:
        env = subprocess_env()
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = log
        self._err = open(log, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else self._err,
                                     text=True, env=env, start_new_session=True)
        self.lines, self.events = [], []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                if line.startswith("{"):
                    self.events.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of output
            self._cond.notify_all()

    def wait_for(self, found, what: str, timeout: float = DEADLINE):
        """The first of this child's output lines (``found(line)``) that is
        true, waiting for it: the child's own output is the event."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if line is not None and found(line):
                        return line
                if self.lines and self.lines[-1] is None:
                    raise AssertionError(f"{what}: the process ended first (rc {self.proc.poll()}):\n{self.tail()}")
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{what}: not within {timeout} s:\n{self.tail()}")
                self._cond.wait(left)

    def event(self, name: str, what: str, **match):
        line = self.wait_for(lambda s: s.startswith("{") and json.loads(s).get("event") == name and all(
            json.loads(s).get(k) == v for k, v in match.items()), what)
        return json.loads(line)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def finish(self, timeout: float = DEADLINE) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.proc.args[-1]} did not finish within {timeout} s:\n{self.tail()}")
        self._thread.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        finally:
            self._err.close()

    def tail(self) -> str:
        self._err.flush()
        err = self.log.read_text()[-3000:] if self.log.exists() else ""
        out = "".join(line for line in self.lines[-20:] if line)
        return f"--- stdout\n{out}\n--- stderr\n{err}"


class Cluster:
    """A lighthouse and replicas, every one ended in :meth:`close`."""

    def __init__(self, tmp: Path, min_replicas: int = 2) -> None:
        self.tmp, self.procs = tmp, []
        self.lighthouse = self._add(Proc([_lighthouse_binary(), "--min_replicas", str(min_replicas), "--bind",
                                          "127.0.0.1:0",
                                          "--join_timeout_ms", str(LIGHTHOUSE_MS), "--heartbeat_timeout_ms",
                                          str(LIGHTHOUSE_MS), "--quorum_tick_ms", "20"], tmp / "lighthouse.log",
                                         merge=True))  # it logs to stderr
        # It binds port 0 and says which port it got.
        try:
            line = self.lighthouse.wait_for(lambda s: "listening on" in s, "the lighthouse to listen", timeout=60)
        except BaseException:
            self.close()  # the fixture never sees a Cluster that failed to start
            raise
        port = re.search(r":(\d+)\s*$", line).group(1)
        self.address = f"http://127.0.0.1:{port}"

    def _add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def replica(self, replica: int, name: str, *args, stdin: bool = False) -> Proc:
        report = self.tmp / f"{name}.json"
        return self._add(Proc([sys.executable, str(REPLICA), "--replica", str(replica), "--lighthouse", self.address,
                               "--timeout", str(TIMEOUT), "--report", str(report), *map(str, args)],
                              self.tmp / f"{name}.log", stdin=stdin))

    def report(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def cluster(tmp_path, request):
    c = None
    try:
        c = Cluster(tmp_path, **getattr(request, "param", {}))
        yield c
    finally:
        if c is not None:
            c.close()


def _check_no_sync_applied_half(named_records, shared_momentum: bool = True) -> None:
    """On every rank, a sync is either committed (the Manager's step, the
    syncs and the anchor move on together) or dropped (none of them moves,
    nor the outer momentum); and every rank that committed a step holds the
    same anchor (and, unless each replica keeps its own, momentum) after it
    as the others of its shard."""
    by_step = {}
    for name, records in named_records:
        prev = None
        for rec in records:
            if prev is not None and not rec["healed"]:
                if rec["committed"]:
                    assert rec["manager_step"] == prev["manager_step"] + 1 and rec["syncs"] == prev["syncs"] + 1
                else:
                    assert (rec["manager_step"], rec["syncs"], rec["anchor_sha"], rec["momentum_sha"]) == (
                        prev["manager_step"], prev["syncs"], prev["anchor_sha"], prev["momentum_sha"]), name
            assert rec["syncs"] == rec["manager_step"]  # every committed sync applied, nothing else
            prev = rec
            if rec["committed"]:
                by_step.setdefault(rec["manager_step"], set()).add(
                    (rec["anchor_sha"], rec["momentum_sha"] if shared_momentum else None))
    assert sorted(by_step) == list(range(1, OUTER + 1))
    assert all(len(v) == 1 for v in by_step.values()), by_step


def _check_survivor(recs, killed_at: float, paused_at: float, replicas: int) -> None:
    """A survivor's syncs: the one the victim died in dropped (its error
    reported to the Manager), then a new quorum without it (a new engine
    group), the heal, and the whole quorum again; never a stop longer than
    one outer step plus the timeout."""
    dropped = [rec for rec in recs if not rec["committed"]]
    assert len(dropped) == 1 and dropped[0]["manager_step"] == PAUSE and dropped[0]["error"], dropped
    assert dropped[0]["replicas"] == replicas and dropped[0]["start"] < killed_at
    after = recs[recs.index(dropped[0]) + 1:]
    assert after[0]["committed"] and after[0]["new_group"] and after[0]["quorum_id"] > dropped[0]["quorum_id"]
    assert any(rec["replicas"] == replicas and rec["participants"] == replicas - 1 for rec in after)  # the heal
    assert after[-1]["replicas"] == replicas and after[-1]["participants"] == replicas
    times = [rec["time"] for rec in recs]
    gaps = [b - a for a, b in zip(times, times[1:])]
    before = [b - a for a, b in zip(times, times[1:]) if b < paused_at]
    assert max(gaps) <= max(before) + TIMEOUT, (gaps, before)


OUTER = 12  # outer steps (the Manager's step at the end)
PAUSE = 5   # the victim stops at the sync that would commit step 6: about 40% of the run


@pytest.mark.parametrize("codec", [("--compressor", "int4"),
                                   # each replica's own momentum; the heal's averages rotated back
                                   ("--compressor", "onebit", "--rotate", "--compress-update")],
                         ids=["int4", "onebit-rotated-updates"])
def test_a_replica_killed_mid_sync_rejoins_and_every_replica_ends_identical(cluster, codec):
    common = ("--outer-steps", OUTER, "--sync-every", 4, *codec)
    # All three start together (each waits for the go once its imports are done).
    starters = [cluster.replica(r, f"replica{r}", *common, *(("--pause-at", PAUSE) if r == 2 else ()),
                                "--wait-for-go", stdin=True) for r in range(3)]
    # The restart of replica 2: a new process, started ahead so that its
    # imports are done, released right after the kill.
    restart = cluster.replica(2, "replica2-restarted", *common, "--wait-for-go", stdin=True)
    for p in [*starters, restart]:
        p.event("ready", "imports")
    for p in starters:
        p.send("go\n")
    victim = starters[2]
    paused = victim.event("paused", "the victim to reach its pause")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    restart.send("go\n")
    survivors = starters[:2]
    for p in [*survivors, restart]:
        assert p.finish() == 0, p.tail()
    reports = {name: cluster.report(name) for name in ("replica0", "replica1", "replica2-restarted")}
    victim_syncs = [e for e in victim.events if e["event"] == "sync"]

    # Every live replica reached the last step with bit-identical parameters.
    assert {r["manager_step"] for r in reports.values()} == {OUTER}
    assert len({r["params_sha"] for r in reports.values()}) == 1, reports
    # The restarted replica healed from a live peer, once, and then synced as the others.
    healed = reports["replica2-restarted"]
    assert healed["heals"] == 1
    first = healed["records"][0]
    assert first["join"] and first["healed"] and first["committed"] and not first["participating"]
    assert first["manager_step"] > PAUSE

    # No sync applied half, on every replica, the healed one included.
    _check_no_sync_applied_half([*((n, r["records"]) for n, r in reports.items()), ("replica2", victim_syncs)],
                                shared_momentum="--compress-update" not in codec)
    for name in ("replica0", "replica1"):
        # An engine group per quorum, each released at the next change.
        r = reports[name]
        assert r["groups_made"] == r["groups_seen"] >= 2 and r["groups_alive"] == 1, r
        _check_survivor(r["records"], killed_at, paused["time"], replicas=3)


SHARDS = 2


@pytest.mark.parametrize("cluster", [{"min_replicas": 1}], indirect=True)
def test_a_sharded_replica_killed_mid_sync_rejoins_shard_by_shard(cluster):
    """2 replicas, each sharded with FSDP2 over 2 processes (a Manager per
    shard rank); both processes of replica 1 killed in a sync and restarted:
    replica 0 goes on alone, and every shard rank of the restarted replica
    heals from the live peer of its own shard."""
    common = ("--outer-steps", OUTER, "--sync-every", 4, "--compressor", "int4", "--min-replicas", 1,
              "--shards", SHARDS)

    def replica(r, name, *extra):
        port = free_port()  # the replica's TCPStore, started by its shard 0
        return [cluster.replica(r, f"{name}-shard{s}", *common, "--shard", s, "--store-port", port, *extra,
                                "--wait-for-go", "--hold-quorum", stdin=True) for s in range(SHARDS)]

    starters = [replica(0, "replica0"), replica(1, "replica1", "--pause-at", PAUSE)]
    restart = replica(1, "replica1-restarted")
    everyone = [p for group in (*starters, restart) for p in group]
    for p in everyone:
        p.event("ready", "imports")
    for p in (*starters[0], *starters[1]):
        p.send("go\n")
    # Every Manager up before the first quorum: with one replica enough,
    # the lighthouse would not wait for the other.
    for p in (*starters[0], *starters[1]):
        p.event("manager", "the Managers")
    for p in (*starters[0], *starters[1]):
        p.send("go\n")
    paused = [p.event("paused", "the victim's shard ranks to reach their pause") for p in starters[1]]
    for p in starters[1]:
        os.killpg(p.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    for p in restart:
        p.send("go\ngo\n")
    for p in (*starters[0], *restart):
        assert p.finish() == 0, p.tail()
    reports = {(name, s): cluster.report(f"{name}-shard{s}") for name in ("replica0", "replica1-restarted")
               for s in range(SHARDS)}

    # Every shard rank reached the last step; the ranks of one shard hold
    # the same bits in both replicas, and the two shards differ.
    assert {r["manager_step"] for r in reports.values()} == {OUTER}
    for s in range(SHARDS):
        assert reports["replica0", s]["params_sha"] == reports["replica1-restarted", s]["params_sha"]
    assert reports["replica0", 0]["params_sha"] != reports["replica0", 1]["params_sha"]
    for s in range(SHARDS):
        healed = reports["replica1-restarted", s]
        assert healed["heals"] == 1
        first = healed["records"][0]
        assert first["join"] and first["healed"] and first["committed"] and not first["participating"]
        assert first["manager_step"] > PAUSE
        victim = [e for e in starters[1][s].events if e["event"] == "sync"]
        _check_no_sync_applied_half([("replica0", reports["replica0", s]["records"]), ("victim", victim),
                                     ("restarted", healed["records"])])
        _check_survivor(reports["replica0", s]["records"], killed_at, min(e["time"] for e in paused), replicas=2)


def test_a_joining_replica_of_another_model_or_settings_is_refused_and_changes_nothing(cluster):
    common = ("--outer-steps", 8, "--sync-every", 4, "--compressor", "int4")
    live = [cluster.replica(r, f"replica{r}", *common, "--wait-for-go", stdin=True) for r in range(2)]
    other_model = cluster.replica(2, "other-model", *common, "--hidden", 24, "--wait-for-go", stdin=True)
    other_settings = cluster.replica(3, "other-settings", "--outer-steps", 8, "--sync-every", 3, "--compressor",
                                     "int8", "--wait-for-go", stdin=True)
    for p in [*live, other_model, other_settings]:
        p.event("ready", "imports")
    for p in live:
        p.send("go\n")
    live[0].event("sync", "the live replicas to commit step 2", manager_step=2)
    for p in (other_model, other_settings):
        p.send("go\n")
    for p in [*live, other_model, other_settings]:
        assert p.finish() == 0, p.tail()

    for name, named in (("other-model", ("parameter shapes", "model state")),
                        ("other-settings", ("sync_every", "compressor"))):
        r = cluster.report(name)["refused"]
        assert r is not None, name
        assert "cannot join the quorum" in r["error"] and all(k in r["error"] for k in named), r["error"]
        assert r["state_after"] == r["state_before"] and r["step_count"] == 0  # nothing changed, no inner step
    reports = [cluster.report(f"replica{r}") for r in range(2)]
    assert [r["manager_step"] for r in reports] == [8, 8]
    assert reports[0]["params_sha"] == reports[1]["params_sha"]
    for r in reports:
        dropped = [rec for rec in r["records"] if not rec["committed"]]
        assert 1 <= len(dropped) <= 2 and all("refused" in rec["error"] for rec in dropped), dropped


def test_bad_arguments_are_refused_naming_them():
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.process_group import ProcessGroupDummy

    net = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager, got object"):
        FaultTolerantDiLoCo(object(), net, inner)
    with pytest.raises(TypeError, match="takes no fragments"):
        FaultTolerantDiLoCo(object(), net, inner, fragments=2)
    with pytest.raises(TypeError, match="takes no process_group"):
        FaultTolerantDiLoCo(object(), net, inner, process_group=None)
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup, got object"):
        pd.wrap_backend(object())
    with pytest.raises(TypeError, match=r"unknown settings \['hierarchy'\]"):
        pd.wrap_backend(torch.distributed.ProcessGroup(0, 1), hierarchy=2)
    with pytest.raises(ValueError, match="group has no backend on cpu"):
        pd.wrap_backend(torch.distributed.ProcessGroup(0, 1))

    # Managers need a lighthouse to talk to: torchft's own, in this process.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    managers = []

    def manager(pg=None, **kw):
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        managers.append(Manager(pg=pg or ProcessGroupGloo(), load_state_dict=None, state_dict=None,
                                min_replica_size=1, lighthouse_addr=lighthouse.address(), store_addr="127.0.0.1",
                                store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1", **kw))
        return managers[-1]

    try:
        with pytest.raises(ValueError, match=r"async quorum \(Manager\(use_async_quorum=True\)"):
            FaultTolerantDiLoCo(manager(use_async_quorum=False), net, inner)
        with pytest.raises(TypeError, match="ProcessGroupGloo .*got ProcessGroupDummy"):
            FaultTolerantDiLoCo(manager(ProcessGroupDummy(0, 1)), net, inner)
        m = manager()
        with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
            FaultTolerantDiLoCo(m, list(net.parameters()), inner)
        opt = FaultTolerantDiLoCo(m, net, inner, compressor="int4")
        with pytest.raises(ValueError, match="registered with it already"):
            FaultTolerantDiLoCo(m, net, inner)
        with pytest.raises(ValueError, match="reset_error_feedback must be True"):
            opt.load_state_dict(opt.state_dict(), reset_error_feedback=False)
        with pytest.raises(RuntimeError, match="no quorum yet"):
            opt.bytes_per_sync()
        assert opt.bytes_per_sync(world_size=3) > 0
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()


def _sharded_refusals(rank, world_size):
    """One rank, its replica sharded over a 1-D mesh of itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    net = torch.nn.Linear(4, 2)
    flat = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    fully_shard(net, mesh=flat)
    managers = []

    def manager(world_size):
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        managers.append(Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=1,
                                lighthouse_addr=lighthouse.address(), store_addr="127.0.0.1", store_port=store.port,
                                rank=0, world_size=world_size, hostname="127.0.0.1"))
        return managers[-1]

    def build(world_size, mesh, model=net):
        return lambda: FaultTolerantDiLoCo(manager(world_size), model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           mesh=mesh)

    try:
        two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        return {"two managers": refusal(build(2, flat)), "two-d mesh": refusal(build(1, two_d)),
                "no mesh": refusal(build(2, None, torch.nn.Linear(4, 2))),
                "sharded, no mesh": refusal(build(1, None))}
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()


def test_a_sharded_replica_needs_a_manager_per_shard_rank_and_its_shard_mesh():
    r = run_ranks(_sharded_refusals, 1, timeout=90)[0]
    assert "one Manager per shard rank" in r["two managers"] and "world_size=2" in r["two managers"], r
    assert "1-D with the dimensions ('shard',)" in r["two-d mesh"], r
    assert "one process (Manager(world_size=1)), or sharded over mesh=" in r["no mesh"], r
    assert "pass mesh=, the 1-D DeviceMesh ('shard',)" in r["sharded, no mesh"], r
