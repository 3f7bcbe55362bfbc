"""One real vLLM engine (offline `LLM`) in its own process, run under the engine's Python (the
vLLM venv) and driven by `layerkv bench serving` (layerkv.bench.vllm.engines): JSON commands on
stdin, one JSON reply per command on the file descriptor given as argv[2]; stdout / stderr
carry vLLM's logs to a file. vLLM spawns its engine core and workers from here. Main thread only.

    python -m layerkv.bench.vllm.host '<spec json>' <reply fd>   (tests: tests.vllm_engine.engine_host)
    spec: {"llm": {LLM keyword arguments}}
    commands: {"op": "generate", "prompts": [[ids]], "max_tokens": 1, "reset_prefix_cache": bool,
               "commit": bool, "kv_transfer_params": {...} or null}, {"op": "counters"}, {"op": "shutdown"}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

COMMIT_TOKEN = 3  # a one-token prompt: no full block, nothing to save or load


def _params(max_tokens: int, kv_transfer_params: dict[str, Any] | None = None) -> Any:
    """Greedy; `kv_transfer_params` reach the connector as a P/D proxy's request body does
    (vLLM reads them from the sampling params' extra_args)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=1, detokenize=False, ignore_eos=True, extra_args=extra
    )


def _output(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs or [])]
    metrics = getattr(out, "metrics", None)
    first_token_s = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    return {
        "request_id": out.request_id,
        "finish_reason": completion.finish_reason,
        "token_ids": list(completion.token_ids),
        "logprobs": [float(lp).hex() for lp in chosen],  # exact: compared bit for bit
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "first_token_ms": first_token_s * 1000 if first_token_s else None,  # engine's arrival -> first token
        "kv_transfer_params": getattr(out, "kv_transfer_params", None),  # what a P/D proxy passes on
    }


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Generate greedily for every prompt (one batch); `reset_prefix_cache` first drops vLLM's
    local prefix cache (not the connector's pool), so prefix hits can only come from the pool.
    `commit`: two one-token requests afterwards, so that layerkv commits the last step's saves
    (a later step carries the verdict, docs/data-safety.md) before this returns."""
    if cmd.get("reset_prefix_cache") and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
    prompts = [{"prompt_token_ids": ids} for ids in cmd["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(cmd.get("max_tokens", 1), cmd.get("kv_transfer_params")), use_tqdm=False)
    wall_ms = (time.perf_counter() - start) * 1000
    if cmd.get("commit"):
        for _ in range(2):
            llm.generate([{"prompt_token_ids": [COMMIT_TOKEN]}], _params(1), use_tqdm=False)
    return {"wall_ms": wall_ms, "outputs": [_output(o) for o in outs]}


def counters(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """The connectors' Prometheus counters in this (front-end) process, summed per name and
    labels: layerkv's `vllm:layerkv_total{counter=...}`, MooncakeStoreConnector's
    `vllm:mooncake_store_operation_*_total{operation=...,status=...}`."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)  # counters and gauges; histograms have none
        if value is None or not metric.name.startswith(("vllm:layerkv", "vllm:mooncake_store")):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ("engine", "model_name"))
        key = f"{metric.name}{{{labels}}}"
        totals[key] = totals.get(key, 0.0) + float(value)
    return {"counters": totals}


HANDLERS = {"generate": generate, "counters": counters}


def main(handlers: dict[str, Any] = HANDLERS) -> int:
    """Serve commands with `handlers` (op -> handler(llm, cmd) -> reply fields) until shutdown."""
    spec = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        reply.write(json.dumps(message) + "\n")

    from vllm import LLM

    try:
        start = time.monotonic()
        kwargs = dict(spec["llm"])
        if isinstance(kwargs.get("kv_events_config"), dict):  # JSON: vLLM's LLM wants the config object
            from vllm.config.kv_events import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        llm = LLM(**kwargs)
    except BaseException as exc:  # reported to the driver with the traceback, then exit
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    send({"ready": True, "startup_s": time.monotonic() - start})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "shutdown":
            break
        try:
            if cmd["op"] not in handlers:
                raise ValueError(f"unknown op {cmd['op']!r}; known: {', '.join(handlers)}, shutdown")
            send({"ok": True, **handlers[cmd["op"]](llm, cmd)})
        except Exception as exc:
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    llm.llm_engine.engine_core.shutdown()  # engine core and workers stop now, before the pool's master
    send({"stopped": True})
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running main
    sys.exit(main())
