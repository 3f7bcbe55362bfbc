"""Harness for tests/vllm: vLLM's real Scheduler and worker hook path on CPU with the layerkv
facade loaded through `kv_connector_module_path`, and recording doubles of the neutral
scheduler / worker connectors. vLLM is installed by `make test` (requirements/vllm.txt)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# vLLM reads these when it picks its platform and when transformers looks for a model.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "1"
# Scheduler and workers share this process (the "uni" executor); on CPU vLLM keeps "uni" only
# without engine-core multiprocessing (it turns it into "mp" otherwise).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

TINY_LLAMA = Path(__file__).parent / "tiny_llama"  # config.json only: 2 layers, 2 KV heads
BLOCK_SIZE = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def require_vllm() -> None:
    """Skip the calling module when vLLM is missing on a developer machine; in CI fail loudly."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            raise RuntimeError("vLLM is not installed: `make test` installs requirements/vllm.txt") from None
        pytest.skip("vLLM not installed (run `make test` to get it)", allow_module_level=True)


# ---------------------------------------------------------------- recording doubles of the core


class RecordingScheduler:
    """Double of layerkv.connector.SchedulerConnector: the "pool" holds `pool_hashes`."""

    pool_hashes: set[bytes] = set()  # set per test through the `doubles` fixture
    ask_again: set[str] = set()  # request ids whose lookup answers None ("ask again next step")

    def __init__(self, config: Any, deployment: Any, store: Any = None) -> None:
        self.config, self.deployment = config, deployment
        self.calls: list[tuple[str, tuple]] = []
        self.steps: list[Any] = []
        self.reports: list[Any] = []
        Doubles.schedulers.append(self)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("get_num_new_matched_tokens", (request, num_computed_tokens)))
        if request.req_id in self.ask_again:
            return None, False
        hit_blocks = 0
        for h in request.block_hashes:
            if h not in self.pool_hashes:
                break
            hit_blocks += 1
        # keep at least one prompt token for the engine to compute
        num_tokens = min(
            hit_blocks * self.deployment.block_size,
            (request.num_prompt_tokens - 1) // self.deployment.block_size * self.deployment.block_size,
        )
        return max(0, num_tokens - num_computed_tokens), False

    def match_window(self, request, num_computed_tokens, max_tokens=None):
        """A sliding-window group: the same pool, the hit bounded by `max_tokens`."""
        tokens, _ = self.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens if max_tokens is None else min(tokens, max_tokens)

    def may_hit(self, request):
        self.calls.append(("may_hit", (request,)))
        return bool(request.block_hashes) and request.block_hashes[0] in self.pool_hashes

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("update_state_after_alloc", (request, block_ids, num_external_tokens)))

    def build_connector_meta(self, step):
        self.steps.append(step)
        return {"step_index": len(self.steps) - 1, "step": step}

    def update_connector_output(self, report):
        self.reports.append(report)

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", (request, block_ids)))
        return False, None

    def has_pending_work(self) -> bool:
        return False


class RecordingWorker:
    """Double of layerkv.connector.WorkerConnector: records the hook sequence."""

    def __init__(self, config: Any, deployment: Any, store: Any = None) -> None:
        self.config, self.deployment = config, deployment
        self.calls: list[tuple] = []
        self.kv_caches: dict[str, Any] = {}
        self.load_errors: set[int] = set()  # reported once, then cleared
        self.counters: dict[str, int] = {}
        Doubles.workers.append(self)

    def register_kv_caches(self, kv_caches, num_blocks):
        self.kv_caches = dict(kv_caches)
        self.calls.append(("register_kv_caches", num_blocks))

    def bind_connector_metadata(self, meta):
        self.calls.append(("bind_connector_metadata", meta["step_index"]))

    def start_load_kv(self):
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name):
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids):
        self.calls.append(("get_finished", frozenset(finished_req_ids)))
        return None, None

    def get_block_ids_with_load_errors(self):
        self.calls.append(("get_block_ids_with_load_errors",))
        errors, self.load_errors = self.load_errors, set()
        return errors

    def report_steps(self):
        self.calls.append(("report_steps",))
        return ()

    def clear_connector_metadata(self):
        self.calls.append(("clear_connector_metadata",))

    def stats(self):
        counters, self.counters = self.counters, {}
        return counters

    def shutdown(self):
        self.calls.append(("shutdown",))


class Doubles:
    schedulers: list[RecordingScheduler] = []
    workers: list[RecordingWorker] = []


@pytest.fixture
def doubles(monkeypatch):
    """Make the facade build recording doubles instead of layerkv.connector's classes."""
    import layerkv.integrations.vllm.sides as sides

    monkeypatch.setattr(Doubles, "schedulers", [])
    monkeypatch.setattr(Doubles, "workers", [])
    monkeypatch.setattr(RecordingScheduler, "pool_hashes", set())
    monkeypatch.setattr(RecordingScheduler, "ask_again", set())
    monkeypatch.setattr(sides, "SCHEDULER_SIDE", RecordingScheduler)
    monkeypatch.setattr(sides, "WORKER_SIDE", RecordingWorker)
    return Doubles


# ---------------------------------------------------------------- vLLM objects


@dataclass
class Engine:
    vllm_config: Any
    kv_cache_config: Any
    scheduler: Any


def layerkv_child(extra: dict | None = None, kv_role: str = "kv_both") -> dict:
    """The layerkv connector's entry in a KVTransferConfig (or a MultiConnector's `connectors`)."""
    return dict(
        kv_connector="LayerKVConnector",
        kv_connector_module_path="layerkv.integrations.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=extra or {},
    )


def make_vllm_config(
    *,
    max_num_batched_tokens: int = 64,
    kv_role: str = "kv_both",
    extra: dict | None = None,
    failure_policy: str = "recompute",
    max_model_len: int = 1024,
    executor: str = "uni",
    multi_connector: bool | list[dict] = False,
    model_kwargs: dict | None = None,
    kv_events: bool = False,
    scheduler_kwargs: dict | None = None,
):
    """A VllmConfig for the tiny model with the layerkv connector (`multi_connector`: True, as the
    only child of vLLM's MultiConnector; a list: these children, `layerkv_child` entries and
    vLLM's own). `executor` "uni": the scheduler and the worker share this
    process, as in these tests (the embedded store needs it). `model_kwargs`: more ModelConfig
    arguments (revision, hf_overrides, quantization, ...). `kv_events`: KV cache events on, vLLM's
    null publisher (a test swaps in its own recorder). `scheduler_kwargs`: more SchedulerConfig
    arguments (max_num_seqs, max_num_inflight_kv_loads, ...)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.kv_events import KVEventsConfig

    model_config = ModelConfig(
        model=str(TINY_LLAMA),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        **(model_kwargs or {}),
    )
    layerkv = layerkv_child(extra, kv_role)
    if multi_connector:
        children = [layerkv] if multi_connector is True else list(multi_connector)
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=kv_role,
            kv_load_failure_policy=failure_policy,
            kv_connector_extra_config={"connectors": children},
        )
    else:
        transfer = KVTransferConfig(**layerkv, kv_load_failure_policy=failure_policy)
    from layerkv.bench.decode_engine import cpu_platform_without_triton

    with cpu_platform_without_triton():
        return VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                **{
                    "max_num_seqs": 8,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    "max_model_len": max_model_len,
                    "enable_chunked_prefill": True,
                    "is_encoder_decoder": False,
                    "disable_hybrid_kv_cache_manager": True,
                    **(scheduler_kwargs or {}),
                }
            ),
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
            ),
            kv_transfer_config=transfer,
            parallel_config=ParallelConfig(distributed_executor_backend=executor),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
        )


FULL_SPEC_ARGS = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16)


def make_kv_cache_config(num_blocks: int, specs: list | None = None, vllm_config: Any = None, layout: str = "LBHNC"):
    """One full-attention group over LAYERS planned by vLLM's own `get_kv_cache_configs` for the
    physical `layout` (default LBHNC, what the CPU attention backend asks for: one backing buffer,
    layer-outermost), recorded as the engine core records it; with `specs`, one hand-made group
    per spec (for the setups the facade rejects)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if specs is None:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        vllm_config = vllm_config or make_vllm_config(max_model_len=min(1024, (num_blocks - 1) * BLOCK_SIZE))
        vllm_config.cache_config.kv_cache_layout = layout  # resolve_kv_cache_layout's result
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        layer_specs = {name: FullAttentionSpec(**FULL_SPEC_ARGS, dtype=torch.float16) for name in LAYERS}
        groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
        (config,) = get_kv_cache_configs(vllm_config, [layer_specs], [1 << 30], groups)
        config.kv_cache_layout = layout  # what the engine core hands the scheduler and the workers
        return config
    groups = [KVCacheGroupSpec(list(LAYERS) if len(specs) == 1 else [LAYERS[i]], s) for i, s in enumerate(specs)]
    page = specs[0].page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks * len(LAYERS), layers=list(LAYERS), layer_stride=page * num_blocks, block_stride=page
        )
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def make_engine(
    num_blocks: int = 64, layout: str = "LBHNC", specs: list | None = None, full_graphs: bool = False, **config_kwargs
) -> Engine:
    """vLLM's real Scheduler (its scheduler-role connector built by vLLM's factory) for a KV
    cache in the physical `layout` (`specs`: hand-made groups, make_kv_cache_config).
    `full_graphs`: the config a CUDA server runs by default (FULL_AND_PIECEWISE CUDA graphs, not
    eager), which vLLM's CPU platform never sets; the worker rig then replays the steps vLLM
    would replay whole without their per-layer hooks (WorkerRig.replayed)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config_kwargs.setdefault("max_model_len", min(1024, (num_blocks - 1) * BLOCK_SIZE))
    vllm_config = make_vllm_config(**config_kwargs)
    kv_cache_config = make_kv_cache_config(num_blocks, specs, vllm_config=vllm_config, layout=layout)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if full_graphs:
        from vllm.config import CUDAGraphMode

        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        vllm_config.model_config.enforce_eager = False
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )
    return Engine(vllm_config, kv_cache_config, scheduler)


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 2,
    kv_transfer_params: dict | None = None,
    prompt_logprobs: int | None = None,
):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        prompt_logprobs=prompt_logprobs,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def runner_output(scheduler, scheduler_output, kv_connector_output=None, token_id: int = 7):
    """What a model runner returns: one sampled token per request whose prompt is complete
    after this step (a partial prefill chunk samples nothing)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)  # None: aborted while the step ran
        sampled.append([token_id] if request is not None and request.num_computed_tokens >= request.num_tokens else [])
    version_fields = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # vLLM 0.33; gone in 0.34
        version_fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_connector_output or KVConnectorOutput(),
        **version_fields,
    )


@dataclass
class WorkerRig:
    """A worker-role facade created by vLLM's factory, installed as the process's KV transfer
    agent and driven by vLLM's own `ActiveKVConnector` (vllm/v1/worker/gpu/kv_connector.py: how
    the model runner drives a connector in 0.33 and 0.34, byte-identical in both), with LAYERS
    bound to CPU caches vLLM's `allocate_kv_cache` made for the engine's layout (logical
    [B, H, N, 2*head] views per layer)."""

    connector: Any
    runner: Any  # ActiveKVConnector
    kv_caches: dict = field(default_factory=dict)
    full_graphs: bool = False  # the engine's config replays uniform decode batches as full CUDA graphs
    replays: int = 0  # steps run as a full graph replay: no per-layer hook

    def replayed(self, scheduler_output) -> bool:
        """Would vLLM 0.34 replay this step as one full CUDA graph? Its rule (gpu/model_runner.py
        gather_batch_req_state, then utils.get_uniform_decode_token_count): every request computes
        the uniform decode query length (1 here: no drafter), each one decoding or computing one
        prompt token over an existing context. (Batches above the largest captured size run
        piecewise in vLLM; treating them as replayed only makes the tests stricter.)"""
        from vllm.v1.worker.utils import get_uniform_decode_token_count

        counts = scheduler_output.num_scheduled_tokens
        if not self.full_graphs or not counts:
            return False
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed.update((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs)
        eligible = all(computed[req_id] > 0 for req_id in counts)
        return (
            get_uniform_decode_token_count(
                len(counts), scheduler_output.total_num_scheduled_tokens, max(counts.values()), eligible
            )
            == 1
        )

    def run_step(self, scheduler_output, run_layer=None, defer_finalize: bool = False):
        """One model-runner step as vLLM's GPU model runner takes it: a step with no scheduled
        token goes through `no_forward`; otherwise `pre_forward` inside the forward context,
        one attention call per layer through the real per-layer `@maybe_transfer_kv_layer`
        wrapper (`run_layer(name)` is the attention body: it runs after the layer's load wait,
        before its save), `finish_forward`, `post_forward`, and with `defer_finalize` (what the
        runner does with a speculator) `finalize_step` after the output was taken."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        @maybe_transfer_kv_layer
        def attention(query, layer_name):  # same wrapper as unified_attention_with_output
            if run_layer is not None:
                run_layer(layer_name)
            return query

        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # this node's worker (tests run several)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.runner.no_forward(scheduler_output).kv_connector_output
        vllm_config = self.connector._vllm_config
        replay = self.replayed(scheduler_output)
        self.replays += replay
        with set_forward_context({n: object() for n in LAYERS}, vllm_config, slot_mapping={}):
            self.runner.pre_forward(scheduler_output)
            for name in LAYERS:
                if not replay:
                    attention(None, name)
                elif run_layer is not None:  # the captured graph: the layers' compute, no hook
                    run_layer(name)
        self.runner.finish_forward()
        output = self.runner.post_forward(set(scheduler_output.finished_req_ids), defer_finalize=defer_finalize)
        if defer_finalize:
            self.runner.finalize_step()
        return output


def make_worker(engine: Engine) -> WorkerRig:
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.utils import allocate_kv_cache

    connector = KVConnectorFactory.create_connector(engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = connector  # what ensure_kv_transfer_initialized sets
    layout = KVCacheLayout[engine.kv_cache_config.kv_cache_layout]
    kv_caches = allocate_kv_cache(engine.kv_cache_config, torch.device("cpu"), layout)  # vLLM's own views
    runner = ActiveKVConnector(engine.vllm_config, kv_caches)  # registers the caches, as the model runner does
    mode = engine.vllm_config.compilation_config.cudagraph_mode
    forward_context = engine.vllm_config.compilation_config.static_forward_context
    for name in LAYERS:  # stand-in Attention layers: what get_attention_context reads
        forward_context[name] = types.SimpleNamespace(kv_cache=kv_caches[name])
    full_graphs = mode is not None and mode.has_full_cudagraphs() and not engine.vllm_config.model_config.enforce_eager
    return WorkerRig(connector, runner, kv_caches, full_graphs=full_graphs)


@pytest.fixture
def clean_agent():
    """Uninstall the worker connector from vLLM's process-global slot after the test."""
    yield
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = None
