"""The connector hook contract, named as vLLM's KVConnectorBase_V1 hooks, in engine-neutral
types. Engines (the reference engine, the vLLM facade) call these; `scheduler.py` and `worker.py` implement
them. Scheduler hooks run on the engine's scheduler thread; worker hooks on the engine's
compute thread (one worker connector per TP rank).

Call order per engine step (as vLLM does it):

    scheduler:  get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
                -> build_connector_meta(step) --meta--> worker
    worker:     bind_connector_metadata(meta); start_load_kv()
                for each layer: wait_for_layer_load(name) -> attention -> save_kv_layer(name)
                wait_for_save(); get_finished(...); get_block_ids_with_load_errors()
                report_steps(); clear_connector_metadata()
    scheduler:  update_connector_output(report: union of every worker's invalid blocks and
                reported steps); request_finished(...) when a request ends
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from layerkv.messages import ReqId, RequestView, SchedulerStep, WorkerReport


class SchedulerHooks(Protocol):
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the pool can provide beyond `num_computed_tokens`, load_async=False); None
        tokens: not known yet, ask again next step (the engine schedules the request later)."""
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[int, ...], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, step: SchedulerStep) -> Any:
        """A picklable metadata object for the workers of this step."""
        ...

    def update_connector_output(self, report: WorkerReport) -> None: ...

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params). layerkv never delays; a role that
        saves names the prefix it commits (connector/prefill_wait.py)."""
        ...

    def has_pending_work(self) -> bool:
        """The engine must keep stepping (nothing scheduled) while this is True: a verdict on
        earlier saves waits for reports or for a step to carry it to the workers."""
        ...

    def reset_cache(self) -> bool:
        """After new weights: no object written before is ever served (a new namespace epoch
        from the next plan on). Between steps; True when done."""
        ...


class WorkerHooks(Protocol):
    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """`kv_caches`: layer name -> tensor or tuple of tensors (see objects/layout.py)."""
        ...

    def bind_connector_metadata(self, meta: Any) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId] | None, set[ReqId] | None]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def report_steps(self) -> tuple[int, ...]:
        """Step numbers (StepPlan.step_seq) this worker ran since the last call; the engine
        concatenates them over every worker into WorkerReport.reported_steps."""
        ...

    def clear_connector_metadata(self) -> None: ...

    def shutdown(self) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for background transfers (writes, commits) to finish; True if they did. Not a
        vLLM hook: engines that want their saves readable when a call returns use it."""
        ...


class NullScheduler:
    """Scheduler hooks of an engine without a pool: no hits, nothing to do."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[int, ...], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, step: SchedulerStep) -> Any:
        return None

    def update_connector_output(self, report: WorkerReport) -> None:
        return None

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> bool:
        return True


class NullWorker:
    """Worker hooks of an engine without a pool."""

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        return None

    def bind_connector_metadata(self, meta: Any) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId] | None, set[ReqId] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def report_steps(self) -> tuple[int, ...]:
        return ()

    def clear_connector_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def flush(self, timeout_s: float | None = None) -> bool:
        return True
