"""`layerkv master` owns what it reports, with real `mooncake_master` processes: a second one on
taken ports fails naming the port, its holder and the fix (never printing the first one's
config); a master killed after start ends the command with exit 1 and the log tail."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import layerkv
from layerkv.commands.master import DEFAULT_HTTP_PORT, DEFAULT_RPC_PORT
from layerkv.store import port_owner
from tests.mooncake_master import MOONCAKE_PROBLEM_LINE, require_mooncake

pytestmark = pytest.mark.mooncake

SRC = str(Path(layerkv.__file__).parents[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SRC, MC_TCP_BIND_ADDRESS="127.0.0.1")
    for name in ("LAYERKV_MOONCAKE_LOG", "MC_LOG_LEVEL"):
        env.pop(name, None)  # the command's own default
    return env


class MasterCommand:
    """A `layerkv master` child; `config` is the JSON line it printed (None if it printed none)."""

    def __init__(self, *argv: str, startup_timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerkv.cli", "master", "--segment-size", "32MB", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="layerkv-test-master-stdout", daemon=True)
        self._reader.start()
        first = self._lines.get(timeout=startup_timeout_s)
        self.config = json.loads(first) if first else None

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self._lines.put(line)
        self._lines.put(None)

    @property
    def rpc_port(self) -> int:
        assert self.config is not None
        return int(self.config["master_server_address"].rpartition(":")[2])

    def master_pid(self) -> int:
        """The pid listening on the printed RPC port (read from /proc, not from our output)."""
        (listener,) = port_owner.listeners(self.rpc_port)
        assert listener.pid is not None
        return listener.pid

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        """Wait for exit; (returncode, stderr)."""
        _, stderr = self.proc.communicate(timeout=timeout_s)
        self._reader.join(timeout=10)
        return self.proc.returncode, stderr

    def stop(self) -> tuple[int, str]:
        """SIGINT (SIGKILL after 30 s); (returncode, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.finish()


def _fails_on_taken_port(second: MasterCommand, port: int, flag: str, holder_pid: int) -> None:
    code, stderr = second.finish()
    assert second.config is None  # never a config for a master it does not own
    assert code == 1, stderr
    assert re.search(
        rf"port {port} \(.*\) on 127\.0\.0\.1 is already in use by pid {holder_pid} \(mooncake_master\)", stderr
    ), stderr
    assert f"{flag} <port>" in stderr and "--port 0 --http-port 0" in stderr, stderr


def test_second_master_on_the_same_ports_fails_naming_the_port_and_the_fix() -> None:
    require_mooncake()
    first = MasterCommand("--port", "0", "--http-port", "0")
    try:
        assert first.config is not None
        http_port = int(first.config["metadata_server"].split(":")[2].split("/")[0])
        pid = first.master_pid()
        _fails_on_taken_port(
            MasterCommand("--port", str(first.rpc_port), "--http-port", str(http_port)), first.rpc_port, "--port", pid
        )
        _fails_on_taken_port(MasterCommand("--port", "0", "--http-port", str(http_port)), http_port, "--http-port", pid)
        assert first.proc.poll() is None and first.master_pid() == pid  # the first one is untouched
    finally:
        first.stop()


def test_second_master_with_default_ports_never_claims_the_first() -> None:
    """The issue's reproduction. Default ports on a shared machine may be in use already: then
    that holder plays the first master, and the command must still fail naming it."""
    require_mooncake()
    first = None
    if not port_owner.listeners(DEFAULT_RPC_PORT) and not port_owner.listeners(DEFAULT_HTTP_PORT):
        first = MasterCommand()
        if first.config is None:
            code, stderr = first.finish()
            pytest.skip(f"default ports were taken between check and start: {stderr[-300:]}")
    try:
        holders = port_owner.listeners(DEFAULT_RPC_PORT) or port_owner.listeners(DEFAULT_HTTP_PORT)
        second = MasterCommand()
        code, stderr = second.finish()
        assert second.config is None and code == 1, stderr
        assert re.search(
            rf"port ({DEFAULT_RPC_PORT}|{DEFAULT_HTTP_PORT}) \(.*\) on 127\.0\.0\.1 is already in use by "
            rf"{re.escape(holders[0].holder())}",
            stderr,
        ), stderr
        assert "--port 0 --http-port 0" in stderr
    finally:
        if first is not None:
            first.stop()


def test_master_killed_after_start_ends_the_command_with_its_log_tail() -> None:
    require_mooncake()
    command = MasterCommand("--port", "0", "--http-port", "0")
    try:
        pid = command.master_pid()
        os.kill(pid, signal.SIGKILL)
        code, stderr = command.finish(timeout_s=30)
    finally:
        if command.proc.poll() is None:
            command.stop()
    assert code == 1, stderr
    assert re.search(
        rf"mooncake_master pid {pid} \(127\.0\.0\.1:{command.rpc_port}\) was killed by SIGKILL after start", stderr
    ), stderr
    log_path = re.search(r"log (\S+mooncake_master-\S+\.log) \(last lines\):", stderr)
    assert log_path is not None and Path(log_path.group(1)).is_file(), stderr
    assert "Master service started on port" in stderr.split("(last lines):")[1]  # the tail itself


def test_healthy_master_prints_no_mooncake_error_or_warning() -> None:
    require_mooncake()
    command = MasterCommand("--port", "0", "--http-port", "0")
    code, stderr = command.stop()
    assert command.config is not None and code == 0, stderr
    assert "layerkv master: mooncake_master pid" in stderr  # layerkv's own lines stay
    assert not MOONCAKE_PROBLEM_LINE.search(stderr), stderr


def test_a_killed_layerkv_master_takes_its_mooncake_master_with_it() -> None:
    """SIGKILL (as the OOM killer does) of `layerkv master` must not leave its mooncake_master
    running: an orphan keeps listening on every interface with nobody to stop it."""
    require_mooncake()
    from layerkv.store.local_master import LocalMaster

    master = LocalMaster(segment_size="64MB")
    try:
        child = int(master.info["pid"])
        os.kill(child, 0)  # running
        os.kill(master._proc.pid, signal.SIGKILL)
        master._proc.wait(10)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _alive(child):  # bounded: the kernel delivers the death signal
            time.sleep(0.05)
        assert not _alive(child), f"mooncake_master pid {child} outlived the layerkv master that started it"
    finally:
        master.stop()


def _alive(pid: int) -> bool:
    """Running and not a zombie (a killed orphan's entry lingers until its new parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_master_with_tenants_runs_mooncake_in_multi_tenant_mode(tmp_path: Path) -> None:
    """`--tenant NAME=SIZE`: the master keeps tenants apart (a client of another tenant does not
    see an object; one the master does not list cannot write); a bad spec is refused."""
    require_mooncake()
    from layerkv.store.base import Code
    from layerkv.store.mooncake import MooncakeStore

    command = MasterCommand("--port", "0", "--http-port", "0", "--tenant", "tenant-a=16MB", "--tenant", "tenant-b=1MB")
    clients: list[MooncakeStore] = []
    try:
        assert command.config is not None
        a, b, c = (
            MooncakeStore.from_mooncake_config(command.config, tenant_id=t) for t in ("tenant-a", "tenant-b", "nobody")
        )
        clients += [a, b, c]
        buf = bytearray(4096)
        ptr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        for client in clients:
            client.register_buffer(ptr, len(buf))
        assert a.batch_put_from(["x"], [ptr], [4096]) == [0]
        assert a.batch_is_exist(["x"]) == [1] and b.batch_is_exist(["x"]) == [0]
        assert c.batch_put_from(["y"], [ptr], [4096]) == [int(Code.TENANT_NOT_REGISTERED)]
    finally:
        for client in clients:
            client.close()
        code, stderr = command.stop()
    assert code == 0, stderr
    bad = subprocess.run(
        [sys.executable, "-m", "layerkv.cli", "master", "--tenant", "no-size"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert bad.returncode == 2 and "--tenant 'no-size' must be NAME=SIZE" in bad.stderr


def test_master_host_must_be_an_address_of_this_host() -> None:
    """`--host` names the address other hosts dial: not an IPv4 address is a usage error (2), an
    address no interface of this host has fails before mooncake_master starts (1), naming it."""
    bad = subprocess.run(
        [sys.executable, "-m", "layerkv.cli", "master", "--host", "master.local"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert bad.returncode == 2 and "'master.local' is not an IPv4 address" in bad.stderr
    absent = subprocess.run(
        [sys.executable, "-m", "layerkv.cli", "master", "--host", "192.0.2.7", "--port", "0", "--http-port", "0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert absent.returncode == 1, absent.stderr
    assert "host '192.0.2.7' is not an address of this host" in absent.stderr and absent.stdout == ""
