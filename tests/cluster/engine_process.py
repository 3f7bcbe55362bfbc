"""A reference engine on one cluster host (tests only): python -m tests.cluster.engine_process
<job.json>. The job names the Mooncake client config (its local_hostname is this host's
address), the model, the engine and layerkv configs, the prompts and where to write the outputs
(torch.save of the RequestOutputs, for the test to compare with local compute). Serves the
prompts one at a time, prints one line "@@" + JSON (worker stats, the put-start keys, the
outputs' hit tokens, the seconds each prompt took), then holds its client until stdin closes
when `hold`.

`gate` {"method", "layer_idx", "when": "before" | "after"}: the first such store call prints
"@@gate" and waits for a line on stdin before (or after) it runs, so the test can cut a link at
that point (fault injection on top of the real client). `check_keys`: reported as `present` (batch_is_exist) and
`processing` (still PROCESSING,
polled for up to `settle_s`, default 0: `processing_s` is when none was left) after the probes.
`probes` {"prompts", "hit", "writes"?, "interval_s"?}: after the prompts, "@@gate" again (the
test heals the link), then, every `interval_s` (default 1), one probe: with `writes`, its write
prompt is served first by the writer (this engine when it saves, else a fresh producer engine in
this process) and its probe prompt by the reader (this engine when it is a consumer, else a
fresh consumer engine); without, this engine serves the probe prompt (a prefix it never
computed). `recovery_s` is the time from the test's go to the first probe that loads `hit`
tokens from the pool (None: none did). `role`: a KVRole value (default both).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from layerkv.config import LayerKVConfig
from layerkv.engine import EngineConfig, ModelConfig
from layerkv.engine.pooled import pooled_engine
from layerkv.messages import KVRole
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import PUT_START, FaultyStore
from layerkv.store.mooncake import MooncakeStore
from tests.store_probes import processing_keys


class Gated:
    """Forwards every call to `inner`; the first call of `method` (at `layer_idx`, if given)
    waits for the test before or after it runs."""

    def __init__(self, inner: Any, gate: dict[str, Any]) -> None:
        self._inner, self._gate = inner, gate
        self._armed = threading.Event()
        self._armed.set()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name != self._gate["method"]:
            return fn

        def gated(*args: Any, **kwargs: Any) -> Any:
            layer = self._gate.get("layer_idx")
            if not self._armed.is_set() or (layer is not None and kwargs.get("layer_idx") != layer):
                return fn(*args, **kwargs)
            self._armed.clear()
            if self._gate.get("when", "before") == "before":
                _wait_for_test()
                return fn(*args, **kwargs)
            result = fn(*args, **kwargs)
            _wait_for_test()
            return result

        return gated


def _wait_for_test() -> None:
    print("@@gate", flush=True)
    sys.stdin.readline()


def _recover(engine: Any, role: KVRole, probes: dict[str, Any], max_tokens: int, helper: Any) -> dict[str, Any]:
    """Serve probes after the test's go, one each `interval_s`, until one gets `hit` tokens.
    `helper` makes the other engine of a write/read probe (see the module docstring)."""
    _wait_for_test()
    start = time.monotonic()
    writer = reader = engine
    if probes.get("writes"):
        if role is KVRole.CONSUMER:
            writer = helper(KVRole.PRODUCER)
        else:
            reader = helper(KVRole.CONSUMER)
    tries = []
    try:
        for i, prompt in enumerate(probes["prompts"]):
            if probes.get("writes"):
                writer.generate([probes["writes"][i]], max_tokens)
            out = reader.generate([prompt], max_tokens)[0]
            tries.append(out.num_external_tokens)
            if out.num_external_tokens >= probes["hit"]:
                return {"recovery_s": round(time.monotonic() - start, 2), "tries": tries}
            time.sleep(probes.get("interval_s", 1.0))  # the next probe later (bounded by the number of probes)
        return {"recovery_s": None, "tries": tries}
    finally:
        for other in {writer, reader} - {engine}:
            other.shutdown()


def _processing(store: MooncakeStore, keys: list[Any], settle_s: float) -> tuple[list[Any], float]:
    """The keys still PROCESSING, polled each second for up to `settle_s`; and when none was."""
    start = time.monotonic()
    while True:
        left = processing_keys(store, keys)
        if not left or time.monotonic() - start >= settle_s:
            return left, round(time.monotonic() - start, 2)
        time.sleep(1.0)


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    store = MooncakeStore.from_mooncake_config(job["mooncake"])
    faulty = FaultyStore(store)  # no rules: its call log
    outer: Any = Gated(faulty, job["gate"]) if job.get("gate") else faulty  # sees the layer_idx CheckedStore passes
    config = LayerKVConfig.from_dict({"backend": "mooncake", **job.get("layerkv", {})}, env={})

    def make(role: KVRole) -> Any:
        return pooled_engine(
            ModelConfig(**job["model"]),
            EngineConfig(**job["engine"]),
            config,
            role=role,
            store_factory=lambda: CheckedStore(
                outer, max_batch_keys=config.max_transfer_blocks, call_timeout_s=config.store_call_timeout_s
            ),
        )

    role = KVRole(job.get("role", KVRole.BOTH.value))
    engine = make(role)
    try:
        outputs, seconds = [], []
        for prompt in job["prompts"]:
            start = time.monotonic()
            outputs.append(engine.generate([prompt], job["max_tokens"])[0])
            seconds.append(round(time.monotonic() - start, 3))
        recovery = _recover(engine, role, job["probes"], job["max_tokens"], make) if job.get("probes") else None
        workers = engine.runner.worker_hooks  # type: ignore[attr-defined]
        # a read sent to a host that is gone may stay inside the Mooncake client past its load's bound
        # (a cut link sends no reset); "idle_wait_s" lets it return before the client is torn down
        idle = all(w.is_idle(float(job.get("idle_wait_s", 10.0))) for w in workers)
        stats = [w.stats().as_dict() for w in workers]
    finally:
        engine.shutdown()
    if job.get("out"):
        torch.save(outputs, job["out"])
    check = job.get("check_keys") or []
    processing, processing_s = _processing(store, check, job.get("settle_s", 0.0)) if check else ([], 0.0)
    print(
        "@@"
        + json.dumps(
            {
                "stats": stats,
                "idle": idle,
                "put_keys": faulty.keys_sent(PUT_START),
                "hit_tokens": [o.num_external_tokens for o in outputs],
                "seconds": seconds,
                "recovery": recovery,
                "processing": processing,
                "processing_s": processing_s,
                "present": list(store.batch_is_exist(check)) if check else [],
            }
        ),
        flush=True,
    )
    if job.get("hold"):
        sys.stdin.read()  # hold the client until the test is done
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
