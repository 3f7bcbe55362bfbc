"""Oracle scenarios for bytes that cannot be trusted: a committed object whose layer bytes were
changed in the store (the checksum catches it: the block is recomputed, the object removed), and
a store outage in the middle of a step (sessions opened before it are fenced: no range call on
them, the blocks are recomputed). Outputs stay equal to local compute."""

from __future__ import annotations

import numpy as np

from layerkv.objects.header import NONCE_OFFSET
from layerkv.store.base import Code
from layerkv.store.faults import GET_RANGES, PUT_START
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import assert_identical, computed_chunks, random_tokens, serve, small_engine

PREFIX = random_tokens(22, seed=81)
PRODUCER_PROMPT = PREFIX + random_tokens(2, seed=82)  # 24 tokens: chunks [0,12) [12,24)
CONSUMER_PROMPT = PREFIX + random_tokens(18, seed=83)  # 40 tokens, 5 blocks shared
MAX_TOKENS = 3
ENGINE = small_engine(max_num_batched_tokens=12)


def _matched(oracle, resume: int):  # type: ignore[no-untyped-def]
    """A local engine with the consumer's schedule: the producer's first `resume` tokens, then C."""
    engine = oracle.local()
    if resume:
        serve(engine, [PRODUCER_PROMPT[:resume]], MAX_TOKENS)
    return engine, serve(engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]


@BOTH_BACKENDS
def test_flipped_bytes_of_one_layer_are_recomputed_and_the_object_removed(make_oracle, backend) -> None:
    oracle = make_oracle(engine_config=ENGINE)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    key = producer.keys(PRODUCER_PROMPT)[3]
    layout = producer.workers[0].layout
    # rewrite block 3's object in the store with 16 bytes of layer 2 flipped (header untouched)
    client = backend.client()
    buf = np.zeros(layout.object_nbytes, dtype=np.uint8)
    client.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        assert client.batch_get_into([key], [buf.ctypes.data], [buf.nbytes]) == [buf.nbytes]
        at = layout.layer_offset(2) + 8
        buf[at : at + 16] ^= 0xFF
        assert client.batch_remove([key]) == [0]
        assert client.batch_put_from([key], [buf.ctypes.data], [buf.nbytes]) == [0]
    finally:
        client.unregister_buffer(buf.ctypes.data)

    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    stats = consumer.workers[0].stats()
    assert stats.checksum_failures == 1 and stats.removed_objects == 1, stats
    # the bad object was removed (not failing every later hit); the consumer recomputed block 3
    # with the producer's chunk and wrote it again: the pool holds the original bytes now
    buf[at : at + 16] ^= 0xFF
    again = np.zeros_like(buf)
    client.register_buffer(again.ctypes.data, again.nbytes)
    try:
        assert client.batch_get_into([key], [again.ctypes.data], [again.nbytes]) == [again.nbytes]
    finally:
        client.unregister_buffer(again.ctypes.data)
    # the same layers and header fields (a new write: its own nonce, so its own tags and MAC)
    assert np.array_equal(again[layout.header_nbytes :], buf[layout.header_nbytes :])
    assert np.array_equal(again[:NONCE_OFFSET], buf[:NONCE_OFFSET]) and not np.array_equal(again, buf)
    chunks = computed_chunks(consumer.engine, got.req_id)
    assert chunks[0][0] == 12  # block 3 and after recomputed
    engine, matched = _matched(oracle, 12)
    assert computed_chunks(engine, matched.req_id) == chunks
    assert_identical([got], [matched])


@BOTH_BACKENDS
def test_an_outage_mid_step_fences_the_sessions_opened_before_it(make_oracle, backend) -> None:
    # direct per-layer saves (register_kv_cache) start their puts during the step, beside the
    # load; staged saves start them after the forward, when the load is over
    oracle = make_oracle(engine_config=ENGINE, store_retry_interval_s=0.2, register_kv_cache=True)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    consumer = oracle.pooled()
    faults = consumer.rank_faults(0)
    # layer 0's read is slow; meanwhile the save's put start finds the master gone (-900 for
    # every key): the store's outage epoch moves on while the load's sessions are open. The put
    # start waits for the layer-0 read to have entered the store (an order, not a timer: on a
    # loaded machine a fixed delay let the outage come before the read was issued)
    slow_read = faults.delay(GET_RANGES, 1.5, layer_idx=0, times=1)
    faults.delay(PUT_START, 30.0, times=1, after=slow_read)
    faults.fail(PUT_START, code=int(Code.RPC_FAIL), times=1)
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    stats = consumer.workers[0].stats()
    assert stats.fenced_keys == 5, stats  # every key of the load: no layer after 0 was read from them
    first_step_reads = [c.layer_idx for c in faults.calls(GET_RANGES)]
    assert first_step_reads == [0], first_step_reads
    chunks = computed_chunks(consumer.engine, got.req_id)
    assert chunks[0][0] == 0
    engine, matched = _matched(oracle, 0)
    assert_identical([got], [matched])
