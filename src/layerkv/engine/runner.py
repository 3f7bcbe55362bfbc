"""The reference engine's model runner: pipeline stages x TP ranks in one process, each worker
(stage, rank) with its own KV caches (of its stage's layers) and worker hooks, each TP rank with
its weight shard; one forward per step, each request in its own slice (no cross-request batching,
so a request's logits depend only on its tokens, its KV and its chunk boundaries). Stage s holds
an even share of the main layers; the last stage also holds the MTP layers. Worker side; runs
on the engine's compute thread (the caller of Engine.step).

Per step and rank (vLLM's order):  bind_connector_metadata -> start_load_kv
  per layer: for each rank: wait_for_layer_load(name) -> attention on that rank -> save_kv_layer(name)
  then:      wait_for_save -> get_finished -> get_block_ids_with_load_errors -> report_steps
             -> clear_connector_metadata; the engine unions invalid blocks and reported steps

With decode context parallelism (dcp_size > 1) a rank's attention reads the caches of every member
of its DCP group (dcp_size consecutive TP ranks; in vLLM a collective inside attention joins them),
so per layer and group: every member's wait_for_layer_load -> every member caches its share of
this step's tokens -> every member's attention -> every member's save_kv_layer. Each rank still
sees wait -> attention -> save, and no rank's attention reads a cache whose load is not done.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerkv.connector.hooks import WorkerHooks
from layerkv.engine.context_parallel import attend_shares, write_share
from layerkv.engine.model import CacheContext, ModelConfig, RankShard, SharedParams, Weights, cache_shapes, rms_norm
from layerkv.engine.paged_cache import CPShare, RankKVCache, cp_slot_mapping, local_slots
from layerkv.engine.scheduler import ScheduledChunk
from layerkv.errors import ConfigError
from layerkv.messages import ReqId


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    last_logits: dict[ReqId, torch.Tensor]  # float32 [vocab] per request
    draft_logits: dict[ReqId, torch.Tensor]  # float32 [vocab] of the last MTP layer (MTP models only)
    invalid_block_ids: frozenset[int]  # union over ranks
    reported_steps: tuple[int, ...]  # every rank's reported step numbers (vLLM's worker-meta aggregate)
    finished_sending: frozenset[ReqId]  # reported by every rank
    finished_recving: frozenset[ReqId]


def stage_of_layers(cfg: ModelConfig, pp_size: int) -> tuple[int, ...]:
    """Pipeline stage of every layer (main layers split evenly, MTP layers on the last stage)."""
    if not 1 <= pp_size <= cfg.num_layers:
        raise ConfigError(f"pp_size={pp_size} must be 1 <= pp_size <= num_layers={cfg.num_layers}")
    main = tuple(li * pp_size // cfg.num_layers for li in range(cfg.num_layers))
    return main + (pp_size - 1,) * cfg.num_mtp_layers


def reduce_ranks(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-reduce of TP partial outputs, in fixed rank order (deterministic)."""
    out = parts[0].clone()
    for part in parts[1:]:
        out += part
    return out


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        tp_size: int,
        num_blocks: int,
        block_size: int,
        worker_hooks: Sequence[WorkerHooks],
        pp_size: int = 1,
        kv_layout: str = "NHD",
        device: str = "cpu",
        dcp_size: int = 1,
        cp_interleave: int = 1,
    ) -> None:
        """`worker_hooks[stage * tp_size + rank]` serves TP rank `rank` of pipeline stage `stage`;
        `kv_layout`, `device`, `dcp_size`, `cp_interleave`: EngineConfig's (weights, caches and the
        forward on `device`; logits come back on the host). `block_size`: tokens per cache block of
        one rank (an engine block is block_size * dcp_size tokens)."""
        assert len(worker_hooks) == tp_size * pp_size
        self.cfg = cfg
        self.device = device
        weights = {name: w.to(device) for name, w in weights.items()} if device != "cpu" else weights
        self.block_size = block_size
        self.tp_size = tp_size
        # CP rank of TP rank r: r % dcp_size; a DCP group: dcp_size consecutive TP ranks (vLLM's layout)
        self.shares = [CPShare(dcp_size, r % dcp_size, cp_interleave) for r in range(tp_size)]
        self.dcp_groups = [tuple(range(g, g + dcp_size)) for g in range(0, tp_size, dcp_size)]
        self.layer_names = cfg.layer_names
        self.stage_of_layer = stage_of_layers(cfg, pp_size)
        self.shared = SharedParams(cfg, weights)
        self.shards = [RankShard(cfg, weights, r, tp_size) for r in range(tp_size)]
        self.caches = []  # [stage * tp_size + rank]
        for stage in range(pp_size):
            stage_names = {name for name, s in zip(cfg.layer_names, self.stage_of_layer) if s == stage}
            for r in range(tp_size):
                shapes = cache_shapes(cfg, r, tp_size, num_blocks, block_size)
                mine = {
                    n: shape
                    for n, shape in shapes.items()
                    if n in stage_names or n.removesuffix(".indexer.k_cache") + ".attn" in stage_names
                }
                self.caches.append(
                    RankKVCache(mine, block_size, cfg.torch_dtype, heads_outer=kv_layout == "HND", device=device)
                )
        self.worker_hooks = list(worker_hooks)
        self._finished_counts: dict[str, Counter[ReqId]] = {"sending": Counter(), "recving": Counter()}
        for hooks, cache in zip(self.worker_hooks, self.caches):
            hooks.register_kv_caches(cache.tensors, num_blocks)

    def execute(self, chunks: Sequence[ScheduledChunk], meta: Any, finished_req_ids: frozenset[ReqId]) -> ForwardOutput:
        for hooks in self.worker_hooks:
            hooks.bind_connector_metadata(meta)
            hooks.start_load_kv()
        try:
            # the forward's own tensors (positions, slots) on the device; on the host no mode (its cost per op)
            with torch.device(self.device) if self.device != "cpu" else contextlib.nullcontext():
                last_logits, draft_logits = self._forward(chunks) if chunks else ({}, {})
            invalid: set[int] = set()
            reported: list[int] = []
            per_rank_finished = []
            for hooks in self.worker_hooks:
                hooks.wait_for_save()
                per_rank_finished.append(hooks.get_finished(set(finished_req_ids)))
                invalid |= hooks.get_block_ids_with_load_errors()
                reported.extend(hooks.report_steps())
        finally:
            for hooks in self.worker_hooks:
                hooks.clear_connector_metadata()
        sending = self._all_ranks_done("sending", [f[0] for f in per_rank_finished])
        recving = self._all_ranks_done("recving", [f[1] for f in per_rank_finished])
        return ForwardOutput(last_logits, draft_logits, frozenset(invalid), tuple(reported), sending, recving)

    def _all_ranks_done(self, kind: str, per_rank: list[set[ReqId] | None]) -> frozenset[ReqId]:
        """A request is finished sending/receiving once every rank reported it (vLLM's aggregator)."""
        counts = self._finished_counts[kind]
        for ids in per_rank:
            counts.update(ids or ())
        done = frozenset(r for r, n in counts.items() if n >= len(self.worker_hooks))
        for r in done:
            del counts[r]
        return done

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[dict[ReqId, torch.Tensor], dict[ReqId, torch.Tensor]]:
        shared = self.shared
        h = {c.req_id: shared.embed[torch.as_tensor(c.token_ids)] for c in chunks}  # [n, H] each
        positions = {c.req_id: torch.arange(c.start_token, c.start_token + len(c.token_ids)) for c in chunks}
        contexts = {c.req_id: self._contexts(c, positions[c.req_id]) for c in chunks}
        for layer_idx in range(self.cfg.num_layers):
            h = self._layer(layer_idx, h, positions, contexts)
        logits = {rid: shared.logits(x[-1]).cpu() for rid, x in h.items()}
        # MTP/draft layers run on the final hidden states; their prediction is the draft token
        for layer_idx in range(self.cfg.num_layers, self.cfg.num_total_layers):
            h = self._layer(layer_idx, h, positions, contexts)
        draft = {rid: shared.logits(x[-1]).cpu() for rid, x in h.items()} if self.cfg.num_mtp_layers else {}
        return logits, draft

    def _contexts(self, chunk: ScheduledChunk, positions: torch.Tensor) -> list[CacheContext]:
        """Where `chunk`'s tokens go in every worker's cache, and under DCP which context tokens each
        worker's share holds (once per step: the same for every layer)."""
        num_tokens = chunk.start_token + len(chunk.token_ids)
        contexts = []
        for worker, cache in enumerate(self.caches):
            share = self.shares[worker % self.tp_size]
            held = local_slots(chunk.block_ids, num_tokens, self.block_size, share) if share.size > 1 else None
            slots = cp_slot_mapping(chunk.block_ids, positions, self.block_size, share)
            contexts.append(CacheContext(cache, slots, chunk.block_ids, num_tokens, share, held))
        return contexts

    def _layer(
        self,
        layer_idx: int,
        h: dict[ReqId, torch.Tensor],
        positions: dict[ReqId, torch.Tensor],
        contexts: dict[ReqId, list[CacheContext]],
    ) -> dict[ReqId, torch.Tensor]:
        """One decoder layer for every request (each in its own slice), with the worker hooks."""
        shared, eps = self.shared, self.cfg.rms_eps
        x = {rid: rms_norm(hr, shared.input_norms[layer_idx], eps) for rid, hr in h.items()}
        partial = self._attention(layer_idx, x, positions, contexts)
        out = {}
        for rid, hr in h.items():
            hr = hr + reduce_ranks(partial[rid])
            x_mlp = rms_norm(hr, shared.post_norms[layer_idx], eps)
            out[rid] = hr + reduce_ranks([shard.mlp(layer_idx, x_mlp) for shard in self.shards])
        return out

    def _attention(
        self,
        layer_idx: int,
        x: dict[ReqId, torch.Tensor],
        positions: dict[ReqId, torch.Tensor],
        contexts: dict[ReqId, list[CacheContext]],
    ) -> dict[ReqId, list[torch.Tensor]]:
        """Every rank's partial o_proj output per request, in rank order, each rank's attention
        between its worker's wait_for_layer_load and save_kv_layer (the module docstring's order)."""
        name = self.layer_names[layer_idx]
        first = self.stage_of_layer[layer_idx] * self.tp_size  # this stage's workers
        partial: dict[ReqId, list[torch.Tensor]] = {rid: [] for rid in x}
        for group in self.dcp_groups:  # (rank,) each without DCP
            for rank in group:
                self.worker_hooks[first + rank].wait_for_layer_load(name)
            if len(group) > 1:
                for rank in group:
                    for rid in x:
                        write_share(self.shards[rank], layer_idx, x[rid], positions[rid], contexts[rid][first + rank])
            for rank in group:
                shard = self.shards[rank]
                for rid in x:
                    ctxs = contexts[rid]
                    if len(group) == 1:
                        partial[rid].append(shard.attention(layer_idx, x[rid], positions[rid], ctxs[first + rank]))
                    else:
                        members = [ctxs[first + m] for m in group]
                        partial[rid].append(attend_shares(shard, layer_idx, x[rid], positions[rid], members))
            for rank in group:
                self.worker_hooks[first + rank].save_kv_layer(name)
        return partial
