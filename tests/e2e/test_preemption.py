"""Oracle scenario: preemption in the middle of a prefill. The consumer's KV cache is so small
that the decoding request forces the scheduler to preempt the other one mid-prefill (twice);
it is recomputed later, from whatever its local cache and the pool still hold.

Why the comparison is per request: a request's logits depend on its tokens, its KV and the
chunk boundaries its tokens were computed in (the runner computes each request in its own
slice, so other requests never change its bits, but different chunk shapes may change float
rounding). Where a request's schedule (its chunks and where its pool / local hits ended) is
the same as in the local run, its logits must be bit-identical; where preemption made the two
runs recompute different chunks, tokens must be identical and logits close (tolerance below)."""

from __future__ import annotations

from layerkv.engine import Engine, EngineConfig, RequestOutput
from layerkv.messages import KVRole
from tests.e2e.harness import assert_close, assert_identical, chunks_of, random_tokens, serve

# float32 logits of a 4-layer, hidden-64 model: recomputing a chunk with a different number of
# rows changes GEMM blocking and so rounding at ~1e-7 relative per op; 1e-4 leaves room for
# that to accumulate through 4 layers and stays far below any change a wrong KV would cause.
ATOL = RTOL = 1e-4
PREFIX_A, PREFIX_B = random_tokens(12, seed=31), random_tokens(12, seed=32)
PRODUCER_PROMPTS = [PREFIX_A + random_tokens(6, seed=33), PREFIX_B + random_tokens(6, seed=34)]
CONSUMER_PROMPTS = [PREFIX_A + random_tokens(6, seed=35), PREFIX_B + random_tokens(10, seed=36)]
MAX_TOKENS = [8, 3]  # A decodes long enough to need B's blocks while B is still in prefill
TINY = EngineConfig(block_size=4, num_blocks=10, max_num_batched_tokens=8)


def run(make_oracle, consumer_role: KVRole) -> tuple[Engine, list[RequestOutput], Engine, list[RequestOutput]]:
    oracle = make_oracle(engine_config=TINY)
    producer = oracle.pooled()
    serve(producer.engine, PRODUCER_PROMPTS, 3)
    consumer = oracle.pooled(role=consumer_role)
    got = consumer.engine.generate(CONSUMER_PROMPTS, MAX_TOKENS)
    local = oracle.local()
    serve(local, PRODUCER_PROMPTS, 3)
    local.steps.clear()  # only the consumer part's schedule is compared
    want = local.generate(CONSUMER_PROMPTS, MAX_TOKENS)
    assert [c[2] for o in got for c in chunks_of(consumer.engine, o.req_id)[:1]] == [12, 12]  # prefixes from the pool
    assert_preempted_mid_prefill(consumer.engine, got[1])
    assert_preempted_mid_prefill(local, want[1])
    assert got[0].num_preemptions == 0
    return consumer.engine, got, local, want


def assert_preempted_mid_prefill(engine: Engine, out: RequestOutput) -> None:
    assert out.num_preemptions >= 1
    computed = 0
    for step in engine.steps:
        if out.req_id in step.preempted_req_ids:
            assert 0 < computed < len(out.prompt_token_ids), f"{out.req_id} preempted at {computed} tokens"
            return
        for r in step.requests:
            if r.req_id == out.req_id:
                computed = r.num_computed_tokens + r.num_scheduled_tokens
    raise AssertionError(f"{out.req_id} was never preempted")


def test_preemption_mid_prefill_with_a_load_only_consumer_is_bit_identical(make_oracle) -> None:
    """A kv_consumer saves nothing, so the resumed request finds exactly what the local run
    finds in its own prefix cache: every request has the local run's schedule."""
    consumer, got, local, want = run(make_oracle, KVRole.CONSUMER)
    for g, w in zip(got, want):
        assert [(s, n) for s, n, _ in chunks_of(consumer, g.req_id)] == [
            (s, n) for s, n, _ in chunks_of(local, w.req_id)
        ]
    assert_identical(got, want)


def test_preemption_mid_prefill_with_a_saving_consumer(make_oracle) -> None:
    """A kv_both consumer saved the block the preempted request computed before it was
    preempted; the local run lost that block to eviction and recomputes it, so the resumed
    request's chunks differ: bit-identical where the schedule matches, close elsewhere."""
    consumer, got, local, want = run(make_oracle, KVRole.BOTH)
    same = [
        [(s, n) for s, n, _ in chunks_of(consumer, g.req_id)] == [(s, n) for s, n, _ in chunks_of(local, w.req_id)]
        for g, w in zip(got, want)
    ]
    assert same[0], "the request that was never preempted has the local schedule"
    for g, w, equal_schedule in zip(got, want, same):
        if equal_schedule:
            assert_identical([g], [w])
        else:
            assert_close([g], [w], atol=ATOL, rtol=RTOL)
    # the resumed request loaded the block its first attempt saved (the local run recomputed it)
    assert got[1].num_external_tokens > 12 and not same[1]
