"""A producer engine in its own process with its own Mooncake client (tests only).

Usage: python -m tests.e2e.producer_process <job.json>. The job names the Mooncake client
config, the engine config and the prompts; the producer serves them one at a time, prints one
line "@@" + JSON (its put-start keys and worker stats) and keeps its client (and so its segment,
which may hold the objects) until stdin closes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from layerkv.config import LayerKVConfig
from layerkv.engine import EngineConfig, ModelConfig
from layerkv.engine.pooled import pooled_engine
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import PUT_START, FaultyStore
from layerkv.store.mooncake import MooncakeStore


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    store = MooncakeStore.from_mooncake_config(job["mooncake"])
    faulty = FaultyStore(store)  # no rules: only its call log (the keys this process started)
    config = LayerKVConfig.from_dict({"backend": "mooncake"}, env={})
    engine = pooled_engine(
        ModelConfig(**job["model"]),
        EngineConfig(**job["engine"]),
        config,
        store_factory=lambda: CheckedStore(faulty, max_batch_keys=config.max_transfer_blocks),
    )
    try:
        for prompt in job["prompts"]:
            engine.generate([prompt], job["max_tokens"])
        stats = [w.stats().as_dict() for w in engine.runner.worker_hooks]  # type: ignore[attr-defined]
        trackers_empty = all(w.is_idle(5.0) for w in engine.runner.worker_hooks)  # type: ignore[attr-defined]
    finally:
        engine.shutdown()
    print(
        "@@" + json.dumps({"put_keys": faulty.keys_sent(PUT_START), "stats": stats, "trackers_empty": trackers_empty}),
        flush=True,
    )
    sys.stdin.read()  # hold the client (and its segment) until the test is done
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
