"""An engine process of the chaos tier (producer, reader or stalled writer), driven over its stdin.

Usage: python -m tests.chaos.agent <job.json>; the job names the Mooncake client config and the
layerkv config. Commands, one JSON object per stdin line, each answered by one stdout line
"@@" + JSON with the same "id":
  {"op": "serve", "prompts": [[...]], "max_tokens": n}   -> {"outputs": [...]} (engines.serve_one)
  {"op": "arm", "method": m, "layer_idx": l, "when": "before" | "after"}   -> {}
  {"op": "open"}                                          -> {}  (the gated call goes on)
  {"op": "status"}                                        -> engines.ChaosEngine.status()
  {"op": "up", "wait_s": t}                               -> {"up": every store answers again}
  {"op": "exit"}                                          -> {} then the process exits
Serving runs on its own thread, so a gated (blocked) request can still be opened or inspected.
A call blocked at the gate prints {"event": "gated", ...} at once. First line: {"event": "ready"}.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from layerkv.engine import EngineConfig, ModelConfig
from tests.chaos.engines import ChaosEngine
from tests.chaos.gate import GateRule

_out_lock = threading.Lock()


def emit(message: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write("@@" + json.dumps(message) + "\n")
        sys.stdout.flush()


def main(job_path: str) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"agent {os.getpid()} %(asctime)s %(name)s %(levelname)s %(message)s",
    )
    job = json.loads(Path(job_path).read_text())
    chaos = ChaosEngine(
        job["mooncake"],
        job["layerkv"],
        announce=emit,
        model_id=job["model_id"],
        model=ModelConfig(**job["model"]),
        engine=EngineConfig(**job["engine"]),
    )
    work: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def serve_loop() -> None:  # one request list at a time, in order
        while (cmd := work.get()) is not None:
            emit({"id": cmd["id"], "outputs": chaos.serve(cmd["prompts"], cmd["max_tokens"])})

    server = threading.Thread(target=serve_loop, name="chaos-agent-serve", daemon=True)
    server.start()
    emit({"event": "ready", "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "serve":
                work.put(cmd)
            elif op == "arm":
                chaos.gate.arm(GateRule(cmd["method"], cmd.get("layer_idx"), cmd.get("when", "before")))
                emit({"id": cmd["id"]})
            elif op == "open":
                chaos.gate.open()
                emit({"id": cmd["id"]})
            elif op == "status":
                emit({"id": cmd["id"], **chaos.status()})
            elif op == "up":
                emit({"id": cmd["id"], "up": chaos.wait_store_up(cmd["wait_s"])})
            elif op == "exit":
                work.put(None)
                server.join(60.0)
                chaos.close()
                emit({"id": cmd["id"]})
                return 0
            else:
                emit({"id": cmd["id"], "error": f"unknown op {op!r}"})
    finally:
        chaos.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
