"""`layerkv doctor` against a real master (passes), a stopped master (fails fast, says why), and
the config printed by `layerkv master` (accepted; the launcher stops cleanly on SIGINT)."""

from __future__ import annotations

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
from layerkv.store.mooncake_master import MasterProcess, tcp_reachable
from tests.mooncake_master import MOONCAKE_PROBLEM_LINE, require_mooncake, start_master

pytestmark = pytest.mark.mooncake

SRC = str(Path(layerkv.__file__).parents[1])
CHECKS = ("version", "methods", "connect", "master", "put session", "get session", "codes", "throughput", "cleanup")


def cli(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC, MC_TCP_BIND_ADDRESS="127.0.0.1")
    env.pop("MOONCAKE_MASTER", None)
    return subprocess.run(
        [sys.executable, "-m", "layerkv.cli", *argv], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def write_config(master: MasterProcess, path: Path) -> Path:
    path.write_text(json.dumps(master.config(global_segment_size="16MB")))
    return path


def test_doctor_passes_against_a_real_master(mooncake_master: MasterProcess, tmp_path: Path) -> None:
    result = cli("doctor", "--config", str(write_config(mooncake_master, tmp_path / "mc.json")))
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for name in CHECKS:
        assert any(re.match(rf"PASS  {name}\s", line) for line in lines), (name, result.stdout)
    assert re.search(r"ranged get \d+ MB/s", result.stdout)
    assert re.search(
        rf"PASS  master\s+{mooncake_master.address} served by pid {mooncake_master.pid} \(mooncake_master\); "
        rf"metadata {mooncake_master.metadata_url} by the same process",
        result.stdout,
    ), result.stdout
    assert "9 passed, 0 failed" in result.stdout
    assert not MOONCAKE_PROBLEM_LINE.search(result.stderr), result.stderr  # Mooncake's start-up log is quiet


def test_doctor_fails_fast_against_a_stopped_master(tmp_path: Path) -> None:
    require_mooncake()
    master = start_master()
    master.stop()
    began = time.monotonic()
    result = cli("doctor", "--config", str(write_config(master, tmp_path / "mc.json")), timeout_s=30)
    assert time.monotonic() - began < 10.0
    assert result.returncode == 1
    assert re.search(rf"FAIL  connect\s+mooncake master at {master.address} is not reachable", result.stdout), (
        result.stdout
    )


def test_doctor_without_config_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    result = cli("doctor")
    assert result.returncode == 2
    assert "MOONCAKE_CONFIG_PATH is unset" in result.stdout


def test_master_command_config_is_accepted_by_doctor_and_stops_on_sigint(tmp_path: Path) -> None:
    require_mooncake()
    config_out = tmp_path / "client.json"
    env = dict(os.environ, PYTHONPATH=SRC, MC_TCP_BIND_ADDRESS="127.0.0.1")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "layerkv.cli",
            "master",
            "--port",
            "0",
            "--http-port",
            "0",
            "--segment-size",
            "32MB",
            "--config-out",
            str(config_out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in launcher.stdout or ()],
        name="layerkv-test-master-stdout",
        daemon=True,
    )
    reader.start()
    try:
        printed = json.loads(lines.get(timeout=60))
        assert printed == json.loads(config_out.read_text())
        assert printed["local_hostname"] == "127.0.0.1" and printed["master_server_address"].startswith("127.0.0.1:")
        result = cli("doctor", "--config", str(config_out))
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
        host, _, port = printed["master_server_address"].rpartition(":")
        assert tcp_reachable(host, int(port), 1.0) is not None  # the master is gone too
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        reader.join(timeout=10)


def test_doctor_fails_a_config_that_mixes_two_masters(mooncake_master: MasterProcess, tmp_path: Path) -> None:
    """The issue's shape: RPC of one master, metadata server of another (a second `layerkv master`
    whose own master died would have printed such a config). Doctor names both pids and fails."""
    other = start_master()
    try:
        config = dict(mooncake_master.config(global_segment_size="16MB"), metadata_server=other.metadata_url)
        (tmp_path / "mixed.json").write_text(json.dumps(config))
        result = cli("doctor", "--config", str(tmp_path / "mixed.json"))
    finally:
        other.stop()
    assert result.returncode == 1, result.stdout
    assert re.search(
        rf"FAIL  master\s+{mooncake_master.address} served by pid {mooncake_master.pid} \(mooncake_master\), "
        rf"but metadata {other.metadata_url} by pid {other.pid} \(mooncake_master\): two processes",
        result.stdout,
    ), result.stdout


def test_doctor_device_round_trip_on_a_real_master_and_embedded(mooncake_master: MasterProcess, tmp_path: Path) -> None:
    """`--device cpu`: the same round trip the GPU runs (save, fresh load, equal to local compute)."""
    for argv in (("--config", str(write_config(mooncake_master, tmp_path / "mc.json"))), ()):
        result = cli("doctor", "--device", "cpu", *argv, timeout_s=120)
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        assert re.search(
            r"PASS  device round trip \(cpu\) 4 blocks x 4 layers \(\d+ bytes, float32\) saved, loaded and "
            r"equal to local compute",
            result.stdout,
        ), result.stdout


def test_doctor_device_without_such_a_device_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device (tests/gpu runs the round trip there)")
    result = cli("doctor", "--device", "cuda")
    assert result.returncode == 1 and re.search(
        r"FAIL  device round trip \(cuda\) torch \S+ sees no CUDA device", result.stdout
    )
    result = cli("doctor", "--device", "npu")
    assert result.returncode == 1 and "only cpu and cuda (cuda:N) are checked" in result.stdout
    result = cli("demo", "--device", "cuda")  # the demo refuses before it builds anything
    assert result.returncode == 2 and re.search(r"layerkv demo: torch \S+ sees no CUDA device", result.stdout), (
        result.stdout
    )
