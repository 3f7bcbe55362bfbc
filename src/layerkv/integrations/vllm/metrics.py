"""layerkv's metrics through vLLM's connector stats and Prometheus hooks: cumulative core counters
turned into per-step deltas (`vllm:layerkv_total{counter=}`), per-step observations drained from
the core's `Samples` (histograms) and the workers' gauges, labelled by the `tenant` config label.
Called by vLLM on the engine core (scheduler role, stats logging), on each worker, and in the
front end (build_kv_connector_stats, LayerKVPromMetrics.observe).

Payload (`LayerKVStats.data`, plain and serialisable; vLLM aggregates it across workers):
    {"load_blocks": 3, ...,                          counters: deltas, summed
     "samples": {"load_wait_s": [0.002, ...], ...},  observations, concatenated
     "gauges": {"pending_puts": [4, 0], ...}}        one value per reporting worker process, concatenated
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.config import LayerKVConfig
from layerkv.connector import stats as core_stats
from layerkv.store.registry import backend_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SAMPLES, GAUGES = "samples", "gauges"  # the payload's two keys that are not counters


def counters_of(stats: Any) -> dict[str, int | float]:
    """Numeric counters of a core stats object (a dataclass, a mapping or None)."""
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        items = dataclasses.asdict(stats)
    elif isinstance(stats, Mapping):
        items = dict(stats)
    else:
        raise TypeError(f"stats returned {type(stats).__name__}; expected a dataclass or a mapping")
    return {k: v for k, v in items.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def hit_source(backend: str) -> CacheHitSource:
    """Where a pool hit's KV comes from, as vLLM's `prompt_tokens_cached_by_source` names it: the
    backend class's `hit_source` (store/base.py). The embedded store is host memory in this
    process; Mooncake's is memory other processes or hosts lend, read over its transfer engine
    (vLLM's own MooncakeConnector says P2P too)."""
    return CacheHitSource(backend_class(backend).hit_source.value)


# A step that changed nothing but the `steps` counter reports nothing; the count goes out with the
# next change, or after this many such steps (vLLM then has no payload to aggregate in most decode steps)
MAX_HELD_STEPS = 64
_STEP_INDEX: dict[tuple[str, ...], int] = {}  # field names of a stats class -> the index of its `steps`


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """A stats dataclass's field names, and a reader of its values as one tuple."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    getter = operator.attrgetter(*names)  # a tuple when there are several
    if "steps" in names:
        _STEP_INDEX[names] = names.index("steps")
    return names, (getter if len(names) > 1 else lambda stats: (getter(stats),))


def _leaves(side: Any) -> list[Any]:
    """The engine-neutral connectors under a grouped side (connector/hybrid.py, shards.py)."""
    subs = getattr(side, "subs", None)
    return [side] if subs is None else [leaf for sub in subs for leaf in _leaves(sub)]


class CounterDeltas:
    """What vLLM wants since its last `get_kv_connector_stats` call, from one connector side.

    * `take`: the core keeps cumulative counters (`WorkerConnector.stats()`,
      `SchedulerConnector.stats()`); names get `prefix` so scheduler and worker counters stay
      apart when vLLM aggregates them.
    * `take_observed`: every leaf's `samples` drained, and the leaves' `gauges()` summed while
      any is non-zero or when they changed (a worker that reports none counts as all zero).
    One caller thread (the side's)."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._last: dict[str, int | float] = {}
        self._last_values: tuple[Any, ...] = ()
        self._last_gauges: dict[str, int] = {}
        self._held_steps = 0  # calls whose only change was the step count (reported with the next change)

    def take(self, stats: Any) -> dict[str, int | float]:
        """Non-zero counter changes since the previous call. A stats dataclass (the core's) is
        read as one tuple of its fields, compared with the last one: vLLM asks every step."""
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
            names, values_of = _fields_of(type(stats))
            values = values_of(stats)
            last = self._last_values if len(self._last_values) == len(values) else (0,) * len(values)
            if values == last:
                return {}
            step = _STEP_INDEX.get(names)
            if (
                step is not None
                and self._held_steps < MAX_HELD_STEPS
                and values[:step] == last[:step]
                and values[step + 1 :] == last[step + 1 :]
            ):
                self._held_steps += 1  # a step that moved nothing: its count goes out with the next change
                return {}
            self._last_values, self._held_steps = values, 0
            return {
                self._prefix + name: value - before
                for name, value, before in zip(names, values, last)
                if value != before and isinstance(value, (int, float)) and not isinstance(value, bool)
            }
        now = counters_of(stats)
        deltas = {name: value - self._last.get(name, 0) for name, value in now.items()}
        self._last = now
        return {self._prefix + name: value for name, value in deltas.items() if value}

    def take_observed(self, side: Any) -> dict[str, Any]:
        """{"samples": ..., "gauges": ...} of `side` (either key left out when it has nothing)."""
        samples: dict[str, list[float]] = {}
        gauges: dict[str, int] = {}
        for leaf in _leaves(side):
            leaf_samples = getattr(leaf, "samples", None)
            if isinstance(leaf_samples, core_stats.Samples):  # test doubles have none
                for name, values in leaf_samples.take().items():
                    samples.setdefault(name, []).extend(values)
            for name, value in (getattr(leaf, "gauges", dict)() or {}).items():
                gauges[name] = gauges.get(name, 0) + value
        observed: dict[str, Any] = {SAMPLES: samples} if samples else {}
        if gauges and (any(gauges.values()) or gauges != self._last_gauges):
            observed[GAUGES] = {name: [value] for name, value in gauges.items()}
        self._last_gauges = gauges
        return observed


@dataclasses.dataclass
class LayerKVStats(KVConnectorStats):
    """One interval's payload (module docstring), summed / concatenated across steps and TP
    workers by `aggregate`. Owns its lists: a payload it was built from is never changed."""

    def __post_init__(self) -> None:
        self.data = {
            name: ({k: list(v) for k, v in value.items()} if name in (SAMPLES, GAUGES) else value)
            for name, value in (self.data or {}).items()
        }

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in (SAMPLES, GAUGES):
                mine = self.data.setdefault(name, {})
                for key, values in value.items():
                    mine.setdefault(key, []).extend(values)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's `KV Transfer metrics:` log line: the counters, and each sample's mean and
        max (`load_wait_s_avg`, `load_wait_s_max`, ...); gauges are for Prometheus only."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k not in (SAMPLES, GAUGES)}
        for name, values in self.data.get(SAMPLES, {}).items():
            if values:
                out[f"{name}_avg"] = round(sum(values) / len(values), 6)
                out[f"{name}_max"] = round(max(values), 6)
        return dict(sorted(out.items()))

    def is_empty(self) -> bool:
        counters = any(v for k, v in self.data.items() if k not in (SAMPLES, GAUGES))
        return not (counters or any(self.data.get(SAMPLES, {}).values()) or self.data.get(GAUGES))


@dataclass(frozen=True, slots=True)
class Family:
    """One Prometheus family layerkv exports: `kind` histogram or gauge; `sources` maps each
    payload name (a Samples name or a gauge name) to the `direction` label value it gets
    ("" when the family has no direction label)."""

    name: str
    kind: str
    documentation: str
    sources: tuple[tuple[str, str], ...]
    buckets: tuple[float, ...] = ()


SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NBYTES = tuple(float(1 << k) for k in range(12, 36, 2))  # 4 KiB .. 8 GiB, x4
FAMILIES = (
    Family(
        "vllm:layerkv_load_wait_seconds",
        "histogram",
        "Per step with pool loads and worker: compute thread time waiting for layers to arrive from the pool.",
        ((core_stats.LOAD_WAIT_S, ""),),
        SECONDS,
    ),
    Family(
        "vllm:layerkv_transfer_seconds",
        "histogram",
        "Per step and worker: a load's start to its last layer "
        "read (direction=load, loads that read every layer), a save's time in store writes (direction=save).",
        ((core_stats.LOAD_TRANSFER_S, "load"), (core_stats.SAVE_TRANSFER_S, "save")),
        SECONDS,
    ),
    Family(
        "vllm:layerkv_step_bytes",
        "histogram",
        "Per step and worker: bytes read from the pool (direction=load) or written to it (direction=save).",
        ((core_stats.LOAD_BYTES, "load"), (core_stats.SAVE_BYTES, "save")),
        NBYTES,
    ),
    Family(
        "vllm:layerkv_lookup_seconds",
        "histogram",
        "Per request lookup (and KV cache group): the scheduler's exists calls to the pool.",
        ((core_stats.LOOKUP_S, ""),),
        SECONDS,
    ),
    Family(
        "vllm:layerkv_pending_puts",
        "gauge",
        "Put sessions written and waiting for their commit verdict, summed over workers.",
        (("pending_puts", ""),),
    ),
    Family(
        "vllm:layerkv_staging_bytes_in_use",
        "gauge",
        "Staging bytes lent to transfer jobs that have not finished, summed over workers.",
        (("staging_bytes_in_use", ""),),
    ),
    Family(
        "vllm:layerkv_running_jobs",
        "gauge",
        "Transfer jobs (loads, saves, commits) whose store calls have not all returned, summed over workers.",
        (("running_jobs", ""),),
    ),
)


def tenant_label(vllm_config: VllmConfig) -> str:
    """The `tenant` config label of this engine's layerkv config ("default" without one). Only
    the label: the tenant key (tenant_key_file) never reaches a metric."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    return LayerKVConfig.from_dict(extra).tenant


class LayerKVPromMetrics(KVConnectorPromMetrics):
    """`vllm:layerkv_total{counter=...}` per engine and counter name, and FAMILIES, labelled
    (vLLM's labels, `tenant`[, `direction`]). Called on the front end's stats thread."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._total = self._counter_cls(
            name="vllm:layerkv_total",
            documentation="layerkv connector counters (label `counter`: hits, tokens/bytes loaded/saved, ...).",
            labelnames=[*labelnames, "counter"],
        )
        # payload name -> {engine index: the labelled child}
        self._samples: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        for family in FAMILIES:
            self._register(family, labelnames, tenant_label(vllm_config))

    def _register(self, family: Family, labelnames: list[str], tenant: str) -> None:
        directed = any(direction for _, direction in family.sources)
        names = [*labelnames, "tenant", *(["direction"] if directed else [])]
        metric: Any
        if family.kind == "histogram":
            metric = self._histogram_cls(
                name=family.name,
                documentation=family.documentation,  # type: ignore[call-arg]
                buckets=list(family.buckets),
                labelnames=names,
            )
        else:
            metric = self._gauge_cls(
                name=family.name,
                documentation=family.documentation,  # type: ignore[call-arg]
                multiprocess_mode="mostrecent",
                labelnames=names,
            )
        into = self._samples if family.kind == "histogram" else self._gauges
        for source, direction in family.sources:
            into[source] = {
                idx: metric.labels(*values, tenant, *([direction] if directed else []))
                for idx, values in self.per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """One step's payload (aggregated across workers): counters incremented, samples
        observed, each gauge set to the sum of its workers' values."""
        data = transfer_stats_data or {}
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                self._total.labels(*labels, name).inc(value)  # type: ignore[union-attr]
        for name, values in (data.get(SAMPLES) or {}).items():
            histogram = self._samples.get(name, {}).get(engine_idx)
            if histogram is not None:  # a name this version does not export: left out
                for value in values:
                    histogram.observe(value)
        for name, values in (data.get(GAUGES) or {}).items():
            gauge = self._gauges.get(name, {}).get(engine_idx)
            if gauge is not None:
                gauge.set(sum(values))
