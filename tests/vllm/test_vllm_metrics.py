"""layerkv's histograms, gauges and cache-hit source under vLLM's real metric code (0.33 and 0.34): a pool run
through vLLM's real Scheduler and worker hooks (embedded and Mooncake) fed to vLLM's own
PrometheusStatLogger; the Prometheus class with vLLM's metric types; the stats payload's
aggregation across workers; the gauges' reporting rule."""

from __future__ import annotations

import re

import pytest

from tests.vllm.vllm_harness import make_engine, require_vllm

require_vllm()

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from layerkv.connector.stats import Samples  # noqa: E402
from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402
from layerkv.integrations.vllm.metrics import CounterDeltas  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import produce  # noqa: E402

pytestmark = pytest.mark.vllm

NEW_FAMILIES = {
    "vllm:layerkv_load_wait_seconds": "histogram",
    "vllm:layerkv_transfer_seconds": "histogram",
    "vllm:layerkv_step_bytes": "histogram",
    "vllm:layerkv_lookup_seconds": "histogram",
    "vllm:layerkv_pending_puts": "gauge",
    "vllm:layerkv_staging_bytes_in_use": "gauge",
    "vllm:layerkv_running_jobs": "gauge",
}


@pytest.fixture
def vllm_registry():
    """vLLM's global registry, without vLLM's collectors before and after the test."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    yield REGISTRY
    unregister_vllm_metrics()


def prom_types():
    registry = CollectorRegistry()

    def in_registry(cls):
        return lambda **kw: cls(registry=registry, **kw)

    return registry, {Gauge: in_registry(Gauge), Counter: in_registry(Counter), Histogram: in_registry(Histogram)}


def test_pool_run_reaches_vllms_prometheus_with_tenant_label_and_hit_source(pool, vllm_registry):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    tokens = prompt(31, 40)  # 2 full blocks + 8 tokens
    tenant = pool.extra["tenant"]
    producer, _, _ = produce(pool, "p", tokens)
    saving = producer.outputs[0].kv_connector_stats.data  # the first step wrote 2 blocks
    gauges = saving["gauges"]
    assert gauges["pending_puts"][0] + gauges["running_jobs"][0] > 0  # its puts wait for a verdict (or still write)
    # after the last commit (flushed): the drop to zero was reported by a step or is by this call, then nothing
    idle = producer.worker.connector.get_kv_connector_stats()
    reports = [o.kv_connector_stats.data for o in producer.outputs if o.kv_connector_stats] + (
        [idle.data] if idle else []
    )
    assert [r["gauges"] for r in reports if "gauges" in r][-1] == {
        "pending_puts": [0],
        "running_jobs": [0],
        "staging_bytes_in_use": [0],
    }
    assert producer.worker.connector.get_kv_connector_stats() is None
    save_bytes = [n for r in reports for n in r.get("samples", {}).get("save_bytes", [])]
    assert len(save_bytes) >= 1 and sum(save_bytes) == sum(r.get("saved_bytes", 0) for r in reports) > 0  # per save job
    assert producer.worker.connector.get_kv_connector_stats() is None

    consumer = pool.node()
    logger = PrometheusStatLogger(consumer.engine.vllm_config)  # the front end's, on vLLM's registry
    consumer.add("c", tokens)
    out, connector_output, engine_outputs = consumer.step()
    assert out.num_scheduled_tokens == {"c": 8}  # 32 tokens from the pool
    scheduler_stats = engine_outputs[0].scheduler_stats
    want_source = CacheHitSource.HOST if pool.backend == "embedded" else CacheHitSource.P2P
    assert scheduler_stats.connector_prefix_cache_stats.hits_by_source == {want_source: 32}
    payload = scheduler_stats.kv_connector_stats  # worker's and scheduler's, as the front end gets it
    assert len(payload["samples"]["load_wait_s"]) == 1 and len(payload["samples"]["lookup_s"]) == 1
    assert payload["samples"]["load_bytes"] == [payload["loaded_bytes"]]
    logger.record(scheduler_stats, None)

    text = generate_latest(vllm_registry).decode()
    labels = f'engine="0",model_name="{consumer.engine.vllm_config.model_config.served_model_name}",tenant="{tenant}"'
    value = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}
    assert value[f"vllm:layerkv_load_wait_seconds_count{{{labels}}}"] == 1
    assert value[f"vllm:layerkv_lookup_seconds_count{{{labels}}}"] == 1
    assert value[f'vllm:layerkv_step_bytes_sum{{direction="load",{labels}}}'] == payload["loaded_bytes"]
    assert value[f'vllm:layerkv_transfer_seconds_count{{direction="load",{labels}}}'] == 1
    assert f"vllm:layerkv_pending_puts{{{labels}}}" in value  # a consumer: set, 0
    model_name = consumer.engine.vllm_config.model_config.served_model_name
    by_source = f'engine="0",model_name="{model_name}",source="{want_source.value}"'
    assert value[f"vllm:prompt_tokens_cached_by_source_total{{{by_source}}}"] == 32
    assert (
        value[
            'vllm:layerkv_total{counter="load_blocks",engine="0",model_name="%s"}'
            % consumer.engine.vllm_config.model_config.served_model_name
        ]
        == 2
    )  # the counters stay
    consumer.run_to_completion()


def test_prom_metrics_use_vllms_metric_types_and_only_the_tenant_label(tmp_path):
    from layerkv.objects.tenant_key import write_key_file

    key_file = tmp_path / "tenant.key"
    write_key_file(key_file)
    engine = make_engine(extra={"tenant": "acme", "tenant_key_file": str(key_file)})
    registry, types = prom_types()
    prom = LayerKVConnector.build_prom_metrics(engine.vllm_config, types, ["engine"], {0: ["0"], 1: ["1"]})
    # one step of two TP workers, aggregated as vLLM does
    rank0 = LayerKVConnector.build_kv_connector_stats(
        {
            "load_blocks": 2,
            "samples": {"load_wait_s": [0.003], "load_bytes": [8192], "save_bytes": [4096]},
            "gauges": {"pending_puts": [3], "staging_bytes_in_use": [65536], "running_jobs": [1]},
        }
    )
    rank1 = LayerKVConnector.build_kv_connector_stats(
        {
            "load_blocks": 2,
            "samples": {"load_wait_s": [0.2], "lookup_s": [0.0004]},
            "gauges": {"pending_puts": [4], "staging_bytes_in_use": [0], "running_jobs": [0]},
        }
    )
    prom.observe(rank0.aggregate(rank1).to_dict(), engine_idx=1)

    def sample(name, **labels):
        return registry.get_sample_value(name, {"engine": "1", "tenant": "acme", **labels})

    assert sample("vllm:layerkv_load_wait_seconds_count") == 2
    assert sample("vllm:layerkv_load_wait_seconds_sum") == pytest.approx(0.203)
    assert sample("vllm:layerkv_load_wait_seconds_bucket", le="0.005") == 1
    assert sample("vllm:layerkv_step_bytes_sum", direction="load") == 8192
    assert sample("vllm:layerkv_step_bytes_sum", direction="save") == 4096
    assert sample("vllm:layerkv_lookup_seconds_count") == 1
    assert sample("vllm:layerkv_pending_puts") == 7  # summed over the workers
    assert sample("vllm:layerkv_staging_bytes_in_use") == 65536
    assert registry.get_sample_value("vllm:layerkv_total", {"engine": "1", "counter": "load_blocks"}) == 4
    # engine 0 has its children (families show at zero) and saw nothing
    assert registry.get_sample_value("vllm:layerkv_load_wait_seconds_count", {"engine": "0", "tenant": "acme"}) == 0

    text = generate_latest(registry).decode()
    for family, kind in NEW_FAMILIES.items():
        assert f"# TYPE {family} {kind}" in text
    lines = [line for line in text.splitlines() if line.startswith(tuple(NEW_FAMILIES))]
    assert lines and all('tenant="acme"' in line for line in lines)
    secret = key_file.read_text().strip()
    assert secret and secret not in text and str(key_file) not in text and "tenant_key" not in text


def test_stats_payload_concatenates_across_workers_and_reduces_for_the_log():
    payload = {"load_blocks": 1, "samples": {"load_wait_s": [0.5]}, "gauges": {"pending_puts": [2]}}
    a = LayerKVConnector.build_kv_connector_stats(payload)
    b = LayerKVConnector.build_kv_connector_stats(
        {"load_blocks": 2, "samples": {"load_wait_s": [0.25, 1.5]}, "gauges": {"pending_puts": [1]}}
    )
    merged = a.aggregate(b)
    assert merged.data == {
        "load_blocks": 3,
        "samples": {"load_wait_s": [0.5, 0.25, 1.5]},
        "gauges": {"pending_puts": [2, 1]},
    }
    assert payload["samples"]["load_wait_s"] == [0.5] and payload["gauges"]["pending_puts"] == [2]  # not changed
    assert merged.reduce() == {"load_blocks": 3, "load_wait_s_avg": 0.75, "load_wait_s_max": 1.5}
    # zero gauges alone still carry news (a drop to zero); no counters, samples or gauges: empty
    assert not LayerKVConnector.build_kv_connector_stats({"gauges": {"pending_puts": [0]}}).is_empty()
    assert LayerKVConnector.build_kv_connector_stats({"load_blocks": 0, "samples": {}}).is_empty()


class _Leaf:
    def __init__(self) -> None:
        self.samples = Samples()
        self.now = {"pending_puts": 0, "running_jobs": 0, "staging_bytes_in_use": 0}

    def gauges(self) -> dict[str, int]:
        return dict(self.now)


class _Grouped:  # what connector/hybrid.py's GroupedWorker exposes
    def __init__(self, *subs) -> None:
        self.subs = list(subs)


def test_observed_drains_every_leaf_and_reports_gauges_while_nonzero_or_changed():
    a, b = _Leaf(), _Leaf()
    side, deltas = _Grouped(a, _Grouped(b)), CounterDeltas()
    assert deltas.take_observed(side) == {
        "gauges": {"pending_puts": [0], "running_jobs": [0], "staging_bytes_in_use": [0]}
    }
    assert deltas.take_observed(side) == {}  # unchanged zeros: nothing to send
    a.samples.observe("load_wait_s", 0.1)
    b.samples.observe("load_wait_s", 0.2)
    a.now["pending_puts"], b.now["pending_puts"] = 2, 3
    assert deltas.take_observed(side) == {
        "samples": {"load_wait_s": [0.1, 0.2]},
        "gauges": {"pending_puts": [5], "running_jobs": [0], "staging_bytes_in_use": [0]},
    }
    assert deltas.take_observed(side)["gauges"]["pending_puts"] == [5]  # non-zero: every step
    a.now["pending_puts"] = b.now["pending_puts"] = 0
    assert deltas.take_observed(side)["gauges"]["pending_puts"] == [0]  # the drop
    assert deltas.take_observed(side) == {}
    assert deltas.take_observed(object()) == {}  # a test double without samples or gauges


def test_steps_that_change_nothing_but_the_step_count_report_nothing_until_something_changes():
    """vLLM asks for stats every step: a decode step that moved nothing gives it no payload; the
    held step count goes out with the next change, or after MAX_HELD_STEPS such steps."""
    from layerkv.connector.stats import WorkerStats
    from layerkv.integrations.vllm.metrics import MAX_HELD_STEPS

    stats, deltas = WorkerStats(), CounterDeltas()
    assert deltas.take(stats) == {}
    for _ in range(5):
        stats.steps += 1
        assert deltas.take(stats) == {}
    stats.steps += 1
    stats.save_keys += 3
    assert deltas.take(stats) == {"steps": 6, "save_keys": 3}
    for _ in range(MAX_HELD_STEPS + 1):
        stats.steps += 1
        taken = deltas.take(stats)
    assert taken == {"steps": MAX_HELD_STEPS + 1}
