"""The real-engine tier's engine host: layerkv.bench.vllm.host (one offline vLLM `LLM` in its own
process, JSON commands on stdin, replies on a file descriptor) plus test commands:
`abort_while_loading`, `metrics` and `update_weights`. Run by the tests as `python -m tests.vllm_engine.engine_host`
(the repo root is on the engine's PYTHONPATH). Main thread only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from layerkv.bench.vllm.host import HANDLERS, _output, _params, main


def abort_while_loading(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Add one request, wait until the worker says its load is in flight (the marker file the
    test connector writes from start_load_kv), abort it, then drain the engine."""
    engine = llm.llm_engine
    marker = Path(cmd["marker"])
    if cmd.get("reset_prefix_cache"):
        assert llm.reset_prefix_cache()
    engine.add_request("aborted-while-loading", {"prompt_token_ids": cmd["prompt"]}, _params(cmd["max_tokens"]))
    deadline = time.monotonic() + cmd.get("timeout_s", 60)
    outputs: list[Any] = []
    while not marker.exists():  # another process's file: poll with a deadline
        if time.monotonic() > deadline:
            raise TimeoutError(f"no load started within {cmd.get('timeout_s', 60)} s (marker {marker})")
        time.sleep(0.01)
    aborted_at = time.monotonic()
    engine.abort_request(["aborted-while-loading"])
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return {"outputs": [_output(o) for o in outputs if o.outputs], "drained_s": time.monotonic() - aborted_at}


def metrics(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Counters from vLLM's Prometheus registry in this (front-end) process: layerkv's
    `vllm:layerkv_total{counter=...}` by counter name, and vLLM's preemption count."""
    layerkv: dict[str, float] = {}
    preemptions = 0.0
    for metric in llm.get_metrics():
        if metric.name in ("vllm:layerkv_total", "vllm:layerkv"):  # counter family vs sample name
            layerkv[metric.labels["counter"]] = layerkv.get(metric.labels["counter"], 0) + metric.value
        elif metric.name in ("vllm:num_preemptions", "vllm:num_preemptions_total"):
            preemptions += metric.value
    return {"layerkv": layerkv, "num_preemptions": preemptions}


_ORIGINAL: dict[str, Any] = {}  # parameter name -> its weights before update_weights (restore)


def _shift_weights(worker: Any, delta: float) -> list[str]:
    """On the worker (collective_rpc): every parameter += delta * a fixed +-1 pattern, or back
    to the loaded weights when delta is 0. What an RL trainer's weight push looks like to vLLM:
    the same files, other weights."""
    import torch

    names = []
    for name, param in worker.model_runner.get_model().named_parameters():
        with torch.no_grad():
            if delta == 0.0:
                if name in _ORIGINAL:
                    param.copy_(_ORIGINAL.pop(name))
            else:
                _ORIGINAL.setdefault(name, param.detach().clone())
                pattern = torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape).remainder(3).sub(1)
                param.add_(pattern, alpha=delta)
        names.append(name)
    return names


def update_weights(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """New weights in place (`delta`; 0 restores the loaded ones), then, with `reset`, vLLM's
    reset_prefix_cache(reset_connector=True) as RL flows call it after a weight update. Needs a
    worker in this process (the uni executor without multiprocessing)."""
    names = llm.collective_rpc(_shift_weights, args=(float(cmd["delta"]),))[0]
    reset = bool(llm.reset_prefix_cache(reset_connector=True)) if cmd.get("reset") else None
    return {"num_params": len(names), "reset": reset}


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running main
    sys.exit(
        main(
            {
                **HANDLERS,
                "abort_while_loading": abort_while_loading,
                "metrics": metrics,
                "update_weights": update_weights,
            }
        )
    )
