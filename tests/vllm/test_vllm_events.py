"""KV cache events for routers, through vLLM's real Scheduler (it takes the connector's events
each step and publishes them with its own): the pool's blocks are announced once committed,
with their token ids and parent hashes as vLLM's own BlockStored events carry them; a block
whose load failed is announced removed; a cache reset clears all. Both backends."""

from __future__ import annotations

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, require_vllm

require_vllm()

from layerkv.store.base import Code  # noqa: E402
from tests.tokens import prompt  # noqa: E402

pytestmark = pytest.mark.vllm


class Recorder:
    """Stands in for vLLM's event publisher (the scheduler calls publish(batch) each step)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return None

    def pool(self, kind: type) -> list:
        from vllm.distributed.kv_events import MEDIUM_STORAGE

        return [e for e in self.events if isinstance(e, kind) and getattr(e, "medium", None) == MEDIUM_STORAGE]


def _ext(block_hash: bytes):
    """vLLM's event form of a block hash (an int by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)


def _node(pool, **kwargs):
    node = pool.node(kv_events=True, **kwargs)
    recorder = Recorder()
    node.scheduler.kv_event_publisher = recorder
    return node, recorder


def test_committed_blocks_are_announced_with_their_tokens(pool):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    producer, events = _node(pool)
    tokens = prompt(11, 3 * BLOCK_SIZE + 5)
    request = producer.add("a", tokens)
    producer.step()  # the prompt's 3 full blocks are written in this step, committed by a later one
    assert events.pool(BlockStored) == []  # planned is not stored
    producer.run_to_completion()
    stored = events.pool(BlockStored)
    assert [e.block_hashes for e in stored] == [[_ext(request.block_hashes[i])] for i in range(3)]
    assert [e.token_ids for e in stored] == [tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(3)]
    assert [e.parent_block_hash for e in stored] == [None, _ext(request.block_hashes[0]), _ext(request.block_hashes[1])]
    assert {(e.block_size, e.locality, e.group_idx) for e in stored} == {(BLOCK_SIZE, "REMOTE", 0)}
    assert producer.scheduler.connector.reset_cache() is True
    producer.step()
    assert any(isinstance(e, AllBlocksCleared) for e in events.events)


def test_a_block_whose_load_failed_is_announced_removed(pool, monkeypatch):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    import layerkv.integrations.vllm.sides as sides
    from layerkv.store.checked import CheckedStore
    from layerkv.store.factory import open_store
    from layerkv.store.faults import GET_RANGES, FaultyStore

    tokens = prompt(12, 3 * BLOCK_SIZE + 8)
    producer, _ = _node(pool)
    producer.add("p", tokens)
    producer.run_to_completion()

    faulty: list[FaultyStore] = []

    def open_faulty_store(config):
        faulty.append(FaultyStore(open_store(config)))
        return CheckedStore(faulty[-1], max_batch_keys=config.max_transfer_blocks)

    monkeypatch.setattr(sides, "OPEN_STORE", open_faulty_store)
    consumer, events = _node(pool, extra={"transfer_plan": "layers"})
    _, worker_faults = faulty  # built in this order: scheduler, worker
    request = consumer.add("c", tokens)
    block1 = request.block_hashes[1].hex()
    worker_faults.fail(GET_RANGES, lambda key: block1 in key, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)
    consumer.step()
    consumer.step()
    assert [e.block_hashes for e in events.pool(BlockRemoved)] == [[_ext(request.block_hashes[1])]]
    consumer.run_to_completion()
    # it recomputed blocks 1 and 2; the pool still had them (the read failed, not the object): the
    # worker's put starts found them and wrote nothing, and they are announced held again
    assert [e.block_hashes for e in events.pool(BlockStored)] == [
        [_ext(request.block_hashes[1])],
        [_ext(request.block_hashes[2])],
    ]
    stats = consumer.core_worker.stats()
    assert (stats.save_skipped_existing, stats.saved_bytes) == (2, 0)
