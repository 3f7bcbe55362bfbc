"""Prefill/decode disaggregation on the reference engine (connector/prefill_wait.py): a prefill
engine (kv_producer) serves a prompt with max_tokens=1; the moment its output exists (what a
server sends back, before its saves are committed) a decode engine (kv_consumer) gets the same
prompt with the output's kv_transfer_params, as a proxy sends it. Both engines step in turn on
this thread, as two servers would run side by side."""

from __future__ import annotations

import dataclasses
import time

from layerkv.connector.prefill_wait import PREFIX_TOKENS
from layerkv.engine import Engine
from layerkv.engine.request import RequestOutput
from layerkv.messages import KVRole
from layerkv.store.faults import PUT_END, PUT_RANGES, PUT_START
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import BLOCK_SIZE, MAX_TOKENS, assert_identical, random_tokens

PROMPT_TOKENS = 27  # 6 full blocks of 4 + 3
PREFIX = PROMPT_TOKENS // BLOCK_SIZE * BLOCK_SIZE  # what the prefill engine commits: 24 tokens
WAIT_S = 2.0  # prefill_wait_s of the tests that wait it out
HELD_WAIT_S = 6.0  # a wait other requests must not queue behind: far longer than serving them on a busy machine


def _prefill(engine: Engine, prompt: list[int]) -> RequestOutput:
    """Step until the request's output exists; no step more (its last saves are not committed)."""
    req = engine.add_request(prompt, 1)
    for _ in range(50):  # bounded: one prompt of 27 tokens
        engine.step()
        out = engine.output(req)
        if out is not None:
            return out
    raise AssertionError("the prefill request did not finish in 50 steps")


def _decode(
    decode: Engine, prefill: Engine | None, reqs: list[str], timeout_s: float = 30.0
) -> dict[str, RequestOutput]:
    """Both engines step in turn until `reqs` finished on `decode` (bounded in time)."""
    deadline = time.monotonic() + timeout_s
    while any(decode.output(r) is None for r in reqs):
        assert time.monotonic() < deadline, "decode requests not done in time"
        decode.step()
        if prefill is not None and prefill.has_work():
            prefill.step()
    for engine in (decode, prefill):  # the steps that tell the workers (and commit what they saved)
        while engine is not None and engine.has_work():
            assert time.monotonic() < deadline, "engines not idle in time"
            engine.step()
    return {r: out for r in reqs if (out := decode.output(r)) is not None}


def _local(oracle, prompt: list[int]) -> RequestOutput:  # type: ignore[no-untyped-def]
    """The prefill's schedule (max_tokens 1), then the decode request over the local cache."""
    local = oracle.local()
    local.generate([prompt], 1)
    return local.generate([prompt], MAX_TOKENS)[0]


@BOTH_BACKENDS
def test_a_decode_request_sent_at_the_prefill_response_loads_the_whole_prefix(make_oracle) -> None:
    oracle = make_oracle()
    prompt = random_tokens(PROMPT_TOKENS, seed=701)
    prefill = oracle.pooled(KVRole.PRODUCER)
    decode = oracle.pooled(KVRole.CONSUMER)
    # the prefill's write thread is slow to start its puts (as on a loaded server): the
    # response leaves long before its objects are readable
    prefill.rank_faults(0).delay(PUT_START, 0.5, times=1)
    made = _prefill(prefill.engine, prompt)
    assert made.kv_transfer_params == {PREFIX_TOKENS: PREFIX}
    view = prefill.engine.scheduler.requests[made.req_id].view()
    plain = dataclasses.replace(view, req_id="probe", kv_transfer_params=None)
    assert decode.engine.scheduler.hooks.get_num_new_matched_tokens(plain, 0) == (
        0,
        False,
    )  # the race, without the wait
    req = decode.engine.add_request(prompt, MAX_TOKENS, kv_transfer_params=made.kv_transfer_params)
    got = _decode(decode.engine, prefill.engine, [req])[req]
    assert got.num_external_tokens == PREFIX and got.num_local_cached_tokens == 0
    stats = decode.engine.scheduler.hooks.stats()
    assert stats.prefill_waits == 1 and stats.prefill_wait_timeouts == 0 and stats.prefill_wait_ms >= 400, stats
    assert_identical([got], [_local(oracle, prompt)])


@BOTH_BACKENDS
def test_a_prefill_that_dies_before_its_commit_costs_one_bounded_wait_and_a_recompute(make_oracle) -> None:
    oracle = make_oracle(prefill_wait_s=WAIT_S)
    prompt = random_tokens(PROMPT_TOKENS, seed=702)
    prefill = oracle.pooled(KVRole.PRODUCER)
    decode = oracle.pooled(KVRole.CONSUMER)
    # its commit never lands (put end fails: the sessions are revoked), and then it is gone
    prefill.rank_faults(0).fail(PUT_END)
    made = _prefill(prefill.engine, prompt)
    prefill.engine.shutdown()
    oracle.runs.remove(prefill)  # nothing of it to check at teardown but the PROCESSING objects (below)
    start = time.monotonic()
    req = decode.engine.add_request(prompt, MAX_TOKENS, kv_transfer_params=made.kv_transfer_params)
    got = _decode(decode.engine, None, [req])[req]
    waited = time.monotonic() - start
    assert got.num_external_tokens == 0
    stats = decode.engine.scheduler.hooks.stats()
    assert stats.prefill_waits == 1 and stats.prefill_wait_timeouts == 1, stats
    assert WAIT_S <= waited < WAIT_S + 10, waited
    local = oracle.local()
    assert_identical([got], local.generate([prompt], MAX_TOKENS))
    assert oracle.backend.processing_keys(prefill.put_start_keys(0)) == []


@BOTH_BACKENDS
def test_a_prefill_servers_objects_are_readable_once_written_without_another_step(make_oracle) -> None:
    """A kv_producer never loads, so nothing can taint its saves: it commits them right after
    their writes, not in a later step's verdict (the decode request then has nothing to wait for)."""
    oracle = make_oracle()
    prompt = random_tokens(PROMPT_TOKENS, seed=705)
    prefill = oracle.pooled(KVRole.PRODUCER)
    made = _prefill(prefill.engine, prompt)
    assert all(w.is_idle(10.0) for w in prefill.workers)  # its write thread is done; no step ran since
    keys = prefill.keys(prompt)
    assert len(keys) == PREFIX // BLOCK_SIZE
    assert oracle.backend.exists(keys) == [1] * len(keys)
    assert sum(w.stats().committed_keys for w in prefill.workers) == len(keys)
    decode = oracle.pooled(KVRole.CONSUMER)
    view = prefill.engine.scheduler.requests[made.req_id].view()
    plain = dataclasses.replace(view, req_id="probe", kv_transfer_params=None)
    assert decode.engine.scheduler.hooks.get_num_new_matched_tokens(plain, 0) == (PREFIX, False)
    _decode(decode.engine, prefill.engine, [])  # the prefill's last step reaches its workers (teardown: idle)


@BOTH_BACKENDS
def test_a_request_waiting_for_a_prefill_does_not_hold_up_the_others(make_oracle) -> None:
    """A waits for a prefix nobody commits; B, queued behind it, is served meanwhile. The
    waiting request asks the pool at most once per poll interval."""
    oracle = make_oracle(prefill_wait_s=HELD_WAIT_S)
    decode = oracle.pooled(KVRole.CONSUMER)
    waiting, other = random_tokens(PROMPT_TOKENS, seed=703), random_tokens(PROMPT_TOKENS, seed=704)
    a = decode.engine.add_request(waiting, MAX_TOKENS, kv_transfer_params={PREFIX_TOKENS: PREFIX})
    b = decode.engine.add_request(other, MAX_TOKENS)
    hooks = decode.engine.scheduler.hooks
    for _ in range(10_000):  # bounded: B's steps, while A polls
        decode.engine.step()
        if decode.engine.output(b) is not None:
            break
    assert hooks.stats().prefill_wait_timeouts == 0  # B done before A's wait ran out: not held behind it
    outs = _decode(decode.engine, None, [a, b])
    assert outs[b].finish_time_s < outs[a].first_token_time_s  # B done while A still waited
    assert outs[a].ttft_s >= HELD_WAIT_S
    stats = hooks.stats()
    assert stats.prefill_waits == 1 and stats.prefill_wait_timeouts == 1
    assert stats.lookups <= HELD_WAIT_S / 0.005 + 10, stats.lookups  # throttled polls, not a busy loop of RPCs
    local = oracle.local()  # in the order they ran: B, then A computed whole
    want_b, want_a = (local.generate([p], MAX_TOKENS)[0] for p in (other, waiting))
    assert_identical([outs[a], outs[b]], [want_a, want_b])


@BOTH_BACKENDS
def test_a_write_failing_on_one_prefill_rank_leaves_its_block_out_of_every_hit(make_oracle) -> None:
    """A kv_producer commits each rank's objects at once, without a verdict across ranks: rank 1's
    write of block 3 fails, rank 0 commits its shard of it. A block is a hit only with every shard
    COMPLETE, so the decode engine loads blocks 0-2, computes from block 3 on, and equals a local
    engine with that schedule bit for bit; block 3's missing shard is never served."""
    oracle = make_oracle()
    prompt = random_tokens(PROMPT_TOKENS, seed=706)
    # chunks of 12 tokens: blocks 0-2 are computed as the matched local engine computes them
    prefill = oracle.pooled(KVRole.PRODUCER, tp_size=2, max_num_batched_tokens=3 * BLOCK_SIZE)
    (bad,) = prefill.keys(prompt, storage_rank=1, blocks=[3])
    prefill.rank_faults(1).fail(PUT_RANGES, [bad])
    made = _prefill(prefill.engine, prompt)
    assert all(w.is_idle(10.0) for w in prefill.workers)
    assert prefill.workers[1].stats().save_failed_keys == 1 and prefill.workers[0].stats().save_failed_keys == 0
    assert oracle.backend.exists(prefill.keys(prompt, storage_rank=0)) == [1] * (
        PREFIX // BLOCK_SIZE
    )  # rank 0 committed all
    assert oracle.backend.exists([bad]) == [0]
    decode = oracle.pooled(KVRole.CONSUMER, tp_size=2)
    req = decode.engine.add_request(prompt, MAX_TOKENS, kv_transfer_params=made.kv_transfer_params)
    got = _decode(decode.engine, prefill.engine, [req], timeout_s=60.0)[req]
    assert got.num_external_tokens == 3 * BLOCK_SIZE
    matched = oracle.local(tp_size=2)
    matched.generate([prompt[: 3 * BLOCK_SIZE]], 1)  # blocks 0-2 in its prefix cache, the rest computed
    assert_identical([got], matched.generate([prompt], MAX_TOKENS))
