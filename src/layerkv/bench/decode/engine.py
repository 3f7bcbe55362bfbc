"""Suite `decode`'s engine: vLLM's REAL Scheduler (its scheduler-role connector built by vLLM's
factory) and vLLM's REAL worker hook path (a worker-role connector installed as the process's KV
transfer agent, driven by vLLM's `ActiveKVConnector` and the per-layer `maybe_transfer_kv_layer`
wrapper, worker.py) on CPU caches, with no model: a step samples one token per request whose prompt is
complete. Driver thread only (it plays vLLM's engine-core thread and the model-runner thread);
the connectors' own threads run beside it. Imports vllm only inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerkv.bench.decode.worker import Worker, make_worker, worker_process_state

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 16  # small heads: 32 layers x 2,300 blocks of [2, 16, 2, 16] float16 stay under 200 MB
SAMPLED_TOKEN = 7  # what every request samples (ignore_eos: it never stops on it)


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """`values` set in os.environ while the block runs, the previous values restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# vLLM reads these when it picks its platform (CPU) and when transformers looks for a model
# (offline); the scheduler and the worker share this process. Set before vllm is imported.
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def write_model(model_dir: Path, num_layers: int) -> Path:
    """A config-only Llama (no weights: nothing computes) with `num_layers` attention layers."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float16",
        "torch_dtype": "float16",
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What one run's engine looks like: the model, the batch limits and the KV cache size."""

    model_dir: Path
    num_layers: int
    max_num_seqs: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int = 8192


@contextlib.contextmanager
def cpu_platform_without_triton() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses to build a VllmConfig on x86 without Triton (its CPU
    model runner compiles kernels with triton-cpu). Harness-only patch (this bench and
    tests/vllm): they run vLLM's scheduler and connector hooks, never a kernel, so the check is
    passed while the config is constructed and restored at once; the product never does this."""
    import vllm.triton_utils as triton_utils

    has_triton = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = has_triton


def make_vllm_config(shape: EngineShape, transfer: dict[str, Any] | None) -> Any:
    """A VllmConfig for the config-only model: block size 16, prefix caching, chunked prefill,
    one KV cache group; `transfer`: KVTransferConfig arguments (None: no connector)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(shape.model_dir), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=shape.max_model_len
    )
    with cpu_platform_without_triton():
        return VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=shape.max_num_seqs,
                max_num_batched_tokens=shape.max_num_batched_tokens,
                max_model_len=shape.max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                disable_hybrid_kv_cache_manager=True,
            ),
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
            ),
            kv_transfer_config=KVTransferConfig(**transfer) if transfer is not None else None,
            parallel_config=ParallelConfig(distributed_executor_backend="uni"),
            device_config=DeviceConfig("cpu"),
        )


def make_kv_cache_config(vllm_config: Any, shape: EngineShape, layout: str = "LBHNC") -> Any:
    """One full-attention group over every layer, planned by vLLM's own `get_kv_cache_configs`
    for the physical `layout` (LBHNC: what the CPU attention backend asks for), recorded as the
    engine core records it."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    vllm_config.cache_config.kv_cache_layout = layout  # resolve_kv_cache_layout's result
    vllm_config.cache_config.num_gpu_blocks_override = shape.num_blocks
    specs: dict[str, Any] = {
        name: FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16
        )
        for name in layer_names(shape.num_layers)
    }
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    (config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 34], groups)
    config.kv_cache_layout = layout
    vllm_config.cache_config.num_gpu_blocks = shape.num_blocks
    return config


def make_request(req_id: str, prompt_token_ids: list[int], max_tokens: int) -> Any:
    """A request that never stops on EOS (ignore_eos) before `max_tokens`."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def runner_output(scheduler: Any, scheduler_output: Any, kv_connector_output: Any = None) -> Any:
    """What a model runner returns: one sampled token (SAMPLED_TOKEN) per request whose prompt is
    complete after this step (a partial prefill chunk samples nothing); on vLLM 0.33 and 0.34 (the
    tests/vllm harness drives its engines with this one too)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        sampled.append(
            [SAMPLED_TOKEN] if request is not None and request.num_computed_tokens >= request.num_tokens else []
        )
    version_fields: dict[str, Any] = {}
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


def completes_block(scheduler_output: Any) -> bool:
    """Whether some request fills a block in this step: (computed + scheduled) // 16 passes
    computed // 16 (what makes layerkv plan a save)."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return any(
        (computed[r] + n) // BLOCK_SIZE > computed[r] // BLOCK_SIZE
        for r, n in scheduler_output.num_scheduled_tokens.items()
    )


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One engine step's wall times (ns) on the driver thread and whether a block completed."""

    schedule_ns: int
    worker_ns: int
    update_ns: int
    block_completes: bool
    num_decoding: int  # requests scheduled for exactly one token


class DecodeEngine:
    """Scheduler + (optional) worker for one contender and one batch size. `step()` runs
    schedule -> worker step -> update_from_output; `shutdown()` closes both connectors."""

    def __init__(
        self, shape: EngineShape, transfer: dict[str, Any] | None, worker_state_dir: Path | None = None
    ) -> None:
        """`worker_state_dir`: set up `worker_process_state` (its rendezvous file goes there)."""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.shape = shape
        self.layers = layer_names(shape.num_layers)
        self.vllm_config = make_vllm_config(shape, transfer)
        self.kv_cache_config = make_kv_cache_config(self.vllm_config, shape)
        self._state = contextlib.ExitStack()
        self.worker: Worker | None = None
        with contextlib.ExitStack() as failing:
            failing.callback(self._state.close)
            if worker_state_dir is not None:
                self._state.enter_context(worker_process_state(self.vllm_config, worker_state_dir))
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                log_stats=True,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=BLOCK_SIZE,
            )
            failing.callback(self.scheduler.shutdown)
            if transfer is not None:
                self.worker = make_worker(self.vllm_config, self.kv_cache_config, self.layers)
            failing.pop_all()  # built: shutdown() closes them

    @property
    def scheduler_connector(self) -> Any:
        """The scheduler-role connector vLLM's Scheduler built (None without one)."""
        return getattr(self.scheduler, "connector", None)

    def add_requests(self, prompts: list[list[int]], max_tokens: int) -> None:
        for i, tokens in enumerate(prompts):
            self.scheduler.add_request(make_request(f"req-{i}", tokens, max_tokens))

    def step(self) -> StepTimes:
        start = time.perf_counter_ns()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter_ns()
        connector_output = self.worker.run_step(out) if self.worker is not None else None
        ran = time.perf_counter_ns()
        self.scheduler.update_from_output(out, runner_output(self.scheduler, out, connector_output))
        updated = time.perf_counter_ns()
        return StepTimes(
            scheduled - start,
            ran - scheduled,
            updated - ran,
            completes_block(out),
            sum(1 for n in out.num_scheduled_tokens.values() if n == 1),
        )

    def shutdown(self) -> None:
        """The worker's connector (its transfer threads), then the scheduler's. Idempotent."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        worker, self.worker = self.worker, None
        try:
            if worker is not None:
                worker.connector.shutdown()
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            try:
                self.scheduler.shutdown()
            finally:
                self._state.close()
