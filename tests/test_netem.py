"""The emulated cluster network (pycomm_bench.netem): shaped namespaces,
teardown (normal, on an exception, on SIGINT, stale leftovers) and the
loopback fallback. Tests that build namespaces skip, with the reason, where
emulation_available() is False (not root, no iproute2, ...)."""

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _dist import subprocess_env

from pycomm_bench import netem
from pycomm_bench.links import measure_busbw
from pycomm_bench.netem import EmulatedCluster, LoopbackCluster, emulation_available

_OK, _WHY = emulation_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"network emulation unavailable: {_WHY}")

PREFIX = "pycommtest"  # not the harness's own prefix: a test never deletes a real run's namespaces
RATE = 100e6
NBYTES = 4 << 20  # 0.34 s per all-reduce at 100 Mbit/s, 2 ranks


def _ours(prefix=PREFIX):
    # Exactly this prefix's names: the DDP and hierarchy benchmark tests build
    # pycommtest-ddp-* and pycommtest-hier-*, maybe at the same time.
    pattern = re.compile(rf"^{re.escape(prefix)}-(sw|r[0-9]+|n[0-9]+)$")
    return [n for n in netem._netns_list() if pattern.match(n)]


@pytest.fixture
def clean():
    """Nothing with the test prefix before or after a test."""
    for n in _ours():
        netem._netns_delete(n)
    yield
    left = _ours()
    for n in left:
        netem._netns_delete(n)
    assert not left, f"namespaces left behind: {left}"


@needs_netns
def test_shaped_rate_is_measured_and_unshaped_is_faster(clean):
    with EmulatedCluster(2, RATE, prefix=PREFIX) as c:
        assert c.emulated and c.rate_bits_per_s == RATE
        shaped = measure_busbw(c, nbytes=NBYTES, repeats=5, timeout=60)
    with EmulatedCluster(2, None, prefix=PREFIX) as c:
        unshaped = measure_busbw(c, nbytes=NBYTES, repeats=5, timeout=60)
    print(f"set {RATE / 1e6:.0f} Mbit/s: measured {shaped / 1e6:.1f} Mbit/s "
          f"({shaped / RATE:.2f} x); unshaped {unshaped / 1e6:.0f} Mbit/s")
    assert 0.8 * RATE <= shaped <= 1.05 * RATE
    assert unshaped > 3 * shaped


@needs_netns
def test_layout_and_interface(clean):
    with EmulatedCluster(3, RATE, prefix=PREFIX) as c:
        assert sorted(_ours()) == sorted(c.namespaces()) == [f"{PREFIX}-r{i}" for i in range(3)] + [f"{PREFIX}-sw"]
        assert [c.netns(r) for r in range(3)] == [f"{PREFIX}-r{i}" for i in range(3)]
        assert c.master_addr == c.addr(0) and len({c.addr(r) for r in range(3)}) == 3
        env = c.env(1)
        assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == c.addr(0)
        assert env["RANK"] == "1" and env["WORLD_SIZE"] == "3"
        assert c.command(2, ["true"]) == ["ip", "netns", "exec", f"{PREFIX}-r2", "true"]
        # tbf in both directions of every link; rank namespaces see only lo + eth0
        for r in range(3):
            q = subprocess.run(["tc", "-n", c.netns(r), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, timeout=10).stdout
            assert "tbf" in q and "100Mbit" in q, q
            q = subprocess.run(["tc", "-n", c.switch, "qdisc", "show", "dev", f"v{r}"],
                               capture_output=True, text=True, timeout=10).stdout
            assert "tbf" in q and "100Mbit" in q, q
        links = subprocess.run(c.command(1, ["ip", "-o", "link"]), capture_output=True, text=True,
                               timeout=10).stdout
        assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == ["eth0", "lo"]
        # rank 1 reaches rank 2 across the bridge (TCP; ping is not installed everywhere)
        listen = ("import socket; s = socket.create_server(('%s', 29511)); print('up', flush=True); "
                  "conn, _ = s.accept(); conn.sendall(b'hi'); conn.close()" % c.addr(2))
        server = c.spawn(2, [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        connect = "import socket; print(socket.create_connection(('%s', 29511), timeout=5).recv(2).decode())" % c.addr(2)
        got = subprocess.run(c.command(1, [sys.executable, "-c", connect]), capture_output=True, text=True,
                             timeout=20)
        assert got.stdout.strip() == "hi", got.stderr
        server.wait(timeout=10)
    assert _ours() == []


@needs_netns
def test_nodes_hold_several_ranks(clean):
    # 4 ranks in 2 nodes: ranks of a node share its namespace and address
    # (they meet over its unshaped loopback); nodes are joined by shaped links.
    with EmulatedCluster(4, RATE, prefix=PREFIX, ranks_per_node=2) as c:
        assert sorted(_ours()) == sorted(c.namespaces()) == [f"{PREFIX}-n0", f"{PREFIX}-n1", f"{PREFIX}-sw"]
        assert [c.netns(r) for r in range(4)] == [f"{PREFIX}-n0"] * 2 + [f"{PREFIX}-n1"] * 2
        assert c.addr(0) == c.addr(1) != c.addr(2) == c.addr(3)
        assert [(c.env(r)["LOCAL_RANK"], c.env(r)["LOCAL_WORLD_SIZE"]) for r in range(4)] == [
            ("0", "2"), ("1", "2"), ("0", "2"), ("1", "2")]
        assert "2 nodes of 2" in c.describe()
        for ns in (c.netns(0), c.netns(2)):
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, timeout=10).stdout
            assert "tbf" in q, q
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "lo"], capture_output=True,
                               text=True, timeout=10).stdout
            assert "tbf" not in q, q
    assert _ours() == []
    with pytest.raises(ValueError, match="does not divide"):
        EmulatedCluster(4, RATE, prefix=PREFIX, ranks_per_node=3)


@needs_netns
def test_teardown_when_body_raises_kills_ranks(clean):
    with pytest.raises(ZeroDivisionError):
        with EmulatedCluster(2, RATE, prefix=PREFIX) as c:
            p = c.spawn(1, ["sleep", "60"])
            assert len(_ours()) == 3
            1 / 0
    assert p.poll() is not None  # killed and waited for
    assert _ours() == []


@needs_netns
def test_stale_namespaces_removed_first(clean):
    for name in (f"{PREFIX}-r0", f"{PREFIX}-r7", f"{PREFIX}-sw"):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    other = f"{PREFIX}x-r0"  # a different prefix: left alone
    subprocess.run(["ip", "netns", "add", other], check=True, timeout=10)
    try:
        with EmulatedCluster(2, None, prefix=PREFIX) as c:
            assert sorted(_ours()) == sorted(c.namespaces())  # r7 gone, r0/sw rebuilt
            assert other in netem._netns_list()
        assert _ours() == []
    finally:
        netem._netns_delete(other)


@needs_netns
def test_sigint_cleans_up(clean, tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pycomm_bench.netem import EmulatedCluster
        with EmulatedCluster(2, 1e8, prefix={PREFIX!r}) as c:
            p = c.spawn(0, ["sleep", "60"])
            print(p.pid, flush=True)
            time.sleep(60)
    """)
    # SIGINT at its default even where the suite was started in the
    # background (a shell's "&" ignores it, and children inherit that).
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        rank_pid = int(proc.stdout.readline())
        assert len(_ours()) == 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert _ours() == []
    assert not os.path.exists(f"/proc/{rank_pid}") or "zombie" in open(f"/proc/{rank_pid}/status").read().lower()


def test_loopback_fallback_interface(monkeypatch, caplog):
    monkeypatch.setattr(netem, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="pycomm_bench.netem"):
        c = LoopbackCluster(2, reason="testing")
        LoopbackCluster(2, reason="testing")
    warnings = [r for r in caplog.records if "loopback" in r.getMessage()]
    assert len(warnings) == 1 and "testing" in warnings[0].getMessage()  # said once
    with c:
        assert c.emulated is False and c.rate_bits_per_s is None
        assert c.netns(0) is None and c.addr(1) == c.master_addr == "127.0.0.1"
        assert c.command(1, ["python", "x"]) == ["python", "x"]
        env = c.env(1)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
        assert "not emulated" in c.describe()
        assert measure_busbw(c, nbytes=1 << 20, repeats=2, timeout=60) > 0


def test_make_cluster_falls_back(monkeypatch):
    monkeypatch.setattr(netem, "emulation_available", lambda: (False, "no root here"))
    monkeypatch.setattr(netem, "_warned_fallback", True)
    c = netem.make_cluster(2, 1e8)
    assert isinstance(c, LoopbackCluster) and c.reason == "no root here"


def test_helpers():
    assert netem.parse_rate("100M") == 1e8 and netem.parse_rate("2.5Gbit") == 2.5e9
    assert netem.parse_rate("none") is None
    assert netem.tbf_burst_bytes(100e6) == 64 * 1024  # 1 ms is 12.5 KB: the floor applies
    assert netem.tbf_burst_bytes(2.5e9) == 312500
    with pytest.raises(ValueError):
        EmulatedCluster(2, 1e8, prefix="bad name; rm")


def test_bad_netns_prefix_names_the_flag():
    # Refused before any namespace is made, naming the flag (not --merge).
    with pytest.raises(ValueError, match=r"--netns-prefix: bad namespace prefix 'ncq-'"):
        EmulatedCluster(2, 1e9, prefix="ncq-")
    proc = subprocess.run([sys.executable, "-m", "pycomm_bench", "ddp", "--netns-prefix", "ncq-"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--netns-prefix: bad namespace prefix 'ncq-'" in proc.stderr and "--merge" not in proc.stderr
