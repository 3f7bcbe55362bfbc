"""The engine-neutral connector: `SchedulerConnector` (scheduler.py) and `WorkerConnector`
(worker.py; `worker_connector` builds a rank's, shards.py) implement the vLLM-named hooks of
hooks.py over a `CheckedStore` the caller opens (`store.factory.open_checked_store`). Engines
(reference engine, vLLM facade) import from here.
"""

from __future__ import annotations

from layerkv.connector.lookup import PoolLookup
from layerkv.connector.scheduler import SchedulerConnector
from layerkv.connector.shards import ShardedWorker, worker_connector
from layerkv.connector.stats import SchedulerStats, WorkerStats
from layerkv.connector.worker import WorkerConnector
from layerkv.metadata import BlockSpec, StepPlan, StepVerdict

__all__ = [
    "BlockSpec",
    "PoolLookup",
    "SchedulerConnector",
    "SchedulerStats",
    "StepPlan",
    "StepVerdict",
    "WorkerConnector",
    "WorkerStats",
    "ShardedWorker",
    "worker_connector",
]
