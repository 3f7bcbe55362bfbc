"""A producer node under whichever vLLM release this process imports (the test that starts it
puts the other release first on PYTHONPATH): it computes a prompt to completion into a real
Mooncake pool, prints one JSON line (vLLM version, namespace, block hashes), and keeps its
client (whose segment may hold the objects) open until a line arrives on stdin.

    python -m tests.vllm.other_release_producer MOONCAKE_CONFIG_JSON TENANT SEED NUM_TOKENS
"""

from __future__ import annotations

import json
import sys


def main(config_path: str, tenant: str, seed: int, num_tokens: int) -> None:
    import vllm

    from tests.tokens import prompt
    from tests.vllm.pool_rig import Node, StandInModel
    from tests.vllm.vllm_harness import make_engine
    from tests.vllm.worker_rig import make_worker

    extra = {"tenant": tenant, "backend": "mooncake", "mooncake_config_path": config_path}
    engine = make_engine(extra=extra)
    worker = make_worker(engine)
    node = Node(engine, worker, StandInModel(worker.kv_caches))
    try:
        request = node.add("p", prompt(seed, num_tokens))
        node.run_to_completion()
        print(
            json.dumps(
                {
                    "vllm": vllm.__version__,
                    "namespace": node.core_worker.namespace.name,
                    "block_hashes": [h.hex() for h in request.block_hashes],
                    "committed_keys": node.core_worker.stats().committed_keys,
                }
            ),
            flush=True,
        )
        sys.stdin.readline()  # the consumer has read the pool
    finally:
        node.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
