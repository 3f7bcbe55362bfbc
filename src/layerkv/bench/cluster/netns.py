"""Hosts for the cluster tier: each host is a network namespace of its own, held open by a
sleeper process (`unshare --net`), with one veth link to a switch namespace that bridges them
(10.99.0.0/24: addresses that exist only inside the namespaces made here, never routed
anywhere else). The test process's own namespace (scripts/isolated.sh's) joins the switch too, as
host `TEST_HOST_ADDR`, so an engine in the test process is a host like the others.

Everything dies with its sleeper: `Cluster.close` kills the processes started on the hosts,
then the sleepers; the kernel then drops the namespaces and every veth end in them. Each
sleeper also dies with the test process (PR_SET_PDEATHSIG), so a crashed run leaves nothing.
Needs root and iproute2 (`ip`, `nsenter`, `unshare`, `tc`). Test thread only.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.99.0"
TEST_HOST_ADDR = f"{SUBNET}.254"
TEST_HOST = "test"  # Cluster.limit / unlimit: the test process's own port
_PR_SET_PDEATHSIG = 1
TOOLS = ("ip", "nsenter", "unshare", "tc")
# A connection to a host that is cut sends SYNs into the void: the kernel's default 6 retries give
# up after ~127 s, longer than a test waits for a Mooncake client call to a lost host to return.
# 3 retries give up after ~15 s (the setting an operator would choose for a pool on a LAN too).
SYN_RETRIES = 3


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _in_netns(netns_pid: int, argv: Sequence[str]) -> list[str]:
    """`argv` run inside the network namespace of `netns_pid`."""
    return ["nsenter", f"--net=/proc/{netns_pid}/ns/net", "--", *argv]


def _checked(argv: Sequence[str]) -> None:
    """Run `argv`; RuntimeError with its command line and stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _ip(*args: str, netns_pid: int | None = None) -> None:
    _checked(["ip", *args] if netns_pid is None else _in_netns(netns_pid, ["ip", *args]))


def _sysctl(netns_pid: int, key: str, value: int) -> None:
    """Set `key` in the network namespace of `netns_pid` (net.* keys are per namespace; /proc/sys/net
    shows the namespace of the process reading it)."""
    path = "/proc/sys/" + key.replace(".", "/")
    _checked(_in_netns(netns_pid, ["sh", "-c", f"echo {int(value)} > {path}"]))


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["unshare", "--net", "--", "sleep", "86400"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )


def _wait_own_netns(pid: int, timeout_s: float = 5.0) -> None:
    """Until `pid` (an `unshare --net` child) has entered its new namespace."""
    mine = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != mine:
                return
        except OSError:
            pass
        time.sleep(0.01)  # polling a child's namespace switch, bounded
    raise RuntimeError(f"process {pid} did not enter a network namespace of its own within {timeout_s:.0f} s")


@dataclass
class Host:
    name: str
    addr: str
    sleeper: subprocess.Popen[bytes]
    port: str  # its veth end in the switch namespace (cut = down)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.sleeper.pid

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return _in_netns(self.pid, argv)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this host; it is killed at Cluster.close (and with the test process)."""
        proc = subprocess.Popen(self.argv(argv), preexec_fn=_die_with_parent, **kwargs)
        self.procs.append(proc)
        return proc


class Cluster:
    """Hosts `names` (10.99.0.1, .2, ...) and the test process (10.99.0.254) on one switch."""

    def __init__(self, names: Sequence[str]) -> None:
        self.hosts: dict[str, Host] = {}
        self._switch = _sleeper()
        self._test_port = ""
        try:
            _wait_own_netns(self._switch.pid)
            _ip(
                "link",
                "add",
                "br0",
                "type",
                "bridge",
                "forward_delay",
                "0",
                "stp_state",
                "0",
                netns_pid=self._switch.pid,
            )
            _ip("link", "set", "br0", "up", netns_pid=self._switch.pid)
            for i, name in enumerate(names, start=1):
                self.hosts[name] = self._add_host(name, f"{SUBNET}.{i}", i)
            self._test_port = self._link(None, TEST_HOST_ADDR, "lkvt")
            for host in self.hosts.values():
                wait_reachable(host.addr)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _add_host(self, name: str, addr: str, index: int) -> Host:
        sleeper = _sleeper()
        host = Host(name, addr, sleeper, "")
        self.hosts[name] = host  # closed with the others if linking fails
        _wait_own_netns(sleeper.pid)
        _ip("link", "set", "lo", "up", netns_pid=sleeper.pid)
        _sysctl(sleeper.pid, "net.ipv4.tcp_syn_retries", SYN_RETRIES)
        host.port = self._link(sleeper.pid, addr, f"lkv{index}")
        return host

    def _link(self, host_pid: int | None, addr: str, base: str) -> str:
        """A veth pair: `<base>h` with `addr` in the host (None: this process's namespace),
        `<base>s` on the switch's bridge; returns the switch end's name."""
        inner, outer = f"{base}h", f"{base}s"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        try:
            _ip("link", "set", outer, "netns", str(self._switch.pid))
            if host_pid is not None:
                _ip("link", "set", inner, "netns", str(host_pid))
        except BaseException:
            subprocess.run(["ip", "link", "del", inner], capture_output=True, timeout=10)
            raise
        _ip("addr", "add", f"{addr}/24", "dev", inner, netns_pid=host_pid)
        _ip("link", "set", inner, "up", netns_pid=host_pid)
        _ip("link", "set", outer, "master", "br0", netns_pid=self._switch.pid)
        _ip("link", "set", outer, "up", netns_pid=self._switch.pid)
        return outer

    def cut(self, name: str) -> None:
        """Partition host `name`: its switch port goes down (its own interface stays up)."""
        _ip("link", "set", self.hosts[name].port, "down", netns_pid=self._switch.pid)

    def heal(self, name: str) -> None:
        """Undo `cut`; returns once the host carries traffic again. Its failed neighbour entries
        (ARP lookups made while cut) are flushed: they would answer "no route to host" for a
        while after the link is back."""
        host = self.hosts[name]
        _ip("link", "set", host.port, "up", netns_pid=self._switch.pid)
        _ip("neigh", "flush", "all", netns_pid=host.pid)
        wait_reachable(host.addr)

    def _port(self, name: str) -> str:
        return self._test_port if name == TEST_HOST else self.hosts[name].port

    def limit(self, name: str, rate: str) -> None:
        """Shape what the switch sends to host `name` (its downlink; TEST_HOST: this process's)
        to `rate` (e.g. 1gbit)."""
        port = self._port(name)
        tbf = ["tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        _checked(_in_netns(self._switch.pid, tbf))

    def unlimit(self, name: str) -> None:
        """Remove the shaping `limit` put on host `name`'s downlink."""
        argv = _in_netns(self._switch.pid, ["tc", "qdisc", "del", "dev", self._port(name), "root"])
        subprocess.run(argv, capture_output=True, text=True, timeout=10)  # none there: nothing to remove

    def close(self) -> None:
        """Kill every process started on a host, then the hosts and the switch: their
        namespaces and links go with them. Idempotent."""
        for host in self.hosts.values():
            for proc in host.procs:
                _kill(proc)
        for host in self.hosts.values():
            _kill(host.sleeper)
        _kill(self._switch)
        if self._test_port:  # its host end lives in this namespace: delete it (and so its peer)
            subprocess.run(["ip", "link", "del", "lkvth"], capture_output=True, timeout=10)
            self._test_port = ""

    @staticmethod
    def leftover_links(wait_s: float = 5.0) -> list[str]:
        """Links of this test's namespace that a cluster made and that still exist after
        `wait_s` (the kernel tears a dead namespace's links down in the background)."""
        deadline = time.monotonic() + wait_s
        while True:
            out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
            left = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ": lkv" in line]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)  # polling the kernel's teardown, bounded


def wait_reachable(addr: str, timeout_s: float = 15.0) -> None:
    """Until `addr` answers from this namespace (a refused connection to a closed port is an
    answer): a new link takes about a second before it carries traffic."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, 9), timeout=0.5):
                return
        except ConnectionRefusedError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{addr} not reachable within {timeout_s:.0f} s") from None
            time.sleep(0.05)  # polling a link coming up, bounded


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
