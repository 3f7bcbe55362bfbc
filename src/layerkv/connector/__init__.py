"""The engine-neutral connector: `SchedulerConnector` (scheduler.py) and `WorkerConnector`
(worker.py) implement the vLLM-named hooks of hooks.py over a `CheckedStore` the caller opens
(`store.factory.open_checked_store`). Engines (reference engine, vLLM facade) import from here.
"""

from __future__ import annotations

from layerkv.metadata import BlockSpec, StepPlan, StepVerdict
from layerkv.connector.scheduler import PoolLookup, SchedulerConnector
from layerkv.connector.stats import SchedulerStats, WorkerStats
from layerkv.connector.worker import WorkerConnector

__all__ = [
    "BlockSpec",
    "PoolLookup",
    "SchedulerConnector",
    "SchedulerStats",
    "StepPlan",
    "StepVerdict",
    "WorkerConnector",
    "WorkerStats",
]
