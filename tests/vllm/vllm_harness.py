"""Harness for tests/vllm: vLLM's real config, Scheduler, requests and model-runner outputs on
CPU, with the layerkv facade loaded through `kv_connector_module_path` (one process: the
scheduler and the workers share it). The worker hook path is worker_rig.py, the recording
doubles of the neutral connectors recording_doubles.py. Importing this module sets the
environment vLLM reads (CPU platform, offline, no engine-core multiprocessing); vLLM itself is
imported inside the functions. vLLM is installed by `make test` (requirements/vllm.txt)."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
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
    parallel_kwargs: dict | None = None,
):
    """A VllmConfig for the tiny model with the layerkv connector (`multi_connector`: True, as the
    only child of vLLM's MultiConnector; a list: these children, `layerkv_child` entries and
    vLLM's own). `executor` "uni": the scheduler and the worker share this
    process, as in these tests (the embedded store needs it). `model_kwargs`: more ModelConfig
    arguments (revision, hf_overrides, quantization, ...). `kv_events`: KV cache events on, vLLM's
    null publisher (a test swaps in its own recorder). `scheduler_kwargs`: more SchedulerConfig
    arguments (max_num_seqs, max_num_inflight_kv_loads, ...). `parallel_kwargs`: more ParallelConfig
    arguments (tensor_parallel_size, decode_context_parallel_size, cp_kv_cache_interleave_size, ...)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
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
    transfer = _transfer_config(layerkv, failure_policy, multi_connector)
    from layerkv.bench.decode.engine import cpu_platform_without_triton

    with cpu_platform_without_triton():
        return VllmConfig(
            model_config=model_config,
            scheduler_config=_scheduler_config(max_num_batched_tokens, max_model_len, scheduler_kwargs),
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
            ),
            kv_transfer_config=transfer,
            parallel_config=ParallelConfig(distributed_executor_backend=executor, **(parallel_kwargs or {})),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
        )


def _transfer_config(layerkv: dict, failure_policy: str, multi_connector: bool | list[dict]):
    """vLLM's KVTransferConfig: the `layerkv` child alone, or vLLM's MultiConnector over it
    (multi_connector True) or over the given children."""
    from vllm.config import KVTransferConfig

    if not multi_connector:
        return KVTransferConfig(**layerkv, kv_load_failure_policy=failure_policy)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=layerkv["kv_role"],
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config={"connectors": [layerkv] if multi_connector is True else list(multi_connector)},
    )


def _scheduler_config(max_num_batched_tokens: int, max_model_len: int, scheduler_kwargs: dict | None):
    """Up to 8 sequences, chunked prefill, one KV cache manager for all groups (no hybrid)."""
    from vllm.config import SchedulerConfig

    return SchedulerConfig(
        **{
            "max_num_seqs": 8,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "enable_chunked_prefill": True,
            "is_encoder_decoder": False,
            "disable_hybrid_kv_cache_manager": True,
            **(scheduler_kwargs or {}),
        }
    )


FULL_SPEC_ARGS = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16)


def make_kv_cache_config(num_blocks: int, specs: list | None = None, vllm_config: Any = None, layout: str = "LBHNC"):
    """One full-attention group over LAYERS planned by vLLM's own `get_kv_cache_configs` for the
    physical `layout` (default LBHNC, what the CPU attention backend asks for: one backing buffer,
    layer-outermost), recorded as the engine core records it (one rank's spec: its share of the
    KV heads under TP, `BLOCK_SIZE` tokens per block; `hash_block_size` from vLLM's own
    `resolve_kv_cache_block_sizes`: BLOCK_SIZE x decode_context_parallel_size); with `specs`, one
    hand-made group per spec (for the setups the facade rejects)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if specs is None:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        vllm_config = vllm_config or make_vllm_config(max_model_len=min(1024, (num_blocks - 1) * BLOCK_SIZE))
        vllm_config.cache_config.kv_cache_layout = layout  # resolve_kv_cache_layout's result
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        heads = max(1, vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config))  # this rank's
        spec_args = {**FULL_SPEC_ARGS, "num_kv_heads": heads}
        layer_specs = {name: FullAttentionSpec(**spec_args, dtype=torch.float16) for name in LAYERS}
        groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
        (config,) = get_kv_cache_configs(vllm_config, [layer_specs], [1 << 30], groups)
        config.kv_cache_layout = layout  # what the engine core hands the scheduler and the workers
        config.hash_block_size = scheduler_block_sizes(vllm_config, config)[1]
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
    block_size, hash_block_size = scheduler_block_sizes(vllm_config, kv_cache_config)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    return Engine(vllm_config, kv_cache_config, scheduler)


def scheduler_block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM's engine core resolves them for its
    Scheduler: BLOCK_SIZE x decode_context_parallel_size for one group of sharded attention."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 2,
    kv_transfer_params: dict | None = None,
    prompt_logprobs: int | None = None,
    hash_block_size: int = BLOCK_SIZE,
):
    """A vLLM Request whose block hashes cover `hash_block_size` tokens each (the engine block:
    BLOCK_SIZE x decode_context_parallel_size)."""
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
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )
