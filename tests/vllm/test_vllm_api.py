"""What vLLM 0.34 added to the connector API, asked through vLLM's own code: how the workers
reach the KV cache (`kv_cache_access`, for 0.34's extensible KV cache), lookahead block hashes
(off), and requests that read no external KV (prompt logprobs; 0.33 and 0.34). The 0.34-only
hooks are skipped, saying so, in the run against vLLM 0.33, which never calls them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from layerkv.bench.decode.engine import runner_output
from tests.vllm.vllm_harness import make_request, make_vllm_config, require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import assert_blocks, produce  # noqa: E402

pytestmark = pytest.mark.vllm
needs_034 = pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "may_load_async"), reason="a vLLM 0.34 hook: this run's vLLM (0.33) never calls it"
)


@needs_034
@pytest.mark.parametrize("multi_connector", [False, True], ids=["alone", "under MultiConnector"])
@pytest.mark.parametrize("register", [False, True], ids=["staging only", "register_kv_cache"])
def test_kv_cache_access_registers_exactly_when_the_live_cache_is_registered(register, multi_connector):
    from vllm.config.kv_transfer import KVCacheAccess

    transfer = make_vllm_config(
        extra={"register_kv_cache": register}, multi_connector=multi_connector
    ).kv_transfer_config
    assert transfer.kv_cache_access() == (KVCacheAccess.REGISTERS if register else KVCacheAccess.IN_PROCESS)
    assert transfer.registers_kv_cache_memory() is register  # one physical allocation per segment


@needs_034
@pytest.mark.parametrize("multi_connector", [False, True], ids=["alone", "under MultiConnector"])
def test_lookahead_block_hashes_stay_off_where_vllm_resolves_them(monkeypatch, multi_connector):
    """vLLM turns lookahead hashing on for a drafter only if the connector supports it: objects
    are named by the block hashes every engine computes, with or without a drafter."""
    vllm_config = make_vllm_config(multi_connector=multi_connector)
    drafter = SimpleNamespace(
        use_eagle_block_drop=lambda: True,
        disable_lookahead_block_hashes=False,
        speculator_config=SimpleNamespace(num_prefill_lookahead_tokens=3),
    )
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


# ---------------------------------------------------------------- may_load_async (several groups)


def hybrid_engine(**scheduler_kwargs):
    """vLLM's real Scheduler with its hybrid KV cache manager over a full-attention and a
    sliding-window group (layerkv loads such a model before the request's first step:
    asynchronously), the neutral cores replaced by the recording doubles."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from tests.vllm.vllm_harness import BLOCK_SIZE, FULL_SPEC_ARGS, make_engine

    specs = [
        FullAttentionSpec(**FULL_SPEC_ARGS, dtype=torch.float16),
        SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64),
    ]
    return make_engine(64, specs=specs, scheduler_kwargs={"disable_hybrid_kv_cache_manager": False, **scheduler_kwargs})


def queued(engine, req_id: str) -> str:
    scheduler = engine.scheduler
    for name in ("async_kv_waiting", "waiting"):
        if any(r.request_id == req_id for r in getattr(scheduler, name)):
            return name
    return "elsewhere"


@needs_034
def test_a_pool_hit_of_a_hybrid_model_starts_loading_while_the_batch_is_full(doubles):
    from vllm.v1.request import RequestStatus

    engine = hybrid_engine(max_num_seqs=2, max_num_inflight_kv_loads=2)
    assert engine.scheduler.connector.scheduler_side.load_async
    hit = make_request("hit", prompt(51, 40))
    doubles.schedulers[0].pool_hashes.update(hit.block_hashes[:2])  # the pool holds its first 2 blocks
    for i, req_id in enumerate(("r1", "r2")):
        engine.scheduler.add_request(make_request(req_id, prompt(52 + i, 40), max_tokens=8))
    engine.scheduler.add_request(hit)
    engine.scheduler.add_request(make_request("miss", prompt(60, 40)))
    assert (queued(engine, "hit"), queued(engine, "miss")) == ("async_kv_waiting", "waiting")

    out = engine.scheduler.schedule()  # r1 and r2 fill the batch
    assert set(out.num_scheduled_tokens) == {"r1", "r2"}
    assert engine.scheduler.requests["hit"].status is RequestStatus.WAITING_FOR_REMOTE_KVS  # its load started
    assert engine.scheduler.requests["miss"].status is RequestStatus.WAITING


@needs_034
def test_a_capped_pool_hit_of_a_hybrid_model_does_not_hold_up_local_requests(doubles):
    from vllm.v1.request import RequestStatus

    engine = hybrid_engine(max_num_seqs=8, max_num_inflight_kv_loads=1)
    first, second = make_request("hit1", prompt(61, 40)), make_request("hit2", prompt(62, 40))
    doubles.schedulers[0].pool_hashes.update(first.block_hashes[:2] + second.block_hashes[:2])
    engine.scheduler.add_request(first)
    out = engine.scheduler.schedule()  # hit1's load takes the one in-flight slot (its worker never reports it)
    engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out))
    assert engine.scheduler.requests["hit1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.scheduler.add_request(second)
    engine.scheduler.add_request(make_request("local", prompt(63, 40)))
    out = engine.scheduler.schedule()
    assert out.num_scheduled_tokens == {"local": 40}  # not held up behind the capped hit2
    assert (
        engine.scheduler.requests["hit2"].status is RequestStatus.WAITING
        and queued(engine, "hit2") == "async_kv_waiting"
    )


@needs_034
def test_may_load_async_is_false_for_one_group_a_miss_and_prompt_logprobs(doubles):
    """One KV cache group loads inside the step (synchronously): never async. A prompt whose
    first block the pool lacks, or a request that reads no external KV: no lookup at all."""
    from tests.vllm.vllm_harness import make_engine

    single = make_engine(scheduler_kwargs={"max_num_inflight_kv_loads": 1})
    request = make_request("a", prompt(64, 40))
    doubles.schedulers[0].pool_hashes.update(request.block_hashes)
    assert single.scheduler.connector.may_load_async(request) is False
    hybrid = hybrid_engine(max_num_inflight_kv_loads=1)
    core = doubles.schedulers[-2]
    assert hybrid.scheduler.connector.may_load_async(request) is True
    assert hybrid.scheduler.connector.may_load_async(make_request("b", prompt(65, 40))) is False
    asked = len([c for c in core.calls if c[0] == "may_hit"])
    assert (
        hybrid.scheduler.connector.may_load_async(make_request("lp", request.prompt_token_ids, prompt_logprobs=1))
        is False
    )
    assert len([c for c in core.calls if c[0] == "may_hit"]) == asked


@needs_034
def test_a_bad_layerkv_config_is_refused_by_the_connector_not_by_the_access_question():
    """vLLM 0.34 asks kv_cache_access while it builds its config: a bad layerkv key must still be
    refused by the connector, with layerkv's message (IN_PROCESS meanwhile: nothing registered)."""
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from layerkv.errors import ConfigError
    from tests.vllm.vllm_harness import make_kv_cache_config

    vllm_config = make_vllm_config(extra={"register_kv_cache": "yes"})
    assert vllm_config.kv_transfer_config.kv_cache_access() == KVCacheAccess.IN_PROCESS
    with pytest.raises(ConfigError, match="register_kv_cache='yes' must be of type bool"):
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))
