"""Faults across hosts, each its own test, on the pool of tests/cluster/conftest.py. Every
output equals local compute bit for bit: a request served from the pool equals the local run
that computed its prefix as the producer did (`local_oracle`), and a request whose loads failed
and were recomputed from its first block equals a fresh local run (`serve` on a new engine).
No engine hangs (every wait is bounded), and no object is left PROCESSING. Each test prints how
long the pool took to serve hits again."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from layerkv.engine import Engine
from layerkv.engine.request import RequestOutput
from layerkv.messages import KVRole
from layerkv.store.faults import GET_RANGES
from tests.cluster.conftest import Pool
from tests.e2e.harness import MODEL, local_oracle, prompts_with_prefix, random_tokens, serve, small_engine

pytestmark = pytest.mark.mooncake
MAX_TOKENS = 3
PREFIX_TOKENS, HIT_TOKENS = 22, 20  # 5 full blocks of 4 are shared
# bounded waits on the consumer: a cut link costs these, never a hang
FAST_FAILURE = {"load_timeout_s": 8.0, "save_timeout_s": 8.0, "store_call_timeout_s": 8.0}


@dataclasses.dataclass
class Prompts:
    producer: list[list[int]]
    consumer: list[list[int]]
    probes: list[list[int]]  # prefixes the consumer never computed: served to see hits return


def _prompts(seed: int, num: int = 2, num_probes: int = 0) -> Prompts:
    prefixes = [random_tokens(PREFIX_TOKENS, seed=seed + 10 * i) for i in range(num + num_probes)]
    producer = [prompts_with_prefix(p, 1, 6, seed=seed + 10 * i + 1)[0] for i, p in enumerate(prefixes)]
    consumer = [prompts_with_prefix(p, 1, 9, seed=seed + 10 * i + 2)[0] for i, p in enumerate(prefixes)]
    return Prompts(producer, consumer[:num], consumer[num:])


def _job(tag: str, prompts: Sequence[Sequence[int]], **extra: Any) -> dict[str, Any]:
    engine = dataclasses.replace(small_engine(), model_id=f"cluster/{tag}")
    return {"model": dataclasses.asdict(MODEL), "engine": dataclasses.asdict(engine), "prompts": [list(p) for p in prompts],
            "max_tokens": MAX_TOKENS, **extra}


def _identical(a: RequestOutput, b: RequestOutput) -> bool:
    return a.token_ids == b.token_ids and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def assert_local(tag: str, got: Sequence[RequestOutput], prompts: Prompts) -> list[str]:
    """Each output equals a local run: with the producer's prefix KV, or fresh (recomputed from
    the first block). Returns which it equals first, per request (the two may be the same bits:
    computing a row does not depend on how many rows share its chunk; the stats tell which
    path ran)."""
    config = dataclasses.replace(small_engine(), model_id=f"cluster/{tag}")
    loaded = local_oracle(Engine(MODEL, config), prompts.producer, prompts.consumer, MAX_TOKENS)
    fresh = serve(Engine(MODEL, config), prompts.consumer, MAX_TOKENS)
    kinds = []
    for g, want, alone in zip(got, loaded, fresh, strict=True):
        if _identical(g, want):
            kinds.append("loaded")
        elif _identical(g, alone):
            kinds.append("recomputed")
        else:
            raise AssertionError(f"{g.req_id}: equals neither the local run with the pool's prefix nor a fresh local run")
    return kinds


def test_the_consumers_link_to_its_storage_host_goes_down_mid_load_and_comes_back(pool: Pool) -> None:
    """All objects on store1 (preferred_segment); the consumer's first request has read layer 0
    when store1 is cut off: its later layers fail within load_timeout_s and the request is
    recomputed; the next request (still cut) too; after the link returns, probes of prefixes
    the consumer never computed hit the pool again."""
    prompts = _prompts(seed=101, num_probes=12)
    placement = {"preferred_segment": pool.segment_names["store1"]}
    producer = pool.engine("producer", _job("linkcut", prompts.producer, layerkv=placement, hold=True), "producer")
    out = pool.tmp / "linkcut.pt"
    try:
        made = pool.report(producer)
        assert made["idle"] and made["stats"][0]["committed_keys"] > 0 and made["stats"][0]["save_failed_keys"] == 0
        consumer = pool.engine("consumer", _job("linkcut", prompts.consumer, out=str(out), role=KVRole.CONSUMER.value,
                                                layerkv={"transfer_plan": "layers", **FAST_FAILURE},
                                                gate={"method": GET_RANGES, "layer_idx": 1, "when": "before"},
                                                probes={"prompts": prompts.probes, "hit": HIT_TOKENS}), "consumer")
        try:
            consumer.line("@@gate", 120.0)  # layer 0 read; layer 1 about to be
            pool.cluster.cut("store1")
            consumer.send()
            consumer.line("@@gate", 120.0)  # both requests served while store1 was cut off
            pool.cluster.heal("store1")
            consumer.send()
            seen = pool.report(consumer)
        finally:
            pool.cluster.heal("store1")
            assert consumer.stop() == 0
    finally:
        assert producer.stop() == 0
    kinds = assert_local("linkcut", torch.load(out, weights_only=False), prompts)
    stats = seen["stats"][0]
    print(f"link to store1 cut mid-load: {kinds}, load failures {stats['load_failed_blocks']} blocks, "
          f"requests {seen['seconds']} s; after the link returned: {seen['recovery']}")
    # the first request's later layers failed (its 5 blocks recomputed); the second found that
    # load still inside the store call and recomputed at once instead of queueing behind it
    assert stats["load_failed_blocks"] >= 5 and stats["load_failed_blocks"] + 5 * stats["load_skipped_stuck"] >= 10
    assert seen["recovery"]["recovery_s"] is not None, seen["recovery"]
    assert seen["idle"]
