"""The test side of the engine processes: `TierEngine` is layerkv.bench.vllm.engines'
EngineProcess running the tier's host (tests/vllm_engine/engine_host.py), whose `generate`
commits the last step by default and returns the outputs; `ServeProcess` (`vllm serve` with its
/health polled) is layerkv.bench.vllm.serve_proc's. Test thread only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from layerkv.bench.vllm.engines import EngineProcess
from layerkv.bench.vllm.serve_proc import ServeProcess

__all__ = ["ServeProcess", "TierEngine"]


class TierEngine(EngineProcess):
    """One offline vLLM engine under this Python (the engine venv) running the tier's host."""

    def __init__(self, name: str, llm_kwargs: dict[str, Any], env: dict[str, str], log_dir: Path) -> None:
        super().__init__(name, sys.executable, llm_kwargs, env, log_dir, host="tests.vllm_engine.engine_host")

    def call(self, op: str, timeout_s: float = 180, **args: Any) -> dict[str, Any]:
        return super().call(op, timeout_s, **args)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 1,  # type: ignore[override]
        reset_prefix_cache: bool = False,
        commit: bool = True,
    ) -> list[dict[str, Any]]:
        """Outputs in prompt order; `commit` (default): the last step's saves are committed
        before this returns (layerkv.bench.vllm.host.generate)."""
        return super().generate(prompts, reset_prefix_cache=reset_prefix_cache, commit=commit, max_tokens=max_tokens)[
            "outputs"
        ]
