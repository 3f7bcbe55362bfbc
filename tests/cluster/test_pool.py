"""One Mooncake pool over five hosts (tests/cluster/conftest.py): a producer engine on its host
saves through the master host into the two storage hosts' segments, a consumer engine on
another host loads them; its outputs equal local compute, bit for bit."""

from __future__ import annotations

import dataclasses
import subprocess
from typing import Any

import pytest
import torch

from layerkv.bench.cluster.netns import SYN_RETRIES
from layerkv.engine import Engine
from tests.cluster.pool import Pool
from tests.e2e.harness import MODEL, assert_identical, local_oracle, prompts_with_prefix, random_tokens, small_engine

pytestmark = pytest.mark.mooncake
MAX_TOKENS = 3


def _job(tag: str, prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
    engine = dataclasses.replace(small_engine(), model_id=f"cluster/{tag}")
    return {
        "model": dataclasses.asdict(MODEL),
        "engine": dataclasses.asdict(engine),
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    prefixes = [random_tokens(22, seed=seed), random_tokens(22, seed=seed + 1)]
    producer = [prompts_with_prefix(p, 1, 6, seed=seed + 2 + i)[0] for i, p in enumerate(prefixes)]
    consumer = [prompts_with_prefix(p, 1, 9, seed=seed + 4 + i)[0] for i, p in enumerate(prefixes)]
    return producer, consumer


def test_a_consumer_on_another_host_loads_what_a_producer_saved_into_two_storage_hosts(pool: Pool) -> None:
    producer_prompts, consumer_prompts = _prompts(seed=71)
    producer = pool.engine("producer", _job("basic", producer_prompts, hold=True), "producer")
    try:
        report = pool.report(producer)
        assert report["idle"] and all(s["committed_keys"] > 0 and s["save_failed_keys"] == 0 for s in report["stats"])
        out = pool.tmp / "basic-consumer.pt"
        consumer = pool.engine("consumer", _job("basic", consumer_prompts, out=str(out)), "consumer")
        seen = pool.report(consumer)
        assert consumer.stop() == 0
    finally:
        assert producer.stop() == 0
    got = torch.load(out, weights_only=False)
    engine = dataclasses.replace(small_engine(), model_id="cluster/basic")
    want = local_oracle(Engine(MODEL, engine), producer_prompts, consumer_prompts, MAX_TOKENS)
    assert_identical(got, want)
    assert seen["hit_tokens"] == [20, 20]
    assert all(s["load_failed_blocks"] == 0 and s["load_range_calls"] > 0 for s in seen["stats"])


def test_every_host_gives_up_a_connection_to_a_cut_host_in_seconds(pool: Pool) -> None:
    """A Mooncake read to a host that is gone sits in the kernel's SYN retries: the default 6
    give up after ~127 s, past every wait of the fault tests (one engine aborted at exit with that
    read in flight). Each host's namespace retries SYN_RETRIES times (~15 s)."""
    for host in pool.cluster.hosts.values():
        argv = host.argv(["cat", "/proc/sys/net/ipv4/tcp_syn_retries"])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
        assert int(done.stdout) == SYN_RETRIES < 6, host.name
