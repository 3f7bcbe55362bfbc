"""Objects keyed by the KV heads they hold (objects/keys.py storage_role, connector/shards.py):
servers of different TP sizes that split a block alike (config store_shards) share objects.

KV computed at another TP size differs from a server's own by the rounding of the TP reductions,
so the oracle is not the consumer's own recompute: it is the consumer's engine given the
producer's KV bytes directly (tests/engine's copy hooks, heads regrouped for the consumer's
ranks, no pool). The pool's answer must be bit-identical to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from layerkv.engine import Engine
from layerkv.errors import UnsupportedSetupError
from layerkv.messages import KVRole
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import BLOCK_SIZE, MAX_TOKENS, assert_identical, random_tokens
from tests.engine.engine_doubles import CopyScheduler, CopyWorker

PROMPT_TOKENS = 27  # 6 full blocks of 4 + 3
PREFIX = PROMPT_TOKENS // BLOCK_SIZE * BLOCK_SIZE
HEADS_DIM = 3  # of a K/V cache tensor [2, num_blocks, block_size, heads, head_dim]


def _heads_of(producer: Engine, tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """The producer's caches regrouped as rank `rank` of a `tp_size` engine holds them."""
    ranks = [producer.caches_for_rank(r) for r in range(producer.config.tp_size)]
    out = {}
    for name in ranks[0]:
        whole = torch.cat([caches[name] for caches in ranks], dim=HEADS_DIM)
        per = whole.shape[HEADS_DIM] // tp_size
        out[name] = whole[:, :, :, rank * per : (rank + 1) * per]
    return out


def _given_producer_kv(oracle, producer: Engine, tp_size: int, prompt: list[int]):  # type: ignore[no-untyped-def]
    """The consumer's engine (TP `tp_size`) with the prefix KV copied from the producer."""
    workers = [CopyWorker(_heads_of(producer, tp_size, r)) for r in range(tp_size)]
    engine = Engine(
        oracle.model,
        dataclasses.replace(oracle.engine_config, tp_size=tp_size, kv_layout="HND"),
        CopyScheduler(producer, BLOCK_SIZE),
        workers,
    )
    oracle.locals.append(engine)
    return engine.generate([prompt], MAX_TOKENS)[0]


@BOTH_BACKENDS
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(2, 1), (1, 2)])
def test_servers_of_different_tp_sizes_share_the_prefix_bit_identical(
    make_oracle, producer_tp: int, consumer_tp: int
) -> None:
    oracle = make_oracle(store_shards=2)  # MODEL has 2 KV heads: one object per head
    prompt = random_tokens(PROMPT_TOKENS, seed=811)
    producer = oracle.pooled(KVRole.PRODUCER, tp_size=producer_tp, kv_layout="HND")
    producer.engine.generate([prompt], 1)
    assert all(w.flush(10.0) for w in producer.workers)
    assert len(producer.keys(prompt, 0)) == PREFIX // BLOCK_SIZE
    consumer = oracle.pooled(KVRole.CONSUMER, tp_size=consumer_tp, kv_layout="HND")
    got = consumer.engine.generate([prompt], MAX_TOKENS)[0]
    assert got.num_external_tokens == PREFIX, "no hit across TP sizes"
    want = _given_producer_kv(oracle, producer.engine, consumer_tp, prompt)
    assert want.num_external_tokens == PREFIX
    assert_identical([got], [want])
    # a block's two shards: both written, both read (one object per head, whatever the TP size)
    written = {k.rsplit("@", 1)[1] for k in oracle.written_keys()}
    assert written == {"0", "1"}, written


@BOTH_BACKENDS
def test_without_store_shards_objects_stay_private_to_a_tp_size(make_oracle) -> None:
    oracle = make_oracle()
    prompt = random_tokens(PROMPT_TOKENS, seed=812)
    producer = oracle.pooled(KVRole.PRODUCER, tp_size=2, kv_layout="HND")
    producer.engine.generate([prompt], 1)
    assert all(w.flush(10.0) for w in producer.workers)
    consumer = oracle.pooled(KVRole.CONSUMER, tp_size=1, kv_layout="HND")
    got = consumer.engine.generate([prompt], MAX_TOKENS)[0]
    assert got.num_external_tokens == 0
    assert_identical([got], [oracle.local().generate([prompt], MAX_TOKENS)[0]])


@BOTH_BACKENDS
def test_a_finer_split_needs_the_heads_outermost_in_a_block(make_oracle) -> None:
    oracle = make_oracle(store_shards=2)
    with pytest.raises(UnsupportedSetupError, match="needs the heads outermost in each cache block"):
        oracle.pooled(KVRole.CONSUMER, tp_size=1, kv_layout="NHD")
