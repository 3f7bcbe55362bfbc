"""The oracle: KV loaded from the pool layer by layer gives exactly the output of computing it
locally. A producer engine fills the pool, a fresh consumer engine serves prompts sharing the
prefixes, and a local engine (no hooks) computes the producer prompts with the producer's
schedule and then the consumer prompts: same tokens, bit-identical logits."""

from __future__ import annotations

from layerkv.store.faults import GET_RANGES, GET_START
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import (
    BLOCK_SIZE,
    HIT_TOKENS,
    MAX_TOKENS,
    MLA_MODEL,
    MODEL,
    PREFIX,
    assert_identical,
    assert_loaded,
    computed_chunks,
    local_oracle,
    produce_and_consume,
    prompts_with_prefix,
    random_tokens,
    serve,
    small_engine,
    two_docs,
)


@BOTH_BACKENDS
def test_tp1_consumer_equals_local(make_oracle) -> None:
    oracle = make_oracle()
    producer_prompts, consumer_prompts = two_docs(seed=20)
    producer, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    stats = producer.workers[0].stats()
    assert stats.committed_keys > 0 and stats.save_failed_keys == 0 and stats.revoked_tainted == 0
    # one range read per layer per loading step (the consumer served its prompts one at a time)
    assert consumer.workers[0].stats().load_range_calls == MODEL.num_layers * len(consumer_prompts)


@BOTH_BACKENDS
def test_tp2_consumer_equals_local(make_oracle) -> None:
    oracle = make_oracle(engine_config=small_engine(tp_size=2))
    producer_prompts, consumer_prompts = two_docs(seed=30)
    producer, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    # two KV heads over two ranks: each rank writes and reads its own storage rank
    for rank in range(2):
        assert {k.rsplit("@", 1)[1] for k in producer.put_start_keys(rank)} == {str(rank)}
        assert {k.rsplit("@", 1)[1] for k in consumer.rank_faults(rank).keys_sent(GET_START)} == {str(rank)}


@BOTH_BACKENDS
def test_tp4_with_two_kv_heads_writes_from_ranks_0_and_2_only(make_oracle) -> None:
    oracle = make_oracle(engine_config=small_engine(tp_size=4))  # MODEL: 4 heads, 2 KV heads -> put_step 2
    producer_prompts, consumer_prompts = two_docs(seed=40)
    producer, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    writers = {rank: producer.put_start_keys(rank) for rank in range(4)}
    assert [bool(writers[r]) for r in range(4)] == [True, False, True, False]
    assert {k.rsplit("@", 1)[1] for k in writers[0]} == {"0"}
    assert {k.rsplit("@", 1)[1] for k in writers[2]} == {"1"}
    assert len(writers[0]) == len(writers[2])
    # every rank loads, from the storage rank of its head group
    for rank in range(4):
        assert {k.rsplit("@", 1)[1] for k in consumer.rank_faults(rank).keys_sent(GET_START)} == {str(rank // 2)}


def test_mla_indexer_and_mtp_layer_tp2(make_oracle) -> None:
    oracle = make_oracle(model=MLA_MODEL, engine_config=small_engine(tp_size=2))
    producer_prompts, consumer_prompts = two_docs(seed=50)
    producer, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    assert all(len(o.draft_logits) == MAX_TOKENS for o in got)  # the MTP layer ran (and matched)
    layout = consumer.workers[0].layout
    assert layout is not None and layout.num_layers == MLA_MODEL.num_total_layers  # MTP layer is in the object
    # MLA is one storage rank: rank 0 writes it, every rank loads it
    assert producer.put_start_keys(0) and not producer.put_start_keys(1)
    for rank in range(2):
        assert {k.rsplit("@", 1)[1] for k in consumer.rank_faults(rank).keys_sent(GET_START)} == {"0"}


def test_chunked_prefill_hit_ends_mid_chunk(make_oracle) -> None:
    budget = 12
    oracle = make_oracle(engine_config=small_engine(max_num_batched_tokens=budget))
    producer_prompts = prompts_with_prefix(PREFIX, 1, 2, seed=10)  # 24 tokens: chunks [0,12) [12,24)
    consumer_prompts = prompts_with_prefix(PREFIX, 1, 18, seed=11)  # 40 tokens, 20 from the pool
    assert HIT_TOKENS % budget != 0
    _, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    prefill = computed_chunks(consumer.engine, got[0].req_id)[:2]
    assert prefill == [(HIT_TOKENS, budget), (HIT_TOKENS + budget, 40 - HIT_TOKENS - budget)]


@BOTH_BACKENDS
def test_concurrent_requests_share_prefix_keys(make_oracle) -> None:
    oracle = make_oracle()
    producer_prompts = prompts_with_prefix(PREFIX, 2, 6, seed=12)
    consumer_prompts = prompts_with_prefix(PREFIX, 3, 9, seed=13)
    producer, consumer, got = produce_and_consume(
        oracle, producer_prompts, consumer_prompts, producer_batched=True, consumer_batched=True
    )
    assert_loaded(consumer, got, HIT_TOKENS)
    # the producer computed the shared blocks twice in one step but saved each once
    saved = producer.put_start_keys(0)
    assert len(saved) == len(set(saved))
    prefix_keys = consumer.keys(PREFIX, blocks=range(HIT_TOKENS // BLOCK_SIZE))
    assert set(prefix_keys) <= set(saved)
    # three requests, one read per shared key, fanned out to three local blocks each
    stats = consumer.workers[0].stats()
    assert (stats.load_keys, stats.load_blocks) == (len(prefix_keys), 3 * len(prefix_keys))
    assert consumer.rank_faults(0).keys_sent(GET_START) == prefix_keys
    reads = consumer.rank_faults(0).calls(GET_RANGES)
    assert len(reads) == MODEL.num_layers and all(list(c.keys) == prefix_keys for c in reads)


def test_partial_hit_from_a_shorter_producer_prompt(make_oracle) -> None:
    oracle = make_oracle()
    producer_prompts = [PREFIX[:10]]  # 2 full blocks reach the pool
    consumer_prompts = prompts_with_prefix(PREFIX, 1, 9, seed=14)
    _, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, 8)


def test_partial_hit_when_later_keys_are_gone(make_oracle, backend) -> None:
    """Block 2 lost its rank-1 object and block 4 both: only blocks 0-1 are a hit (a block
    counts only if every storage rank's object is there; the hit stops at the first miss)."""
    budget = 8
    oracle = make_oracle(engine_config=small_engine(tp_size=2, max_num_batched_tokens=budget))
    producer_prompt = [*PREFIX, *random_tokens(2, seed=15)]  # 24 tokens: chunks [0,8) [8,16) [16,24)
    consumer_prompts = prompts_with_prefix(PREFIX, 1, 9, seed=16)
    producer = oracle.pooled()
    serve(producer.engine, [producer_prompt], MAX_TOKENS)
    backend.remove(
        producer.keys(PREFIX, storage_rank=1, blocks=[2])
        + [k for r in range(2) for k in producer.keys(PREFIX, storage_rank=r, blocks=[4])]
    )
    consumer = oracle.pooled()
    got = serve(consumer.engine, consumer_prompts, MAX_TOKENS)
    # the local run: blocks 0-1 computed in the producer's first chunk [0, 8), nothing else cached
    want = local_oracle(oracle.local(), [producer_prompt[:budget]], consumer_prompts, MAX_TOKENS)
    assert want[0].num_local_cached_tokens == budget
    assert_identical(got, want)
    assert_loaded(consumer, got, 8)
    for rank in range(2):
        assert consumer.rank_faults(rank).keys_sent(GET_START) == producer.keys(
            PREFIX, storage_rank=rank, blocks=[0, 1]
        )


@BOTH_BACKENDS
def test_an_answers_blocks_are_saved_unless_save_decode_blocks_is_false(make_oracle, backend) -> None:
    """The reference engine's steps name each request's prompt length: with save_decode_blocks
    false only the prompt's full blocks reach the pool, by default the answer's too."""
    for seed, save_decode_blocks, saved in ((77, True, [1] * 4), (78, False, [1, 1, 0, 0])):
        prompt = random_tokens(2 * BLOCK_SIZE + 1, seed=seed)  # one pool: a prompt of its own each
        run = make_oracle(save_decode_blocks=save_decode_blocks).pooled()
        out = run.engine.generate([prompt], 2 * BLOCK_SIZE)[0]
        full = prompt + list(out.token_ids)  # KV of all but the last answer token was computed: 4 blocks
        assert backend.exists(run.keys(full, blocks=range(4))) == saved
