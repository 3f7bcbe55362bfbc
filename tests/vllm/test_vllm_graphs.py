"""Full CUDA graphs kept on a server that loads (connector/graphs.py), under vLLM's real Scheduler
and worker hook path: nodes built with `full_graphs` (FULL_AND_PIECEWISE, what a CUDA server
runs) replay every step vLLM's own dispatch rule would replay whole without any per-layer hook
(WorkerRig.replayed). Loads never land under an attention that did not wait for them, saves of
replayed steps are copied after the forward, and what the pool serves equals local compute.
Also: decode steps make no store call on the scheduling thread (saves planned without one)."""

from __future__ import annotations

import threading

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, require_vllm

require_vllm()

from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import SAMPLED_TOKEN, assert_blocks, produce  # noqa: E402

pytestmark = pytest.mark.vllm


def _decoding(node, req_id: str, seed: int, num_tokens: int = 20, max_tokens: int = 64) -> None:
    """Add a request and step until it decodes (one token per step from then on)."""
    node.add(req_id, prompt(seed, num_tokens), max_tokens=max_tokens)
    for _ in range(32):
        node.step()
        if node.scheduler.requests[req_id].num_output_tokens >= 1:
            return
    raise AssertionError(f"{req_id} never decoded")


def _counters(node):
    return node.core_worker.stats(), node.scheduler.connector.scheduler_side.subs[0].stats()


def test_a_hit_leaving_one_token_loads_before_its_first_step_and_decode_graphs_run_over_it(pool):
    tokens = prompt(3, 3 * BLOCK_SIZE + 1)  # a full hit leaves one token: its first step is a decode step
    _, produced, saved = produce(pool, "p", tokens)
    consumer = pool.node(full_graphs=True)
    _decoding(consumer, "other", seed=9)
    request = consumer.add("c", tokens, max_tokens=3)
    replays = consumer.worker.replays
    out, _, _ = consumer.step()  # c waits for its load (0 tokens): "other" decodes, replayed, the load beside it
    assert list(out.num_scheduled_tokens) == ["other"]
    out, _, _ = consumer.step()  # c's one token over its loaded prefix, a decode graph with "other"
    assert out.num_scheduled_tokens == {"other": 1, "c": 1}
    assert consumer.scheduler.requests["c"].num_computed_tokens == 3 * BLOCK_SIZE + 1
    assert consumer.worker.replays - replays == 2
    assert_blocks(consumer, "c", tokens, 3, saved, request)
    worker, scheduler = _counters(consumer)
    assert (worker.load_blocks, worker.load_failed_blocks, worker.load_unwaited_steps, scheduler.load_failures) == (
        3,
        0,
        0,
        0,
    )


def test_a_one_token_chunk_over_a_load_loads_before_the_forward(pool):
    """vLLM's token budget cuts a new request's chunk to one token over its hit: the step is a
    decode batch that vLLM replays whole; its plan loads first (start_load_kv returns once every
    layer landed), so the replayed attention reads loaded KV."""
    tokens = prompt(4, 5 * BLOCK_SIZE + 8)  # the hit leaves 8 tokens: loaded synchronously
    _, produced, saved = produce(pool, "p", tokens)
    consumer = pool.node(full_graphs=True, max_num_batched_tokens=4, scheduler_kwargs={"max_num_seqs": 4})
    for i in range(3):
        _decoding(consumer, f"d{i}", seed=20 + i)
    request = consumer.add("c", tokens, max_tokens=2)
    replays = consumer.worker.replays
    consumer.step()  # 3 decodes + c's first token over its 5 loaded blocks: 4 x 1 token
    assert consumer.scheduler.requests["c"].num_computed_tokens == 5 * BLOCK_SIZE + 1
    assert consumer.worker.replays - replays == 1
    assert_blocks(consumer, "c", tokens, 5, saved, request)
    worker, scheduler = _counters(consumer)
    assert (worker.load_blocks, worker.load_failed_blocks, worker.load_unwaited_steps, scheduler.load_failures) == (
        5,
        0,
        0,
        0,
    )


def test_a_load_no_layer_waited_for_is_recomputed(pool, monkeypatch):
    """A scheduler that planned a load into a replayed step without loading it first (the rules
    of graphs.py switched off): the worker sees no layer wait for it and reports its blocks
    failed; vLLM recomputes them and the KV is still the model's."""
    import layerkv.connector.async_loads as async_loads

    monkeypatch.setattr(async_loads, "mark", lambda plan, *args: plan)
    tokens = prompt(5, 5 * BLOCK_SIZE + 8)
    produce(pool, "p", tokens)
    consumer = pool.node(full_graphs=True, max_num_batched_tokens=4, scheduler_kwargs={"max_num_seqs": 4})
    for i in range(3):
        _decoding(consumer, f"d{i}", seed=30 + i)
    consumer.add("c", tokens, max_tokens=2)
    replays = consumer.worker.replays
    consumer.step()
    assert consumer.worker.replays - replays == 1
    worker, scheduler = _counters(consumer)
    assert (worker.load_unwaited_steps, scheduler.load_failures) == (1, 5)
    assert consumer.scheduler.requests["c"].num_computed_tokens == 0  # rewound to its first failed block
    for _ in range(8):
        consumer.step()
    assert_blocks(consumer, "c", tokens, 5)  # recomputed: the model's KV


def test_blocks_completed_in_replayed_decode_steps_are_saved_after_the_forward(pool):
    producer = pool.node(full_graphs=True)
    tokens = prompt(6, 2 * BLOCK_SIZE + 8)
    producer.add("p", tokens, max_tokens=12)  # decode steps 1-8 complete block 2
    producer.run_to_completion()
    worker, _ = _counters(producer)
    assert producer.worker.replays >= 8 and worker.save_after_forward_steps >= 1
    assert (worker.save_incomplete_steps, worker.committed_keys) == (0, 3)

    consumer = pool.node()
    longer = tokens + [SAMPLED_TOKEN] * 8 + [5]  # the prompt, its first 8 answers, one more token
    consumer.add("c", longer)
    consumer.step()
    assert consumer.core_worker.stats().load_blocks == 3
    assert_blocks(consumer, "c", longer, 3)


def test_decode_steps_make_no_store_call_on_the_scheduling_thread(pool):
    """Requests of mixed lengths decode: a block completes in most steps and is saved; after
    their lookups, the scheduler side asks the store nothing (SavedBlocks, connector/saved.py)."""
    node = pool.node(num_blocks=96, max_num_batched_tokens=512)
    for i, length in enumerate((20, 27, 35, 42, 50, 61)):
        node.add(f"r{i}", prompt(40 + i, length), max_tokens=40)
    node.step()  # every prompt in one step: their lookups
    from layerkv.store.base import STORE_CALLS

    store = node.scheduler.connector._store
    calls: list[str] = []
    here = threading.get_ident()  # the engine's scheduling thread (the manifest writer has its own)
    for name in STORE_CALLS:
        method = getattr(store, name)
        setattr(
            store,
            name,
            lambda *a, _m=method, _n=name, **k: (threading.get_ident() == here and calls.append(_n), _m(*a, **k))[1],
        )
    saved_before = _counters(node)[1].save_blocks
    for _ in range(30):
        node.step()
    assert calls == []
    assert _counters(node)[1].save_blocks - saved_before >= 6  # blocks completed in decode were planned


def test_a_step_that_moves_nothing_never_reaches_the_per_layer_work(pool):
    """Decode steps with nothing to load or save: the facade's per-layer hooks return before the
    engine-neutral worker (no lock, no allocation there); a step that saves reaches it."""
    node = pool.node()
    node.add("r", prompt(50, 20), max_tokens=24)
    core = node.core_worker
    reached: list[str] = []
    for name in ("wait_for_layer_load", "save_kv_layer"):
        method = getattr(core, name)
        setattr(core, name, lambda layer, _m=method, _n=name: (reached.append(_n), _m(layer))[1])
    node.step()  # the prompt: 1 block saved
    assert reached
    idle = 0
    for _ in range(20):  # decode: block 1 completes once (position 31), every other step moves nothing
        reached.clear()
        before = node.scheduler.requests["r"].num_computed_tokens
        node.step()
        if (before + 1) % BLOCK_SIZE:  # completes no block: nothing to save
            idle += 1
            assert reached == [], f"the decode step at position {before} reached the core worker"
        else:
            assert "save_kv_layer" in reached
    assert idle >= 15
