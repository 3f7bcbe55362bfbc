"""A read that returns after its load gave up (a partition longer than load_timeout_s; here a
fault holds the read call inside the store until the test lets it go, as a cut link would) while
the engine has reused the given-up request's blocks: the late bytes land in staging slots nobody
else holds, never in the cache, and the abandoned job verifies and removes nothing. Outputs equal
local compute; the producer's good objects stay in the pool. With register_kv_cache (reads
straight into the cache) the same partition corrupts the blocks the engine reused: a strict xfail
that documents what the opt-in exposes."""

from __future__ import annotations

import pytest

from layerkv.store.faults import GET_RANGES
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import assert_identical, computed_chunks, random_tokens, serve, small_engine

PREFIX = random_tokens(22, seed=91)  # 5 full blocks of 4 tokens
PROMPT_A = PREFIX + random_tokens(2, seed=92)  # the request whose load gives up
PROMPT_B = random_tokens(40, seed=93)  # 10 blocks: takes A's freed blocks (12 blocks in all)
PROMPT_B2 = PROMPT_B + random_tokens(5, seed=94)  # hits B's blocks in the engine's own prefix cache
MAX_TOKENS = 3
ENGINE = small_engine(num_blocks=12, max_num_batched_tokens=12)
HELD_S = 120.0  # the read is held until released (bounded: the fault gives up after this)


@BOTH_BACKENDS
@pytest.mark.parametrize(
    "register_kv_cache",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason=(
                    "register_kv_cache: a read straight into the cache that returns after its load gave up "
                    "writes into blocks the engine has reused (docs/data-safety.md)"
                ),
            ),
        ),
    ],
)
def test_a_read_that_returns_after_its_load_gave_up_lands_in_staging_only(
    make_oracle,
    backend,  # type: ignore[no-untyped-def]
    register_kv_cache: bool,
) -> None:
    oracle = make_oracle(engine_config=ENGINE, load_timeout_s=1.0, register_kv_cache=register_kv_cache)
    producer = oracle.pooled()
    serve(producer.engine, [PROMPT_A], MAX_TOKENS)
    pooled_keys = producer.keys(PROMPT_A)
    consumer = oracle.pooled()
    faults = consumer.rank_faults(0)
    held = faults.delay(GET_RANGES, HELD_S, layer_idx=0, times=1)  # the link to the storage host is cut
    try:
        got_a = serve(consumer.engine, [PROMPT_A], MAX_TOKENS)[0]  # gives up after 1 s: recomputed
        assert consumer.workers[0].stats().load_timeouts >= 1
        got_b = serve(consumer.engine, [PROMPT_B], MAX_TOKENS)[0]  # reuses A's freed blocks
    finally:
        faults.release()  # the link is back: the held read lands now
    assert consumer.workers[0].is_idle(10.0)  # the held read has returned and its job ended
    assert faults.fired(held) == 1
    assert all(isinstance(c.result, list) and min(c.result) >= 0 for c in faults.calls(GET_RANGES)), (
        "the held read did not move its bytes (a lease ran out?): the test would prove nothing"
    )
    got_b2 = serve(consumer.engine, [PROMPT_B2], MAX_TOKENS)[0]  # B's blocks from the engine's prefix cache

    engine = oracle.local()
    want = serve(engine, [PROMPT_A, PROMPT_B, PROMPT_B2], MAX_TOKENS)
    for got, local in zip((got_a, got_b, got_b2), want):
        assert computed_chunks(consumer.engine, got.req_id) == computed_chunks(engine, local.req_id)
    assert_identical([got_a, got_b, got_b2], want)
    stats = consumer.workers[0].stats()
    assert stats.removed_objects == 0 and stats.checksum_failures == 0, stats  # nothing verified against reused blocks
    assert backend.client(0).batch_is_exist(pooled_keys) == [1] * len(pooled_keys)  # no good object removed
