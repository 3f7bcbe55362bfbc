"""New weights in a real vLLM engine (an RL flow's weight push: the same checkpoint files, other
weights in memory), then vLLM's reset_prefix_cache(reset_connector=True): the pool never serves
the KV of the old weights again. The same prompt is recomputed with the new weights, and what
the pool serves from then on is, to the bit, what the engine computed with them.
On the "embedded" engine (one process: the weight update runs on its in-process worker)."""

from __future__ import annotations

import pytest

from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("embedded")]


def test_after_new_weights_and_a_reset_the_pool_serves_only_the_new_weights_kv(fleet):
    engine = fleet.get("embedded")
    request = prompt(80, 4 * BLOCK_SIZE) + prompt(81, 9)
    engine.generate([request], max_tokens=4, reset_prefix_cache=True)  # weights A: computed, saved
    (a_pooled,) = engine.generate([request], max_tokens=4, reset_prefix_cache=True)
    assert a_pooled["num_cached_tokens"] == 4 * BLOCK_SIZE, pool_diagnosis(engine)  # A's KV is in the pool
    resets_before = engine.call("metrics")["layerkv"].get("scheduler_cache_resets", 0)
    assert engine.call("update_weights", delta=1e-2, reset=True)["reset"] is True
    try:
        (b_fresh,) = engine.generate([request], max_tokens=4)
        assert b_fresh["num_cached_tokens"] == 0, pool_diagnosis(engine)  # A's KV is never served again
        assert b_fresh["logprobs"] != a_pooled["logprobs"]  # the weights did change the output
        (b_local,) = engine.generate([request], max_tokens=4)  # vLLM's local prefix cache (B's KV)
        (b_pooled,) = engine.generate([request], max_tokens=4, reset_prefix_cache=True)  # the pool's
        assert b_local["num_cached_tokens"] == b_pooled["num_cached_tokens"] == 4 * BLOCK_SIZE, pool_diagnosis(engine)
        same_bits(b_pooled, b_local)
        assert engine.call("metrics")["layerkv"].get("scheduler_cache_resets", 0) == resets_before + 1
    finally:  # the loaded weights back, and a reset, for the engine's other tests
        assert engine.call("update_weights", delta=0.0, reset=True)["reset"] is True
