"""One real vLLM engine (offline `LLM`) in its own process, driven by the test process: JSON
commands on stdin, one JSON reply per command on the file descriptor given as argv[2] (stdout and
stderr carry vLLM's logs to a file). vLLM spawns its engine core and workers from here.

    python engine_host.py '<spec json>' <reply fd>
    spec: {"llm": {LLM keyword arguments}}
    commands: generate, abort_while_loading, metrics, shutdown (see HANDLERS)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


SETTLE_TOKEN = 3


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, detokenize=False, ignore_eos=True)


def _output(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs or [])]
    return {
        "request_id": out.request_id,
        "token_ids": list(completion.token_ids),
        "logprobs": [float(lp).hex() for lp in chosen],  # exact: compared bit for bit
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": completion.finish_reason,
    }


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Generate greedily for every prompt (one batch); `reset_prefix_cache` first drops vLLM's
    local prefix cache, so prefix hits can only come from the pool."""
    if cmd.get("reset_prefix_cache"):
        assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
    prompts = [{"prompt_token_ids": ids} for ids in cmd["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(cmd.get("max_tokens", 1)), use_tqdm=False)
    wall_ms = (time.perf_counter() - start) * 1000
    if cmd.get("settle", True):
        # The last step's saves are committed by a later step's verdict (docs/data-safety.md);
        # an idle engine runs no later step here (the in-process engine stops stepping when the
        # outputs are done) or runs it after the next request was already scheduled. Two more
        # one-token requests (no full block: nothing to save or load) make the objects readable
        # before this returns, also with async scheduling (verdicts one step later).
        for _ in range(2):
            llm.generate([{"prompt_token_ids": [SETTLE_TOKEN]}], _params(1), use_tqdm=False)
    return {"wall_ms": wall_ms, "outputs": [_output(o) for o in outs]}


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
    return {
        "outputs": [_output(o) for o in outputs if o.outputs],
        "drained_s": time.monotonic() - aborted_at,
    }


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


HANDLERS = {"generate": generate, "abort_while_loading": abort_while_loading, "metrics": metrics}


def main() -> int:
    spec = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        reply.write(json.dumps(message) + "\n")

    from vllm import LLM

    try:
        start = time.monotonic()
        llm = LLM(**spec["llm"])
    except BaseException as exc:  # startup failure: the test may expect it (and its message)
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    send({"ready": True, "startup_s": time.monotonic() - start})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "shutdown":
            break
        try:
            send({"ok": True, **HANDLERS[cmd["op"]](llm, cmd)})
        except Exception as exc:
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    del llm  # shuts the engine core and workers down
    send({"stopped": True})
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running main
    sys.exit(main())
