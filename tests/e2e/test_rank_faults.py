"""Oracle scenario: a load fault on ONE worker (one TP rank or one pipeline stage) must not let
any other worker commit KV computed over it. TP=2, TP=4 with 2 KV heads (replicated heads), PP=2
and MLA (one storage rank every rank reads), every fault kind on the consumer's load side.

Why it matters: the ranks' partial attention outputs are all-reduced, and stage 1 computes on
stage 0's hidden states, so one worker's bad KV makes every worker's later layers bad. Before
the commit protocol, the other workers committed their saves and the pool served poisoned
blocks forever.

Checks, per case:
* outputs: tokens equal the plain local run; logits bit-identical to a local run with the
  consumer's schedule (resume is a chunk boundary of the producer, as in test_faults.py);
* no poisoned object: every object the run left in the pool is byte-equal to the same object
  written by a clean run (a fresh embedded pool, the same namespace, the consumer forced to the
  same schedule by removing the producer's objects from the resume block on).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from layerkv.engine import ModelConfig, block_hashes
from layerkv.messages import KVRole
from layerkv.objects.keys import block_keys
from layerkv.store.base import Code
from layerkv.store.faults import GET_RANGES, GET_START, FaultyStore
from tests.backends import BOTH_BACKENDS, EmbeddedBackend
from tests.e2e.harness import (
    BLOCK_SIZE,
    MODEL,
    Oracle,
    assert_close,
    assert_identical,
    computed_chunks,
    local_oracle,
    random_tokens,
    serve,
    small_engine,
)
from tests.e2e.pool_contents import assert_pool_is_clean, pool_objects

ATOL = RTOL = 1e-4
BUDGET = 12
PREFIX = random_tokens(22, seed=71)
PRODUCER_PROMPT = PREFIX + random_tokens(2, seed=72)  # 24 tokens, chunks [0,12) [12,24)
CONSUMER_PROMPT = PREFIX + random_tokens(18, seed=73)  # 40 tokens, 5 blocks shared
MAX_TOKENS = 3
MLA_MODEL = ModelConfig(
    num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=9, mla_latent_dim=24
)


@dataclass(frozen=True)
class Topology:
    model: ModelConfig
    tp_size: int
    pp_size: int
    faulty_worker: int  # index stage * tp_size + rank of the one worker whose loads fail


TOPOLOGIES = {
    "tp2-rank1": Topology(MODEL, 2, 1, 1),
    "tp4-2heads-rank1": Topology(MODEL, 4, 1, 1),  # rank 1 only reads (rank 0 writes their heads)
    "tp4-2heads-rank2": Topology(MODEL, 4, 1, 2),  # rank 2 writes storage rank 1
    "pp2-stage0": Topology(MODEL, 1, 2, 0),
    "pp2-stage1": Topology(MODEL, 1, 2, 1),
    "mla-tp2-rank1": Topology(MLA_MODEL, 2, 1, 1),  # one storage rank: rank 1 reads what rank 0 wrote
}

Install = Callable[[FaultyStore, list[str]], object]  # (the faulty worker's store, its keys of P)
FAULTS: dict[str, tuple[Install, int]] = {  # name -> (rule, first token the consumer computes after recovery)
    "range_fail_one_key": (lambda f, k: f.fail(GET_RANGES, k[3], layer_idx=1, times=1), 12),
    "evicted_before_get_start": (lambda f, k: f.fail(GET_START, k[3], code=int(Code.OBJECT_NOT_FOUND), times=1), 12),
    "lease_expired": (lambda f, k: f.expire_lease(k[3], layer_idx=1, times=1), 12),
    "range_malformed": (lambda f, k: f.malformed(GET_RANGES, None, layer_idx=1, times=1), 0),
    "range_raises": (lambda f, k: f.raise_in(GET_RANGES, layer_idx=1, times=1), 0),
    "get_start_malformed": (lambda f, k: f.malformed(GET_START, [0], times=1), 0),
    "get_start_raises": (lambda f, k: f.raise_in(GET_START, times=1), 0),
    "range_stalls_past_the_timeout": (lambda f, k: f.delay(GET_RANGES, 30.0, layer_idx=1, times=1), 0),
}


def _release_after_the_give_up(faults: FaultyStore, rule: Any, load_timeout_s: float) -> None:
    """Release the stalled call `load_timeout_s` + 2 s after it started: the load has given up
    by then, and the engine's end-of-generate flush need not wait for its save timeout."""

    def release() -> None:
        deadline = time.monotonic() + 120
        while faults.armed(rule) and time.monotonic() < deadline:  # until the stalled call entered
            time.sleep(0.02)
        time.sleep(load_timeout_s + 2.0)
        faults.release()

    threading.Thread(target=release, name="release-stall", daemon=True).start()


def _engine(topology: Topology):  # type: ignore[no-untyped-def]
    return small_engine(tp_size=topology.tp_size, pp_size=topology.pp_size, max_num_batched_tokens=BUDGET)


def _hashes(prompt: list[int]) -> list[bytes]:
    return block_hashes(list(prompt), BLOCK_SIZE)


def _clean_pool(tag: str, topology: Topology, resume: int, **layerkv: Any) -> dict[str, bytes]:
    """The objects a fault-free run with the consumer's schedule writes (fresh embedded pool,
    same model id, hence the same keys): the producer, then the consumer after the producer's
    objects from the resume block on were removed (so it loads the same blocks and computes the
    same chunks as the faulty run after its recovery)."""
    backend = EmbeddedBackend()
    backend.tag = tag
    oracle = Oracle(backend, model=topology.model, engine_config=_engine(topology), **layerkv)
    try:
        producer = oracle.pooled()
        serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
        produced = pool_objects(backend.client(), producer, [PRODUCER_PROMPT])
        # block ids as the keys name them (keyed: each stage namespace's keyed hash, not the engine's)
        late = {
            w.namespace.block_id(h).hex()
            for w in producer.workers
            for h in _hashes(PRODUCER_PROMPT)[resume // BLOCK_SIZE :]
        }
        backend.remove([k for k in produced if k.split("@")[1] in late])
        consumer = oracle.pooled()
        serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)
        consumed = pool_objects(backend.client(), consumer, [PRODUCER_PROMPT, CONSUMER_PROMPT])
        for key in set(produced) & set(consumed):
            assert produced[key] == consumed[key], f"clean producer and clean consumer disagree on {key}"
        return {**produced, **consumed}
    finally:
        oracle.check_and_close()


@BOTH_BACKENDS
@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "tenant key"])
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_one_workers_load_fault_poisons_nothing(
    make_oracle, backend, topology: str, fault: str, keyed: bool, tmp_path: Path
) -> None:
    if keyed and backend.name != "embedded":
        pytest.skip("the keyed variant runs on the embedded store (the same code path; the suite's time)")
    topo = TOPOLOGIES[topology]
    install, resume = FAULTS[fault]
    key: dict[str, Any] = {}
    if keyed:  # every object authenticated: the same faults, the same clean pool
        key_file = tmp_path / "tenant.key"
        key_file.write_text(secrets.token_bytes(32).hex())
        key_file.chmod(0o600)
        key = {"tenant_key_file": str(key_file)}
    oracle = make_oracle(model=topo.model, engine_config=_engine(topo), load_timeout_s=1.0, **key)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)

    consumer = oracle.pooled()
    faulty_worker = consumer.workers[topo.faulty_worker]
    keys = block_keys(faulty_worker.namespace, _hashes(PRODUCER_PROMPT), faulty_worker.storage_role.storage_rank)
    rule = install(consumer.rank_faults(topo.faulty_worker), keys)
    if fault == "range_stalls_past_the_timeout":  # the stalled read returns once the load gave up
        _release_after_the_give_up(consumer.rank_faults(topo.faulty_worker), rule, load_timeout_s=1.0)
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    consumer.rank_faults(topo.faulty_worker).release()  # a stalled call returns now
    assert faulty_worker.is_idle(10.0)
    assert consumer.rank_faults(topo.faulty_worker).fired(rule) == 1  # type: ignore[arg-type]
    chunks = computed_chunks(consumer.engine, got.req_id)
    assert chunks[0][0] == resume, f"resumed at {chunks[0][0]}: {chunks}"
    others = [w for i, w in enumerate(consumer.workers) if i != topo.faulty_worker]
    assert sum(w.stats().revoked_tainted for w in consumer.workers) > 0, "the failed step's saves were not revoked"
    assert all(w.stats().load_failed_blocks == 0 for w in others)  # the fault hit one worker only

    plain = local_oracle(oracle.local(), [PRODUCER_PROMPT], [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert_close([got], [plain], atol=ATOL, rtol=RTOL)
    matched_engine = oracle.local()
    if resume:
        serve(matched_engine, [PRODUCER_PROMPT[:resume]], MAX_TOKENS)
    matched = serve(matched_engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert computed_chunks(matched_engine, matched.req_id) == chunks
    assert_identical([got], [matched])

    # every object left in the pool is what a clean run with this schedule writes
    pool = pool_objects(backend.client(), consumer, [PRODUCER_PROMPT, CONSUMER_PROMPT])
    assert_pool_is_clean(pool, _clean_pool(backend.tag, topo, resume, **key))
    verifier = oracle.pooled(role=KVRole.CONSUMER)
    again = serve(verifier.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert again.token_ids == got.token_ids
