"""`layerkv bench network`'s consumer host: python -m layerkv.bench.network.host <job.json>, run
by layerkv.bench.network.cluster on the cluster's consumer host. The job names the pool's client
config for this host, the prompt lengths, the repetitions and whether the prefixes are still to
be written. For each prompt: a producer engine here writes its first 90 % into the pool (over the
network, to the storage host) when asked, then the best of `reps` fresh engines of each variant:
recompute (no pool), the local-cache ceiling (the suffix over a prefix in the engine's own
cache), layerkv with its defaults, layerkv with transfer_plan "layers" (each layer read ahead of
the layer that needs it), and load-everything-first (every layer read before the
forward: its load time is `transfer alone`). Prints one line "@@" + JSON. Main thread only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from layerkv.bench.common import BenchOptions
from layerkv.bench.micro.overlap_rig import (
    BLOCK_SIZE,
    HIT_FRACTION,
    LoadAllFirst,
    best_of,
    model_for,
    ttft_compute_alone,
    ttft_recompute,
)
from layerkv.config import LayerKVConfig
from layerkv.connector import SchedulerConnector, WorkerConnector
from layerkv.messages import KVRole
from layerkv.store.checked import CheckedStore
from layerkv.store.mooncake import MooncakeStore


class NetworkRig:
    """One prompt of `prompt_tokens` over the pool `store` (a Mooncake client on this host)."""

    def __init__(self, store: MooncakeStore, options: BenchOptions, prompt_tokens: int) -> None:
        from layerkv.engine import EngineConfig, init_weights

        self.store = store
        self.model, _ = model_for(options)
        self.weights = init_weights(self.model)
        self.prompt_tokens = prompt_tokens
        self.engine_config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=prompt_tokens // BLOCK_SIZE + 8,
            max_num_batched_tokens=prompt_tokens,
            model_id=f"bench/network-{prompt_tokens}",
        )
        self.prompt = np.random.default_rng(prompt_tokens).integers(0, self.model.vocab_size, prompt_tokens).tolist()
        self.prefix_tokens = int(prompt_tokens * HIT_FRACTION) // BLOCK_SIZE * BLOCK_SIZE
        self.prefix_bytes = 0

    def _pooled(self, role: KVRole, load_all: bool = False, plan: str | None = None):  # type: ignore[no-untyped-def]
        from layerkv.engine import Engine, make_deployment

        config = LayerKVConfig.from_dict({"backend": "mooncake", **({"transfer_plan": plan} if plan else {})}, env={})

        def store() -> CheckedStore:
            return CheckedStore(
                self.store, max_batch_keys=config.max_transfer_blocks, call_timeout_s=config.store_call_timeout_s
            )

        scheduler = SchedulerConnector(config, make_deployment(self.model, self.engine_config, 0, role), store())
        workers: list[Any] = [
            WorkerConnector(config, make_deployment(self.model, self.engine_config, 0, role), store())
        ]
        if load_all:
            workers = [LoadAllFirst(w) for w in workers]
        return Engine(self.model, self.engine_config, scheduler, workers, weights=self.weights)

    def write_prefix(self) -> None:
        producer = self._pooled(KVRole.PRODUCER)
        try:
            producer.generate([self.prompt[: self.prefix_tokens + 1]], 1)
            stats = producer.runner.worker_hooks[0].stats()
            if stats.committed_keys < self.prefix_tokens // BLOCK_SIZE:
                raise RuntimeError(
                    f"network: {stats.committed_keys} blocks committed, expected {self.prefix_tokens // BLOCK_SIZE}"
                )
        finally:
            producer.shutdown()

    def recompute(self) -> float:
        return ttft_recompute(self.model, self.engine_config, self.weights, self.prompt)

    def ceiling(self) -> float:
        return ttft_compute_alone(self.model, self.engine_config, self.weights, self.prompt, self.prefix_tokens)

    def pooled(self, load_all: bool, plan: str | None = None) -> tuple[float, float, dict[str, int]]:
        """(TTFT, transfer alone or nan, the plans the planner chose) of one fresh consumer
        (`plan`: its transfer_plan, default auto)."""
        engine = self._pooled(KVRole.CONSUMER, load_all, plan)
        try:
            out = engine.generate([self.prompt], 1)[0]
            if out.num_external_tokens != self.prefix_tokens:
                raise RuntimeError(f"network: loaded {out.num_external_tokens} tokens, expected {self.prefix_tokens}")
            worker = engine.runner.worker_hooks[0]
            stats = worker.stats().as_dict()
            self.prefix_bytes = int(stats.get("loaded_bytes", 0)) or self.prefix_bytes
            plans = {
                k.removeprefix("load_plans_"): int(v) for k, v in stats.items() if k.startswith("load_plans_") and v
            }
            return float(out.ttft_s), float(worker.load_s[0]) if load_all else float("nan"), plans
        finally:
            engine.shutdown()


def measure(store: MooncakeStore, options: BenchOptions, prompt_tokens: int, write: bool) -> dict[str, Any]:
    rig = NetworkRig(store, options, prompt_tokens)
    if write:
        rig.write_prefix()
    reps = options.reps
    load_all, transfer, _ = best_of(lambda: rig.pooled(True), reps)
    defaults, _, plans = best_of(lambda: rig.pooled(False), reps)
    layerwise, _, _ = best_of(lambda: rig.pooled(False, "layers"), reps)
    return {
        "prompt_tokens": prompt_tokens,
        "prefix_tokens": rig.prefix_tokens,
        "recompute_s": best_of(rig.recompute, reps),
        "ceiling_s": best_of(rig.ceiling, reps),
        "layerkv_s": defaults,
        "layerwise_s": layerwise,
        "load_all_s": load_all,
        "transfer_s": transfer,
        "plans": plans,
        "prefix_bytes": rig.prefix_bytes,
        "model_layers": rig.model.num_layers,
    }


def main(job_path: str) -> int:
    import torch

    torch.set_num_threads(1)  # 2 CPUs: leave one to layerkv's receive thread (as suite overlap)
    job = json.loads(Path(job_path).read_text())
    options = BenchOptions(quick=job["quick"], out_dir=Path(job_path).parent, tiny=job["tiny"])
    store = MooncakeStore.from_mooncake_config(job["mooncake"])
    try:
        cells = [measure(store, options, n, job["write"]) for n in job["prompt_tokens"]]
    finally:
        store.close()
    print("@@" + json.dumps(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
