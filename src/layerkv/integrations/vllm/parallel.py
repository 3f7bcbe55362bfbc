"""Where a vLLM worker sits in vLLM's model-parallel groups (tensor, pipeline and decode context
parallel ranks) and the decode context parallel (DCP) setups layerkv can name (setup.py asks at
construction). Called once per connector instance (scheduler role on the engine core, worker
role on each worker); no state but the WORKER_RANKS seam.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.errors import UnsupportedSetupError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class ParallelRanks(NamedTuple):
    """A worker's place in vLLM's model-parallel groups."""

    tp_rank: int
    pp_rank: int
    dcp_rank: int  # decode context parallel rank (tp_rank % dcp_size without PCP); 0 without DCP


def ranks_from_parallel_state(vllm_config: VllmConfig) -> ParallelRanks:
    """This worker's ranks from vLLM's model-parallel groups (the DCP rank as vLLM's own Mooncake
    store connector reads it). Raises UnsupportedSetupError when they are not built yet and the
    deployment has more than one rank."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    if parallel_state.model_parallel_is_initialized():
        dcp = parallel.decode_context_parallel_size
        return ParallelRanks(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pp_group().rank_in_group,
            parallel_state.get_dcp_group().rank_in_group if dcp > 1 else 0,
        )
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise UnsupportedSetupError(
            "the layerkv worker connector was built before vLLM's model-parallel groups "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}): its rank is unknown"
        )
    return ParallelRanks(0, 0, 0)


# Where a worker-role connector learns its ranks. A seam for rigs that build several ranks'
# workers in one process, where vLLM's model-parallel groups do not exist (tests/vllm).
WORKER_RANKS: Callable[[VllmConfig], ParallelRanks] = ranks_from_parallel_state


def parallel_ranks(vllm_config: VllmConfig, role: KVConnectorRole) -> ParallelRanks:
    """This worker's ranks; the scheduler has none and reports (0, 0, 0)."""
    if role is KVConnectorRole.SCHEDULER:
        return ParallelRanks(0, 0, 0)
    return WORKER_RANKS(vllm_config)


def context_parallel_problems(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[str]:
    """Decode context parallelism (DCP) layerkv can name: each CP rank's share of a block is an
    object of its own (objects/keys.py), so it needs one KV cache group of DCP-sharded blocks,
    an interleave inside the block and, for GQA, each KV head's replicas holding whole sets of
    the CP shares (store_shards other than the head groups: storage_role refuses it)."""
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    if dcp <= 1 or not groups:
        return []
    setting = f"decode_context_parallel_size={dcp}"
    problems: list[str] = []
    if len(groups) > 1:
        problems.append(
            f"{setting} with {len(groups)} KV cache groups (a hybrid model): vLLM scales each group's blocks "
            "differently under DCP; layerkv supports DCP with one KV cache group: run with "
            "--decode-context-parallel-size 1, or with --disable-hybrid-kv-cache-manager where vLLM allows it"
        )
    if any(not getattr(g.kv_cache_spec, "dcp_sharded", True) for g in groups):
        problems.append(
            f"{setting} with a KV cache spec that is not DCP-sharded (dcp_sharded=False: every rank holds "
            "every token): layerkv names one object per CP rank's share; run with --decode-context-parallel-size 1"
        )
    block_size = groups[0].kv_cache_spec.block_size
    interleave = cp_interleave_of(vllm_config)
    if interleave < 1 or interleave > block_size or block_size % interleave:
        problems.append(
            f"{setting} with cp_kv_cache_interleave_size={interleave}: the interleave must divide the KV block "
            f"size {block_size} (a rank's share of a block stays inside the block): set "
            f"--cp-kv-cache-interleave-size to a divisor of {block_size}"
        )
    model = vllm_config.model_config
    tp, heads = parallel.tensor_parallel_size, model.get_total_num_kv_heads()
    if not model.use_mla and (tp < heads or (tp // heads) % dcp):
        problems.append(
            f"{setting} with tensor_parallel_size={tp} and {heads} KV heads: the ranks that replicate a KV "
            f"head must hold whole sets of the {dcp} CP shares, so tensor_parallel_size // num_kv_heads "
            f"({tp // heads}) must be a multiple of {dcp}: choose a TP size where it is"
        )
    return problems


def cp_interleave_of(vllm_config: VllmConfig) -> int:
    """Tokens a DCP rank holds in a row (vLLM's cp_kv_cache_interleave_size), as vLLM resolves it
    (VllmConfig.adjust_dcp_kv_cache_interleave_size, which the engine core runs before any
    connector is built): the deprecated dcp_kv_cache_interleave_size wins when set above 1, except
    under NIXL P/D, where vLLM then chooses the interleave itself (the field holds its choice)."""
    parallel = vllm_config.parallel_config
    interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
    deprecated = int(getattr(parallel, "dcp_kv_cache_interleave_size", 1) or 1)
    transfer = vllm_config.kv_transfer_config
    nixl = transfer is not None and transfer.has_connector("NixlConnector")
    return deprecated if deprecated > 1 and not nixl else interleave
