"""An emulated slow cluster network on one machine, for the all-reduce benchmarks.

Each rank runs in its own network namespace ``<prefix>-r<i>`` with a veth
``eth0``; the other end of every veth (``v<i>``) sits on a bridge ``br0``
inside one more namespace, the "switch" ``<prefix>-sw``. With
``ranks_per_node`` L > 1 a namespace ``<prefix>-n<j>`` is a *node* holding
ranks ``[j L, (j+1) L)``: they share its address and reach each other over
its loopback, unshaped (the fast intra-node link), while traffic between
nodes crosses the shaped veths (``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are
set as torchrun sets them). Nothing is created
in the host namespace and the host's interfaces, routes and qdiscs are never
touched: the veths are created inside the switch namespace and moved straight
into the rank namespaces. Addresses come from a private /24 that exists only
inside these namespaces. Every link is shaped in both directions with tbf
(``tc qdisc replace dev X root tbf rate R burst B latency 100ms``, B about
R x 1 ms and at least 64 KiB): on the rank's ``eth0`` (rank -> switch) and on
its peer ``v<i>`` in the switch (switch -> rank). ``lo`` is never shaped
(shaping one shared ``lo`` caps the sum of all ranks' traffic: not a cluster).
The kernel here has tbf but no netem: the rate can be limited, latency and
loss cannot be injected.

Building needs root and iproute2 (``ip``, ``tc``). Namespaces left over by a
crashed run with the same prefix are deleted (by exact name) before a build;
everything built is deleted on exit from the ``with`` block, at interpreter
exit (atexit) and on SIGINT/SIGTERM, after the rank processes started through
the cluster have been killed and waited for by PID. Rank processes are
started by :mod:`pycomm_bench.launch`, through :meth:`EmulatedCluster.spawn`.

Where emulation is not available, :func:`make_cluster` says so once and
returns a :class:`LoopbackCluster` with the same interface (all ranks on
127.0.0.1, ``emulated=False``), so results can be labelled as such.

Example (as root)::

    >>> from pycomm_bench.netem import EmulatedCluster                  # doctest: +SKIP
    >>> from pycomm_bench.links import measure_busbw                    # doctest: +SKIP
    >>> with EmulatedCluster(2, 100e6) as c:                             # doctest: +SKIP
    ...     print(c.describe(), measure_busbw(c) / 1e6, "Mbit/s")
    2 ranks, namespaces pycomm-r*, tbf 100 Mbit/s each way  95.1 Mbit/s

    $ python -m pycomm_bench.links check --ranks 2 --rate 100M   # build, measure, print, tear down

This module starts no ranks itself: :mod:`pycomm_bench.launch` starts them
in a cluster, and :mod:`pycomm_bench.links` measures a cluster's links
with them.
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

#: Private /24 used only inside the namespaces built here (rank i gets .i+1).
SUBNET = "10.213.37"
MAX_RANKS = 200
DEFAULT_PORT = 29500
#: Seconds any single ``ip``/``tc`` call may take.
CMD_TIMEOUT = 10.0
#: Smallest tbf bucket (bytes): below ~64 KiB tbf throttles well under its rate.
MIN_BURST_BYTES = 64 * 1024
_NAME_OK = re.compile(r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")


# --------------------------------------------------------------------------- helpers


def _run(argv: Sequence[str], timeout: float = CMD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command, bounded in time; raise with its stderr on failure."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_list() -> List[str]:
    """Names of the existing network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_delete(name: str) -> None:
    """Delete one namespace by exact name (its veth ends go with it)."""
    _run(["ip", "netns", "delete", name], check=False)


def tbf_burst_bytes(rate_bits_per_s: float) -> int:
    """tbf bucket: the bytes of ~1 ms at the rate, at least 64 KiB."""
    return max(MIN_BURST_BYTES, int(rate_bits_per_s / 8 * 1e-3))


def parse_rate(text: str) -> Optional[float]:
    """``"100M"`` / ``"2.5G"`` / ``"800k"`` / ``"1e8"`` bits per second; ``"none"`` -> None.

    >>> parse_rate("100M"), parse_rate("2.5G"), parse_rate("none")
    (100000000.0, 2500000000.0, None)
    """
    t = text.strip().lower().removesuffix("bit/s").removesuffix("bps").removesuffix("bit")
    if t in ("", "none", "0", "unshaped"):
        return None
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1], 1.0)
    return float(t[:-1] if mult != 1.0 else t) * mult


def fmt_rate(bits_per_s: Optional[float]) -> str:
    """``100 Mbit/s``, ``2.5 Gbit/s``; ``unshaped`` for None.

    >>> fmt_rate(1e8), fmt_rate(2.5e9), fmt_rate(None)
    ('100 Mbit/s', '2.5 Gbit/s', 'unshaped')
    """
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


_available: Optional[Tuple[bool, str]] = None


def emulation_available() -> Tuple[bool, str]:
    """(True, "") where namespaces, veths and tbf work here; else (False, why).

    Checks root and iproute2, then builds and removes a throw-away namespace
    ``pycomm-probe-<pid>`` holding a veth pair shaped with tbf (the host
    namespace is not touched). The answer is cached for the process.
    """
    global _available
    if _available is not None:
        return _available
    if not sys.platform.startswith("linux"):
        _available = (False, f"network namespaces need Linux (this is {sys.platform})")
    elif os.geteuid() != 0:
        _available = (False, "network namespaces and tc need root (not running as root)")
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _available = (False, "iproute2 (ip, tc) is not installed")
    else:
        probe = f"pycomm-probe-{os.getpid()}"
        try:
            _netns_delete(probe)
            _run(["ip", "netns", "add", probe])
            _run(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
            _run(["tc", "-n", probe, "qdisc", "replace", "dev", "pa", "root", "tbf",
                  "rate", "100mbit", "burst", str(MIN_BURST_BYTES), "latency", "100ms"])
            _available = (True, "")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _available = (False, f"cannot build a shaped namespace here: {exc}")
        finally:
            try:
                _netns_delete(probe)
            except (OSError, subprocess.TimeoutExpired):
                pass
    return _available


# --------------------------------------------------------------------------- clusters


class _ClusterBase(abc.ABC):
    """What both clusters share: rank processes started through them, killed on close."""

    emulated = False
    world_size: int
    rate_bits_per_s: Optional[float]
    master_port: int
    ranks_per_node: int = 1

    def __init__(self) -> None:
        self._procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()

    # per-rank facts, overridden
    @abc.abstractmethod
    def addr(self, rank: int) -> str:
        """The address rank ``rank`` listens on."""

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    def _ifname(self) -> Optional[str]:
        return None

    def env(self, rank: int) -> Dict[str, str]:
        """Environment a rank process needs (on top of ``os.environ``) for
        ``init_process_group("gloo", init_method="env://")``."""
        e = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
        }
        if self._ifname():
            e["GLOO_SOCKET_IFNAME"] = self._ifname()
            e["TP_SOCKET_IFNAME"] = self._ifname()
        return e

    @abc.abstractmethod
    def command(self, rank: int, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed so that it runs where rank ``rank`` lives."""

    def spawn(self, rank: int, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
        """Start ``argv`` as rank ``rank`` (inside its namespace, with :meth:`env`).
        The process is killed and waited for when the cluster closes."""
        env = dict(os.environ)
        env.update(self.env(rank))
        env.update(popen_kw.pop("env", {}) or {})
        proc = subprocess.Popen(self.command(rank, argv), env=env, **popen_kw)
        with self._lock:
            self._procs.append(proc)
        return proc

    def kill_ranks(self) -> None:
        """Kill every still-running rank process started here and wait for each by PID."""
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=CMD_TIMEOUT)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                log.error("rank process %d did not exit after SIGKILL", p.pid)

    @abc.abstractmethod
    def describe(self) -> str:
        """One line saying what this cluster is (for reports)."""

    def close(self) -> None:
        self.kill_ranks()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_warned_fallback = False


class LoopbackCluster(_ClusterBase):
    """No emulation: every rank on 127.0.0.1 in the host namespace, unshaped.

    Same interface as :class:`EmulatedCluster` (``netns`` is None for every
    rank, ``command`` returns argv unchanged), ``emulated`` is False and
    :meth:`describe` says "loopback (not emulated)". The first one built in a
    process logs a warning with ``reason``, unless ``warn`` is False (local
    ranks on purpose, not a fallback).
    """

    emulated = False

    def __init__(self, world_size: int, reason: str = "", master_port: Optional[int] = None,
                 ranks_per_node: int = 1, warn: bool = True) -> None:
        super().__init__()
        global _warned_fallback
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.ranks_per_node = _check_ranks_per_node(ranks_per_node, world_size)
        self.rate_bits_per_s = None
        self.master_port = master_port if master_port is not None else free_port()
        self.reason = reason
        if warn and not _warned_fallback:
            _warned_fallback = True
            log.warning("network emulation unavailable%s; running on plain loopback (not emulated)",
                        f" ({reason})" if reason else "")

    def netns(self, rank: int) -> Optional[str]:
        self._check_rank(rank)
        return None

    def addr(self, rank: int) -> str:
        self._check_rank(rank)
        return "127.0.0.1"

    def command(self, rank: int, argv: Sequence[str]) -> List[str]:
        self._check_rank(rank)
        return list(argv)

    def describe(self) -> str:
        nodes = f" ({self.ranks_per_node} per node)" if self.ranks_per_node > 1 else ""
        return f"{self.world_size} ranks{nodes}, loopback (not emulated)"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} not in [0, {self.world_size})")


def _check_ranks_per_node(ranks_per_node: int, world_size: int) -> int:
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} does not divide world_size {world_size}")
    return ranks_per_node


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it).

    >>> 0 < free_port() < 65536
    True
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tx_bytes(ifname: Optional[str]) -> Optional[int]:
    """Bytes sent so far on ``ifname`` of this process's network namespace
    (``/proc/self/net/dev`` is per namespace), or None if there is none.

    >>> tx_bytes("lo") >= 0, tx_bytes(None)
    (True, None)
    """
    if not ifname:
        return None
    try:
        with open("/proc/self/net/dev", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    return int(rest.split()[8])  # receive has 8 fields, then transmit bytes
    except OSError:
        return None
    return None


class EmulatedCluster(_ClusterBase):
    """``world_size`` ranks in namespaces on a bridge, each link shaped to
    ``rate_bits_per_s`` in both directions (None: not shaped). Needs root.
    ``ranks_per_node`` > 1 puts that many ranks in each namespace (a node).

    Built on ``__enter__`` (or :meth:`build`), removed on ``__exit__`` /
    :meth:`close`, at exit and on SIGINT/SIGTERM. Names: ``<prefix>-sw`` (the
    switch) and ``<prefix>-r<i>`` (``<prefix>-n<j>`` for nodes); anything of
    that form that already exists is a leftover of a crashed run and is
    deleted first.
    """

    emulated = True

    def __init__(self, world_size: int, rate_bits_per_s: Optional[float] = None,
                 prefix: str = "pycomm", master_port: int = DEFAULT_PORT, ranks_per_node: int = 1) -> None:
        super().__init__()
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be in [1, {MAX_RANKS}], got {world_size}")
        if rate_bits_per_s is not None and not rate_bits_per_s > 0:
            raise ValueError(f"rate must be > 0 bit/s or None, got {rate_bits_per_s}")
        if not _NAME_OK.match(prefix) or len(prefix) > 40:
            raise ValueError(f"--netns-prefix: bad namespace prefix {prefix!r}: letters, digits, '_' and '.', "
                             f"in words joined by single '-', at most 40 characters")
        self.world_size = world_size
        self.ranks_per_node = _check_ranks_per_node(ranks_per_node, world_size)
        self.rate_bits_per_s = rate_bits_per_s
        self.prefix = prefix
        self.master_port = master_port
        self.switch = f"{prefix}-sw"
        nodes, kind = world_size // self.ranks_per_node, "n" if self.ranks_per_node > 1 else "r"
        self._rank_ns = [f"{prefix}-{kind}{i}" for i in range(nodes)]  # one per node
        self._created: List[str] = []
        self._built = False
        self._closed = False
        self._old_handlers: Dict[int, object] = {}

    # ---- names and addresses
    def netns(self, rank: int) -> str:
        return self._rank_ns[rank // self.ranks_per_node]

    def addr(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} not in [0, {self.world_size})")
        return self._node_addr(rank // self.ranks_per_node)

    def _node_addr(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _ifname(self) -> Optional[str]:
        return "eth0"

    def command(self, rank: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.netns(rank), *argv]

    def namespaces(self) -> List[str]:
        """Every namespace this cluster creates (switch first)."""
        return [self.switch, *self._rank_ns]

    def describe(self) -> str:
        shaping = (f"tbf {fmt_rate(self.rate_bits_per_s)} each way" if self.rate_bits_per_s
                   else "unshaped")
        if self.ranks_per_node > 1:
            return (f"{self.world_size} ranks in {len(self._rank_ns)} nodes of {self.ranks_per_node} "
                    f"(namespaces {self.prefix}-n*, loopback inside), links between nodes {shaping}")
        return f"{self.world_size} ranks, namespaces {self.prefix}-r*, {shaping}"

    # ---- build / tear down
    def stale_namespaces(self) -> List[str]:
        """Existing namespaces named like this prefix's (``<prefix>-sw``, ``<prefix>-r<N>``)."""
        pat = re.compile(rf"^{re.escape(self.prefix)}-(sw|r[0-9]+|n[0-9]+)$")
        return [n for n in _netns_list() if pat.match(n)]

    def remove_stale(self) -> List[str]:
        stale = self.stale_namespaces()
        for name in stale:
            log.info("deleting stale namespace %s", name)
            _netns_delete(name)
        return stale

    def build(self) -> "EmulatedCluster":
        if self._built:
            return self
        ok, why = emulation_available()
        if not ok:
            raise RuntimeError(f"cannot emulate a network here: {why}")
        self._install_cleanup()
        self._built = True
        try:
            self.remove_stale()
            sw = self.switch
            self._add_ns(sw)
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
            for node, ns in enumerate(self._rank_ns):
                self._add_ns(ns)
                peer = f"v{node}"
                # created inside the switch namespace, one end moved straight into the rank's
                _run(["ip", "-n", sw, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns])
                _run(["ip", "-n", sw, "link", "set", peer, "master", "br0"])
                _run(["ip", "-n", sw, "link", "set", peer, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self._node_addr(node)}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                if self.rate_bits_per_s is not None:
                    self._shape(ns, "eth0")   # rank -> switch
                    self._shape(sw, peer)     # switch -> rank
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def _shape(self, ns: str, dev: str) -> None:
        rate = int(self.rate_bits_per_s)
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
              "burst", str(tbf_burst_bytes(rate)), "latency", "100ms"])

    def close(self) -> None:
        """Kill rank processes (waited by PID), then delete every namespace created."""
        if self._closed:
            return
        self._closed = True
        try:
            self.kill_ranks()
        finally:
            for name in reversed(self._created):
                try:
                    _netns_delete(name)
                except (OSError, subprocess.TimeoutExpired) as exc:  # pragma: no cover
                    log.error("could not delete namespace %s: %s", name, exc)
            self._created = []
            self._restore_handlers()

    def __enter__(self) -> "EmulatedCluster":
        return self.build()

    # ---- cleanup on exit / Ctrl-C
    def _install_cleanup(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.close)
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, old)
        self._old_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # also restores the old handler
        if callable(old):
            old(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif old == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def make_cluster(world_size: int, rate_bits_per_s: Optional[float] = None, prefix: str = "pycomm",
                 ranks_per_node: int = 1):
    """An :class:`EmulatedCluster` where emulation works, else a :class:`LoopbackCluster`
    (which logs why, once). Use as a context manager."""
    ok, why = emulation_available()
    if ok:
        return EmulatedCluster(world_size, rate_bits_per_s, prefix=prefix, ranks_per_node=ranks_per_node)
    return LoopbackCluster(world_size, reason=why, ranks_per_node=ranks_per_node)
