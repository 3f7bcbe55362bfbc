"""The test side of engine_host.py: an `EngineProcess` starts one real vLLM engine process at
construction (so several can start at once), `ready()` waits for it, `call()` sends one command
and waits for its reply, `stop()` shuts it down. Also `ServeProcess` for `vllm serve`.
Test thread only; a reader thread per process moves reply lines into a queue.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HOST = Path(__file__).with_name("engine_host.py")


def log_tail(path: Path, num_lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


def _stop_group(popen: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM this child's process group (it leads its own session: vLLM's engine core and
    workers are in it), then SIGKILL after `timeout_s`."""
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(10)
    try:  # children that outlived the leader
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class EngineProcess:
    """One engine_host.py child running `LLM(**llm_kwargs)` with `env`."""

    def __init__(self, name: str, llm_kwargs: dict[str, Any], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self._popen = subprocess.Popen(
                [sys.executable, str(HOST), json.dumps({"llm": llm_kwargs}), str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                env=env, cwd=HOST.parent, text=True, start_new_session=True,
            )
        os.close(write_fd)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), name=f"engine-{name}-replies", daemon=True)
        self._reader.start()
        self._ready: dict[str, Any] | None = None

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as replies:
            for line in replies:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the host closed the pipe (exited)

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"engine {self.name}: no reply within {timeout_s:.0f} s; log {self.log_path}:\n"
                               f"{log_tail(self.log_path)}") from None
        if reply is None:
            raise RuntimeError(f"engine {self.name} exited (code {self._popen.poll()}); log {self.log_path}:\n"
                               f"{log_tail(self.log_path)}")
        return reply

    def startup(self, timeout_s: float = 420) -> dict[str, Any]:
        """The host's first reply: {"ready": True, ...} or {"ready": False, "error": ...}."""
        if self._ready is None:
            self._ready = self._next_reply(timeout_s)
        return self._ready

    def ready(self, timeout_s: float = 420) -> EngineProcess:
        reply = self.startup(timeout_s)
        if not reply["ready"]:
            raise RuntimeError(f"engine {self.name} failed to start: {reply['error']}\n{reply['traceback']}\n"
                               f"log {self.log_path}:\n{log_tail(self.log_path)}")
        return self

    def call(self, op: str, timeout_s: float = 180, **args: Any) -> dict[str, Any]:
        self.ready()
        assert self._popen.stdin is not None
        self._popen.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._popen.stdin.flush()
        reply = self._next_reply(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"engine {self.name} {op} failed: {reply.get('error')}\n{reply.get('traceback')}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, reset_prefix_cache: bool = False) -> list[dict[str, Any]]:
        return self.call("generate", prompts=prompts, max_tokens=max_tokens, reset_prefix_cache=reset_prefix_cache)["outputs"]

    def request_stop(self) -> None:
        """Ask the host to shut vLLM down (returns at once; `stop` waits)."""
        if self._popen.poll() is None and self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self._popen.stdin.close()
            except BrokenPipeError:
                pass

    def stop(self, timeout_s: float = 60) -> None:
        """Shut vLLM down, then make sure the whole process group is gone."""
        self.request_stop()
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _stop_group(self._popen, 10)
        self._reader.join(10)


class ServeProcess:
    """`vllm serve <argv>` on 127.0.0.1:`port`; `ready()` polls its /health."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log_dir: Path) -> None:
        self.name, self.port = name, port
        self.log_path = log_dir / f"{name}.log"
        self.base_url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "wb") as log:
            self._popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)

    def ready(self, timeout_s: float = 420) -> ServeProcess:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise RuntimeError(f"vllm serve {self.name} exited with {self._popen.returncode}; log {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling another process's HTTP endpoint with a deadline
        raise TimeoutError(f"vllm serve {self.name} not healthy after {timeout_s:.0f} s; log {self.log_path}:\n"
                           f"{log_tail(self.log_path)}")

    def request_stop(self) -> None:
        if self._popen.poll() is None:
            os.killpg(self._popen.pid, signal.SIGTERM)  # vllm serve shuts down gracefully on SIGTERM

    def stop(self, timeout_s: float = 60) -> None:
        _stop_group(self._popen, timeout_s)
