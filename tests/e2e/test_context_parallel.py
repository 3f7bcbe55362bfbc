"""The oracle under decode context parallelism (DCP 2, per-rank cache blocks of 4 tokens, so
engine blocks and block hashes of 8): a producer fills the pool, a fresh consumer loads the
shared prefix layer by layer and its logits equal bit for bit a local (hook-free) engine's with
the same DCP config. Each worker writes and reads only under its own CP namespace (the CP rank
is in the namespace; the first rank of each CP share writes). A load fault on CP rank 1 only
taints the request and poisons nothing; one CP share missing ends the hit at its block."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from layerkv.engine import block_hashes
from layerkv.messages import KVRole
from layerkv.objects.keys import block_keys
from layerkv.store.base import Code
from layerkv.store.faults import GET_RANGES, GET_START
from tests.backends import BOTH_BACKENDS, EmbeddedBackend
from tests.e2e.harness import (
    MAX_TOKENS,
    MLA_MODEL,
    MODEL,
    Oracle,
    PooledRun,
    assert_close,
    assert_identical,
    assert_loaded,
    computed_chunks,
    local_oracle,
    produce_and_consume,
    prompts_with_prefix,
    random_tokens,
    serve,
    small_engine,
)
from tests.e2e.pool_contents import assert_pool_is_clean, pool_objects

DCP = 2
ENGINE_BLOCK = 4 * DCP  # tokens per block hash (harness block_size 4 per rank)
HIT_TOKENS = 40  # the 5 full engine blocks a 44-token prefix gives
# MLA with an MTP layer (it runs like any attention layer under DCP); no indexer: refused with DCP
MLA_DCP_MODEL = dataclasses.replace(MLA_MODEL, index_dim=0)


def dcp_engine(tp_size: int, cp_interleave: int = 1, **changes: int):  # type: ignore[no-untyped-def]
    return small_engine(tp_size=tp_size, dcp_size=DCP, cp_interleave=cp_interleave, **changes)


def two_long_docs(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two documents with their own 44-token prefix: (producer prompts, consumer prompts)."""
    prefixes = [random_tokens(44, seed=seed), random_tokens(44, seed=seed + 1)]
    producer = [prompts_with_prefix(p, 1, 6, seed=seed + 2 + i)[0] for i, p in enumerate(prefixes)]
    consumer = [prompts_with_prefix(p, 1, 9, seed=seed + 4 + i)[0] for i, p in enumerate(prefixes)]
    return producer, consumer


def share_keys(run: PooledRun, rank: int, prompts: list[list[int]], num_blocks: int) -> set[str]:
    """Keys of the first `num_blocks` engine blocks of `prompts` under TP rank `rank`'s own namespace."""
    worker = run.workers[rank]
    return {
        k
        for p in prompts
        for k in block_keys(
            worker.namespace, block_hashes(p, ENGINE_BLOCK)[:num_blocks], worker.storage_role.storage_rank
        )
    }


def assert_own_cp_namespaces(
    producer: PooledRun, consumer: PooledRun, consumer_prompts: list[list[int]], writers: set[int]
) -> None:
    """Each rank's puts and gets are keyed by its own namespace, one per CP rank (tp_rank % DCP)."""
    tp_size = producer.engine.config.tp_size
    names = [w.namespace.name for w in consumer.workers]
    assert names == [w.namespace.name for w in producer.workers]
    assert len(set(names)) == DCP and all(names[r] == names[r % DCP] for r in range(tp_size))
    assert [w.deployment.dcp_rank for w in consumer.workers] == [r % DCP for r in range(tp_size)]
    for rank in range(tp_size):
        gets = consumer.rank_faults(rank).keys_sent(GET_START)
        assert set(gets) == share_keys(consumer, rank, consumer_prompts, HIT_TOKENS // ENGINE_BLOCK), f"rank {rank}"
        puts = producer.put_start_keys(rank)
        assert bool(puts) == (rank in writers), f"rank {rank} wrote {len(puts)} objects"
        assert {k.split("@")[0] for k in puts} <= {names[rank]}


CASES = {  # name -> (model, tp_size, cp_interleave, the ranks that write)
    "mla-tp2-i1": (MLA_DCP_MODEL, 2, 1, {0, 1}),
    "mla-tp2-i4": (MLA_DCP_MODEL, 2, 4, {0, 1}),
    "gqa-tp4": (MODEL, 4, 1, {0, 1, 2, 3}),  # 2 KV heads: two head groups x two CP shares
    "mla-tp4": (MLA_DCP_MODEL, 4, 2, {0, 1}),  # ranks 2, 3 hold the shares of ranks 0, 1: readers only
}


@BOTH_BACKENDS
@pytest.mark.parametrize("case", list(CASES))
def test_dcp_consumer_equals_local_dcp_engine(make_oracle, case: str) -> None:
    model, tp_size, interleave, writers = CASES[case]
    oracle = make_oracle(model=model, engine_config=dcp_engine(tp_size, interleave))
    producer_prompts, consumer_prompts = two_long_docs(seed=60)
    producer, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    if model.num_mtp_layers:
        assert all(len(o.draft_logits) == MAX_TOKENS for o in got)
    assert_own_cp_namespaces(producer, consumer, consumer_prompts, writers)


# ---- one CP rank's load fault; one CP share missing --------------------------------------------

BUDGET = 24  # 3 engine blocks per step
FAULT_PREFIX = random_tokens(44, seed=81)
PRODUCER_PROMPT = FAULT_PREFIX + random_tokens(4, seed=82)  # 48 tokens: chunks [0,24) [24,48)
CONSUMER_PROMPT = FAULT_PREFIX + random_tokens(20, seed=83)  # 64 tokens, 5 engine blocks shared
FAULTY_RANK = 1  # CP rank 1 of MLA tp2/dcp2
FAULTS = {  # name -> (rule on CP rank 1's store, given its keys of the producer prompt; where the consumer resumes)
    "range_fail_one_key": (lambda f, k: f.fail(GET_RANGES, k[3], layer_idx=1, times=1), 3 * ENGINE_BLOCK),
    "evicted_before_get_start": (
        lambda f, k: f.fail(GET_START, k[3], code=int(Code.OBJECT_NOT_FOUND), times=1),
        3 * ENGINE_BLOCK,
    ),
    "get_start_raises": (lambda f, k: f.raise_in(GET_START, times=1), 0),
}


def _clean_pool(tag: str, resume: int) -> dict[str, bytes]:
    """The objects a fault-free run with the faulty run's schedule writes (a fresh embedded pool,
    the same model id, hence the same names): the producer, then the consumer after every CP
    share's objects of the producer from the resume block on were removed."""
    backend = EmbeddedBackend()
    backend.tag = tag
    oracle = Oracle(backend, model=MLA_DCP_MODEL, engine_config=dcp_engine(2, max_num_batched_tokens=BUDGET))
    try:
        producer = oracle.pooled()
        serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
        produced = pool_objects(backend.client(), producer, [PRODUCER_PROMPT])
        late = {
            w.namespace.block_id(h).hex()
            for w in producer.workers
            for h in block_hashes(PRODUCER_PROMPT, ENGINE_BLOCK)[resume // ENGINE_BLOCK :]
        }
        backend.remove([k for k in produced if k.split("@")[1] in late])
        consumer = oracle.pooled()
        serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)
        consumed = pool_objects(backend.client(), consumer, [PRODUCER_PROMPT, CONSUMER_PROMPT])
        return {**produced, **consumed}
    finally:
        oracle.check_and_close()


@BOTH_BACKENDS
@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_cp_ranks_load_fault_poisons_nothing(make_oracle, backend, fault: str) -> None:
    install, resume = FAULTS[fault]
    engine_config = dcp_engine(2, max_num_batched_tokens=BUDGET)
    oracle = make_oracle(model=MLA_DCP_MODEL, engine_config=engine_config, load_timeout_s=1.0)
    serve(oracle.pooled().engine, [PRODUCER_PROMPT], MAX_TOKENS)
    consumer = oracle.pooled()
    faulty = consumer.workers[FAULTY_RANK]
    keys = block_keys(faulty.namespace, block_hashes(PRODUCER_PROMPT, ENGINE_BLOCK), faulty.storage_role.storage_rank)
    rule: Any = install(consumer.rank_faults(FAULTY_RANK), keys)
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert faulty.is_idle(10.0) and consumer.rank_faults(FAULTY_RANK).fired(rule) == 1
    chunks = computed_chunks(consumer.engine, got.req_id)
    assert chunks[0][0] == resume, f"resumed at {chunks[0][0]}: {chunks}"
    assert sum(w.stats().revoked_tainted for w in consumer.workers) > 0, "the failed step's saves were not revoked"
    assert consumer.workers[0].stats().load_failed_blocks == 0  # the fault hit CP rank 1 only

    plain = local_oracle(oracle.local(), [PRODUCER_PROMPT], [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert_close([got], [plain], atol=1e-4, rtol=1e-4)
    matched_engine = oracle.local()
    if resume:
        serve(matched_engine, [PRODUCER_PROMPT[:resume]], MAX_TOKENS)
    matched = serve(matched_engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert computed_chunks(matched_engine, matched.req_id) == chunks
    assert_identical([got], [matched])

    pool = pool_objects(backend.client(), consumer, [PRODUCER_PROMPT, CONSUMER_PROMPT])
    assert_pool_is_clean(pool, _clean_pool(backend.tag, resume))
    again = serve(oracle.pooled(role=KVRole.CONSUMER).engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert again.token_ids == got.token_ids


@BOTH_BACKENDS
def test_a_missing_cp_share_ends_the_hit_at_its_block(make_oracle, backend) -> None:
    budget = 2 * ENGINE_BLOCK
    oracle = make_oracle(model=MLA_DCP_MODEL, engine_config=dcp_engine(2, max_num_batched_tokens=budget))
    producer = oracle.pooled()  # chunks [0,16) [16,32) [32,48)
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    block2 = {
        r: share_keys(producer, r, [PRODUCER_PROMPT], 3) - share_keys(producer, r, [PRODUCER_PROMPT], 2)
        for r in range(2)
    }
    assert backend.exists(sorted(block2[0] | block2[1])) == [1, 1]
    backend.remove(sorted(block2[1]))  # CP rank 1's share of block 2; CP rank 0's stays
    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)
    want = local_oracle(oracle.local(), [PRODUCER_PROMPT[:budget]], [CONSUMER_PROMPT], MAX_TOKENS)
    assert want[0].num_local_cached_tokens == budget
    assert_identical(got, want)
    assert_loaded(consumer, got, budget)
    for rank in range(2):
        assert set(consumer.rank_faults(rank).keys_sent(GET_START)) == share_keys(consumer, rank, [CONSUMER_PROMPT], 2)
    assert backend.exists(sorted(block2[0])) == [1]
