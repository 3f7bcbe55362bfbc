"""The reference engine wired to layerkv's connector: one scheduler connector and one worker
connector per TP rank over the store a LayerKVConfig names. Built on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable

from layerkv.config import LayerKVConfig
from layerkv.connector import SchedulerConnector, worker_connector
from layerkv.engine.engine import Engine, EngineConfig, make_deployment
from layerkv.engine.model import ModelConfig, Weights
from layerkv.messages import KVRole
from layerkv.store.checked import CheckedStore
from layerkv.store.factory import open_checked_store


def pooled_engine(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    config: LayerKVConfig,
    *,
    role: KVRole = KVRole.BOTH,
    store_factory: Callable[[], CheckedStore] | None = None,
    weights: Weights | None = None,
) -> Engine:
    """An Engine whose hooks are layerkv connectors. `store_factory` makes one store client per
    connector (default: `open_checked_store(config)`)."""
    open_store = store_factory or (lambda: open_checked_store(config))
    scheduler = SchedulerConnector(config, make_deployment(model_config, engine_config, 0, role), open_store())
    workers = [  # stage-major: worker_hooks[stage * tp_size + rank]
        worker_connector(config, make_deployment(model_config, engine_config, rank, role, stage), open_store())
        for stage in range(engine_config.pp_size)
        for rank in range(engine_config.tp_size)
    ]
    return Engine(model_config, engine_config, scheduler, workers, weights=weights)
