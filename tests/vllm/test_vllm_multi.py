"""layerkv as a child of vLLM's MultiConnector, with stats on: vLLM's real Scheduler and worker
hooks through MultiConnector, then the front end's real stats consumers (`KVConnectorLogging`,
MultiConnector's Prometheus metrics) rebuilding layerkv's stats by connector name."""

from __future__ import annotations

import itertools

import pytest
from tests.vllm.vllm_harness import LAYERS, make_engine, make_worker, require_vllm

require_vllm()

from tests.vllm.pool_rig import Node, StandInModel, expected_block, prompt  # noqa: E402

from layerkv.integrations import vllm_plugin  # noqa: E402

pytestmark = pytest.mark.vllm
_tenants = itertools.count()


def multi_node(tenant: str, **kwargs) -> Node:
    engine = make_engine(multi_connector=True, extra={"tenant": tenant}, **kwargs)
    worker = make_worker(engine)
    return Node(engine, worker, StandInModel(worker.kv_caches))


def prom_registry_types():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def in_registry(cls):
        return lambda **kw: cls(registry=registry, **kw)

    return registry, {Gauge: in_registry(Gauge), Counter: in_registry(Counter), Histogram: in_registry(Histogram)}


def stats_payloads(engine_outputs: dict) -> list[dict]:
    """What the engine core sends the front end after a step: `SchedulerStats.kv_connector_stats`
    (MultiKVConnectorStats.to_dict(): {connector class name: plain counters})."""
    return [eco.scheduler_stats.kv_connector_stats for eco in engine_outputs.values()
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats]


def run_to_completion(node: Node) -> list[dict]:
    payloads = []
    while node.scheduler.has_requests():  # what vLLM's EngineCore busy loop checks
        payloads += stats_payloads(node.step()[2])
    return payloads


def test_layerkv_under_multiconnector_loads_and_its_stats_reach_the_front_end(clean_agent):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from layerkv.integrations.vllm import LayerKVConnector

    tokens = prompt(21, 56)  # 3 full blocks + 8 tokens
    tenant = f"multi-{next(_tenants)}"
    producer = multi_node(tenant)
    consumer = None
    try:
        assert isinstance(producer.worker.connector, MultiConnector)
        (child,) = producer.worker.connector._connectors
        assert isinstance(child, LayerKVConnector)
        producer.add("p", tokens)
        produced = run_to_completion(producer)
        assert all(set(p) == {"LayerKVConnector"} for p in produced)
        assert sum(p["LayerKVConnector"].get("committed_keys", 0) for p in produced) == 3

        consumer = multi_node(tenant)
        consumer.add("c", tokens)
        out, connector_output, engine_outputs = consumer.step()
        assert out.num_scheduled_tokens == {"c": 8} and out.has_sync_kv_loads  # 48 tokens from the pool
        ids = consumer.block_ids("c")
        for name in LAYERS:
            for b in range(3):
                got = consumer.block(name, ids[b])
                assert (got == expected_block(LAYERS.index(name), tokens, b, got)).all()
        consumed = stats_payloads(engine_outputs) + run_to_completion(consumer)

        # The front end: vLLM's logger and Prometheus metrics rebuild each child's stats by name.
        vllm_config = consumer.engine.vllm_config
        logging = KVConnectorLogging(vllm_config.kv_transfer_config)
        for payload in produced + consumed:
            logging.observe(payload)
        lines: list[str] = []
        logging.log(lambda fmt, *args: lines.append(fmt % args))
        assert lines and "LayerKVConnector" in lines[0] and "committed_keys" in lines[0]

        registry, types = prom_registry_types()
        prom = MultiConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
        for payload in produced + consumed:
            prom.observe(payload, engine_idx=0)
        assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "committed_keys"}) == 3
        assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "load_blocks"}) == 3
        assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "scheduler_hit_blocks"}) == 3
    finally:
        for node in (producer, consumer):
            if node is not None:
                node.shutdown()
        from layerkv.store.factory import close_shared_stores

        close_shared_stores()


def test_front_end_needs_the_connector_name_registered(monkeypatch):
    # What vLLM raised before layerkv registered its name: a front-end process that never
    # imported layerkv rebuilds MultiConnector stats from the engine core's plain dicts.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    monkeypatch.delitem(KVConnectorFactory._registry, "LayerKVConnector")
    with pytest.raises(ValueError, match="Connector 'LayerKVConnector' is not registered"):
        MultiConnector.build_kv_connector_stats({"LayerKVConnector": {"load_blocks": 2}})

    vllm_plugin.register()  # what vLLM's plugin loader runs in every process (entry point)
    vllm_plugin.register()  # idempotent
    stats = MultiConnector.build_kv_connector_stats({"LayerKVConnector": {"load_blocks": 2}})
    assert stats.reduce() == {"LayerKVConnector": {"load_blocks": 2}}
