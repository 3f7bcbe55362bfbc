"""A hybrid model in real vLLM engines: a random-weight Gemma-3 (sliding window of 64 tokens on
4 of its 6 layers, full attention on 2) with vLLM's hybrid KV cache manager on (layerkv's
connector is SupportsHMA): three KV cache groups (two sliding-window, one full-attention), one
object per block and group in the pool. Producer (kv_both) and consumer (kv_consumer, with load
faults on demand) are two engines on a real Mooncake master; the oracle is the producer's own
local prefix cache with the same schedule, bit for bit (as test_engine_pool.py). With several
groups vLLM recovers a failed load only for a request that waits for it, so the consumer loads
a hybrid model's prefix before the request's first step (connector/async_loads.py).
"""

from __future__ import annotations

import pytest

from tests.vllm_engine.fault_control import arm
from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("hybrid", "hybrid-consumer")]


@pytest.fixture(scope="module")
def pair(fleet):
    return fleet.get("hybrid"), fleet.get("hybrid-consumer")


def _counters(engine) -> dict[str, float]:
    return engine.call("metrics")["layerkv"]


def test_hybrid_model_keeps_the_hybrid_manager_and_loads_bit_identical(pair):
    producer, consumer = pair
    prefix = prompt(80, 6 * BLOCK_SIZE)  # 6 blocks: longer than the 2-block window
    request = prefix + prompt(81, 20)
    producer.generate([prefix], reset_prefix_cache=True)  # prefills in chunks of 64 tokens, each saved
    before = _counters(consumer)

    (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=4)

    assert pooled["num_cached_tokens"] == local["num_cached_tokens"] == 6 * BLOCK_SIZE, pool_diagnosis(*pair)
    same_bits(pooled, local)
    after = _counters(consumer)
    loaded = after.get("load_blocks", 0) - before.get("load_blocks", 0)
    # the full-attention group loads all 6 blocks, each sliding-window group only the 2 blocks of
    # the window that ends at the hit (vLLM's null block stands for the rest)
    assert loaded == 6 + 2 * 2, after
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)


def test_hybrid_chunked_prefill_after_a_load_is_bit_identical(pair):
    producer, consumer = pair
    prefix = prompt(82, 9 * BLOCK_SIZE)
    request = prefix + prompt(83, 150)  # after the load: chunks of 64 + 64 + 22, windows slide over loaded blocks
    producer.generate([prefix], reset_prefix_cache=True)

    (pooled,) = consumer.generate([request], max_tokens=3, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=3)

    assert pooled["num_cached_tokens"] == local["num_cached_tokens"] == 9 * BLOCK_SIZE, pool_diagnosis(*pair)
    same_bits(pooled, local)


def test_a_failed_hybrid_load_is_recomputed_and_the_engine_serves_on(pair, fleet):
    """vLLM 0.32 stops the engine core when a connector reports failed blocks of a model with
    several KV cache groups; layerkv reports the request's load as failed instead, and vLLM
    recomputes the request from token 0 (the pool is not offered to it again)."""
    producer, consumer = pair
    faults = fleet.fault_dir("hybrid-consumer")
    prefix = prompt(84, 5 * BLOCK_SIZE)
    request = prefix + prompt(85, 12)
    producer.generate([prefix], reset_prefix_cache=True)
    before = _counters(consumer)
    arm(faults, 20, [{"kind": "fail", "layer_idx": 1, "times": 1}], marker="hybrid-fault-20")

    (faulted,) = consumer.generate([request], max_tokens=3, reset_prefix_cache=True)

    assert (faults / "hybrid-fault-20").exists(), "the fault was not armed at a loading step"
    after = _counters(consumer)
    assert after.get("load_failed_blocks", 0) > before.get("load_failed_blocks", 0)
    assert faulted["num_cached_tokens"] == 0  # recomputed, not served from the failed load
    (local,) = producer.generate([request], max_tokens=3, reset_prefix_cache=True)  # computed by the producer too
    assert faulted["token_ids"] == local["token_ids"]
    (pooled,) = consumer.generate([request], max_tokens=3, reset_prefix_cache=True)  # the engine serves on
    assert pooled["num_cached_tokens"] == 5 * BLOCK_SIZE, pool_diagnosis(*pair)
