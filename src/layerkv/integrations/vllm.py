"""vLLM v1 facade: `LayerKVConnector(KVConnectorBase_V1)`, the only module that imports vllm.
Translates vLLM's types into `layerkv.messages` and delegates every hook to the engine-neutral
scheduler or worker connector (`layerkv.connector`). The scheduler role runs on vLLM's engine
core thread; the worker role on each worker's model-runner thread (one instance per rank).

Load with: --kv-transfer-config '{"kv_connector": "LayerKVConnector",
  "kv_connector_module_path": "layerkv.integrations.vllm", "kv_role": "kv_both",
  "kv_connector_extra_config": {...layerkv config...}}'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from layerkv.config import LayerKVConfig
from layerkv.errors import UnsupportedSetupError
from layerkv.hooks import SchedulerHooks, WorkerHooks
from layerkv.messages import Deployment, KVRole, ReqId, RequestView, ScheduledRequest, SchedulerStep, WorkerReport

if TYPE_CHECKING:
    from layerkv.store.base import KVStore
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def open_connector_store(config: LayerKVConfig) -> KVStore:
    """The store client one connector instance uses (and closes on `shutdown`): a CheckedStore
    over `config.backend`. The embedded backend is process-wide, so a scheduler and a worker in
    one process see the same objects; Mooncake opens one client per connector."""
    from layerkv.store.factory import open_checked_store

    return open_checked_store(config)


def _default_scheduler_side(config: LayerKVConfig, deployment: Deployment, store: KVStore) -> SchedulerHooks:
    from layerkv.connector import SchedulerConnector

    return SchedulerConnector(config, deployment, store)


def _default_worker_side(config: LayerKVConfig, deployment: Deployment, store: KVStore) -> WorkerHooks:
    from layerkv.connector import WorkerConnector

    return WorkerConnector(config, deployment, store)


# How the facade opens its store and builds the engine-neutral sides. Tests wrap OPEN_STORE to
# inject faults (CheckedStore(FaultyStore(...))) and replace the sides with recording doubles.
OPEN_STORE: Callable[[LayerKVConfig], KVStore] = open_connector_store
SCHEDULER_SIDE: Callable[[LayerKVConfig, Deployment, KVStore], SchedulerHooks] = _default_scheduler_side
WORKER_SIDE: Callable[[LayerKVConfig, Deployment, KVStore], WorkerHooks] = _default_worker_side

# Exact spec types whose blocks are plain per-layer pages addressed by the prefix hash chain.
_SUPPORTED_SPECS = (FullAttentionSpec, MLAAttentionSpec)


# --------------------------------------------------------------------------- setup checks


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise `UnsupportedSetupError` naming every setup the neutral connector cannot express."""
    problems: list[str] = []
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        problems.append(
            f"hybrid KV cache groups: {len(groups)} kv_cache_groups ({kinds}); layerkv needs exactly one "
            "full-attention group (a model with one attention type, --disable-hybrid-kv-cache-manager)"
        )
    for group in groups:
        specs = _layer_specs(group)
        unsupported = sorted({type(s).__name__ for s in specs if type(s) not in _SUPPORTED_SPECS})
        if unsupported:
            problems.append(f"KV cache spec {', '.join(unsupported)}: only full attention (MHA/GQA/MQA) and MLA are supported")
        elif len({_spec_text(s) for s in specs}) > 1:
            problems.append(
                f"per-layer KV specs differ within one group ({len({_spec_text(s) for s in specs})} shapes): "
                "vLLM's scheduler sees only one of them, so layerkv cannot name the objects"
            )
    parallel = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size > 1:
            problems.append(f"context parallel: {name}={size}; layerkv supports only 1")
    if vllm_config.model_config.is_encoder_decoder:
        problems.append("encoder-decoder models (cross-attention KV is not prefix-addressed)")
    if len(groups) == 1:
        block_size = groups[0].kv_cache_spec.block_size
        hash_block_size = kv_cache_config.hash_block_size
        if hash_block_size not in (None, block_size):
            problems.append(
                f"hash_block_size={hash_block_size} differs from the KV block size {block_size}; "
                "layerkv keys one object per KV block"
            )
    if problems:
        raise UnsupportedSetupError("layerkv cannot run this vLLM setup: " + "; ".join(problems))


def _layer_specs(group: Any) -> list[Any]:
    """Per-layer specs of one KV cache group (a UniformTypeKVCacheSpecs holds one per layer)."""
    specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    return list(specs.values()) if specs else [group.kv_cache_spec]


def _spec_text(spec: Any) -> str:
    kind = "mla" if isinstance(spec, MLAAttentionSpec) else "attn"
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    return (
        f"vllm-{kind}[block_size={spec.block_size},num_kv_heads={spec.num_kv_heads},head_size={spec.head_size},"
        f"head_size_v={head_size_v}]{str(spec.dtype).removeprefix('torch.')}:page={spec.page_size_bytes}"
    )


def kv_signature_of(kv_cache_config: KVCacheConfig) -> str:
    """`Deployment.kv_signature`: the per-layer cache spec of the single group, computed the same
    on the scheduler and on every worker. vLLM hands the scheduler rank 0's config with a
    UniformTypeKVCacheSpecs reduced to one of its specs and (under PP) other layer names, so
    this names the spec, not the layers (`check_supported` rejects groups whose specs differ)."""
    (text,) = sorted({_spec_text(s) for s in _layer_specs(kv_cache_config.kv_cache_groups[0])})
    return text


def _parallel_ranks(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; the scheduler has no rank and reports (0, 0)."""
    parallel = vllm_config.parallel_config
    if role is KVConnectorRole.SCHEDULER:
        return 0, 0
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise UnsupportedSetupError(
            "the layerkv worker connector was built before vLLM's model-parallel groups "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}): its rank is unknown"
        )
    return 0, 0


def deployment_from(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, role: KVConnectorRole) -> Deployment:
    """The neutral `Deployment` of this vLLM instance (call after `check_supported`)."""
    model = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cache_dtype = vllm_config.cache_config.cache_dtype
    # "auto" means the model dtype; an explicit fp8 name says more than torch.uint8 would.
    kv_dtype = str(spec.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)  # type: ignore[attr-defined]
    tp_rank, pp_rank = _parallel_ranks(vllm_config, role)
    assert vllm_config.kv_transfer_config is not None  # a connector exists only with a transfer config
    kv_role = vllm_config.kv_transfer_config.kv_role
    return Deployment(
        model_id=str(model.model),
        kv_dtype=kv_dtype,
        block_size=int(spec.block_size),
        num_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        pp_rank=pp_rank,
        model_revision=str(model.revision or ""),
        is_mla=bool(model.use_mla),
        role=KVRole(kv_role),
        kv_signature=kv_signature_of(kv_cache_config),
    )


# --------------------------------------------------------------------------- scheduler translation


def request_view(request: Request) -> RequestView:
    """`request.block_hashes` already chain the cache salt, LoRA id and multimodal hashes."""
    return RequestView(
        req_id=request.request_id,
        num_prompt_tokens=request.num_prompt_tokens,
        num_tokens=request.num_tokens,
        block_hashes=tuple(request.block_hashes),
    )


class StepTranslator:
    """SchedulerOutput -> SchedulerStep. vLLM sends only new block ids for running requests, so
    this keeps each live request's full block-id list and a reference to its `Request` (whose
    block hashes grow as tokens arrive). Scheduler thread only."""

    def __init__(self) -> None:
        self._requests: dict[ReqId, Request] = {}
        self._block_ids: dict[ReqId, list[int]] = {}

    def track(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def forget(self, req_id: ReqId) -> None:
        self._requests.pop(req_id, None)
        self._block_ids.pop(req_id, None)

    def translate(self, out: SchedulerOutput) -> SchedulerStep:
        scheduled: list[ScheduledRequest] = []
        for new in out.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids[0])
            scheduled.append(self._scheduled(new.req_id, new.num_computed_tokens, out, resumed=False))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:  # preempted earlier: its old blocks were freed, these replace them
                self._block_ids[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self._block_ids.setdefault(req_id, []).extend(new_ids[0])
            scheduled.append(self._scheduled(req_id, cached.num_computed_tokens[i], out, resumed=resumed))
        preempted = frozenset(out.preempted_req_ids or ())
        for req_id in preempted:
            self._block_ids.pop(req_id, None)
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        return SchedulerStep(tuple(scheduled), frozenset(out.finished_req_ids), preempted)

    def _scheduled(self, req_id: ReqId, num_computed_tokens: int, out: SchedulerOutput, resumed: bool) -> ScheduledRequest:
        request = self._requests.get(req_id)
        assert request is not None, f"request {req_id} scheduled but never seen by the connector"
        return ScheduledRequest(
            req_id=req_id,
            block_ids=tuple(self._block_ids[req_id]),
            num_computed_tokens=num_computed_tokens,
            num_scheduled_tokens=out.num_scheduled_tokens[req_id],
            block_hashes=tuple(request.block_hashes),
            resumed=resumed,
        )


class LayerKVMetadata(KVConnectorMetadata):
    """Carries the neutral scheduler side's per-step metadata to the workers (pickled)."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload


# --------------------------------------------------------------------------- stats


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
    """The core keeps cumulative counters (`WorkerConnector.stats()`, `SchedulerConnector.stats`);
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


# --------------------------------------------------------------------------- the connector


class LayerKVConnector(KVConnectorBase_V1):
    """vLLM's connector API over layerkv's neutral scheduler / worker connector."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        config = LayerKVConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config)
        self.deployment = deployment_from(vllm_config, kv_cache_config, role)
        self._num_blocks = kv_cache_config.num_blocks
        self._steps = StepTranslator()
        self._scheduler: SchedulerHooks | None = None
        self._worker: WorkerHooks | None = None
        self._load_started = False  # worker: start_load_kv already delegated for this step
        self._deltas = CounterDeltas("scheduler_" if role is KVConnectorRole.SCHEDULER else "")
        self._store: KVStore | None = OPEN_STORE(config)
        try:
            if role is KVConnectorRole.SCHEDULER:
                self._scheduler = SCHEDULER_SIDE(config, self.deployment, self._store)
            else:
                self._worker = WORKER_SIDE(config, self.deployment, self._store)
        except BaseException:
            self._store.close()
            raise

    @property
    def scheduler_side(self) -> SchedulerHooks:
        assert self._scheduler is not None, "scheduler hook called on a worker-role connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerHooks:
        assert self._worker is not None, "worker hook called on a scheduler-role connector"
        return self._worker

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load / save_kv_layer run between attention layers

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # layer templates hold the registered cache addresses

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a pool: a dropped save is a later miss, never a lost hand-off

    # ---- scheduler side -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._steps.track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._steps.track(request)
        num_tokens, _ = self.scheduler_side.get_num_new_matched_tokens(request_view(request), num_computed_tokens)
        return num_tokens, False  # layerwise loads happen inside the forward: always synchronous

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._steps.track(request)
        (block_ids,) = blocks.get_block_ids()
        self.scheduler_side.update_state_after_alloc(request_view(request), tuple(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        step = self._steps.translate(scheduler_output)
        return LayerKVMetadata(self.scheduler_side.build_connector_meta(step))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(
            WorkerReport(
                finished_sending=frozenset(connector_output.finished_sending or ()),
                finished_recving=frozenset(connector_output.finished_recving or ()),
                invalid_block_ids=frozenset(connector_output.invalid_block_ids or ()),
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result = self.scheduler_side.request_finished(request_view(request), tuple(block_ids))
        self._steps.forget(request.request_id)
        return result

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches, self._num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._load_started = False
        assert isinstance(connector_metadata, LayerKVMetadata), type(connector_metadata).__name__
        self.worker_side.bind_connector_metadata(connector_metadata.payload)

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
        self._start_load_once()
        self.worker_side.wait_for_layer_load(str(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker_side.save_kv_layer(str(layer_name))

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.worker_side.get_block_ids_with_load_errors())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter changes since the previous call (vLLM calls this once per step on each worker
        and, when logging stats, on the scheduler); None when nothing changed."""
        side = self._worker if self._worker is not None else self._scheduler
        stats = getattr(side, "stats", None)  # worker: a method; scheduler: an attribute; doubles: none
        data = self._deltas.take(stats() if callable(stats) else stats)
        return LayerKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LayerKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return LayerKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop the worker's transfers, then close this connector's store client. Idempotent."""
        store, self._store = self._store, None
        try:
            if self._worker is not None and store is not None:
                self._worker.shutdown()
            shutdown = getattr(self._scheduler, "shutdown", None)  # optional on the scheduler side
            if shutdown is not None and store is not None:
                shutdown()
        finally:
            if store is not None:
                store.close()
