"""The bench suites' step driver: one engine step of a WorkerConnector with no compute, its
hooks in vLLM's order (as the reference engine's runner calls them, engine/runner.py), so that
every suite that times the connector's own data path drives it the same way. Driver thread
(the compute thread); the connector's transfer threads run inside the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from layerkv.connector import WorkerConnector
from layerkv.metadata import StepPlan


def drive_step(
    worker: WorkerConnector, plan: StepPlan, layer_names: Sequence[str], *, load: bool, save: bool
) -> set[int]:
    """bind_connector_metadata(plan) -> start_load_kv -> per layer in `layer_names`: wait for its
    load (`load`), hand it to the save (`save`) -> wait_for_save -> get_block_ids_with_load_errors
    -> clear_connector_metadata. Returns the block ids whose load failed."""
    worker.bind_connector_metadata(plan)
    worker.start_load_kv()
    for name in layer_names:
        if load:
            worker.wait_for_layer_load(name)
        if save:
            worker.save_kv_layer(name)
    worker.wait_for_save()
    invalid = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return invalid
