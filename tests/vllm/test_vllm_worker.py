"""The facade's worker side under vLLM's real `ActiveKVConnector` (the model runner's connector driver) and per-layer
`@maybe_transfer_kv_layer` wrapper (CPU caches in vLLM's layout), load failures fed back into
vLLM's real Scheduler, and the stats / Prometheus hooks."""

from __future__ import annotations

import pytest

from layerkv.bench.decode.engine import runner_output
from tests.tokens import prompt
from tests.vllm.vllm_harness import LAYERS, make_engine, make_request, require_vllm
from tests.vllm.worker_rig import make_worker

require_vllm()

from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402

pytestmark = pytest.mark.vllm

LAYER_HOOKS = [c for name in LAYERS for c in (("wait_for_layer_load", name), ("save_kv_layer", name))]


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
        ("bind_connector_metadata", 0),
        ("start_load_kv",),
        *LAYER_HOOKS,
        ("wait_for_save",),
        ("get_finished", frozenset()),
        ("get_block_ids_with_load_errors",),
        ("report_steps",),
        ("clear_connector_metadata",),
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
    assert calls[: 2 + len(LAYER_HOOKS)] == [("bind_connector_metadata", 0), ("start_load_kv",), *LAYER_HOOKS]
    assert calls.count(("start_load_kv",)) == 1


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


def test_stats_aggregate_across_ranks_and_reach_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    stats = LayerKVConnector.build_kv_connector_stats({"load_blocks": 2, "loaded_bytes": 4096})
    other = LayerKVConnector.build_kv_connector_stats({"load_blocks": 1, "load_range_calls": 3})  # a second TP rank
    assert stats.aggregate(other).reduce() == {"load_blocks": 3, "load_range_calls": 3, "loaded_bytes": 4096}
    assert LayerKVConnector.build_kv_connector_stats({"load_blocks": 0}).is_empty()

    registry = CollectorRegistry()

    def in_registry(cls):
        return lambda **kw: cls(registry=registry, **kw)

    types = {Gauge: in_registry(Gauge), Counter: in_registry(Counter), Histogram: in_registry(Histogram)}
    prom = LayerKVConnector.build_prom_metrics(make_engine().vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(stats.reduce(), engine_idx=0)
    prom.observe({"load_blocks": 1}, engine_idx=0)
    assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "load_blocks"}) == 4
    assert registry.get_sample_value("vllm:layerkv_total", {"engine": "0", "counter": "loaded_bytes"}) == 4096


def test_counter_deltas_turn_cumulative_core_stats_into_per_step_counters():
    from layerkv.connector.stats import WorkerStats
    from layerkv.integrations.vllm.metrics import CounterDeltas

    deltas, stats = CounterDeltas("scheduler_"), WorkerStats(load_blocks=2, loaded_bytes=100)
    assert deltas.take(stats) == {"scheduler_load_blocks": 2, "scheduler_loaded_bytes": 100}
    assert deltas.take(stats) == {}
    stats.load_blocks += 3
    assert deltas.take(stats) == {"scheduler_load_blocks": 3}


def test_worker_registers_vllm_backing_buffer_once(clean_agent):
    # vLLM views every layer into one int8 buffer; the store must get that buffer, not a
    # region per layer view that starts mid-buffer and runs past its end.
    from layerkv.transfer.memory import memory_regions

    engine = make_engine(num_blocks=32)
    rig = make_worker(engine)
    storage = rig.kv_caches[LAYERS[0]].untyped_storage()
    assert rig.kv_caches[LAYERS[1]].data_ptr() > storage.data_ptr()
    assert memory_regions(rig.kv_caches) == [(storage.data_ptr(), storage.nbytes())]
    rig.connector.shutdown()
