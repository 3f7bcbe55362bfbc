"""layerkv counters through vLLM's connector stats and Prometheus hooks: cumulative core counters
turned into per-step deltas, summed across workers, exported as `vllm:layerkv_total{counter=}`.
Called by vLLM on the engine core (scheduler role, stats logging) and on each worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import layerkv.integrations.vllm_version  # noqa: F401  (refuses an unsupported vLLM first)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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


class CounterDeltas:
    """The core keeps cumulative counters (`WorkerConnector.stats()`, `SchedulerConnector.stats()`);
    vLLM wants what happened since its last `get_kv_connector_stats` call. Names get `prefix`
    so scheduler and worker counters stay apart when vLLM aggregates them. One caller thread."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._last: dict[str, int | float] = {}

    def take(self, stats: Any) -> dict[str, int | float]:
        """Non-zero counter changes since the previous call."""
        now = counters_of(stats)
        deltas = {name: value - self._last.get(name, 0) for name, value in now.items()}
        self._last = now
        return {self._prefix + name: value for name, value in deltas.items() if value}


@dataclasses.dataclass
class LayerKVStats(KVConnectorStats):
    """Per-interval counters (hits, tokens/bytes loaded and saved, range calls, failures,
    revokes), summed across steps and TP workers."""

    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class LayerKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter, `vllm:layerkv_total{counter=...}`, per engine and stat name."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._total = self._counter_cls(
            name="vllm:layerkv_total",
            documentation="layerkv connector counters (label `counter`: hits, tokens/bytes loaded/saved, ...).",
            labelnames=[*labelnames, "counter"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            if isinstance(value, (int, float)) and value > 0:
                self._total.labels(*labels, name).inc(value)  # type: ignore[union-attr]


