"""Oracle scenario: every failure kind of FaultyStore, on the producer's or the consumer's side.
Outputs stay correct and nothing tainted is committed.

Setup (block 4, token budget 12): the producer computes P (24 tokens) in chunks [0,12) [12,24);
the consumer serves C (40 tokens) sharing P's first 5 blocks. A consumer-side fault makes the
engine drop the step's output and roll back to the first invalid block (vLLM's recovery), a
producer-side fault leaves blocks out of the pool; either way the consumer's KV of tokens
[0, resume) comes from the pool and it computes [resume, 40) in budget-sized chunks.
* Tokens must equal the plain local run (producer's prompt, then C).
* The plain local run computes C from token 20, so where resume != 20 its chunks differ and
  logits may differ in rounding: they must be close (ATOL / RTOL below).
* Logits must be bit-identical to a local run with the consumer's schedule: resume is a chunk
  boundary of the producer (0 or 12) by construction, so a local engine that computes P[:resume]
  (the producer's first chunk) and then C has exactly the consumer's chunks.
* Nothing tainted is committed: a fresh verifier loads C's first 9 blocks (everything the
  faulty consumer and the producer committed) and computes [36, 40) — the consumer's own last
  prefill chunk — so its logits are bit-identical to the consumer's only if every committed
  object holds exactly the KV the consumer computed or loaded after recovery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from layerkv.engine import EngineConfig
from layerkv.messages import KVRole
from layerkv.store.base import Code
from layerkv.store.faults import (
    GET_RANGES,
    GET_START,
    IS_EXIST,
    PUT_END,
    PUT_RANGES,
    PUT_REVOKE,
    PUT_START,
    FaultyStore,
)
from tests.e2e.harness import assert_close, assert_identical, computed_chunks, local_oracle, random_tokens, serve

# float32, 4 layers, hidden 64: a different chunking changes GEMM shapes and rounding at ~1e-7
# relative per op; 1e-4 leaves room for accumulation and is far below what a wrong KV does.
ATOL = RTOL = 1e-4
BUDGET = 12
PREFIX = random_tokens(22, seed=41)
PRODUCER_PROMPT = PREFIX + random_tokens(2, seed=42)  # 24 tokens
CONSUMER_PROMPT = PREFIX + random_tokens(18, seed=43)  # 40 tokens, 5 blocks shared
MAX_TOKENS = 3
ENGINE = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=BUDGET)

Install = Callable[[FaultyStore, list[str]], object]  # (store of the faulty side, P's rank-0 keys)


@dataclass(frozen=True)
class Case:
    side: str  # "producer" / "consumer": whose rank-0 store gets the rule; "lookup": the consumer's scheduler
    install: Install
    resume: int  # first token the consumer computes (after recovery)


CASES = {
    # consumer side: a load fails, the step is dropped, the request rolls back
    "range_fail_one_key": Case("consumer", lambda f, k: f.fail(GET_RANGES, k[3], layer_idx=2, times=1), 12),
    "get_start_fail": Case("consumer", lambda f, k: f.fail(GET_START, k[3], times=1), 12),
    "lease_expired": Case("consumer", lambda f, k: f.expire_lease(k[3], layer_idx=1, times=1), 12),
    "range_malformed": Case("consumer", lambda f, k: f.malformed(GET_RANGES, None, layer_idx=2, times=1), 0),
    "range_raises": Case("consumer", lambda f, k: f.raise_in(GET_RANGES, layer_idx=3, times=1), 0),
    "get_start_malformed": Case("consumer", lambda f, k: f.malformed(GET_START, [0], times=1), 0),
    "get_start_raises": Case("consumer", lambda f, k: f.raise_in(GET_START, times=1), 0),
    "exists_raises": Case("lookup", lambda f, k: f.raise_in(IS_EXIST, times=1), 0),
    # producer side: blocks do not reach the pool; the consumer's hit is shorter
    "commit_fail": Case("producer", lambda f, k: f.fail(PUT_END, k[3], times=1), 12),
    "commit_malformed": Case("producer", lambda f, k: f.malformed(PUT_END, None, k[3], times=1), 12),
    "put_start_fail": Case("producer", lambda f, k: f.fail(PUT_START, k[3], code=int(Code.NO_SPACE), times=1), 12),
    "put_start_malformed": Case("producer", lambda f, k: f.malformed(PUT_START, True, k[3], forward=True, times=1), 12),
    # (staged saves write each object image in one range call, with no layer)
    "put_range_fail": Case("producer", lambda f, k: f.fail(PUT_RANGES, k[3], times=1), 12),
    "put_range_raises": Case("producer", lambda f, k: f.raise_in(PUT_RANGES, keys=k[3], times=1), 12),
    "put_start_raises_first_chunk": Case("producer", lambda f, k: f.raise_in(PUT_START, keys=k[0], times=1), 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fault_outputs_stay_correct_and_nothing_tainted_is_committed(make_oracle, backend, name: str) -> None:
    case = CASES[name]
    oracle = make_oracle(engine_config=ENGINE)
    producer = oracle.pooled()
    keys = producer.keys(PRODUCER_PROMPT)  # rank-0 keys of P's 6 blocks
    if case.side == "producer":
        rule = case.install(producer.rank_faults(0), keys)
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    if case.side == "producer":
        assert producer.rank_faults(0).fired(rule) == 1  # type: ignore[arg-type]
        stats = producer.workers[0].stats()
        assert stats.save_failed_keys + stats.commit_failed > 0, stats
        revoked = set(producer.rank_faults(0).keys_sent(PUT_REVOKE))
        revoked_readable = [k for k, e in zip(sorted(revoked), backend.exists(sorted(revoked))) if e == 1]
        assert not revoked_readable or name == "put_start_malformed", f"revoked yet readable: {revoked_readable}"

    consumer = oracle.pooled()
    if case.side in ("consumer", "lookup"):
        faulty = consumer.rank_faults(0) if case.side == "consumer" else consumer.scheduler_faults
        rule = case.install(faulty, keys)
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    if case.side in ("consumer", "lookup"):
        assert faulty.fired(rule) == 1  # type: ignore[arg-type]
    chunks = computed_chunks(consumer.engine, got.req_id)
    assert chunks[0][0] == case.resume, f"resumed at {chunks[0][0]}: {chunks}"
    if case.side == "consumer":
        # the failed step was dropped and its saves (computed from bad KV) revoked as tainted
        assert any(got.req_id in s.discarded_req_ids for s in consumer.engine.steps)
        stats = consumer.workers[0].stats()
        assert stats.load_failed_blocks > 0 and stats.revoked_tainted > 0, stats

    # tokens as the plain local run, logits close to it
    plain = local_oracle(oracle.local(), [PRODUCER_PROMPT], [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert_close([got], [plain], atol=ATOL, rtol=RTOL)
    # bit-identical to the local run with the consumer's schedule
    matched_engine = oracle.local()
    if case.resume:
        serve(matched_engine, [PRODUCER_PROMPT[: case.resume]], MAX_TOKENS)
    matched = serve(matched_engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert computed_chunks(matched_engine, matched.req_id) == chunks
    assert_identical([got], [matched])

    # the pool holds exactly the KV the consumer used: a fresh reader gets the same bits
    verifier = oracle.pooled(role=KVRole.CONSUMER)
    again = serve(verifier.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert again.num_external_tokens == 36 and computed_chunks(verifier.engine, again.req_id)[0] == (36, 4)
    assert chunks[-MAX_TOKENS] == (36, 4)  # the consumer's last prefill chunk
    assert_identical([again], [got])
