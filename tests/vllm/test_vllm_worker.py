"""The facade's worker side under vLLM's real KVConnectorModelRunnerMixin and per-layer
`@maybe_transfer_kv_layer` wrapper (CPU caches in vLLM's layout), load failures fed back into
vLLM's real Scheduler, and the stats / Prometheus hooks."""

from __future__ import annotations

import pytest
from vllm_harness import LAYERS, make_engine, make_request, make_worker, require_vllm, runner_output

require_vllm()

from layerkv.integrations.vllm import LayerKVConnector, LayerKVStats  # noqa: E402

pytestmark = pytest.mark.vllm

LAYER_HOOKS = [c for name in LAYERS for c in (("wait_for_layer_load", name), ("save_kv_layer", name))]


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 53 + k) % 500 + 3 for k in range(num_tokens)]


def test_register_kv_caches_passes_vllm_tensors_and_num_blocks(doubles, clean_agent):
    engine = make_engine(num_blocks=32)
    rig = make_worker(engine)
    assert isinstance(rig.connector, LayerKVConnector)
    (core,) = doubles.workers
    assert core.calls == [("register_kv_caches", 32)]
    assert core.kv_caches.keys() == set(LAYERS)
    for name in LAYERS:
        assert core.kv_caches[name] is rig.kv_caches[name]
        assert tuple(core.kv_caches[name].shape) == (32, 2, 16, 32)  # [blocks, kv heads, tokens, K|V]


def test_sync_load_step_calls_hooks_in_vllm_order(doubles, clean_agent):
    engine = make_engine()
    rig = make_worker(engine)
    request = make_request("a", prompt(1, 40))
    doubles.schedulers[0].pool_hashes.update(request.block_hashes[:2])
    engine.scheduler.add_request(request)
    out = engine.scheduler.schedule()
    assert out.has_sync_kv_loads

    output = rig.run_step(out)

    assert doubles.workers[0].calls[1:] == [
        ("bind_connector_metadata", 0), ("start_load_kv",), *LAYER_HOOKS, ("wait_for_save",),
        ("get_finished", frozenset()), ("get_block_ids_with_load_errors",), ("clear_connector_metadata",),
    ]
    assert output.invalid_block_ids == set() and output.kv_connector_stats is None


def test_step_without_sync_loads_starts_loading_before_first_layer_once(doubles, clean_agent):
    # vLLM calls start_load_kv after the forward when no request loads synchronously; the
    # neutral contract wants it before the first layer: the facade starts it there, once.
    engine = make_engine()
    rig = make_worker(engine)
    engine.scheduler.add_request(make_request("a", prompt(2, 40)))
    out = engine.scheduler.schedule()
    assert not out.has_sync_kv_loads

    rig.run_step(out)

    calls = doubles.workers[0].calls[1:]
    assert calls[:2 + len(LAYER_HOOKS)] == [("bind_connector_metadata", 0), ("start_load_kv",), *LAYER_HOOKS]
    assert calls.count(("start_load_kv",)) == 1


def test_load_error_makes_vllm_recompute_from_first_invalid_block(doubles, clean_agent):
    engine = make_engine(failure_policy="recompute")
    rig = make_worker(engine)
    request = make_request("a", prompt(3, 40))
    doubles.schedulers[0].pool_hashes.update(request.block_hashes[:2])
    engine.scheduler.add_request(request)
    out = engine.scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 8}  # 32 tokens loaded from the pool
    (block_ids,) = engine.scheduler.kv_cache_manager.get_block_ids("a")
    doubles.workers[0].load_errors = {block_ids[1]}  # block 1 failed to load

    output = rig.run_step(out)
    assert output.invalid_block_ids == {block_ids[1]}
    engine_outputs = engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out, output))

    assert doubles.schedulers[0].reports[-1].invalid_block_ids == {block_ids[1]}
    assert request.num_computed_tokens == 16  # truncated at the first invalid block
    assert request.num_output_tokens == 0  # the token sampled over bad KV was dropped
    assert not any(o.new_token_ids for eco in engine_outputs.values() for o in eco.outputs)
    again = engine.scheduler.schedule()
    assert again.num_scheduled_tokens == {"a": 24}  # recomputes blocks 1.. and the tail
    (scheduled,) = doubles.schedulers[0].steps[-1].requests
    assert scheduled.num_computed_tokens == 16


def test_load_error_with_fail_policy_fails_the_request(doubles, clean_agent):
    engine = make_engine(failure_policy="fail")
    rig = make_worker(engine)
    request = make_request("a", prompt(4, 40))
    doubles.schedulers[0].pool_hashes.update(request.block_hashes[:2])
    engine.scheduler.add_request(request)
    out = engine.scheduler.schedule()
    (block_ids,) = engine.scheduler.kv_cache_manager.get_block_ids("a")
    doubles.workers[0].load_errors = {block_ids[0]}
    output = rig.run_step(out)
    engine_outputs = engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out, output))
    (finished,) = [o for eco in engine_outputs.values() for o in eco.outputs]
    assert finished.request_id == "a" and finished.finish_reason is not None
    assert "a" not in engine.scheduler.requests


def test_worker_stats_reach_vllm_and_prometheus(doubles, clean_agent):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    engine = make_engine()
    rig = make_worker(engine)
    engine.scheduler.add_request(make_request("a", prompt(5, 20)))
    out = engine.scheduler.schedule()
    doubles.workers[0].counters = {"hits": 2, "bytes_loaded": 4096, "revokes": 0, "healthy": True}

    output = rig.run_step(out)

    stats = output.kv_connector_stats
    assert isinstance(stats, LayerKVStats) and stats.data == {"hits": 2, "bytes_loaded": 4096, "revokes": 0}
    other = LayerKVConnector.build_kv_connector_stats({"hits": 1, "range_calls": 3})  # a second TP rank
    assert stats.aggregate(other).reduce() == {"bytes_loaded": 4096, "hits": 3, "range_calls": 3, "revokes": 0}
    assert rig.connector.get_kv_connector_stats() is None  # counters were taken by the last step

    registry = CollectorRegistry()

    def in_registry(cls):
        return lambda **kw: cls(registry=registry, **kw)

    types = {Gauge: in_registry(Gauge), Counter: in_registry(Counter), Histogram: in_registry(Histogram)}
    prom = LayerKVConnector.build_prom_metrics(engine.vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(stats.reduce(), engine_idx=0)
    prom.observe({"hits": 1}, engine_idx=0)
    assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "hits"}) == 4
    assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "bytes_loaded"}) == 4096
