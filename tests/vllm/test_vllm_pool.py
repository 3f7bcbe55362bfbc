"""vLLM's real Scheduler and per-layer hook path driving the REAL layerkv connector over a real
store: the process-wide embedded store (scheduler and workers in one process) and a real
mooncake_master (every connector its own Mooncake client, configured through
kv_connector_extra_config). A producer node saves; a fresh consumer node (new scheduler, worker
and caches) gets the hit and loads layer by layer; the bytes are checked against the producer's
cache and against the stand-in model's formula."""

from __future__ import annotations

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, LAYERS, require_vllm

require_vllm()

import torch  # noqa: E402

from layerkv.integrations.vllm import LayerKVConnector, LayerKVStats  # noqa: E402
from layerkv.store.base import Code  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import assert_blocks, expected_block, produce  # noqa: E402

pytestmark = pytest.mark.vllm


def test_producer_saves_consumer_loads_layer_by_layer(pool):
    tokens = prompt(1, 40)  # 2 full blocks + 8 tokens
    producer, produced, saved = produce(pool, "p", tokens)
    # committed after the step that wrote them (the verdict waits for every worker), in the background
    committed = [
        o.kv_connector_stats.data.get("committed_keys", 0) if o.kv_connector_stats else 0 for o in producer.outputs
    ]
    assert committed[0] == 0
    assert producer.core_worker.flush(5.0) and producer.core_worker.stats().committed_keys == 2

    consumer = pool.node()
    assert isinstance(consumer.worker.connector, LayerKVConnector)
    # Both sides named the objects from kv_cache_config alone (Deployment.kv_signature).
    assert consumer.scheduler.connector.scheduler_side.subs[0].namespace == consumer.core_worker.namespace
    assert consumer.core_worker.deployment.kv_signature.startswith("vllm-attn[block_size=16,num_kv_heads=2")
    request = consumer.add("c", tokens)
    assert request.block_hashes == produced.block_hashes  # same prompt, same chained hashes
    loaded_at_layer: dict[str, bool] = {}

    def before_attention(name: str) -> None:  # runs after wait_for_layer_load(name)
        ids = consumer.block_ids("c")
        layer = LAYERS.index(name)
        loaded_at_layer[name] = all(
            torch.equal(consumer.block(name, ids[b]), expected_block(layer, tokens, b, consumer.block(name, ids[b])))
            for b in range(2)
        )

    out, connector_output, engine_outputs = consumer.step(before_attention)

    assert out.has_sync_kv_loads is True
    assert out.num_scheduled_tokens == {"c": 8}  # 32 tokens came from the pool
    assert loaded_at_layer == {name: True for name in LAYERS}
    assert connector_output.invalid_block_ids == set()
    assert_blocks(consumer, "c", tokens, 2, saved, request)
    stats = connector_output.kv_connector_stats
    assert isinstance(stats, LayerKVStats)
    assert stats.data["load_blocks"] == 2 and stats.data["loaded_bytes"] > 0 and stats.data["load_range_calls"] >= 1
    scheduler_stats = engine_outputs[0].scheduler_stats.kv_connector_stats
    assert scheduler_stats["scheduler_hit_blocks"] == 2 and scheduler_stats["load_blocks"] == 2

    consumer.step()  # a decode step: stats are deltas, nothing was loaded again
    later = consumer.outputs[-1].kv_connector_stats
    assert later is None or "load_blocks" not in later.data
    consumer.run_to_completion()
    assert consumer.core_worker.is_idle(5.0)


def test_chunked_prefill_saves_every_chunk_and_consumer_loads_them(pool):
    tokens = prompt(2, 100)  # 6 full blocks, produced in 32-token chunks
    producer, produced, saved = produce(pool, "p", tokens, max_num_batched_tokens=32)
    stats = [o.kv_connector_stats.data if o.kv_connector_stats else {} for o in producer.outputs]
    chunks = [s.get("committed_keys", 0) for s in stats[:4]]
    assert chunks[0] == 0  # nothing is committed by the step that wrote it
    assert producer.core_worker.flush(5.0) and producer.core_worker.stats().committed_keys == 6

    consumer = pool.node(max_num_batched_tokens=32)
    consumer.add("c", tokens)
    out, connector_output, _ = consumer.step()
    assert out.num_scheduled_tokens == {"c": 4} and out.has_sync_kv_loads
    assert connector_output.kv_connector_stats.data["load_blocks"] == 6
    assert_blocks(consumer, "c", tokens, 6, saved, produced)


def test_preempted_requests_resume_and_their_blocks_reach_the_pool(pool):
    # 10 blocks (9 usable): two 64-token prompts take 8, their first decode blocks preempt one.
    producer = pool.node(num_blocks=10, max_num_batched_tokens=128)
    a, b = prompt(4, 64), prompt(5, 64)
    producer.add("a", a, max_tokens=20)
    producer.add("b", b, max_tokens=20)
    preempted = set()
    for _ in range(120):
        out, _, _ = producer.step()
        preempted |= set(out.preempted_req_ids or ())
        if not producer.scheduler.has_requests():
            break
    assert preempted, "the scenario must preempt a request"
    assert producer.core_worker.is_idle(5.0)

    consumer = pool.node()
    consumer.add("a", a + [7] * 16)  # prompt + 16 decoded tokens: 5 full blocks, all saved
    consumer.add("b", b + [7] * 16)
    out, connector_output, _ = consumer.step()
    assert out.num_scheduled_tokens == {"a": 16, "b": 16}  # 64 tokens each from the pool
    assert connector_output.invalid_block_ids == set()
    assert_blocks(consumer, "a", a + [7] * 16, 5)
    assert_blocks(consumer, "b", b + [7] * 16, 5)


def test_requests_preempted_between_steps_resume_and_the_pool_holds_their_true_blocks(pool):
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts the running requests
    between two steps; the next step schedules them again, whole (0.34: as new requests with
    prompt + generated tokens), in the same output that names them preempted. What they save
    afterwards (blocks of prompt and of generated tokens) is what a fresh consumer loads, equal
    to the stand-in model's KV for those tokens."""
    producer = pool.node(num_blocks=32, max_num_batched_tokens=256)
    a, b = prompt(11, 40), prompt(12, 24)
    producer.add("a", a, max_tokens=30)
    producer.add("b", b, max_tokens=30)
    for _ in range(3):  # the prefill and two decode steps
        producer.step()
    assert producer.scheduler.reset_prefix_cache(reset_running_requests=True)
    out, _, _ = producer.step()
    assert set(out.preempted_req_ids) == {"a", "b"} and set(out.num_scheduled_tokens) == {"a", "b"}
    producer.run_to_completion()

    consumer = pool.node()
    full_a, full_b = a + [7] * 30, b + [7] * 30  # 4 and 3 full blocks (the last token never saved)
    consumer.add("a", full_a)
    consumer.add("b", full_b)
    out, connector_output, _ = consumer.step()
    assert out.num_scheduled_tokens == {"a": 70 - 64, "b": 54 - 48}  # every full block from the pool
    assert connector_output.invalid_block_ids == set()
    assert_blocks(consumer, "a", full_a, 4)
    assert_blocks(consumer, "b", full_b, 3)


def test_request_aborted_mid_step_leaves_no_sessions(pool):
    from vllm.v1.request import RequestStatus

    tokens = prompt(6, 72)
    produce(pool, "p", tokens[:40])  # the pool holds blocks 0 and 1

    consumer = pool.node()
    consumer.add("c", tokens)
    total_free = consumer.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def abort_during_forward(name: str) -> None:
        # The engine core aborts while the worker is mid-forward: loads of this step are
        # reading, the save of blocks 2-3 is open.
        if name == LAYERS[0]:
            consumer.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)

    out, connector_output, _ = consumer.step(abort_during_forward)
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"c": 40}
    assert connector_output.invalid_block_ids == set()
    consumer.step()  # carries finished_req_ids ("c") to the worker
    assert "c" not in consumer.scheduler.requests
    assert consumer.core_worker.is_idle(5.0)
    assert consumer.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() >= total_free
    # The open save still committed whole objects (the request's blocks were computed).
    again = pool.node()
    again.add("d", tokens)
    out, _, _ = again.step()
    assert out.num_scheduled_tokens == {"d": 8}  # 4 blocks from the pool
    assert_blocks(again, "d", tokens, 4)


def test_load_failure_is_recomputed_by_vllm_from_first_invalid_block(pool, monkeypatch):
    import layerkv.integrations.vllm.sides as sides
    from layerkv.store.checked import CheckedStore
    from layerkv.store.factory import open_store
    from layerkv.store.faults import GET_RANGES, FaultyStore

    tokens = prompt(7, 56)  # 3 full blocks + 8 tokens
    produce(pool, "p", tokens)

    faulty: list[FaultyStore] = []

    def open_faulty_store(config):
        faulty.append(FaultyStore(open_store(config)))
        return CheckedStore(faulty[-1], max_batch_keys=config.max_transfer_blocks)

    monkeypatch.setattr(sides, "OPEN_STORE", open_faulty_store)
    consumer = pool.node(extra={"transfer_plan": "layers"})  # the fault is on layer 1's read
    _, worker_faults = faulty  # built in this order: scheduler, worker
    request = consumer.add("c", tokens)
    block1 = request.block_hashes[1].hex()
    rule = worker_faults.fail(GET_RANGES, lambda key: block1 in key, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)

    out, connector_output, engine_outputs = consumer.step()

    assert out.num_scheduled_tokens == {"c": 8} and out.has_sync_kv_loads
    assert worker_faults.fired(rule) == 1
    ids = consumer.block_ids("c")
    assert connector_output.invalid_block_ids == {ids[1]}
    assert request.num_computed_tokens == BLOCK_SIZE  # vLLM truncated at the first invalid block
    assert request.num_output_tokens == 0  # the token sampled over bad KV was dropped
    assert not any(o.new_token_ids for eco in engine_outputs.values() for o in eco.outputs)

    out, connector_output, _ = consumer.step()
    assert out.num_scheduled_tokens == {"c": 40}  # blocks 1, 2 and the tail recomputed
    assert not out.has_sync_kv_loads and connector_output.invalid_block_ids == set()
    assert_blocks(consumer, "c", tokens, 3)
    consumer.run_to_completion()
    assert consumer.core_worker.is_idle(5.0)
