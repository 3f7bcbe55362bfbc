"""The processes of a chaos round besides the test's own: the master (with extra flags and
SIGKILL), the segment holder and the agents (engines driven over stdin/stdout, see agent.py).
Each child runs in its own process group and is stopped / continued / killed through it; one
reader thread per child collects its stdout. Test code only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import layerkv
from layerkv.store.mooncake_master import MasterProcess

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
Output = dict[str, Any]


@dataclasses.dataclass
class ChaosMaster(MasterProcess):
    """A mooncake_master with extra flags (e.g. --put_start_discard_timeout_sec)."""

    extra_args: tuple[str, ...] = ()

    def argv(self, binary: Path) -> list[str]:
        return [*super().argv(binary), *self.extra_args]

    def signal(self, signum: int) -> None:
        if self.running():
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL (no goodbye to anyone) and reap."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a child: this layerkv and the tests package importable, loopback only."""
    paths = [str(Path(layerkv.__file__).parents[1]), str(REPO_ROOT)]
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", PYTHONPATH=os.pathsep.join(paths))
    env.update(extra or {})
    return env


class Child:
    """A child process in its own process group; stdout lines go to `lines`."""

    def __init__(self, name: str, argv: list[str], stderr_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as stderr_file:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                text=True,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"chaos-{name}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.on_line(line.rstrip("\n"))
        self.lines.put(None)

    def on_line(self, line: str) -> None:
        self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass  # the pipe's reader is dead
        self._reader.join(5)

    def stderr_tail(self, num_lines: int = 25) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError as exc:
            return f"(unreadable: {exc})"

    def end(self, timeout_s: float = 20.0) -> None:
        """Close stdin, wait, then SIGCONT + SIGKILL the group (also when it was stopped)."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("chaos: %s did not exit within %.0f s; killing it", self.name, timeout_s)
        finally:
            if self.alive():
                self.signal(signal.SIGCONT)
                self.kill()
            self._reader.join(5)


class Holder(Child):
    """The process whose global segment holds every object of the round."""

    def __init__(self, master: MasterProcess, segment_bytes: int, tmp: Path) -> None:
        config = json.dumps(master.config(global_segment_size=segment_bytes))
        super().__init__(
            "holder", [sys.executable, "-m", "tests.chaos.holder", config], tmp / "holder.stderr", child_env()
        )
        try:
            line = self.lines.get(timeout=60)
        except queue.Empty:
            line = None
        if line is None or not line.startswith("ready"):
            self.end(5)
            raise AssertionError(f"segment holder did not start: {line!r}\n{self.stderr_tail()}")


class Agent(Child):
    """An engine process (tests/chaos/agent.py) driven by JSON commands."""

    def __init__(self, name: str, job: dict[str, Any], tmp: Path, env: dict[str, str] | None = None) -> None:
        job_path = tmp / f"{name}.json"
        job_path.write_text(json.dumps(job))
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ids = iter(range(1, 1 << 30))
        super().__init__(
            name, [sys.executable, "-m", "tests.chaos.agent", str(job_path)], tmp / f"{name}.stderr", child_env(env)
        )
        self._ready = False  # its first command waits for it (starting takes 2-3 s: overlapped)

    def ready(self) -> Agent:
        if not self._ready:
            self.wait_event("ready", 90.0)
            self._ready = True
        return self

    def on_line(self, line: str) -> None:
        if not line.startswith("@@"):
            return
        message = json.loads(line[2:])
        if "event" in message:
            self.events.put(message)
        else:
            with self._cond:
                self._replies[message["id"]] = message
                self._cond.notify_all()

    def send(self, op: str, **fields: Any) -> int:
        self.ready()
        ident = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": ident, **fields}) + "\n")
        self.proc.stdin.flush()
        return ident

    def reply(self, ident: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    raise AssertionError(
                        f"{self.name}: no answer to command {ident} within {timeout_s:.0f} s "
                        f"(alive: {self.alive()})\n{self.stderr_tail()}"
                    )
                self._cond.wait(min(left, 0.5))
            return self._replies.pop(ident)

    def call(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        return self.reply(self.send(op, **fields), timeout_s)

    def serve(self, prompts: Sequence[Sequence[int]], max_tokens: int, timeout_s: float = 120.0) -> list[Output]:
        return self.call("serve", timeout_s, prompts=[list(p) for p in prompts], max_tokens=max_tokens)["outputs"]

    def serve_later(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> int:
        """Start serving; `outputs(ident)` collects the result."""
        return self.send("serve", prompts=[list(p) for p in prompts], max_tokens=max_tokens)

    def outputs(self, ident: int, timeout_s: float = 120.0) -> list[Output]:
        return self.reply(ident, timeout_s)["outputs"]

    def arm(self, method: str, layer_idx: int | None = None, when: str = "before") -> None:
        self.call("arm", method=method, layer_idx=layer_idx, when=when)

    def open_gate(self) -> None:
        self.call("open")

    def status(self) -> dict[str, Any]:
        return self.call("status", 60.0)

    def wait_store_up(self, timeout_s: float) -> None:
        assert self.call("up", timeout_s + 30.0, wait_s=timeout_s)["up"], f"{self.name}: the store did not answer"

    def wait_event(self, kind: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {kind!r} event within {timeout_s:.0f} s\n{self.stderr_tail()}"
                ) from None
            if event["event"] == kind:
                return event

    def close(self) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            try:
                self.call("exit", 60.0)
            except (AssertionError, OSError) as exc:
                log.warning("chaos: %s did not exit cleanly: %s", self.name, exc)
        self.end(20.0)
