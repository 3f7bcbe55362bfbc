"""A staging area of a few slots still serves every request correctly: a consumer whose staging
holds 3 load slots loads two 5-block prefixes in one step (10 keys through 3 slots, a wave
at a time), outputs equal local compute, and the store never holds more of its get sessions at
once than it has slots (counted from the calls the store saw). Per-layer reads open their
sessions per wave; whole-object reads need none."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from layerkv.store.faults import GET_END, GET_RANGES, GET_START, CallRecord
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import HIT_TOKENS, MAX_TOKENS, Oracle, assert_identical, local_oracle, serve, two_docs

SLOTS = 3


def max_open_sessions(calls: Sequence[CallRecord]) -> int:
    """The most get sessions open (started, not ended) while a range read ran, replaying the
    session calls in the order they entered the store."""
    events = sorted(calls, key=lambda c: c.enter_seq)
    open_keys: set[str] = set()
    most = 0
    for call in events:
        if call.method == GET_START:
            open_keys |= {k for k, code in zip(call.keys, call.result or ()) if code == 0}
        elif call.method == GET_END:
            open_keys -= set(call.keys)
        elif call.method == GET_RANGES:
            most = max(most, len(open_keys))
    return most


@BOTH_BACKENDS
@pytest.mark.parametrize("plan", ["layers", "whole"])
def test_a_few_staging_slots_serve_every_request_correctly(make_oracle, backend, plan: str) -> None:
    producer_prompts, consumer_prompts = two_docs(seed=70)
    probe = Oracle(backend).pooled()  # only for the layout's object size
    slot = probe.workers[0].layout.object_nbytes
    probe.engine.shutdown()
    # a quarter for loads: SLOTS slots; saves get 3 x SLOTS, enough for one producer prompt's 7 blocks
    oracle = make_oracle(transfer_plan=plan, staging_nbytes=4 * SLOTS * slot)
    producer = oracle.pooled()
    serve(producer.engine, producer_prompts, MAX_TOKENS)
    assert producer.workers[0].stats().save_skipped_staging == 0
    consumer = oracle.pooled()
    got = serve(consumer.engine, consumer_prompts, MAX_TOKENS, batched=True)  # one step loads both prefixes
    want = local_oracle(oracle.local(), producer_prompts, consumer_prompts, MAX_TOKENS, consumer_batched=True)
    assert_identical(got, want)
    assert [o.num_external_tokens for o in got] == [HIT_TOKENS] * len(got)
    worker = consumer.workers[0]
    assert worker._areas is not None and worker._areas.loads.num_slots == SLOTS
    stats = worker.stats()
    assert stats.load_keys == 10 and stats.load_failed_blocks == 0, stats
    calls = consumer.rank_faults(0).calls()
    reads = [c for c in calls if c.method == GET_RANGES]
    if plan == "layers":  # 10 keys through 3 slots: 4 waves per layer, each with its own sessions
        assert max(len(c.keys) for c in reads) <= SLOTS and len(reads) == 4 * worker.layout.num_layers
        assert 0 < max_open_sessions(calls) <= SLOTS
    else:
        assert reads == [] and not any(c.method == GET_START for c in calls)
