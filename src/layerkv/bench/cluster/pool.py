"""A Mooncake pool spread over network-namespace hosts (layerkv.bench.cluster.netns): `layerkv master
--host` on a master host with no storage of its own, `layerkv segment` on each storage host,
and processes started on any host with the pool's client config for that host. Used by `layerkv
bench network` and the cluster test tiers. `started_pool` makes one and removes it (checked: no
link left behind). Needs root, iproute2 and a private network namespace to join the switch from
(`cluster_problems` says what is missing). Driver thread only.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import layerkv
from layerkv.bench.cluster.netns import Cluster, Host, missing_tools

SEGMENT = "256MB"


def cluster_problems() -> list[str]:
    """Why a cluster cannot be made here (empty: it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("it needs root (network namespaces, veth links)")
    if missing_tools():
        problems.append(f"it needs {', '.join(missing_tools())} (apt-get install iproute2 util-linux)")
    if os.environ.get("LAYERKV_IN_NETNS") != "1":
        problems.append(
            "it must run inside a private network namespace (scripts/isolated.sh; make test does), "
            "never in this machine's own"
        )
    return problems


class HostProcess:
    """A process on a cluster host; its stdout lines are read by a thread, its stderr's last
    lines kept (Mooncake's own info and warning lines left out)."""

    def __init__(self, host: Host, argv: list[str], name: str, pythonpath: Sequence[Path] = ()) -> None:
        path = [str(Path(layerkv.__file__).parents[1]), *map(str, pythonpath)]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=host.addr, PYTHONPATH=os.pathsep.join(path))
        self.name = name
        self.proc = host.popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, name=f"cluster-{name}-out", daemon=True).start()
        threading.Thread(target=self._read_err, name=f"cluster-{name}-err", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if not line.startswith(("I1", "W1")):  # Mooncake's info and warning lines
                self.stderr = (self.stderr + [line])[-60:]

    def line(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line starting with `prefix` (without it); RuntimeError with the
        stderr tail if none comes within `timeout_s` or the process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"{self.name}: no {prefix!r} line within {timeout_s:.0f} s; stderr:\n" + "".join(self.stderr)
                ) from None
            if line is None:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; stderr:\n" + "".join(self.stderr))
            if line.startswith(prefix):
                return line[len(prefix) :]

    def send(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float = 30.0) -> int:
        """Close its stdin (its cue to finish) and wait; killed after `timeout_s`."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@dataclass
class ClusterPool:
    cluster: Cluster
    config: dict[str, Any]  # the client config the master printed (local_hostname: the master host)
    tmp: Path
    metrics_url: str  # the master's HTTP server (/get_all_segments, /get_all_keys)
    pythonpath: Sequence[Path] = ()  # for the modules `run_module` starts
    segments: dict[str, HostProcess] = field(default_factory=dict)
    segment_names: dict[str, str] = field(default_factory=dict)  # host -> Mooncake segment name

    def client_config(self, host: str, segment_bytes: int = 0) -> dict[str, Any]:
        return dict(self.config, local_hostname=self.cluster[host].addr, global_segment_size=segment_bytes)

    def mounted_segments(self) -> list[str]:
        """The segments the master has mounted now (its /get_all_segments): a holder the
        master dropped (no heartbeat for its client_ttl) is no longer listed."""
        with urllib.request.urlopen(self.metrics_url + "/get_all_segments", timeout=10) as answer:
            return answer.read().decode().split()

    def wait_unmounted(self, host: str, timeout_s: float = 60.0) -> float:
        """Seconds until the master no longer lists `host`'s segment; RuntimeError after
        `timeout_s`."""
        start = time.monotonic()
        while self.segment_names[host] in self.mounted_segments():
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the master still lists {host}'s segment after {timeout_s:.0f} s")
            time.sleep(0.5)
        return round(time.monotonic() - start, 2)

    def run_module(self, host: str, module: str, job: dict[str, Any], name: str) -> HostProcess:
        """`python -m module <job.json>` on `host`; the job gets the host's client config as
        "mooncake"."""
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps({"mooncake": self.client_config(host), **job}))
        return HostProcess(self.cluster[host], [sys.executable, "-m", module, str(path)], name, self.pythonpath)

    def start_segment(self, host: str, size: str = SEGMENT) -> HostProcess:
        proc = HostProcess(
            self.cluster[host],
            [
                sys.executable,
                "-m",
                "layerkv.cli",
                "segment",
                "--config",
                str(self.tmp / "pool.json"),
                "--host",
                self.cluster[host].addr,
                "--size",
                size,
            ],
            f"segment-{host}",
        )
        mounted = json.loads("{" + proc.line("{", 60.0))
        self.segments[host] = proc
        self.segment_names[host] = mounted["segment"]
        return proc


@contextmanager
def started_pool(
    tmp: Path,
    hosts: Sequence[str],
    storage: Sequence[str],
    segment: str = SEGMENT,
    pythonpath: Sequence[Path] = (),
    pool_type: type[ClusterPool] | None = None,
) -> Iterator[ClusterPool]:
    """The cluster `hosts` with the master on "master" and a `segment`-byte holder on each of
    `storage` (a `pool_type`, a subclass of ClusterPool, if given); removed on exit, even when the body fails
    (RuntimeError if a link outlives it).
    Raises RuntimeError naming what is missing when a cluster cannot be made here."""
    problems = cluster_problems()
    if problems:
        raise RuntimeError("a namespace cluster cannot be made here: " + "; ".join(problems))
    cluster = Cluster(hosts)
    try:
        master = HostProcess(
            cluster["master"],
            [
                sys.executable,
                "-m",
                "layerkv.cli",
                "master",
                "--host",
                cluster["master"].addr,
                "--port",
                "0",
                "--http-port",
                "0",
                "--segment-size",
                "0",
                "--config-out",
                str(tmp / "pool.json"),
                "--info-out",
                str(tmp / "master.json"),
            ],
            "master",
        )
        config = json.loads("{" + master.line("{", 60.0))
        info = json.loads((tmp / "master.json").read_text())
        pool = (pool_type or ClusterPool)(cluster, config, tmp, info["metrics_url"], pythonpath)
        for host in storage:
            pool.start_segment(host, segment)
        yield pool
    finally:
        cluster.close()
    left = Cluster.leftover_links()
    if left:
        raise RuntimeError(f"the cluster left links behind: {left}")
