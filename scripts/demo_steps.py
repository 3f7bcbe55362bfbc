"""Where a pooled request's TTFT goes in `layerkv demo`, against the same prompt served from the
engine's own prefix cache: per request, the compute thread's waits for layers, the 8 decoder
layers (waits included), the whole forward and the TTFT. What the pooled step spends outside its
layers is connector work on the compute thread (lookup, load start, save hand-off, wait_for_save)
and, inside them beyond the waits, compute slowed by the receive thread's work beside it.

    PYTHONPATH=src .venv/bin/python scripts/demo_steps.py [--store mooncake] [--transfer-plan whole]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from layerkv.cli import main as cli
from layerkv.connector import worker
from layerkv.engine import Engine, runner

_SPANS: dict[str, list[float]] = {"wait": [], "layer": [], "forward": []}


def _timed(cls: type, name: str, span: str, keep: Callable[..., bool] = lambda *a: True) -> None:
    """Wrap cls.name so that each call's duration is appended to _SPANS[span] (if keep(args))."""
    inner = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if keep(*args):
                _SPANS[span].append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main() -> None:
    _timed(worker.WorkerConnector, "wait_for_layer_load", "wait")
    _timed(runner.ModelRunner, "_layer", "layer", keep=lambda self, layer_idx, *a: layer_idx < self.cfg.num_layers)
    _timed(runner.ModelRunner, "_forward", "forward")
    generate = Engine.generate
    lines = []

    def report(self: Engine, prompts: Any, max_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        for spans in _SPANS.values():
            spans.clear()
        outputs = generate(self, prompts, max_tokens, *args, **kwargs)
        out = outputs[0]
        if out.num_external_tokens or out.num_local_cached_tokens:  # the first step is the prefill
            layers = self.runner.cfg.num_layers  # the prefill step's: the first spans recorded
            waits = sum(_SPANS["wait"][: layers * len(self.runner.worker_hooks)])
            kind = "pool " if out.num_external_tokens else "local"
            lines.append(
                f"{kind} TTFT {out.ttft_s * 1e3:6.1f} ms: forward {_SPANS['forward'][0] * 1e3:5.1f}, "
                f"its {layers} layers {sum(_SPANS['layer'][:layers]) * 1e3:5.1f}, of which waits {waits * 1e3:5.1f}"
            )
        return outputs

    Engine.generate = report  # type: ignore[method-assign]
    cli(["demo", *sys.argv[1:]])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
