"""layerkv as a child of vLLM's MultiConnector, with stats on: vLLM's real Scheduler and worker
hooks through MultiConnector, then the front end's real stats consumers (`KVConnectorLogging`,
MultiConnector's Prometheus metrics) rebuilding layerkv's stats by connector name."""

from __future__ import annotations

import itertools
import time

import pytest

from layerkv.bench.decode.engine import runner_output
from tests.vllm.vllm_harness import LAYERS, layerkv_child, make_engine, make_request, require_vllm

require_vllm()

import torch  # noqa: E402

import layerkv.integrations.vllm.plugin as vllm_plugin  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import Node, StandInModel, expected_block  # noqa: E402
from tests.vllm.worker_rig import make_worker  # noqa: E402

pytestmark = pytest.mark.vllm
_tenants = itertools.count()


def multi_node(tenant: str | None = None, children: list[dict] | None = None, **kwargs) -> Node:
    """A node whose connector is vLLM's MultiConnector over `children` (default: one layerkv
    child on `tenant`)."""
    engine = make_engine(multi_connector=children or True, extra={"tenant": tenant}, **kwargs)
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
    return [
        eco.scheduler_stats.kv_connector_stats
        for eco in engine_outputs.values()
        if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats
    ]


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
        from layerkv.store.process_stores import close_shared_stores

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


# ---------------------------------------------------------------- several pools, one engine


def finished_params(engine_outputs: dict, req_id: str) -> dict | None:
    """The kv_transfer_params vLLM hands the client (a P/D proxy) when `req_id` finishes."""
    for eco in engine_outputs.values():
        for output in eco.outputs:
            if output.request_id == req_id and output.finished:
                return output.kv_transfer_params
    raise AssertionError(f"{req_id} did not finish in this step")


def test_two_layerkv_pools_under_multiconnector_promise_each_pool_its_prefix(clean_agent):
    """A prefill engine writes two pools (two layerkv children, one per tenant). vLLM merges the
    children's kv_transfer_params and refuses a key two return: each promise goes under its
    pool's key. A decode engine on one of the pools reads its own promise (it waits for the
    prefix to be committed, then loads it); one on a pool the prefill did not write reads none."""
    from layerkv.store.process_stores import close_shared_stores

    tokens = prompt(31, 56)  # 3 full blocks + 8 tokens
    first, second, third = (f"multi-{next(_tenants)}" for _ in range(3))
    nodes: list[Node] = []
    try:
        producer = multi_node(children=[layerkv_child({"tenant": first}), layerkv_child({"tenant": second})])
        decode_second = multi_node(second)
        decode_third = multi_node(third)
        nodes += [producer, decode_second, decode_third]
        producer.add("p", tokens, max_tokens=1)
        _, _, engine_outputs = producer.step()  # the prefill: finished, its saves not committed yet
        params = finished_params(engine_outputs, "p")
        assert params == dict.fromkeys(promise_keys_of(first, second), 48)

        for node in (decode_second, decode_third):
            node.scheduler.add_request(make_request("d", tokens, kv_transfer_params=params))
        out, _, _ = decode_second.step()
        assert out.num_scheduled_tokens == {}  # its pool's promise: waits for the commit
        out, _, _ = decode_third.step()
        assert out.num_scheduled_tokens == {"d": 56}  # no promise for its pool: computes at once

        run_to_completion(producer)  # the step that commits the prefill's saves
        for child in producer.worker.connector._connectors:
            assert child.worker_side.subs[0].flush(5.0)
        for _ in range(200):  # polls at most every connector/prefill_wait.POLL_S
            out, _, _ = decode_second.step()
            if out.num_scheduled_tokens:
                break
            time.sleep(0.005)
        assert out.num_scheduled_tokens == {"d": 8} and out.has_sync_kv_loads  # 48 tokens from its pool
        ids = decode_second.block_ids("d")
        for name in LAYERS:
            for b in range(3):
                got = decode_second.block(name, ids[b])
                assert torch.equal(got, expected_block(LAYERS.index(name), tokens, b, got))
    finally:
        for node in nodes:
            node.shutdown()
        close_shared_stores()


def promise_keys_of(*tenants: str) -> list[str]:
    from layerkv.config import LayerKVConfig
    from layerkv.connector.prefill_wait import pool_promise_key
    from layerkv.store.factory import pool_identity

    return [pool_promise_key(pool_identity(LayerKVConfig(tenant=t))) for t in tenants]


def test_layerkv_beside_vllms_own_connector_names_its_pools_promise(clean_agent, tmp_path):
    """layerkv and vLLM's ExampleConnector under MultiConnector (vLLM's real Scheduler): the
    finished request's params carry layerkv's promise under its pool's key, nothing else."""
    tenant = f"multi-{next(_tenants)}"
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    engine = make_engine(multi_connector=[layerkv_child({"tenant": tenant}), example])
    engine.scheduler.add_request(make_request("p", prompt(32, 40), max_tokens=1))
    out = engine.scheduler.schedule()
    engine_outputs = engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out))
    assert finished_params(engine_outputs, "p") == {promise_keys_of(tenant)[0]: 32}
    engine.scheduler.shutdown()


def test_two_layerkv_children_on_one_pool_promise_once(clean_agent):
    """A misconfiguration (both children write the same objects) must not stop the engine: the
    second child's promise for the request, the same key, is dropped."""
    tenant = f"multi-{next(_tenants)}"
    engine = make_engine(multi_connector=[layerkv_child({"tenant": tenant}), layerkv_child({"tenant": tenant})])
    for i in range(2):  # and again for the next request
        engine.scheduler.add_request(make_request(f"p{i}", prompt(33 + i, 40), max_tokens=1))
        out = engine.scheduler.schedule()
        engine_outputs = engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out))
        assert finished_params(engine_outputs, f"p{i}") == {promise_keys_of(tenant)[0]: 32}
    engine.scheduler.shutdown()


def test_a_decode_server_reads_the_promise_meant_for_its_pool():
    """What a decode server's connector reads (integrations/vllm/pools.py): its pool's key, else
    the plain key a client may send, else the only pool's key (a prefill server that names the
    same master by another address)."""
    from layerkv.integrations.vllm.pools import promise_read

    mine, other, third = promise_keys_of("a", "b", "c")
    assert promise_read({mine: 32, other: 48}, mine) == 32
    assert promise_read({other: 48, third: 16}, mine) is None
    assert promise_read({"layerkv_prefix_tokens": 64, other: 48}, mine) == 64
    assert promise_read({other: 48, "do_remote_prefill": True}, mine) == 48
    assert promise_read({"do_remote_prefill": True}, mine) is None
