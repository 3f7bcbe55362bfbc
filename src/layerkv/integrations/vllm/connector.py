"""vLLM v1 facade: `LayerKVConnector(KVConnectorBase_V1)`. Only `integrations/vllm/` imports
vllm: setup checks in setup.py, step translation in steps.py, counters in metrics.py; the store
and the neutral sides it builds come from sides.py. Translates vLLM's types into
`layerkv.messages` and delegates every hook to the engine-neutral scheduler or worker connector
(`layerkv.connector`). The scheduler role runs on vLLM's engine core thread; the worker role on
each worker's model-runner thread (one instance per rank).

Load with: --kv-transfer-config '{"kv_connector": "LayerKVConnector",
  "kv_connector_module_path": "layerkv.integrations.vllm", "kv_role": "kv_both",
  "kv_connector_extra_config": {...layerkv config...}}'
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import layerkv.integrations.vllm.sides as sides
import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.config import LayerKVConfig
from layerkv.connector.hybrid import GroupedPlan, GroupedScheduler, GroupedWorker
from layerkv.connector.prefill_wait import pool_promise_key
from layerkv.errors import ConfigError
from layerkv.integrations.vllm.events import VllmPoolEvents
from layerkv.integrations.vllm.metrics import CounterDeltas, LayerKVPromMetrics, LayerKVStats, counters_of, hit_source
from layerkv.integrations.vllm.plugin import register as _register_connector_name
from layerkv.integrations.vllm.pools import promise_named
from layerkv.integrations.vllm.setup import (
    check_cudagraphs,
    check_pool_shared,
    check_supported,
    deployment_from,
    group_deployments,
    kv_signature_of,
    replayed_steps,
    required_kv_cache_layout,
)
from layerkv.integrations.vllm.steps import (
    LayerKVMetadata,
    LayerKVWorkerMeta,
    StepTranslator,
    request_view,
    skips_external_kv,
)
from layerkv.messages import RequestView, WorkerReport
from layerkv.store.factory import pool_identity

__all__ = [
    "LayerKVConnector",
    "LayerKVMetadata",
    "LayerKVWorkerMeta",
    "LayerKVStats",
    "CounterDeltas",
    "counters_of",
    "check_supported",
    "deployment_from",
    "kv_signature_of",
    "request_view",
    "StepTranslator",
    "LayerKVPromMetrics",
]

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from layerkv.store.checked import CheckedStore


# vLLM's MultiConnector finds its children's stats classes by name; the entry point plugin
# registers the name in every vLLM process, this covers an install without entry points.
_register_connector_name()

# --------------------------------------------------------------------------- the connector


class LayerKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector API over layerkv's neutral scheduler / worker connector, one per KV
    cache group (connector/hybrid.py): with `SupportsHMA` vLLM keeps its hybrid KV cache manager on, so
    a model with sliding-window and full-attention layers has one group (one block table, one
    namespace of objects) per kind; every other model has one group."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        config = LayerKVConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config)
        check_pool_shared(config, vllm_config)
        self.deployment = deployment_from(vllm_config, kv_cache_config, role)
        check_cudagraphs(config, self.deployment.role)
        self._promise_key = pool_promise_key(pool_identity(config))  # one key per pool (integrations/vllm/pools.py)
        deployments = group_deployments(self.deployment, kv_cache_config)
        self._num_blocks = kv_cache_config.num_blocks
        # a running request concerns the connector only in a step where it completes a block (an
        # engine block: block_size x decode_context_parallel_size tokens, what a block hash covers)
        self._steps = StepTranslator(len(deployments), math.gcd(*(d.scheduler_block_size for d in deployments)))
        # several groups: vLLM recovers a failed load only for a request waiting for it (connector/async_loads.py)
        load_async = len(deployments) > 1
        self._scheduler: GroupedScheduler | None = None
        self._worker: GroupedWorker | None = None
        self._load_started = False  # worker: start_load_kv already delegated for this step
        self._moves = False  # worker: this step's plan loads or saves (else the per-layer hooks return at once)
        self._deltas = CounterDeltas("scheduler_" if role is KVConnectorRole.SCHEDULER else "")
        events_on = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
        # what the pool holds, for KV-aware routers (integrations/vllm/events.py), when vLLM publishes events
        self._events = (
            VllmPoolEvents(self.deployment.scheduler_block_size)
            if events_on and role is KVConnectorRole.SCHEDULER
            else None
        )
        self._store: CheckedStore | None = sides.OPEN_STORE(config)
        try:
            if role is KVConnectorRole.SCHEDULER:
                # vLLM's null block (id 0) stands for a sliding-window block outside the window
                self._scheduler = GroupedScheduler(
                    [sides.SCHEDULER_SIDE(config, d, self._store) for d in deployments],
                    skip_block_ids=frozenset({0}) if any(d.window_blocks for d in deployments) else frozenset(),
                    windows=[d.window_blocks for d in deployments],
                    load_async=load_async,
                    replayed=replayed_steps(vllm_config),
                )
            else:
                self._worker = GroupedWorker(
                    [sides.WORKER_SIDE(config, d, self._store) for d in deployments],
                    [g.layer_names for g in kv_cache_config.kv_cache_groups],
                    load_async=load_async,
                )
        except BaseException:
            self._store.close()
            raise

    @property
    def scheduler_side(self) -> GroupedScheduler:
        assert self._scheduler is not None, "scheduler hook called on a worker-role connector"
        return self._scheduler

    @property
    def worker_side(self) -> GroupedWorker:
        assert self._worker is not None, "worker hook called on a scheduler-role connector"
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return required_kv_cache_layout(vllm_config)  # any block-compact layout works; see there

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Never: vLLM keeps its full CUDA graphs for decode steps. A step it may replay whole (a
        # uniform decode batch) never needs a per-layer hook: a hit that leaves a decode step's
        # worth to compute loads before the request is scheduled, a short chunk over a load loads
        # before the forward, and a step whose hooks never ran saves after it (connector/graphs.py).
        LayerKVConfig.from_dict(extra_config)  # a bad config fails here, as vLLM builds its own
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34 (its extensible KV cache): how the workers reach the KV cache. REGISTERS
        exactly when the live cache is registered with the store (`register_kv_cache: true`:
        each segment must then be one physical allocation); otherwise IN_PROCESS: only layerkv's
        own staging is registered and the cache is read and written by in-process copies."""
        access = importlib.import_module("vllm.config.kv_transfer").KVCacheAccess  # 0.34 and later
        try:  # asked while vLLM builds its config, before the connector validates its own
            registers = LayerKVConfig.from_dict(kv_transfer_config.kv_connector_extra_config).register_kv_cache
        except ConfigError:
            registers = False  # never registered: the connector refuses this config at startup, naming the key
        return access.REGISTERS if registers else access.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34's lookahead block hashes (speculative decoding): never. Objects are named by
        the block hashes vLLM has always had; hashes that look ahead would name other objects, so
        engines with and without a drafter would stop sharing the pool."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # layer templates hold the registered cache addresses

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a pool: a dropped save is a later miss, never a lost hand-off

    # ---- scheduler side -------------------------------------------------------------

    def _view(self, request: Request) -> RequestView:
        """The neutral view of `request`, the promise meant for this connector's pool included."""
        return request_view(request, self._promise_key)

    def on_new_request(self, request: Request) -> None:
        self._steps.track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._steps.track(request)
        if skips_external_kv(request):  # vLLM drops any external hit for it (prompt logprobs, ...): no lookup
            return 0, False
        # layerwise loads run inside the forward (synchronous); a hybrid model's before it (connector/async_loads.py).
        # None: a prefill server's prefix is not all in the pool yet; vLLM asks again next step.
        return self.scheduler_side.get_num_new_matched_tokens(self._view(request), num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (--max-num-inflight-kv-loads) asks as a request enters its waiting queues:
        would get_num_new_matched_tokens answer an asynchronous load? Only a model with several
        KV cache groups loads asynchronously (connector/async_loads.py); there one exists query of
        the request's first block answers (GroupedScheduler.may_load_async). A wrong answer only
        queues the request differently in vLLM."""
        if self._scheduler is None or skips_external_kv(request):
            return False
        self._steps.track(request)
        return self.scheduler_side.may_load_async(self._view(request))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._steps.track(request)
        self.scheduler_side.update_state_after_alloc(
            self._view(request), tuple(map(tuple, blocks.get_block_ids())), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        steps = self._steps.translate(scheduler_output, everyone=self.scheduler_side.needs_every_request())
        payload = self.scheduler_side.build_connector_meta(steps)
        if self._events is not None:
            self._events.note(payload.plans if isinstance(payload, GroupedPlan) else (payload,), self._steps.request)
        return LayerKVMetadata(payload)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Blocks the pool now holds, lost, or all cleared (a reset), since the last call: vLLM
        publishes them with its own (--kv-events-config). Drained even when it does not."""
        pool_events = self.scheduler_side.take_events() if self._scheduler is not None else []
        return self._events.events(pool_events) if self._events is not None else ()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.scheduler_side.update_connector_output(
            WorkerReport(
                finished_sending=frozenset(connector_output.finished_sending or ()),
                finished_recving=frozenset(connector_output.finished_recving or ()),
                failed_recving=frozenset(getattr(connector_output, "failed_recving", None) or ()),
                invalid_block_ids=frozenset(connector_output.invalid_block_ids or ()),
                reported_steps=meta.steps if isinstance(meta, LayerKVWorkerMeta) else (),
            )
        )

    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this is True (Scheduler.has_requests): the last step's
        saves are committed only by a verdict a later step carries to the workers."""
        return self._scheduler is not None and self.scheduler_side.has_pending_work()

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), after new weights: nothing written
        before is served again (SchedulerConnector.reset_cache)."""
        return self.scheduler_side.reset_cache()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self.scheduler_side.request_finished(self._view(request), tuple(map(tuple, block_ids)))
        self._steps.forget(request.request_id)
        return delay, promise_named(request, params, self._promise_key)

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches, self._num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._load_started = False
        assert isinstance(connector_metadata, LayerKVMetadata), type(connector_metadata).__name__
        payload = connector_metadata.payload
        self._moves = any(
            getattr(plan, "loads", True) or getattr(plan, "saves", True)
            for plan in (payload.plans if isinstance(payload, GroupedPlan) else (payload,))
        )
        self.worker_side.bind_connector_metadata(payload)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker_side.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._start_load_once()

    def _start_load_once(self) -> None:
        # vLLM calls start_load_kv before the forward only when the step has sync loads, and
        # after it otherwise; the neutral contract wants it before the first layer, once.
        if not self._load_started:
            self._load_started = True
            self.worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._moves:  # nothing to load or save this step: start_load_kv can wait for the forward's end
            return
        self._start_load_once()
        self.worker_side.wait_for_layer_load(str(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._moves:
            self.worker_side.save_kv_layer(str(layer_name))

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker_side.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.worker_side.get_block_ids_with_load_errors())

    def build_connector_worker_meta(self) -> LayerKVWorkerMeta | None:
        """The step this worker ran (vLLM calls it after get_block_ids_with_load_errors)."""
        steps = self.worker_side.report_steps()
        return LayerKVWorkerMeta(tuple(steps)) if steps else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter changes, per-step samples and (while non-zero or changed) gauges since the
        previous call (vLLM calls this once per step on each worker and on the scheduler;
        integrations/vllm/metrics.py); None when there is nothing."""
        side = self._worker if self._worker is not None else self._scheduler
        data: dict[str, Any] = dict(
            self._deltas.take(side.stats() if side is not None else None)
        )  # None: test doubles have no stats
        data.update(self._deltas.take_observed(side))
        return LayerKVStats(data=data) if data else None

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's `prompt_tokens_cached_by_source`: every pool token from the backend's tier
        (metrics.hit_source: embedded HOST, mooncake P2P); {} for none. Scheduler thread."""
        return {self._pool_hit_source: num_external_tokens} if num_external_tokens > 0 else {}

    @functools.cached_property
    def _pool_hit_source(self) -> CacheHitSource:
        return hit_source(LayerKVConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config).backend)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LayerKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return LayerKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop the worker's transfers, then close this connector's store client. Idempotent."""
        store, self._store = self._store, None
        try:
            if self._worker is not None and store is not None:
                self._worker.shutdown()
            if self._scheduler is not None and store is not None:
                self._scheduler.shutdown()  # optional on each group's scheduler side
        finally:
            if store is not None:
                store.close()
