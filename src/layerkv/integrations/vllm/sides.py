"""What one vLLM connector instance builds on layerkv's side: its store client and the
engine-neutral scheduler or worker connector over it, one per KV cache group. Read once by
`LayerKVConnector.__init__` (scheduler role on vLLM's engine core thread, worker role on each
worker's model-runner thread); no state of its own. The three names below are the seam tests
replace: OPEN_STORE wrapped to inject faults (CheckedStore(FaultyStore(...))), the sides by
recording doubles. Failure: whatever opening the store or building a side raises reaches vLLM's
connector construction; the facade closes a store it opened when a side fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig
    from layerkv.connector.hooks import SchedulerHooks, WorkerHooks
    from layerkv.messages import Deployment
    from layerkv.store.checked import CheckedStore


def open_connector_store(config: LayerKVConfig) -> CheckedStore:
    """The store client one connector instance uses (and closes on `shutdown`): a CheckedStore
    over `config.backend`. The embedded backend is process-wide, so a scheduler and a worker in
    one process see the same objects; Mooncake opens one client per connector."""
    from layerkv.store.factory import open_checked_store

    return open_checked_store(config)


def _default_scheduler_side(config: LayerKVConfig, deployment: Deployment, store: CheckedStore) -> SchedulerHooks:
    from layerkv.connector import SchedulerConnector

    return SchedulerConnector(config, deployment, store)


def _default_worker_side(config: LayerKVConfig, deployment: Deployment, store: CheckedStore) -> WorkerHooks:
    from layerkv.connector.shards import worker_connector

    return worker_connector(config, deployment, store)


# How the facade opens its store and builds the engine-neutral sides (looked up at each construction).
OPEN_STORE: Callable[[LayerKVConfig], CheckedStore] = open_connector_store
SCHEDULER_SIDE: Callable[[LayerKVConfig, Deployment, CheckedStore], SchedulerHooks] = _default_scheduler_side
WORKER_SIDE: Callable[[LayerKVConfig, Deployment, CheckedStore], WorkerHooks] = _default_worker_side
