"""A local `mooncake_master` child process on loopback: free ports, start, readiness, stop, and
the Mooncake client config that points at it. Used by `layerkv master` and the test fixtures.
No mooncake import (the binary is found next to the running Python). Not thread-safe: one owner
starts and stops a `MasterProcess`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerkv.errors import StoreError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses smaller global segments (setup -> -600)
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
MASTER_BINARY = "mooncake_master"


def find_master_binary() -> Path:
    """The `mooncake_master` next to the running interpreter (the venv's bin), else on PATH.

    Raises StoreError naming both places when neither has it.
    """
    beside = Path(sys.executable).parent / MASTER_BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(MASTER_BINARY)
    if found:
        return Path(found)
    raise StoreError(
        f"{MASTER_BINARY} not found next to {sys.executable} nor on PATH; "
        "install it with `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def tcp_reachable(host: str, port: int, timeout_s: float) -> OSError | None:
    """None if a TCP connect to host:port succeeds within timeout_s, else the error."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return exc
    return None


def http_answers(host: str, port: int, path: str, timeout_s: float) -> bool:
    """True if an HTTP GET gets any response (any status) within timeout_s."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return True


@dataclass(frozen=True, slots=True)
class MasterPorts:
    rpc_port: int
    http_port: int
    metrics_port: int

    @classmethod
    def pick(cls, rpc_port: int | None = None, http_port: int | None = None) -> MasterPorts:
        return cls(rpc_port or free_port(), http_port or free_port(), free_port())


@dataclass(slots=True)
class MasterProcess:
    """A running `mooncake_master` bound to 127.0.0.1. Stop it with `stop()`."""

    ports: MasterPorts
    lease_ttl_ms: int | None
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """The master's RPC address, `127.0.0.1:<rpc_port>` (Mooncake's master_server_address)."""
        return f"{LOOPBACK}:{self.ports.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.http_port}/metadata"

    @property
    def pid(self) -> int:
        assert self.popen is not None, "master not started"
        return self.popen.pid

    def argv(self, binary: Path) -> list[str]:
        args = [
            str(binary),
            f"--rpc_port={self.ports.rpc_port}",
            f"--rpc_address={LOOPBACK}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={self.ports.http_port}",
            f"--metrics_port={self.ports.metrics_port}",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        return args

    def start(self, timeout_s: float = 20.0) -> None:
        """Spawn the master and wait until its RPC port accepts and its HTTP metadata server
        answers. Raises StoreError (with the log tail) if it exits or misses the deadline."""
        binary = find_master_binary()
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(
                self.argv(binary), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop it in order
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise StoreError(
                    f"mooncake_master exited with {self.popen.returncode} at startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.serving(probe_timeout_s=0.2):
                log.info("mooncake_master pid %d serving at %s", self.pid, self.address)
                return
            time.sleep(0.05)  # polling an external process with a deadline
        self.stop()
        raise StoreError(
            f"mooncake_master at {self.address} not serving after {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def serving(self, probe_timeout_s: float = 0.5) -> bool:
        """True if the RPC port accepts a connection and the metadata server answers HTTP."""
        if tcp_reachable(LOOPBACK, self.ports.rpc_port, probe_timeout_s) is not None:
            return False
        return http_answers(LOOPBACK, self.ports.http_port, "/metadata?key=layerkv_probe", probe_timeout_s)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait up to timeout_s, then SIGKILL. Idempotent."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("mooncake_master pid %d ignored SIGTERM for %.0f s; killing", self.pid, timeout_s)
            self.popen.kill()
            self.popen.wait(timeout=timeout_s)

    def restart(self, timeout_s: float = 20.0) -> None:
        """Stop and start again on the same ports (all objects are lost: Mooncake has no HA here)."""
        self.stop()
        self.start(timeout_s)

    def config(
        self,
        global_segment_size: int | str = MIN_SEGMENT_BYTES,
        local_buffer_size: int | str = DEFAULT_LOCAL_BUFFER_BYTES,
    ) -> dict[str, Any]:
        """The Mooncake client JSON config (MOONCAKE_CONFIG_PATH format) for this master."""
        return {
            "local_hostname": LOOPBACK,
            "metadata_server": self.metadata_url,
            "master_server_address": self.address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
        }

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(lines[-num_lines:])


def start_master(
    lease_ttl_ms: int | None = None,
    *,
    rpc_port: int | None = None,
    http_port: int | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout_s: float = 20.0,
) -> MasterProcess:
    """Start a `mooncake_master` on loopback (free ports unless given) and wait until it serves.

    `lease_ttl_ms` sets --default_kv_lease_ttl (Mooncake's default otherwise). The log goes to
    `log_path` (a fresh temp file by default). Raises StoreError if it does not come up.
    """
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
        os.close(fd)
        log_path = name
    master = MasterProcess(MasterPorts.pick(rpc_port, http_port), lease_ttl_ms, Path(log_path))
    master.start(timeout_s)
    return master


class LocalDeployment:
    """`layerkv master` run as a child process (master + segment holder on loopback): what the
    demo and the benchmarks use when no MOONCAKE_CONFIG_PATH is given. Objects live in the
    child's segment, so clients may hold no memory (global_segment_size 0), as in production."""

    def __init__(self, segment_size: str = "512MB", startup_timeout_s: float = 60.0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="layerkv-master-")
        self.config_path = Path(self._dir.name) / "mooncake.json"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "layerkv.cli", "master", "--port", "0", "--http-port", "0",
             "--segment-size", segment_size, "--config-out", str(self.config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        line = _first_line(self._proc, startup_timeout_s)
        if not line.startswith("{"):
            self.stop()
            raise StoreError(f"layerkv master did not start within {startup_timeout_s:.0f} s (exit code {self._proc.poll()})")
        self.client_config = json.loads(line)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._dir.cleanup()

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The child's first stdout line, read on a helper thread so a silent child cannot hang us."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
                              name="layerkv-master-stdout", daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""
