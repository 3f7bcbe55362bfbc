"""The engine-neutral connector: `SchedulerConnector` (scheduler.py) and `WorkerConnector`
(worker.py) implement the vLLM-named hooks of hooks.py; `build_connector` picks one by role.
Engines (reference engine, vLLM facade) import from here only.
"""

from __future__ import annotations

from typing import Literal

from layerkv.config import LayerKVConfig
from layerkv.messages import Deployment
from layerkv.plan import BlockSpec, StepPlan
from layerkv.scheduler import PoolLookup, SchedulerConnector
from layerkv.stats import SchedulerStats, WorkerStats
from layerkv.store.base import KVStore
from layerkv.worker import WorkerConnector

__all__ = [
    "BlockSpec",
    "PoolLookup",
    "SchedulerConnector",
    "SchedulerStats",
    "StepPlan",
    "WorkerConnector",
    "WorkerStats",
    "build_connector",
]


def build_connector(
    role: Literal["scheduler", "worker"], config: LayerKVConfig, deployment: Deployment, store: KVStore | None = None
) -> SchedulerConnector | WorkerConnector:
    if role == "scheduler":
        return SchedulerConnector(config, deployment, store)
    if role == "worker":
        return WorkerConnector(config, deployment, store)
    raise ValueError(f"role={role!r} must be 'scheduler' or 'worker'")
