"""Servers of different TP sizes share objects in a real vLLM engine (store_shards=2 on both:
one object per KV head of the tiny model, whatever the TP size): tp2 (two worker processes) and
tp1-shards (one worker holding both shards, connector/shards.py) each load what the other wrote.

KV computed at TP 2 differs from TP 1's own by the rounding of the all-reduce, so the exact check
is the reader against itself: a request served from the pool and the same request served from
the reader's local prefix cache holding the bytes it loaded are bit-identical. Against the
writer's own answer (same prefix KV, tail computed at the writer's TP size) the tokens agree and
the logprobs agree to rounding: a wrong head mapping would not (the reference-engine tier checks
the head mapping bit for bit: tests/e2e/test_tensor_parallel_sharing.py)."""

from __future__ import annotations

import math

import pytest
from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("tp2", "tp1-shards")]
PREFIX = 4 * BLOCK_SIZE


@pytest.fixture(scope="module")
def engines(fleet):
    return fleet.get("tp2"), fleet.get("tp1-shards")


def _shared(writer, reader, seed: int) -> None:  # type: ignore[no-untyped-def]
    prefix = prompt(seed, PREFIX)
    request = prefix + prompt(seed + 1, 20)
    writer.generate([prefix], reset_prefix_cache=True)  # the writer's ranks save every shard of 4 blocks
    (first,) = reader.generate([prefix + prompt(seed + 2, 1)], reset_prefix_cache=True)
    assert first["num_cached_tokens"] == PREFIX, pool_diagnosis(writer, reader)
    (local,) = reader.generate([request], max_tokens=4)  # the reader's local prefix cache: the bytes it loaded
    (pooled,) = reader.generate([request], max_tokens=4, reset_prefix_cache=True)  # the pool again
    assert local["num_cached_tokens"] == pooled["num_cached_tokens"] == PREFIX, pool_diagnosis(writer, reader)
    same_bits(pooled, local)
    (own,) = writer.generate([request], max_tokens=4)  # the writer over its own prefix KV
    assert own["num_cached_tokens"] == PREFIX
    assert pooled["token_ids"][0] == own["token_ids"][0], (pooled, own)
    first_lp = [_chosen(pooled, 0), _chosen(own, 0)]
    assert math.isclose(*first_lp, rel_tol=1e-3, abs_tol=1e-3), first_lp


def _chosen(output: dict, i: int) -> float:
    return float.fromhex(output["logprobs"][i])  # engine_host sends them exact, as hex


def test_tp1_loads_what_tp2_wrote(engines):
    tp2, tp1 = engines
    _shared(tp2, tp1, seed=70)


def test_tp2_loads_what_tp1_wrote(engines):
    tp2, tp1 = engines
    _shared(tp1, tp2, seed=80)
