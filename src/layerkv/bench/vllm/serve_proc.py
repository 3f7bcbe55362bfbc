"""`vllm serve` as a child of the bench or a test: `ServeProcess` starts one server in its own
process group, `ready()` polls its /health, `metrics()` reads its /metrics, `rss_bytes()` sums
the resident memory of its whole group (API server, engine core, workers). Driver thread only
(the load bench's RSS sampler thread calls `rss_bytes` too: it only reads /proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from layerkv.bench.vllm.engines import log_tail, stop_group

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ServeProcess:
    """`argv` (a `vllm serve` command) listening on 127.0.0.1:`port`; its output goes to
    log_dir/`name`.log."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log_dir: Path) -> None:
        self.name, self.port = name, port
        self.log_path = log_dir / f"{name}.log"
        self.base_url = f"http://127.0.0.1:{port}"
        self._stop_requested = False
        with open(self.log_path, "wb") as log:
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    def ready(self, timeout_s: float = 420) -> ServeProcess:
        """Wait until /health answers 200; RuntimeError (it exited) or TimeoutError with the log tail."""
        wait_http_ok(f"{self.base_url}/health", self._popen, f"vllm serve {self.name}", self.log_path, timeout_s)
        return self

    def alive(self) -> bool:
        return self._popen.poll() is None

    def metrics(self, timeout_s: float = 10) -> str:
        """The server's /metrics text (OSError if it does not answer)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=timeout_s) as answer:
            return str(answer.read().decode())

    def rss_bytes(self) -> int:
        """Resident bytes of every live process in the server's process group (0 once it is gone)."""
        return group_rss_bytes(self._popen.pid)

    def request_stop(self) -> None:
        """SIGTERM to the API server alone, once: it shuts its engine core down in order (a
        SIGTERM to the whole group kills the engine core under it: vLLM then logs
        EngineDeadError; a second SIGTERM during its shutdown kills it: exit -15)."""
        if self._popen.poll() is None and not self._stop_requested:
            self._stop_requested = True
            os.kill(self._popen.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 60) -> int | None:
        """request_stop, wait up to `timeout_s`, then SIGTERM / SIGKILL what is left of the group;
        the API server's exit code (None if it had to be killed here)."""
        self.request_stop()
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(self._popen, 10)
            return None
        stop_group(self._popen, 10)  # workers that outlived it
        return self._popen.returncode


def wait_http_ok(url: str, popen: subprocess.Popen[bytes], what: str, log_path: Path, timeout_s: float) -> None:
    """Poll `url` until it answers 200 while `popen` runs: RuntimeError if it exits first,
    TimeoutError after `timeout_s`; both quote `log_path`'s tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{what} exited with {popen.returncode}; log {log_path}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:  # refused while it starts; URLError and HTTPError are OSErrors
            pass
        time.sleep(0.5)  # polling another process's HTTP endpoint with a deadline
    raise TimeoutError(f"{what} not healthy after {timeout_s:.0f} s; log {log_path}:\n{log_tail(log_path)}")


def group_rss_bytes(pgid: int) -> int:
    """Sum of VmRSS over the processes of group `pgid`, read from /proc (processes that exit
    while it reads are skipped)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
            if int(fields[2]) != pgid:
                continue
            total += int(Path(entry.path, "statm").read_text().split()[1]) * PAGE_BYTES
        except (OSError, ValueError, IndexError):
            continue
    return total
