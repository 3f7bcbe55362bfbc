"""Reference engine scheduler: chunked prefill, preemption, local prefix caching, block pool,
block hashing."""

from __future__ import annotations

import pytest

from layerkv.engine import Engine, EngineConfig, ModelConfig, block_hashes, hash_block
from layerkv.engine.block_pool import BlockPool
from layerkv.engine.hashing import ROOT_PARENT_HASH

CFG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=5)
PROMPT = list(range(40, 63))  # 23 tokens


def run(prompts: list[list[int]], max_tokens: int | list[int], **kw: int) -> tuple[Engine, list]:
    engine = Engine(CFG, EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 64, **kw}))
    return engine, engine.generate(prompts, max_tokens=max_tokens)


def test_chunked_prefill_gives_the_same_tokens_as_unchunked() -> None:
    _, whole = run([PROMPT], 6)
    chunked_engine, chunked = run([PROMPT], 6, max_num_batched_tokens=5)
    assert chunked[0].token_ids == whole[0].token_ids
    prefill = [s.requests[0] for s in chunked_engine.steps[:5]]
    assert [(r.num_computed_tokens, r.num_scheduled_tokens) for r in prefill] == [
        (0, 5),
        (5, 5),
        (10, 5),
        (15, 5),
        (20, 3),
    ]
    assert [s.finished_req_ids for s in chunked_engine.steps].count(frozenset({chunked[0].req_id})) == 1


def test_budget_is_shared_by_running_requests_first() -> None:
    engine, outs = run([PROMPT, [1, 2, 3]], 3, max_num_batched_tokens=16)
    first, second = engine.steps[0], engine.steps[1]
    assert [(r.req_id, r.num_scheduled_tokens) for r in first.requests] == [(outs[0].req_id, 16)]
    assert [(r.req_id, r.num_scheduled_tokens) for r in second.requests] == [(outs[0].req_id, 7), (outs[1].req_id, 3)]
    assert all(sum(r.num_scheduled_tokens for r in s.requests) <= 16 for s in engine.steps)


def test_preemption_in_the_middle_of_a_prefill_keeps_the_tokens() -> None:
    short, long_prompt = [7, 8, 9, 10, 11, 12, 13, 14], list(range(100, 136))
    _, reference = run([short, long_prompt], [10, 4])
    # 10 blocks: the short request decodes while the long one prefills in chunks of 7 tokens
    # until blocks run out; the long one (newest) is preempted at 28 of 36 prompt tokens
    engine, outs = run([short, long_prompt], [10, 4], num_blocks=10, max_num_batched_tokens=8)
    long_id = outs[1].req_id
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert outs[1].num_preemptions >= 1 and outs[0].num_preemptions == 0
    at = next(i for i, s in enumerate(engine.steps) if long_id in s.preempted_req_ids)
    before = next(r for r in engine.steps[at - 1].requests if r.req_id == long_id)
    assert before.num_computed_tokens + before.num_scheduled_tokens < len(long_prompt)  # mid-prefill
    resumed = [r for s in engine.steps[at:] for r in s.requests if r.req_id == long_id and r.resumed]
    # resumed from its freed blocks still in the prefix cache: tail blocks were evicted first
    assert resumed and resumed[0].num_computed_tokens == 20
    assert not engine.scheduler.running and engine.scheduler.block_pool.num_free_blocks == 10


def test_local_prefix_cache_hit_skips_cached_blocks() -> None:
    engine, first = run([PROMPT], 2)
    again = engine.generate([PROMPT], max_tokens=2)[0]
    assert again.num_local_cached_tokens == 20  # 5 full blocks of 23 tokens
    step = engine.steps[len(engine.steps) - 3]  # first step of the second request
    assert (step.requests[0].num_computed_tokens, step.requests[0].num_scheduled_tokens) == (20, 3)
    assert again.token_ids == first[0].token_ids


def test_full_hit_keeps_the_last_token_to_compute() -> None:
    engine, _ = run([PROMPT[:20]], 1)
    again = engine.generate([PROMPT[:20]], max_tokens=1)[0]
    assert again.num_local_cached_tokens == 16


def test_salt_separates_prefix_caches() -> None:
    engine, _ = run([PROMPT], 1)
    out = engine.generate([PROMPT], max_tokens=1, salts=[b"tenant-b"])[0]
    assert out.num_local_cached_tokens == 0


def test_free_cached_blocks_are_evicted_lru() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)  # type: ignore[misc]
    pool.register(a, b"ha")
    pool.register(b, b"hb")
    pool.free([a, b])  # tail first: b is freed (and evicted) before a
    assert pool.cached_prefix([b"ha", b"hb"]) == [a, b]
    new = pool.allocate(3)
    assert new == [2, 3, b]
    assert pool.cached_block_id(b"hb") is None and pool.cached_prefix([b"ha", b"hb"]) == [a]
    pool.touch([a])  # a cached free block is reused without eviction
    assert pool.num_free_blocks == 0 and pool.allocate(1) is None


def test_register_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)  # type: ignore[misc]
    pool.register(x, b"h")
    pool.register(y, b"h")
    assert pool.cached_block_id(b"h") == x


def test_block_hashes_chain_full_blocks_with_salt() -> None:
    hashes = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"s")
    assert len(hashes) == 2 and all(len(h) == 32 for h in hashes)
    assert hashes[0] == hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], b"s")
    assert hashes[1] == hash_block(hashes[0], [5, 6, 7, 8], b"s")
    assert block_hashes([1, 2, 3, 4], 4, b"t")[0] != hashes[0]
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, b"s")[1] != hashes[1]  # parent changes the child


def test_request_larger_than_the_cache_is_rejected() -> None:
    engine = Engine(CFG, EngineConfig(block_size=4, num_blocks=4))
    with pytest.raises(ValueError, match="needs 5 blocks; num_blocks=4"):
        engine.generate([list(range(16))], max_tokens=2)
