"""Starts and drives an attacker process from a test: tests/security/attacker.py (a bare Mooncake
TransferEngine) or tests/security/pool_attacker.py (a bare Mooncake store client); every answer
is bounded in time."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class Attacker:
    def __init__(self, *args: str, module: str = "tests.security.attacker", timeout_s: float = 30.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        env.pop("LAYERKV_TENANT_KEY_FILE", None)  # it never has the key
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile("w+")  # kept for a failing test's message (stderr_tail)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, name="attacker-stdout", daemon=True).start()
        assert self._answer() == {"ready": True}

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)

    def _answer(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"the attacker process did not answer within {self.timeout_s} s (exit code {self._proc.poll()})"
            ) from None
        return json.loads(line)

    def health(self, num_chars: int = 2000) -> str:
        """Its exit code (None: running) and the end of its stderr, for an assertion message."""
        self._stderr.seek(0)
        return f"exit code {self._proc.poll()}, stderr ends: {self._stderr.read()[-num_chars:]}"

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                assert self._proc.stdin is not None
                self._proc.stdin.close()  # its command loop ends
                self._proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait(10)
        self._stderr.close()
