"""A local `mooncake_master` child process on loopback: ports, start, readiness, stop, and the
Mooncake client config that points at it. Ready means *this* child is alive and is the process
listening on its RPC and HTTP ports (pids from /proc, see port_owner), never merely that
something answers there. Used by `layerkv master`, the bench and the test fixtures. No mooncake
import (the binary is found next to the running Python). Not thread-safe: one owner starts and
stops a `MasterProcess`.
"""

from __future__ import annotations

import contextlib
import ctypes
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerkv.errors import ConfigError, PortInUseError, StoreError
from layerkv.store import port_owner
from layerkv.store.wheels import install_hint

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses smaller global segments (setup -> -600)
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
MASTER_BINARY = "mooncake_master"


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the process that started it dies, even by
    SIGKILL or the OOM killer. An orphaned mooncake_master keeps listening on every interface
    (0.3.13 ignores the loopback it is told) with no owner to stop it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the owner's stop() is the only guard
        pass


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
        f"{MASTER_BINARY} not found next to {sys.executable} nor on PATH; install it with {install_hint()}"
    )


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
    def pick(cls, rpc_port: int | None = None, http_port: int | None = None, host: str = LOOPBACK) -> MasterPorts:
        """The given ports, the others chosen free by the kernel on `host` (three distinct
        ports: the picking sockets stay open until all are chosen)."""
        with contextlib.ExitStack() as held:

            def pick_one() -> int:
                sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                try:
                    sock.bind((host, 0))
                except OSError as exc:  # EADDRNOTAVAIL: no interface of this host has it
                    raise ConfigError(
                        f"host {host!r} is not an address of this host ({exc.strerror}): "
                        "give one of its interfaces' addresses, or 127.0.0.1"
                    ) from None
                return int(sock.getsockname()[1])

            return cls(rpc_port or pick_one(), http_port or pick_one(), pick_one())

    def roles(self) -> list[tuple[str, int]]:
        return [("master RPC", self.rpc_port), ("HTTP metadata", self.http_port), ("metrics", self.metrics_port)]


@dataclass(slots=True)
class MasterProcess:
    """A running `mooncake_master` on `host` (127.0.0.1 by default; another address serves other
    hosts) that serves its RPC and HTTP ports itself (checked by pid, not by a connect). Stop it
    with `stop()`. Mooncake 0.3.13 listens on every interface whatever `host` says; `host` is the
    address it publishes and clients dial."""

    ports: MasterPorts
    lease_ttl_ms: int | None
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    tenant_quotas_path: Path | None = None  # multi-tenant mode with these quotas (write_tenant_quotas)
    host: str = LOOPBACK

    @property
    def address(self) -> str:
        """The master's RPC address, `<host>:<rpc_port>` (Mooncake's master_server_address)."""
        return f"{self.host}:{self.ports.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.ports.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        """The master's HTTP server for metrics and its key listing (`/get_all_keys`:
        unauthenticated, every object key in the pool)."""
        return f"http://{self.host}:{self.ports.metrics_port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None, "master not started"
        return self.popen.pid

    def argv(self, binary: Path) -> list[str]:
        args = [
            str(binary),
            f"--rpc_port={self.ports.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.ports.http_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.ports.metrics_port}",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.tenant_quotas_path is not None:
            args += [
                "--enable_multi_tenants=true",
                "--tenant_quota_connector_type=file",
                f"--tenant_quota_connector_uri={self.tenant_quotas_path}",
            ]
        return args

    def start(self, timeout_s: float = 20.0) -> None:
        """Spawn the master and wait until it is the process listening on its RPC and HTTP ports
        and the metadata server answers. Raises PortInUseError (naming the port and its holder)
        if another process holds one of its ports, before or after the spawn; StoreError with
        the log tail if it exits or misses the deadline."""
        binary = find_master_binary()
        self._check_ports_free()
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(
                self.argv(binary),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop it in order
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                self._raise_taken_port("exited at startup")
                raise StoreError(f"{self.describe_exit()} at startup; log {self.log_path}:\n{self.log_tail()}")
            if self.owns_ports() and self.serving(probe_timeout_s=0.2):
                log.info("mooncake_master pid %d serving at %s", self.pid, self.address)
                return
            try:
                self._raise_taken_port("cannot serve")  # lost a port to another process: it never will
            except PortInUseError:
                self.stop()
                raise
            time.sleep(0.05)  # polling an external process with a deadline
        self.stop()
        self._raise_taken_port(f"did not serve within {timeout_s:.0f} s")
        raise StoreError(
            f"mooncake_master at {self.address} not serving after {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def owns_ports(self) -> bool:
        """True if the child is alive and every LISTEN socket on its RPC and HTTP ports is its
        own (so no other process answers in its place). Without /proc: whether it is alive."""
        if not self.running():
            return False
        if not port_owner.supported():
            return True  # no way to tell who listens; serving() still has to pass
        for port in (self.ports.rpc_port, self.ports.http_port):
            found = port_owner.listeners(port, likely_pid=self.pid)
            if not found or any(listener.pid != self.pid for listener in found):
                return False
        return True

    def check_serving(self) -> None:
        """Raise StoreError (exit status / holder of a port, log tail) unless this child is alive
        and the process serving its ports. For owners that re-check after start-up."""
        if not self.running():
            raise StoreError(f"{self.describe_exit()}; log {self.log_path}:\n{self.log_tail()}")
        self._raise_taken_port("does not own its ports")
        if not self.owns_ports():
            raise StoreError(
                f"mooncake_master pid {self.pid} is not listening on {self.address} / "
                f"{self.metadata_url}; log {self.log_path}:\n{self.log_tail()}"
            )

    def describe_exit(self) -> str:
        """`mooncake_master pid 12 exited with code 1` / `... was killed by SIGKILL`."""
        code = self.popen.poll() if self.popen is not None else None
        if code is None:
            return f"mooncake_master pid {self.pid} is running"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"mooncake_master pid {self.pid} ({self.address}) {how}"

    def _check_ports_free(self) -> None:
        if not port_owner.supported():
            return
        for role, port in self.ports.roles():
            found = port_owner.listeners(port)
            if found:
                raise PortInUseError(
                    f"port {port} ({role}) on {self.host} is already in use by {found[0].holder()}; "
                    "mooncake_master cannot serve there",
                    port,
                )

    def _raise_taken_port(self, what: str) -> None:
        """PortInUseError if another process listens on one of this master's ports."""
        if not port_owner.supported():
            return
        for role, port in self.ports.roles():
            foreign = [lst for lst in port_owner.listeners(port, likely_pid=self.pid) if lst.pid != self.pid]
            if foreign:
                raise PortInUseError(
                    f"mooncake_master pid {self.pid} {what}: port {port} ({role}) is held by "
                    f"{foreign[0].holder()}; log {self.log_path}:\n{self.log_tail()}",
                    port,
                )

    def serving(self, probe_timeout_s: float = 0.5) -> bool:
        """True if the RPC port accepts a connection and the metadata server answers HTTP
        (whoever serves them: see owns_ports)."""
        if tcp_reachable(self.host, self.ports.rpc_port, probe_timeout_s) is not None:
            return False
        return http_answers(self.host, self.ports.http_port, "/metadata?key=layerkv_probe", probe_timeout_s)

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
        local_hostname: str | None = None,
    ) -> dict[str, Any]:
        """The Mooncake client JSON config (MOONCAKE_CONFIG_PATH format) for this master; a client
        on another host sets `local_hostname` to its own address (default: the master's host)."""
        return {
            "local_hostname": local_hostname or self.host,
            "metadata_server": self.metadata_url,
            "master_server_address": self.address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
        }

    def log_tail(self, num_lines: int = 15, max_line_chars: int = 300) -> str:
        """The log's last lines, each cut at max_line_chars (Mooncake's metric lines run to 3 KB)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(
            line if len(line) <= max_line_chars else line[:max_line_chars] + " ..." for line in lines[-num_lines:]
        )


START_ATTEMPTS = 3  # auto-picked ports can be taken between the pick and the bind


def write_tenant_quotas(path: Path, quotas: dict[str, int]) -> Path:
    """Mooncake's tenant quota policy file (YAML, version 1; JSON is YAML): each tenant's name
    and its quota in bytes. Names: non-empty, no leading '_', no control characters."""
    for name, nbytes in quotas.items():
        if not name or name.startswith("_") or any(ord(c) < 32 for c in name) or "@" in name:
            raise ConfigError(
                f"tenant name {name!r} must be non-empty, without a leading '_', '@' or control characters"
            )
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ConfigError(f"tenant {name!r} quota={nbytes!r} must be a positive number of bytes")
    path.write_text(json.dumps({"version": 1, "tenants": [{"name": n, "quota": q} for n, q in quotas.items()]}) + "\n")
    return path


def start_master(
    lease_ttl_ms: int | None = None,
    *,
    rpc_port: int | None = None,
    http_port: int | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout_s: float = 20.0,
    tenant_quotas: dict[str, int] | None = None,
    host: str = LOOPBACK,
) -> MasterProcess:
    """Start a `mooncake_master` on `host` (loopback by default; free ports unless given) and
    wait until it serves its ports itself.

    `lease_ttl_ms` sets --default_kv_lease_ttl (Mooncake's default otherwise). The log goes to
    `log_path` (a fresh temp file by default). A port given here that another process holds
    raises PortInUseError; auto-picked ports lost to a race are picked again (3 attempts).
    `tenant_quotas` (tenant -> bytes) starts it in multi-tenant mode: each tenant's objects are
    invisible to the others and bounded by its quota (a put past it evicts the tenant's older
    objects, or fails with TENANT_QUOTA_EXCEEDED); writes by a tenant not listed fail. Mooncake
    does not authenticate tenant ids, and its metrics port lets anyone change quotas.
    Raises StoreError (log path and tail in the message) if it does not come up.
    """
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
        os.close(fd)
        log_path = name
    quotas_path = None
    if tenant_quotas is not None:
        quotas_path = write_tenant_quotas(Path(str(log_path) + ".tenants.yaml"), tenant_quotas)
    for attempt in range(1, START_ATTEMPTS + 1):
        master = MasterProcess(
            MasterPorts.pick(rpc_port, http_port, host),
            lease_ttl_ms,
            Path(log_path),
            tenant_quotas_path=quotas_path,
            host=host,
        )
        try:
            master.start(timeout_s)
            return master
        except PortInUseError as exc:
            master.stop()
            if exc.port in (rpc_port, http_port) or attempt == START_ATTEMPTS:
                raise
            log.info("mooncake_master: %s; picking other ports", str(exc).splitlines()[0])
    raise AssertionError("unreachable")
