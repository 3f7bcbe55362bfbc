"""The test side of the engine processes: `TierEngine` is layerkv.bench.vllm_engines'
EngineProcess running the tier's host (tests/vllm_engine/engine_host.py), whose `generate`
commits the last step by default and returns the outputs; `ServeProcess` is `vllm serve` with its /health
polled. Test thread only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from layerkv.bench.vllm_engines import EngineProcess, log_tail, stop_group


class TierEngine(EngineProcess):
    """One offline vLLM engine under this Python (the engine venv) running the tier's host."""

    def __init__(self, name: str, llm_kwargs: dict[str, Any], env: dict[str, str], log_dir: Path) -> None:
        super().__init__(name, sys.executable, llm_kwargs, env, log_dir, host="tests.vllm_engine.engine_host")

    def call(self, op: str, timeout_s: float = 180, **args: Any) -> dict[str, Any]:
        return super().call(op, timeout_s, **args)

    def generate(self, prompts: list[list[int]], max_tokens: int = 1,  # type: ignore[override]
                 reset_prefix_cache: bool = False, commit: bool = True) -> list[dict[str, Any]]:
        """Outputs in prompt order; `commit` (default): the last step's saves are committed
        before this returns (layerkv.bench.vllm_host.generate)."""
        return super().generate(prompts, reset_prefix_cache=reset_prefix_cache, commit=commit,
                                max_tokens=max_tokens)["outputs"]


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
        stop_group(self._popen, timeout_s)
