"""What vLLM 0.34 added to the connector API, asked through vLLM's own code: how the workers
reach the KV cache (`kv_cache_access`, for 0.34's extensible KV cache), lookahead block hashes
(off), and requests that read no external KV (prompt logprobs; 0.33 and 0.34). The 0.34-only
hooks are skipped, saying so, in the run against vLLM 0.33, which never calls them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tests.vllm.vllm_harness import make_request, make_vllm_config, require_vllm

require_vllm()

from tests.vllm.pool_rig import assert_blocks, produce, prompt  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402

pytestmark = pytest.mark.vllm
needs_034 = pytest.mark.skipif(not hasattr(KVConnectorBase_V1, "may_load_async"),
                               reason="a vLLM 0.34 hook: this run's vLLM (0.33) never calls it")


@needs_034
@pytest.mark.parametrize("multi_connector", [False, True], ids=["alone", "under MultiConnector"])
@pytest.mark.parametrize("register", [False, True], ids=["staging only", "register_kv_cache"])
def test_kv_cache_access_registers_exactly_when_the_live_cache_is_registered(register, multi_connector):
    from vllm.config.kv_transfer import KVCacheAccess

    transfer = make_vllm_config(extra={"register_kv_cache": register}, multi_connector=multi_connector).kv_transfer_config
    assert transfer.kv_cache_access() == (KVCacheAccess.REGISTERS if register else KVCacheAccess.IN_PROCESS)
    assert transfer.registers_kv_cache_memory() is register  # one physical allocation per segment


@needs_034
@pytest.mark.parametrize("multi_connector", [False, True], ids=["alone", "under MultiConnector"])
def test_lookahead_block_hashes_stay_off_where_vllm_resolves_them(monkeypatch, multi_connector):
    """vLLM turns lookahead hashing on for a drafter only if the connector supports it: objects
    are named by the block hashes every engine computes, with or without a drafter."""
    vllm_config = make_vllm_config(multi_connector=multi_connector)
    drafter = SimpleNamespace(use_eagle_block_drop=lambda: True, disable_lookahead_block_hashes=False,
                              speculator_config=SimpleNamespace(num_prefill_lookahead_tokens=3))
    object.__setattr__(vllm_config, "speculative_config", drafter)
    assert "supports_lookahead_block_hashes" in vars(LayerKVConnector)  # layerkv's own answer, not a default
    assert vllm_config._resolve_num_hash_lookahead_tokens() == 0
    monkeypatch.setattr(LayerKVConnector, "supports_lookahead_block_hashes", classmethod(lambda cls, config: True))
    assert vllm_config._resolve_num_hash_lookahead_tokens() == 3  # vLLM does ask the connector


def test_a_request_with_prompt_logprobs_reads_nothing_from_the_pool_and_asks_nothing(pool):
    """vLLM reads no external KV for a request with prompt logprobs (0.34: skip_reading_external_kv;
    0.33: skip_reading_prefix_cache): layerkv answers 0 without a lookup. The same prompt
    without them loads from the pool."""
    tokens = prompt(41, 56)  # 3 full blocks + 8 tokens
    produce(pool, "p", tokens)
    consumer = pool.node()
    core = consumer.scheduler.connector.scheduler_side.subs[0]
    with_logprobs = make_request("lp", tokens, prompt_logprobs=1)
    consumer.scheduler.add_request(with_logprobs)
    out, _, _ = consumer.step()
    assert out.num_scheduled_tokens == {"lp": 56}  # all computed
    assert core.stats().lookups == 0 and core.stats().hit_blocks == 0
    consumer.run_to_completion()

    fresh = pool.node()  # without prompt logprobs (and without the first node's local prefix cache)
    fresh.add("c", tokens)
    out, _, _ = fresh.step()
    assert out.num_scheduled_tokens == {"c": 8}  # 48 tokens from the pool
    assert fresh.scheduler.connector.scheduler_side.subs[0].stats().lookups == 1
    assert_blocks(fresh, "c", tokens, 3)
