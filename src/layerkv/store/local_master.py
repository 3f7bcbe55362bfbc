"""`layerkv master` as a child process (mooncake_master + a segment holder on loopback, free
ports): what the demo and the benchmarks use when no MOONCAKE_CONFIG_PATH is given. The child's
stderr goes to a file whose tail is quoted when it fails to start or dies. No mooncake import.
One owner thread starts, checks and stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from layerkv.errors import StoreError


class LocalMaster:
    """A running `layerkv master --port 0 --http-port 0` child. Objects live in the child's
    segment, so clients may hold no memory (global_segment_size 0), as in production.
    `client_config` / `config_path`: the Mooncake client config it printed."""

    def __init__(self, segment_size: str = "512MB", startup_timeout_s: float = 60.0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="layerkv-master-")
        self.config_path = Path(self._dir.name) / "mooncake.json"
        self.info_path = Path(self._dir.name) / "master.json"
        self.stderr_path = Path(self._dir.name) / "layerkv-master.stderr"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        with open(self.stderr_path, "wb") as stderr_file:
            self._proc = subprocess.Popen(
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
                    segment_size,
                    "--config-out",
                    str(self.config_path),
                    "--info-out",
                    str(self.info_path),
                ],
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                text=True,
                env=env,
            )
        line = _first_line(self._proc, startup_timeout_s)
        if line is None or not line.startswith("{"):
            if line == "":  # end of its stdout: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=10)
            code = self._proc.poll()
            state = (
                f"exited with code {code}"
                if code is not None
                else f"printed no config within {startup_timeout_s:.0f} s"
            )
            tail = self.stderr_tail()  # read before stop() removes the directory
            self.stop()
            raise StoreError(f"layerkv master (local child) {state}; its stderr:\n{tail}")
        self.client_config: dict[str, Any] = json.loads(line)
        # written before the config line is printed: master, metadata_url, metrics_url, pid
        self.info: dict[str, Any] = json.loads(self.info_path.read_text()) if self.info_path.exists() else {}

    def check_alive(self) -> None:
        """Raise StoreError with the child's stderr tail if `layerkv master` has exited (its
        mooncake_master died, or it was killed): results obtained meanwhile had no pool."""
        code = self._proc.poll()
        if code is not None:
            raise StoreError(
                f"layerkv master (local child, pid {self._proc.pid}) exited with code {code} "
                f"while in use; its stderr:\n{self.stderr_tail()}"
            )

    def stderr_tail(self, num_lines: int = 12) -> str:
        """The child's own `layerkv master:` lines (what failed and where its log is) and the
        last `num_lines` lines of its stderr."""
        try:
            lines = self.stderr_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(stderr unreadable: {exc})"
        tail = lines[-num_lines:]
        own = [line for line in lines[:-num_lines] if line.startswith("layerkv master:")]
        return "\n".join(own + (["..."] if own else []) + tail)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGINT (the child stops its holder and master in order), then SIGKILL. Idempotent."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._dir.cleanup()

    def __enter__(self) -> LocalMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str | None:
    """The child's first stdout line ("" at end of file, None after timeout_s), read on a helper
    thread so a silent child cannot hang us."""
    box: list[str] = []
    reader = threading.Thread(
        target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
        name="layerkv-master-stdout",
        daemon=True,
    )
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else None
