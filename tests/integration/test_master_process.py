"""Every place that starts a master (fixtures, bench, demo) gets one it owns, with real
`mooncake_master` processes: a taken port is an error naming its holder, a master whose ports
another process serves is never "ready", auto-picked ports lost to a race are picked again, and
a local master child that fails or dies says why."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import layerkv
from layerkv.errors import PortInUseError, StoreError
from layerkv.store import port_owner
from layerkv.store.local_master import LocalMaster
from layerkv.store.mooncake_master import MasterPorts, MasterProcess
from tests.mooncake_master import MOONCAKE_PROBLEM_LINE, require_mooncake, start_master

pytestmark = pytest.mark.mooncake


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port this test process listens on (as another server would)."""
    require_mooncake()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_given_port_held_by_another_process_is_an_error_naming_it(held_port: int) -> None:
    with pytest.raises(
        PortInUseError,
        match=rf"port {held_port} \(HTTP metadata\) on 127\.0\.0\.1 is already in use "
        rf"by pid {os.getpid()} ",
    ):
        start_master(http_port=held_port)


def test_a_master_whose_ports_another_master_serves_is_never_ready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the pre-start check (a port taken after it), readiness still asks who listens:
    the first master answers on those ports, but the second never becomes "started"."""
    require_mooncake()
    first = start_master()
    monkeypatch.setattr(MasterProcess, "_check_ports_free", lambda self: None)
    second = MasterProcess(
        MasterPorts(first.ports.rpc_port, first.ports.http_port, MasterPorts.pick().metrics_port),
        None,
        tmp_path / "second.log",
    )
    try:
        with pytest.raises(
            PortInUseError,
            match=rf"port {first.ports.rpc_port} \(master RPC\) is held by "
            rf"pid {first.pid} \(mooncake_master\)",
        ):
            second.start(timeout_s=20)
        assert not second.running()  # stopped, not left behind
        assert first.running() and first.owns_ports()
    finally:
        second.stop()
        first.stop()


def test_auto_picked_ports_lost_to_a_race_are_picked_again(held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pick = MasterPorts.pick
    picks: list[MasterPorts] = []

    def pick(rpc_port: int | None = None, http_port: int | None = None, host: str = "127.0.0.1") -> MasterPorts:
        ports = real_pick(held_port if not picks else rpc_port, http_port, host)  # the first pick loses its RPC port
        picks.append(ports)
        return ports

    monkeypatch.setattr(MasterPorts, "pick", staticmethod(pick))
    master = start_master()
    try:
        assert len(picks) == 2 and picks[0].rpc_port == held_port
        assert master.ports.rpc_port != held_port and master.owns_ports()
    finally:
        master.stop()


def test_local_master_that_fails_to_start_says_why() -> None:
    require_mooncake()
    with pytest.raises(StoreError, match=r"(?s)layerkv master \(local child\) exited with code 2.*--segment-size"):
        LocalMaster(segment_size="lots")


def test_local_master_whose_master_dies_is_an_error_with_the_tail() -> None:
    require_mooncake()
    with LocalMaster(segment_size="32MB") as master:
        master.check_alive()
        rpc_port = int(master.client_config["master_server_address"].rpartition(":")[2])
        (listener,) = port_owner.listeners(rpc_port)
        assert listener.pid is not None
        os.kill(listener.pid, signal.SIGKILL)
        master._proc.wait(timeout=30)  # `layerkv master` notices and exits
        with pytest.raises(
            StoreError, match=rf"(?s)exited with code 1 while in use.*pid {listener.pid} .*killed by SIGKILL"
        ):
            master.check_alive()


def test_demo_on_mooncake_prints_no_mooncake_error_or_warning() -> None:
    """`layerkv demo --store mooncake` (tiny sizes) on a healthy machine: Mooncake's own
    start-up ERROR (metadata not found) and WARNING lines stay off the terminal."""
    require_mooncake()
    env = dict(os.environ, PYTHONPATH=str(Path(layerkv.__file__).parents[1]), MC_TCP_BIND_ADDRESS="127.0.0.1")
    for name in ("LAYERKV_MOONCAKE_LOG", "MC_LOG_LEVEL", "MOONCAKE_CONFIG_PATH"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "layerkv.cli", "demo", "--store", "mooncake", "--tiny"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "outputs identical to local compute: yes" in result.stdout
    assert not MOONCAKE_PROBLEM_LINE.search(result.stdout + result.stderr), result.stderr[-3000:]
