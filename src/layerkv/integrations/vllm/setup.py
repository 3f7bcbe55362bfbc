"""vLLM setup checks and the neutral `Deployment` of a vLLM instance: which vLLM configurations
layerkv supports (versions, KV cache layouts, where the pool lives), and the per-layer cache
signature both vLLM roles compute alike (the model's identity in it: model_identity.py). Called
once per connector instance at construction (scheduler role on the engine core, worker role on
each worker); no state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.errors import ConfigError, UnsupportedSetupError
from layerkv.integrations.vllm.model_identity import model_fingerprint_of, model_settings_of
from layerkv.integrations.vllm.parallel import context_parallel_problems, cp_interleave_of, parallel_ranks
from layerkv.messages import Deployment, KVRole
from layerkv.store.base import PoolScope
from layerkv.store.registry import backend_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from layerkv.config import LayerKVConfig

log = logging.getLogger(__name__)

# Exact spec types whose blocks are plain per-layer pages addressed by the prefix hash chain (a
# sliding-window group's blocks outside the window are vLLM's null block: not moved).
_SUPPORTED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)


# --------------------------------------------------------------------------- setup checks


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise `UnsupportedSetupError` naming every setup the neutral connector cannot express."""
    problems = _kv_cache_problems(vllm_config, kv_cache_config) + _execution_problems(vllm_config)
    problems += context_parallel_problems(vllm_config, kv_cache_config)
    layout_problem = _layout_problem(vllm_config, kv_cache_config)
    if layout_problem:
        problems.append(layout_problem)
    if problems:
        raise UnsupportedSetupError("layerkv cannot run this vLLM setup: " + "; ".join(problems))


def _kv_cache_problems(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[str]:
    """What in the KV cache groups layerkv cannot name or move: no group, hybrid groups it cannot
    key alike, layer specs it does not support, blocks hashed at another size."""
    problems: list[str] = []
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        problems.append("no KV cache groups (an attention-free model has no KV cache to pool)")
    if len(groups) > 1:
        block_sizes = sorted({g.kv_cache_spec.block_size for g in groups})
        if len(block_sizes) > 1:
            problems.append(
                f"hybrid KV cache groups with different block sizes {block_sizes}: layerkv keys every "
                "group's objects by the same block hashes"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            problems.append("hybrid KV cache groups with pipeline parallelism (not supported yet)")
    if vllm_config.speculative_config is not None and any(
        isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups
    ):
        problems.append(
            "sliding-window KV cache groups with speculative decoding (vLLM then keeps more blocks "
            "of the window than layerkv checks for a hit; not supported yet)"
        )
    for i, group in enumerate(groups):
        specs = _layer_specs(group)
        unsupported = sorted({type(s).__name__ for s in specs if type(s) not in _SUPPORTED_SPECS})
        if unsupported:
            problems.append(
                f"KV cache group {i} ({len(group.layer_names)} layers): {', '.join(unsupported)}: layerkv supports "
                "full "
                "attention (MHA/GQA/MQA), MLA and sliding-window attention; not Mamba / SSM state, chunked local "
                "attention or cross-attention (a model that needs them runs without layerkv, or with "
                "--disable-hybrid-kv-cache-manager where vLLM allows it)"
            )
        elif len({_spec_text(s, 1) for s in specs}) > 1:
            problems.append(
                f"per-layer KV specs differ within one group ({len({_spec_text(s, 1) for s in specs})} shapes): "
                "vLLM's scheduler sees only one of them, so layerkv cannot name the objects"
            )
    if groups:
        problems += _hash_block_problems(vllm_config, kv_cache_config)
    return problems


def _hash_block_problems(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[str]:
    """layerkv keys one object per block hash: vLLM must hash each engine block, which under
    decode context parallelism spans `dcp` ranks' cache blocks (vLLM's resolve_kv_cache_block_sizes)."""
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    hash_block_size = kv_cache_config.hash_block_size
    if hash_block_size in (None, block_size * dcp):  # None: a hand-made config (vLLM always records it)
        return []
    engine_block = f"{block_size}" if dcp == 1 else f"{block_size} x decode_context_parallel_size {dcp}"
    return [
        f"hash_block_size={hash_block_size} differs from the KV block size {engine_block}; "
        "layerkv keys one object per KV block"
    ]


def _execution_problems(vllm_config: VllmConfig) -> list[str]:
    """How vLLM would run the model that layerkv's per-layer hooks cannot follow: prefill context
    parallelism, micro-batching, an encoder-decoder model."""
    problems: list[str] = []
    parallel = vllm_config.parallel_config
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        problems.append(
            f"prefill context parallel: prefill_context_parallel_size={pcp}; layerkv supports only 1 (PCP needs "
            "vLLM's V2 GPU model runner and at least 2 GPUs, and layerkv has not verified that the PCP KV "
            "all-gather precedes save_kv_layer): run with --prefill-context-parallel-size 1 (decode context "
            "parallelism is supported)"
        )
    if getattr(parallel, "use_ubatching", False):
        problems.append(
            f"micro-batching (enable_dbo={getattr(parallel, 'enable_dbo', False)}, ubatch_size="
            f"{getattr(parallel, 'ubatch_size', 1)}): vLLM runs the per-layer hooks once per micro-batch and "
            "layerkv would save a layer after the first; run without --enable-dbo / --ubatch-size"
        )
    if vllm_config.model_config.is_encoder_decoder:
        problems.append("encoder-decoder models (cross-attention KV is not prefix-addressed)")
    return problems


# --------------------------------------------------------------------------- KV cache layouts
#
# vLLM describes the physical KV cache as a permutation of logical [L, B, H, N, C]
# (vllm/v1/kv_cache_layout.py). layerkv moves one block of one layer as one byte run, which
# every "block-compact" layout gives (L and B outermost: LBHNC, LBNHC, BLHNC, BLNHC); LHBNC and
# BHLNC store each head of a block apart. Inside a block the bytes are [H, N, C] or [N, H, C]:
# that order enters the namespace (different objects), where the layers sit does not.

USABLE_LAYOUTS = tuple(layout.name for layout in KVCacheLayout if layout.is_block_compact)
PREFERRED_LAYOUT = "LBHNC"  # also what vLLM's own NIXL, Mooncake and offloading connectors ask for


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVCacheLayout | None:
    """The layout vLLM's engine core resolved (both roles see it: `KVCacheConfig.kv_cache_layout`,
    `CacheConfig.kv_cache_layout`); None before resolution (hand-made configs in tests)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    return KVCacheLayout[name] if name else None


def block_byte_order(layout: KVCacheLayout | None) -> str:
    """Physical order of one block's [H, N, C] bytes ('HNC', 'NHC', ...); 'HNC' when unknown."""
    if layout is None:
        return "HNC"
    return "".join("LBHNC"[dim] for dim in layout.value if dim > 1)


def required_kv_cache_layout(vllm_config: VllmConfig) -> str | None:
    """`get_required_kvcache_layout`: the layout layerkv asks vLLM for. vLLM uses it when every
    attention backend supports it and otherwise keeps the backends' first choice with a
    warning (`resolve_kv_cache_layout`); layerkv then still accepts any block-compact layout.
    Asking matters where a backend prefers LHBNC (ROCm attention, which also supports LBHNC).
    None when the user pinned VLLM_KV_CACHE_LAYOUT (vLLM uses that; a layout layerkv cannot use
    is refused at startup) or for MLA (one latent head: every layout is one run per block)."""
    if os.environ.get("VLLM_KV_CACHE_LAYOUT"):
        return None
    model = vllm_config.model_config
    if model is not None and model.use_mla:
        return None
    return PREFERRED_LAYOUT


def _layout_problem(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    layout = resolved_layout(vllm_config, kv_cache_config)
    if layout is None or layout.is_block_compact:
        return None
    heads = {s.num_kv_heads for g in kv_cache_config.kv_cache_groups for s in _layer_specs(g)}
    if heads == {1}:  # one head per rank (MLA, or as many ranks as KV heads): nothing is scattered
        return None
    return (
        f"KV cache layout {layout.name}: each head of a block is stored apart, so one block of one layer "
        f"is not one byte run; layerkv needs one of {', '.join(USABLE_LAYOUTS)}: set "
        f"VLLM_KV_CACHE_LAYOUT={PREFERRED_LAYOUT} (or another of those your attention backend supports)"
    )


# --------------------------------------------------------------------------- where the pool lives


def check_pool_shared(config: LayerKVConfig, vllm_config: VllmConfig) -> None:
    """Raise `UnsupportedSetupError` when an in-process backend (`pool_scope` PROCESS: the
    embedded store) cannot be one pool: its store lives in one process, so vLLM's scheduler
    (engine core) must run its only worker in that process ("uni" executor, or
    "external_launcher" with one rank). With the multiprocess or Ray executor the scheduler
    would never see what the workers saved: no hit, ever. A shared pool (Mooncake) with vLLM's
    non-cryptographic block hashes is refused unless acknowledged (`check_block_hashes`)."""
    if backend_class(config.backend).pool_scope is not PoolScope.PROCESS:
        check_block_hashes(config, getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        return
    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    name = backend if backend is None or isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if name == "uni" or (name == "external_launcher" and world_size == 1):
        return
    raise UnsupportedSetupError(
        f"layerkv backend={config.backend!r} keeps the pool inside one process, but this vLLM runs its scheduler and "
        f"its workers in different processes (distributed_executor_backend={name!r}, "
        f"tensor_parallel_size={parallel.tensor_parallel_size}, "
        f"pipeline_parallel_size={parallel.pipeline_parallel_size}): "
        f"the scheduler would never see what the workers save and the pool would never hit. Fix: use Mooncake "
        f'(run `layerkv master --config-out mooncake.json`, then set "backend": "mooncake", '
        f'"mooncake_config_path": "mooncake.json" in kv_connector_extra_config), or run one process with '
        f"--distributed-executor-backend uni (tensor_parallel_size=1)"
    )


def check_cudagraphs(config: LayerKVConfig, kv_role: KVRole) -> None:
    """`full_cudagraphs` is retired: every role keeps vLLM's full CUDA graphs now
    (connector/graphs.py). The key is still accepted; a startup message says so."""
    if config.full_cudagraphs:
        log.warning(
            "layerkv: full_cudagraphs is no longer needed and is ignored: layerkv keeps vLLM's full CUDA graphs "
            "on every role (kv_role=%s); a decode step carries no per-layer work (docs/gpu.md)",
            kv_role.value,
        )


def replayed_steps(vllm_config: VllmConfig) -> tuple[int, bool]:
    """Which steps vLLM may replay as one full CUDA graph (no per-layer hook runs in them):
    (tokens per request of a uniform decode batch that may be replayed, 0 for none; may any
    step be replayed). FULL_AND_PIECEWISE (vLLM's default) and FULL_DECODE_ONLY replay uniform
    decode batches: 1 token per request, 1 + the speculative tokens with a drafter; FULL replays
    mixed batches too; eager execution, NONE and PIECEWISE replay none (connector/graphs.py)."""
    model = getattr(vllm_config, "model_config", None)
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if (model is not None and model.enforce_eager) or mode is None or not mode.has_full_cudagraphs():
        return 0, False
    known = getattr(vllm_config, "uniform_decode_query_len", None)  # vLLM 0.34
    spec = getattr(vllm_config, "speculative_config", None)
    tokens = known if isinstance(known, int) else 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0)
    return tokens, mode.name == "FULL"


def check_block_hashes(config: LayerKVConfig, hash_algo: str) -> None:
    """ConfigError for a shared pool keyed by xxhash block hashes: engines sharing a pool must
    share the hash seed (PYTHONHASHSEED), and with a known seed anyone who can send prompts can
    craft a collision with another user's prefix and be served its KV (or poison it). sha256
    (vLLM's default) is collision resistant. `allow_weak_block_hashes: true` acknowledges it."""
    if str(hash_algo).startswith("xxhash") and not config.allow_weak_block_hashes:
        raise ConfigError(
            f"prefix_caching_hash_algo={hash_algo!r} with a shared pool (backend={config.backend!r}): xxhash block "
            "hashes are not collision resistant, so prompts crafted by one user can collide with another's prefix "
            "and be served its KV. Use --prefix-caching-hash-algo sha256 (vLLM's default), or set "
            '"allow_weak_block_hashes": true in kv_connector_extra_config to accept the risk'
        )


def _layer_specs(group: Any) -> list[Any]:
    """Per-layer specs of one KV cache group (a UniformTypeKVCacheSpecs holds one per layer)."""
    specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    return list(specs.values()) if specs else [group.kv_cache_spec]


def _spec_text(spec: Any, total_kv_heads: int) -> str:
    """One layer's spec for the whole model: `total_kv_heads` for the rank's heads (and the
    page scaled alike), so servers of different TP sizes can name the same objects."""
    kind = "mla" if isinstance(spec, MLAAttentionSpec) else "attn"
    if isinstance(spec, SlidingWindowSpec):
        kind = f"swa{spec.sliding_window}"
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    heads = 1 if kind == "mla" else total_kv_heads
    page = spec.page_size_bytes * heads // max(1, spec.num_kv_heads)
    return (
        f"vllm-{kind}[block_size={spec.block_size},num_kv_heads={heads},head_size={spec.head_size},"
        f"head_size_v={head_size_v}]{str(spec.dtype).removeprefix('torch.')}:page={page}"
    )


def kv_signature_of(kv_cache_config: KVCacheConfig, total_kv_heads: int, group: int = 0) -> str:
    """`Deployment.kv_signature`: the per-layer cache spec of one group for the whole model (every
    one of `total_kv_heads`; the namespace adds the TP size or the chosen split), computed the same
    on the scheduler and on every worker. vLLM hands the scheduler rank 0's config with a
    UniformTypeKVCacheSpecs reduced to one of its specs and (under PP) other layer names, so
    this names the spec, not the layers (`check_supported` rejects groups whose specs differ).
    A block stored in another byte order than [H, N, C] (LBNHC, BLNHC) adds `:order=NHC`, so
    caches that disagree on it name different objects (no hit, never foreign bytes)."""
    specs = _layer_specs(kv_cache_config.kv_cache_groups[group])
    (text,) = sorted({_spec_text(s, total_kv_heads) for s in specs})
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    order = block_byte_order(KVCacheLayout[name] if name else None)
    if order != "HNC" and any(s.num_kv_heads > 1 for s in specs):
        text += f":order={order}"
    return text


def deployment_from(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, role: KVConnectorRole) -> Deployment:
    """The neutral `Deployment` of this vLLM instance (call after `check_supported`)."""
    model = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cache_dtype = vllm_config.cache_config.cache_dtype
    # "auto" means the model dtype; an explicit fp8 name says more than torch.uint8 would.
    model_dtype = spec.dtype  # type: ignore[attr-defined]
    kv_dtype = str(model_dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    tp_rank, pp_rank, dcp_rank = parallel_ranks(vllm_config, role)
    dcp_size = vllm_config.parallel_config.decode_context_parallel_size
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
        model_fingerprint=model_fingerprint_of(vllm_config),
        model_settings=model_settings_of(vllm_config),
        is_mla=bool(model.use_mla),
        role=KVRole(kv_role),
        kv_signature=kv_signature_of(kv_cache_config, 1 if model.use_mla else model.get_total_num_kv_heads()),
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        cp_interleave=cp_interleave_of(vllm_config) if dcp_size > 1 else 1,
    )


def group_deployments(deployment: Deployment, kv_cache_config: KVCacheConfig) -> list[Deployment]:
    """One `Deployment` per KV cache group (connector/hybrid.py): `deployment` itself for a model with one
    group; with several (vLLM's hybrid manager), each group's spec, index and layer names are in
    its `kv_signature`, so each group's objects have their own namespace and a change of vLLM's
    grouping names other objects (a miss, never another group's bytes)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1 and not isinstance(groups[0].kv_cache_spec, SlidingWindowSpec):
        return [deployment]
    out = []
    for g, group in enumerate(groups):
        names = hashlib.sha256(",".join(group.layer_names).encode()).hexdigest()[:16]
        base = kv_signature_of(kv_cache_config, deployment.num_kv_heads, g)
        signature = f"{base}|group={g}/{len(groups)}:layers={len(group.layer_names)}:{names}"
        spec = group.kv_cache_spec
        # vLLM's SlidingWindowManager: a hit of N blocks reads the last cdiv(window - 1, block) of them
        window = -(-(spec.sliding_window - 1) // spec.block_size) if isinstance(spec, SlidingWindowSpec) else 0
        out.append(dataclasses.replace(deployment, kv_signature=signature, window_blocks=window))
    return out
