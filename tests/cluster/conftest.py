"""The cluster tier: a Mooncake pool spread over network namespaces that stand for hosts
(tests/cluster/net.py): a master host (`layerkv master --host`, no storage of its own), two
storage hosts (`layerkv segment`), a producer and a consumer engine host. Needs root, iproute2
and scripts/isolated.sh's private namespace (make test runs the suite in it): without them the
tier fails, saying why; it is never skipped."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import layerkv
from tests.cluster.net import Cluster, Host, missing_tools

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("master", "store1", "store2", "producer", "consumer")
SEGMENT = "256MB"


def _require_cluster_rights() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("it needs root (network namespaces, veth links)")
    if missing_tools():
        problems.append(f"it needs {', '.join(missing_tools())} (apt-get install iproute2 util-linux)")
    if os.environ.get("LAYERKV_IN_NETNS") != "1":
        problems.append("it must run inside scripts/isolated.sh's private network namespace (make test does), "
                        "never in this machine's own")
    if problems:
        pytest.fail("the cluster tier cannot run: " + "; ".join(problems), pytrace=False)


class Proc:
    """A process on a cluster host whose stdout lines are read by a thread."""

    def __init__(self, host: Host, argv: list[str], name: str) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=host.addr,
                   PYTHONPATH=os.pathsep.join([str(Path(layerkv.__file__).parents[1]), str(REPO_ROOT)]))
        self.name = name
        self.proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=REPO_ROOT)
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
        """The first stdout line starting with `prefix` (without it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {prefix!r} line within {timeout_s:.0f} s; stderr:\n"
                                     + "".join(self.stderr)) from None
            if line is None:
                self.proc.wait(timeout=10)
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}; stderr:\n" + "".join(self.stderr))
            if line.startswith(prefix):
                return line[len(prefix):]

    def send(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@dataclass
class Pool:
    cluster: Cluster
    config: dict[str, Any]  # the client config the master printed (local_hostname: the master host)
    tmp: Path
    segments: dict[str, Proc] = field(default_factory=dict)
    segment_names: dict[str, str] = field(default_factory=dict)  # host -> Mooncake segment name

    def client_config(self, host: str, segment_bytes: int = 0) -> dict[str, Any]:
        return dict(self.config, local_hostname=self.cluster[host].addr, global_segment_size=segment_bytes)

    def engine(self, host: str, job: dict[str, Any], name: str) -> Proc:
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps({"mooncake": self.client_config(host), **job}))
        return Proc(self.cluster[host], [sys.executable, "-m", "tests.cluster.engine_process", str(path)], name)

    def report(self, proc: Proc, timeout_s: float = 180.0) -> dict[str, Any]:
        """The engine's "@@" report line."""
        return json.loads("{" + proc.line("@@{", timeout_s))

    def start_segment(self, host: str) -> Proc:
        proc = Proc(self.cluster[host], [sys.executable, "-m", "layerkv.cli", "segment", "--config",
                                         str(self.tmp / "pool.json"), "--host", self.cluster[host].addr,
                                         "--size", SEGMENT], f"segment-{host}")
        mounted = json.loads("{" + proc.line("{", 60.0))
        self.segments[host] = proc
        self.segment_names[host] = mounted["segment"]
        return proc


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    _require_cluster_rights()
    tmp = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(HOSTS)
    try:
        master = Proc(cluster["master"], [sys.executable, "-m", "layerkv.cli", "master", "--host", cluster["master"].addr,
                                          "--port", "0", "--http-port", "0", "--segment-size", "0",
                                          "--config-out", str(tmp / "pool.json")], "master")
        config = json.loads("{" + master.line("{", 60.0))
        pool = Pool(cluster, config, tmp)
        for host in ("store1", "store2"):
            pool.start_segment(host)
        yield pool
    finally:
        cluster.close()
    assert Cluster.leftover_links() == [], "the cluster left links behind"
