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


def _shared(writer, reader, seed: int) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """The writer saves a 4-block prefix; the reader loads it (first), serves a longer request
    from its local prefix cache over the loaded bytes (local) and from the pool again (pooled);
    the writer serves the request over its own prefix KV (own)."""
    prefix = prompt(seed, PREFIX)
    request = prefix + prompt(seed + 1, 20)
    writer.generate([prefix], reset_prefix_cache=True)  # the writer's ranks save every shard of 4 blocks
    (first,) = reader.generate([prefix + prompt(seed + 2, 1)], reset_prefix_cache=True)
    (local,) = reader.generate([request], max_tokens=4)
    (pooled,) = reader.generate([request], max_tokens=4, reset_prefix_cache=True)
    (own,) = writer.generate([request], max_tokens=4)
    return {"first": first, "local": local, "pooled": pooled, "own": own}


def _chosen(output: dict, i: int) -> float:
    return float.fromhex(output["logprobs"][i])  # engine_host sends them exact, as hex


def _assert_shared(runs: dict[str, dict], writer, reader) -> None:  # type: ignore[no-untyped-def]
    assert runs["first"]["num_cached_tokens"] == PREFIX, pool_diagnosis(writer, reader)  # all from the pool
    assert runs["local"]["num_cached_tokens"] == runs["pooled"]["num_cached_tokens"] == PREFIX, pool_diagnosis(
        writer, reader
    )
    same_bits(runs["pooled"], runs["local"])
    assert runs["own"]["num_cached_tokens"] == PREFIX
    assert runs["pooled"]["token_ids"][0] == runs["own"]["token_ids"][0], runs
    first_lp = [_chosen(runs["pooled"], 0), _chosen(runs["own"], 0)]
    assert math.isclose(*first_lp, rel_tol=1e-3, abs_tol=1e-3), first_lp


def test_tp1_loads_what_tp2_wrote(engines):
    tp2, tp1 = engines
    runs = _shared(tp2, tp1, seed=70)
    assert runs["first"]["num_cached_tokens"] == PREFIX, pool_diagnosis(tp2, tp1)
    _assert_shared(runs, tp2, tp1)


def test_tp2_loads_what_tp1_wrote(engines):
    tp2, tp1 = engines
    runs = _shared(tp1, tp2, seed=80)
    assert runs["first"]["num_cached_tokens"] == PREFIX, pool_diagnosis(tp1, tp2)
    _assert_shared(runs, tp1, tp2)
