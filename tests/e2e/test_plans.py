"""Every load plan gives the same bits: per layer through staging, per layer straight into a
registered cache (register_kv_cache), layer groups through staging, whole objects, and the
adaptive plan (the default) that picks among them per step. TP1, TP2 and MLA with an
indexer cache and an MTP layer; embedded store and the real Mooncake master."""

from __future__ import annotations

import pytest

from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import HIT_TOKENS, MLA_MODEL, MODEL, produce_and_consume, small_engine, two_docs

TOPOLOGIES = {"tp1": (MODEL, 1), "tp2": (MODEL, 2), "mla-tp2": (MLA_MODEL, 2)}


@BOTH_BACKENDS
@pytest.mark.parametrize("plan", ["auto", "layers", "direct", "groups", "whole"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_every_plan_equals_local_compute(make_oracle, plan: str, topology: str) -> None:
    model, tp_size = TOPOLOGIES[topology]
    extra = (
        {"read_layers_per_range": 2} if plan == "groups" else {"register_kv_cache": True} if plan == "direct" else {}
    )
    oracle = make_oracle(
        model=model,
        engine_config=small_engine(tp_size=tp_size),
        transfer_plan="layers" if plan == "direct" else plan,
        **extra,
    )
    producer_prompts, consumer_prompts = two_docs(seed=60)
    _, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert [o.num_external_tokens for o in got] == [HIT_TOKENS] * len(got)
    for worker in consumer.workers:
        stats = worker.stats()
        assert stats.load_failed_blocks == 0 and stats.checksum_failures == 0, stats
        used = {"layers": stats.load_plans_layers, "groups": stats.load_plans_groups, "whole": stats.load_plans_whole}
        assert sum(used.values()) == len(consumer_prompts), used
        # "layers" reads layer by layer into staging (a group plan of 1-layer groups); only a
        # registered cache is read straight into ("direct")
        kind = {"auto": None, "direct": "layers", "layers": "groups"}.get(plan, plan)
        if kind is not None:
            assert used[kind] == len(consumer_prompts), used
