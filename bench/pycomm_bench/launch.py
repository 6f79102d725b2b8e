"""Starting the W rank processes of a benchmark, and what every rank shares.

:func:`run_ranks` runs a module-level function ``target(rank)`` in W fresh
processes, either local ones on 127.0.0.1 (a free port each run) or inside
the network namespaces of an emulated cluster
(:class:`pycomm_bench.netem.EmulatedCluster`: one namespace per rank or per
node, shaped links). Each rank process is ``python -m pycomm_bench.launch
SPEC``: it joins the default Gloo process group (env://, with a bounded
timeout, so a hung collective raises inside the rank), runs ``target`` with a
:class:`Rank`, and sends events to the parent as JSON lines on its stdout
(anything else the rank prints goes to its stderr, kept in a file).

The parent hands every event to ``on_event`` as it arrives (progress bars)
and returns them all. A rank that raises or dies ends the run: its peers get
a few seconds to report, then every rank is killed and :class:`RanksFailed`
carries the failing rank's stderr (its traceback) and the others' last
lines; so does a run that sends no event for ``stall`` seconds. Every path
out (success, failure, Ctrl-C) kills what is left and waits for each rank by
PID; a rank whose parent dies exits by itself.

Adding a benchmark
------------------
1. A module ``bench/pycomm_bench/<name>.py`` with ``HELP``, ``add_arguments(parser)``,
   optionally ``resolve_args(args)``, and ``run(args) -> int``; one line for it
   in ``SUBCOMMANDS`` of :mod:`pycomm_bench.cli` (and in ``PARTS`` of
   :mod:`pycomm_bench.all` to run it with the others).
2. The rank side: a module-level ``def _rank_main(rank: Rank) -> None`` reading
   its settings from ``rank.cfg``, verifying results first (``rank.identical``),
   timing with :func:`pycomm_bench.time_interleaved` and sending what it
   measured with ``rank.emit("result", record=...)`` (JSON values).
3. The parent side: ``events = run_ranks(_rank_main, world_or_cluster, cfg,
   on_event=...)``, then the JSON document and
   ``return finish(doc, args.json, table(...), failures, started)``
   (:mod:`pycomm_bench.report`). Method names come from
   :func:`pycomm_bench.methods.parse_method`.
4. A test in ``tests/test_bench_<name>.py`` running it on 2 ranks, tiny sizes.

Example::

    >>> from pycomm_bench.launch import run_ranks
    >>> def _sum(rank):                      # module level in a real file
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([float(rank.rank)])
    ...     dist.all_reduce(t)
    ...     rank.emit("sum", value=t.item())
    >>> [e["value"] for e in run_ranks(_sum, 2)]    # doctest: +SKIP
    [1.0, 1.0]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .netem import LoopbackCluster, free_port, tx_bytes

__all__ = ["DEFAULT_TIMEOUT", "Rank", "RankProcesses", "RanksFailed", "free_port", "run_ranks",
           "threads_per_rank"]

#: Seconds a collective may hang inside a rank before it raises.
DEFAULT_TIMEOUT = 120.0
#: Seconds the peers of a failed rank get to report their own errors.
GRACE_S = 3.0
#: Characters of a failed rank's stderr quoted in :class:`RanksFailed`.
STDERR_TAIL = 3000

Event = Dict[str, Any]


class RanksFailed(RuntimeError):
    """A rank raised, died or stalled; every rank has been killed."""


def threads_per_rank(world: int, threads: Optional[int] = None) -> int:
    """``threads`` if given, else the cores shared out: W ranks with torch's
    default thread count each would oversubscribe a small machine W times.

    >>> threads_per_rank(4, 3)
    3
    """
    if threads is not None:
        return threads
    return max(1, (os.cpu_count() or 1) // world)


# --------------------------------------------------------------- rank side ---
class Rank:
    """What ``target(rank)`` gets in a rank process: who it is, its settings
    (``cfg``, as given to :func:`run_ranks`), a channel to the parent and
    helpers for checks across ranks (collectives on the default group)."""

    def __init__(self, cfg: Dict[str, Any], events=None) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.cfg = cfg
        #: The interface whose bytes :meth:`tx_bytes` counts: the rank's own
        #: link in a namespace, else what the benchmark named (e.g. "lo").
        self.ifname: Optional[str] = os.environ.get("GLOO_SOCKET_IFNAME") or cfg.get("count_ifname")
        self._events = events
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        """Send ``{"event": event, "rank": r, **fields}`` (JSON values) to the parent.

        >>> rank.emit("result", record={"median_s": 0.1})   # doctest: +SKIP
        """
        if self._events is None:
            return
        line = json.dumps({"event": event, "rank": self.rank, **fields}) + "\n"
        with self._lock:
            self._events.write(line)
            self._events.flush()

    def max_over_ranks(self, values: Sequence[float]) -> List[float]:
        """Element-wise max over every rank (e.g. per step: done when the slowest is)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def mean_over_ranks(self, values: Sequence[float]) -> List[float]:
        """Element-wise mean over every rank."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def identical(self, tensor) -> bool:
        """True on every rank iff (almost surely) ``tensor`` holds the same
        bits on every rank: two position-weighted sums of its words, min and
        max over ranks compared."""
        import torch
        import torch.distributed as dist

        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        words = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).to(torch.int64)
        w = torch.arange(1, words.numel() + 1, dtype=torch.int64)
        mine = torch.stack([words.sum(), (words * w % 1_000_003).sum()])
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))

    def tx_bytes(self) -> Optional[int]:
        """Bytes sent so far on :attr:`ifname` (None if there is none)."""
        return tx_bytes(self.ifname)


def _watch_parent(parent_pid: int) -> None:
    # A rank whose parent died (SIGKILL, a closed terminal) must not linger
    # holding ports and gigabytes: exit as soon as it is orphaned.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def _load_target(module: str, qualname: str, path: Optional[str]) -> Callable[[Rank], None]:
    if module == "__main__":  # the parent's script: load its file under another name
        spec = importlib.util.spec_from_file_location("__pycomm_rank_main__", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_process(spec_path: str) -> int:
    """``python -m pycomm_bench.launch SPEC``: one rank of :func:`run_ranks`."""
    # Events get the real stdout; whatever else writes to fd 1 (a print, a
    # C library) lands in stderr instead of corrupting the event stream.
    events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group: the parent handles it and
    # kills the ranks, which would otherwise print W tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    sys.path[:] = spec["sys_path"]  # the parent's: its modules (tests too) import here
    rank = Rank(spec["cfg"], events)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        target = _load_target(*spec["target"])
        if spec["threads"] is not None:
            torch.set_num_threads(spec["threads"])
        if spec["init"]:
            dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=spec["timeout"]))
        target(rank)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - anything a rank raises goes to the parent
        # Reported before the group is torn down: closing the connections
        # makes the peers fail too, and the parent names the first report.
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        rank.emit("error")
        os._exit(1)  # no teardown of a group that may hang
    events.close()
    return 0


# ------------------------------------------------------------- parent side ---
def _target_ref(target: Callable) -> List[Optional[str]]:
    module, qualname = target.__module__, target.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{qualname}: a rank's target must be a module-level function")
    path = None
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name:  # python -m pkg.mod: importable by name
            module = spec.name
        else:
            path = os.path.abspath(main.__file__)
    return [module, qualname, path]


class RankProcesses:
    """The rank processes of one run (context manager); :func:`run_ranks`
    is the usual way in. ``ranks`` starts only some of them (e.g. ``[1]``
    when this process takes rank 0 itself, with ``cluster.env(0)``).

    Example::

        >>> with RankProcesses(_worker, 2, ranks=[1]) as procs:     # doctest: +SKIP
        ...     os.environ.update(procs.cluster.env(0))
        ...     ...                                                 # rank 0 here
        ...     procs.wait()
    """

    def __init__(self, target: Callable[[Rank], None], cluster: Union[int, Any], cfg: Optional[Dict] = None, *,
                 ranks: Optional[Sequence[int]] = None, timeout: float = DEFAULT_TIMEOUT,
                 stall: Optional[float] = None, threads: Optional[int] = None, init: bool = True) -> None:
        self._own_cluster = isinstance(cluster, int)
        self.cluster = LoopbackCluster(cluster, warn=False) if self._own_cluster else cluster
        self.ranks = list(range(self.cluster.world_size)) if ranks is None else list(ranks)
        self.stall = timeout + 60.0 if stall is None else stall
        self._spec = {"target": _target_ref(target), "cfg": cfg or {}, "timeout": timeout, "threads": threads,
                      "init": init, "parent_pid": os.getpid(), "sys_path": list(sys.path)}
        self._tmp: Optional[str] = None
        self._procs: Dict[int, subprocess.Popen] = {}
        self._logs: Dict[int, Any] = {}
        self._lines: "queue.Queue" = queue.Queue()

    def start(self) -> "RankProcesses":
        self._tmp = tempfile.mkdtemp(prefix="pycomm-ranks-")
        spec_path = os.path.join(self._tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(self._spec, fh)
        argv = [sys.executable, "-m", "pycomm_bench.launch", spec_path]
        for r in self.ranks:
            self._logs[r] = open(os.path.join(self._tmp, f"rank{r}.err"), "w+", encoding="utf-8",
                                 errors="replace")
            p = self.cluster.spawn(r, argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=self._logs[r], text=True)
            self._procs[r] = p
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()
        return self

    def _read(self, r: int, p: subprocess.Popen) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            self._lines.put((r, line))
        self._lines.put((r, None))

    def stderr_tail(self, r: int, chars: int = STDERR_TAIL) -> str:
        """The end of rank ``r``'s stderr so far."""
        fh = self._logs[r]
        fh.flush()
        fh.seek(0)
        return fh.read()[-chars:].strip()

    def wait(self, on_event: Optional[Callable[[Event], None]] = None) -> List[Event]:
        """Every event of the ranks, after all have exited with status 0;
        ``on_event(event)`` is called for each as it comes. Raises
        :class:`RanksFailed` (every rank killed first) if one fails or the
        ranks send nothing for ``stall`` seconds."""
        events: List[Event] = []
        errors: Dict[int, str] = {}  # in the order the ranks reported
        closed: set = set()
        last = time.monotonic()
        grace_end: Optional[float] = None
        stalled = False
        while not (len(closed) == len(self._procs) and all(p.poll() is not None for p in self._procs.values())):
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if now - last > self.stall:
                stalled = True
                break
            try:
                r, line = self._lines.get(timeout=0.25)
            except queue.Empty:
                for r, p in self._procs.items():
                    # Stdout closed and a bad exit without an error event: died (segfault, OOM kill).
                    if r in closed and p.poll() not in (None, 0) and r not in errors:
                        errors[r] = f"exited with code {p.returncode} without reporting"
                        grace_end = grace_end or now + GRACE_S
                continue
            if line is None:
                closed.add(r)
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            last = time.monotonic()
            if event.get("event") == "error":
                # A peer already gone without a word (killed, os._exit) came first: it is the cause.
                for q, p in self._procs.items():
                    if q in closed and q not in errors and p.poll() not in (None, 0):
                        errors[q] = f"exited with code {p.returncode} without reporting"
                errors.setdefault(r, "raised")
                # The peers of a failed rank hang in a collective or fail
                # because it left: a moment for their own reports, no more.
                grace_end = grace_end or last + GRACE_S
                continue
            events.append(event)
            if on_event is not None:
                on_event(event)
        for r, p in self._procs.items():
            if p.poll() not in (None, 0) and r not in errors:
                errors[r] = f"exited with code {p.returncode}"
        if errors or stalled or any(p.poll() is None for p in self._procs.values()):
            self._kill()
            raise RanksFailed(self._failure(errors, stalled))
        return events

    def _failure(self, errors: Dict[int, str], stalled: bool) -> str:
        where = self.cluster.describe()
        if stalled:
            lines = [f"no progress from the ranks for {self.stall:.0f} s on {where}; all ranks were killed"]
            for r in self._procs:
                tail = self.stderr_tail(r, 600)
                lines.append(f"rank {r}: {tail.splitlines()[-1] if tail else '(no output)'}")
            return "\n".join(lines)
        # The first rank to report is usually the cause; the others typically
        # fail because it left (connection closed) or timed out.
        first = next(iter(errors))
        lines = [f"rank {first} failed ({errors[first]}) on {where}:\n"
                 f"{self.stderr_tail(first) or '(nothing on its stderr)'}"]
        for r in sorted(errors):
            if r != first:
                tail = self.stderr_tail(r, 600)
                lines.append(f"rank {r}: {tail.splitlines()[-1] if tail else errors[r]}")
        missing = [r for r, p in self._procs.items() if r not in errors and p.returncode != 0]
        if missing:
            lines.append(f"ranks {missing} did not finish (killed)")
        return "\n".join(lines)

    def _kill(self) -> None:
        for p in self._procs.values():
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in self._procs.values():
            p.wait()

    def close(self) -> None:
        """Kill what is left, wait for every rank by PID, remove the files."""
        try:
            self._kill()
            for p in self._procs.values():
                if p.stdout is not None:
                    p.stdout.close()
            for fh in self._logs.values():
                fh.close()
        finally:
            if self._own_cluster:
                self.cluster.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "RankProcesses":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def run_ranks(target: Callable[[Rank], None], cluster: Union[int, Any], cfg: Optional[Dict] = None, *,
              timeout: float = DEFAULT_TIMEOUT, stall: Optional[float] = None, threads: Optional[int] = None,
              on_event: Optional[Callable[[Event], None]] = None) -> List[Event]:
    """Run ``target(rank)`` on every rank of ``cluster`` (a world size: local
    ranks on 127.0.0.1; or a :mod:`pycomm_bench.netem` cluster, already
    built) and return the events the ranks emitted, in arrival order.

    ``cfg`` (JSON values) is ``rank.cfg``; ``timeout`` bounds each
    collective inside the ranks; ``stall`` (default ``timeout`` + 60 s) is
    how long the parent waits without any event; ``threads`` sets
    ``torch.set_num_threads`` in each rank. Raises :class:`RanksFailed`.

    Example::

        >>> events = run_ranks(_rank_main, 2, {"sizes": [65536]}, on_event=print)   # doctest: +SKIP
    """
    with RankProcesses(target, cluster, cfg, timeout=timeout, stall=stall, threads=threads) as procs:
        return procs.wait(on_event)


if __name__ == "__main__":
    sys.exit(_rank_process(sys.argv[1]))


def run_each_world(target: Callable[["Rank"], None], args: Any, cfg: Dict, records: List[Any],
                   failures: List[Dict[str, Any]], on_event: Callable[[Dict[str, Any]], None],
                   after_failure: Optional[Callable[[int], None]] = None) -> None:
    """:func:`run_ranks` of ``target`` with ``cfg`` at each world size of
    ``args.ranks`` (``args.timeout`` and ``args.threads`` as the collective
    benchmarks take them: a hung collective raises inside the ranks after
    the timeout, the stall limit 60 s later is the backstop). A world size
    that fails is recorded in ``failures`` and the next one runs;
    ``after_failure(added)`` is told how many records it added."""
    for world in args.ranks:
        before = len(records)
        try:
            run_ranks(target, world, cfg, timeout=args.timeout, stall=args.timeout + 60.0,
                      threads=threads_per_rank(world, args.threads), on_event=on_event)
        except RanksFailed as exc:
            failures.append({"ranks": world, "error": str(exc)})
            if after_failure is not None:
                after_failure(len(records) - before)
