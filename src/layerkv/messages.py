"""Engine-neutral messages between an engine adapter (vLLM, the reference engine) and the
connector: what the engine tells the connector about requests, steps and the deployment.
Plain frozen dataclasses, picklable, no behaviour; built on the engine's scheduler thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from layerkv.errors import ConfigError

ReqId = str
BlockHash = bytes  # the engine's chained block hash (already salted: cache salt, LoRA, mm)


class KVRole(str, Enum):
    PRODUCER = "kv_producer"  # saves only
    CONSUMER = "kv_consumer"  # loads only
    BOTH = "kv_both"

    @property
    def loads(self) -> bool:
        return self is not KVRole.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not KVRole.CONSUMER


@dataclass(frozen=True, slots=True)
class Deployment:
    """What makes two deployments' objects (in)compatible, plus this worker's coordinates."""

    model_id: str  # e.g. "meta-llama/Llama-3.1-8B" or a local path
    kv_dtype: str  # e.g. "float16", "bfloat16", "float32", "fp8_e4m3"
    block_size: int  # tokens per KV block
    num_kv_heads: int  # total KV heads of the model (MLA: 1)
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    # What identifies the weights (a revision / commit, or a fingerprint of the checkpoint
    # files; see objects/fingerprint.py) and a digest of the settings that change KV bytes
    # (quantization, rope / hf overrides, layer count incl. draft layers, KV cache scales).
    model_fingerprint: str = ""
    model_settings: str = ""
    is_mla: bool = False
    role: KVRole = KVRole.BOTH
    # Per-layer cache shapes as both the scheduler and the workers can compute them (e.g.
    # "L0:k[16,2,64]f16+v[16,2,64]f16;L1:..."); part of the key namespace, so deployments
    # with different cache layouts never share objects.
    kv_signature: str = ""
    # A sliding-window KV cache group of a hybrid model (connector/hybrid.py): a hit ending at block N
    # needs only this group's blocks [N - window_blocks, N); 0: every block of the hit.
    window_blocks: int = 0
    # Objects per block: the KV heads split into this many equal head ranges (objects/keys.py
    # storage_role); 0: one per KV head group of this deployment (min(tp_size, num_kv_heads)).
    # Servers of different TP sizes share objects when they split alike (config store_shards).
    store_shards: int = 0
    # Decode context parallelism (vLLM's decode_context_parallel_size; it reuses TP ranks): each of
    # `dcp_size` CP ranks holds an interleaved share of every block (runs of `cp_interleave` tokens
    # in turn), so an engine's block (what it hashes) is `block_size * dcp_size` tokens while each
    # rank's cache block is `block_size`. `dcp_rank` is this worker's share (vLLM: tp_rank % dcp_size).
    dcp_size: int = 1
    dcp_rank: int = 0
    cp_interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "tp_size", "pp_size", "dcp_size", "cp_interleave"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Deployment.{name}={value!r} must be an int >= 1")
        if isinstance(self.store_shards, bool) or not isinstance(self.store_shards, int) or self.store_shards < 0:
            raise ConfigError(f"Deployment.store_shards={self.store_shards!r} must be an int >= 0")
        if not self.model_id:
            raise ConfigError("Deployment.model_id must not be empty")
        if isinstance(self.dcp_rank, bool) or not isinstance(self.dcp_rank, int):
            raise ConfigError(f"Deployment.dcp_rank={self.dcp_rank!r} must be an int")
        if not 0 <= self.dcp_rank < self.dcp_size:
            raise ConfigError(f"Deployment.dcp_rank={self.dcp_rank} must be 0 <= dcp_rank < dcp_size={self.dcp_size}")
        if self.dcp_size > 1 and (self.cp_interleave > self.block_size or self.block_size % self.cp_interleave):
            raise ConfigError(
                f"Deployment.cp_interleave={self.cp_interleave} must divide block_size={self.block_size} "
                f"(vLLM's cp_kv_cache_interleave_size)"
            )

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per engine block (what one block hash covers): `block_size` on each of the
        `dcp_size` context-parallel ranks."""
        return self.block_size * self.dcp_size


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request as the connector's scheduler side sees it."""

    req_id: ReqId
    num_prompt_tokens: int
    num_tokens: int  # prompt + output so far
    block_hashes: tuple[BlockHash, ...]  # one per full block of the request's tokens
    # what the client sent along (vLLM's Request.kv_transfer_params; a prefill server's promise:
    # connector/prefill_wait.py)
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request in one engine step, after the scheduler allocated its blocks."""

    req_id: ReqId
    block_ids: tuple[int, ...]  # all local block ids of the request, in token order
    num_computed_tokens: int  # tokens whose KV is in local blocks before this step's compute
    #                           (includes tokens the connector loads in this step)
    num_scheduled_tokens: int  # tokens the engine computes in this step
    block_hashes: tuple[BlockHash, ...]  # hashes of the request's full blocks known so far
    resumed: bool = False  # re-scheduled after preemption: block_ids were replaced
    # hybrid models: the request's block ids in its other KV cache groups (connector/hybrid.py); a block
    # that failed to load there taints this request's saves here too
    other_block_ids: tuple[int, ...] = ()
    num_prompt_tokens: int | None = None  # None: unknown (every full block counts as the prompt's)


@dataclass(frozen=True, slots=True)
class SchedulerStep:
    """Everything the connector's scheduler side needs to build one step's worker metadata.

    `requests`: every scheduled request, or (when `scheduled_req_ids` is given) only those that
    can concern the connector: every request new or resumed in this step and every one that
    completes a block in it. A decode step that completes no block then carries none, and costs
    the connector nothing per running request (integrations/vllm/steps.py; an engine asked for
    every request, SchedulerConnector.needs_every_request, passes all of them)."""

    requests: tuple[ScheduledRequest, ...]
    finished_req_ids: frozenset[ReqId] = field(default_factory=frozenset)
    preempted_req_ids: frozenset[ReqId] = field(default_factory=frozenset)
    # every request scheduled in this step (None: those in `requests`); a set or a dict's keys
    scheduled_req_ids: AbstractSet[ReqId] | None = None
    num_tokens: int | None = None  # tokens computed in this step (None: the sum over `requests`)

    def is_scheduled(self, req_id: ReqId) -> bool:
        """Is `req_id` scheduled in this step (whether or not it is in `requests`)?"""
        if self.scheduled_req_ids is not None and req_id in self.scheduled_req_ids:
            return True
        return any(r.req_id == req_id for r in self.requests)

    def total_tokens(self) -> int:
        return self.num_tokens if self.num_tokens is not None else sum(r.num_scheduled_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What the workers return to the scheduler side after a step (vLLM's KVConnectorOutput),
    already combined over every worker: `invalid_block_ids` is the union, `reported_steps` the
    concatenation of each worker's step numbers (a step counts once per worker that ran it)."""

    finished_sending: frozenset[ReqId] = field(default_factory=frozenset)
    finished_recving: frozenset[ReqId] = field(default_factory=frozenset)
    invalid_block_ids: frozenset[int] = field(default_factory=frozenset)
    reported_steps: tuple[int, ...] = ()
    failed_recving: frozenset[ReqId] = field(
        default_factory=frozenset
    )  # loads before the request's first step that failed
