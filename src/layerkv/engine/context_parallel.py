"""Decode context parallelism (vLLM's DCP) in the reference engine: the `dcp_size` consecutive
TP ranks of a DCP group hold the same KV heads (MLA: the same latent) but each caches only its
interleaved share of every block's tokens (paged_cache.CPShare). A member's queries attend over
every member's share; the partial results are combined through their log-sum-exp (the math of
vLLM's `_correct_attn_cp_out_kernel`) in fixed rank order, so the result is deterministic.
Worker side; the engine's compute thread only. Shapes as in model.py; t = one share's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from layerkv.engine.model import CacheContext, LayerShard, ModelConfig, RankShard, apply_rope, rope_cos_sin
from layerkv.engine.paged_cache import PAD_SLOT
from layerkv.errors import ConfigError


def check_dcp(cfg: ModelConfig, tp_size: int, dcp_size: int) -> None:
    """Refuse a DCP size this model cannot be split by (ConfigError naming the rule)."""
    if dcp_size == 1:
        return
    if tp_size % dcp_size:
        raise ConfigError(f"dcp_size={dcp_size} must divide tp_size={tp_size} (DCP reuses the TP ranks)")
    if cfg.index_dim:
        raise ConfigError(
            f"dcp_size={dcp_size} with index_dim={cfg.index_dim}: the sparse-attention indexer biases every "
            f"key of the context, which DCP spreads over ranks; not built (use dcp_size=1)"
        )
    if not cfg.is_mla and (tp_size <= cfg.num_kv_heads or (tp_size // cfg.num_kv_heads) % dcp_size):
        raise ConfigError(
            f"dcp_size={dcp_size} with tp_size={tp_size} and num_kv_heads={cfg.num_kv_heads}: DCP shares tokens "
            f"over the ranks that replicate a KV head, so tp_size must exceed num_kv_heads and "
            f"tp_size // num_kv_heads must be a multiple of dcp_size (vLLM: dcp <= tp // num_kv_heads)"
        )


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [n, hq, d] at `q_positions` [n] over one share's k/v [t, hkv, d] at
    `k_positions` [t] (causal: keys after a query are masked). Returns float32 (out [n, hq, d],
    lse [n, hq]); a query that sees no key of the share gets out 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()  # [t, hq, d]
    v = v.repeat_interleave(group, dim=1).float()
    scores = q.transpose(0, 1).float() @ k.permute(1, 2, 0) / math.sqrt(q.shape[-1])  # [hq, n, t]
    future = k_positions[None, :] > q_positions[:, None]  # [n, t]
    scores = scores.masked_fill(future[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [hq, n]; -inf where every key is masked (or t == 0)
    seen = torch.isfinite(lse)[..., None]
    probs = torch.where(seen, torch.exp(scores - torch.where(seen, lse[..., None], 0.0)), 0.0)
    out = probs @ v.transpose(0, 1)  # [hq, n, d]
    return out.transpose(0, 1), lse.transpose(0, 1)


def combine(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The attention over all shares from each share's (out [n, hq, d], lse [n, hq]), float32, summed in
    the given (rank) order: lse = max + log sum exp(lse_r - max), out = sum exp(lse_r - lse) * out_r;
    a NaN or +inf lse counts as -inf (an empty share), as in vLLM's correction kernel."""
    stacked = torch.stack([lse.float() for lse in lses])  # [R, n, hq]
    stacked = torch.where(torch.isnan(stacked) | (stacked == float("inf")), float("-inf"), stacked)
    top = stacked.max(dim=0).values
    top = torch.where(top == float("-inf"), 0.0, top)  # every share empty: no NaN from -inf - -inf
    total = top + torch.log(torch.exp(stacked - top).sum(dim=0))  # [n, hq]
    result = torch.zeros_like(outs[0], dtype=torch.float32)
    for out, lse in zip(outs, stacked):
        scale = torch.exp(lse - total)
        result += torch.where(torch.isnan(scale), 0.0, scale)[..., None] * out.float()
    return result


def write_share(shard: RankShard, layer_idx: int, x: torch.Tensor, positions: torch.Tensor, ctx: CacheContext) -> None:
    """Cache the entries of this step's tokens x [n, H] (normed) at `positions` [n] that `ctx`'s
    share holds (MLA: the latent; GQA: K with RoPE, V); the other members cache the rest."""
    lw, d = shard.layers[layer_idx], shard.cfg.head_dim
    mine = ctx.slots != PAD_SLOT
    x, positions, slots = x[mine], positions[mine], ctx.slots[mine]
    if lw.w_dkv is not None:
        ctx.cache.write_flat(lw.name, slots, F.linear(x, lw.w_dkv))
        return
    cos, sin = rope_cos_sin(positions, d, shard.cfg.rope_theta, x.dtype)
    k = apply_rope(F.linear(x, lw.wk).view(-1, shard.num_kv_heads, d), cos, sin)  # type: ignore[arg-type]
    ctx.cache.write_kv(lw.name, slots, k, F.linear(x, lw.wv).view(-1, shard.num_kv_heads, d))  # type: ignore[arg-type]


def attend_shares(
    shard: RankShard, layer_idx: int, x: torch.Tensor, positions: torch.Tensor, shares: Sequence[CacheContext]
) -> torch.Tensor:
    """This rank's partial o_proj output [n, H]: its query heads over the caches of every member
    of its DCP group (`shares`, in CP rank order, this step's entries already written)."""
    lw, d, n = shard.layers[layer_idx], shard.cfg.head_dim, x.shape[0]
    cos, sin = rope_cos_sin(positions, d, shard.cfg.rope_theta, x.dtype)
    q = apply_rope(F.linear(x, lw.wq).view(n, shard.num_q_heads, d), cos, sin)
    outs, lses = [], []
    for ctx in shares:
        k, v, k_positions = _share_kv(shard, lw, ctx)
        out, lse = partial_attention(q, k, v, positions, k_positions)
        outs.append(out)
        lses.append(lse)
    out = combine(outs, lses).to(x.dtype)  # [n, hq, d]
    return F.linear(out.reshape(n, -1), lw.wo)


def _share_kv(shard: RankShard, lw: LayerShard, ctx: CacheContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V [t, hkv, d] of the context tokens one member's cache holds, and their positions [t]
    (MLA: that member's latent up-projected with this rank's heads' weights)."""
    assert ctx.held is not None, "a DCP context carries the slots its share holds (runner._forward)"
    slots, k_positions = ctx.held
    if lw.w_dkv is None:
        k, v = ctx.cache.gather_kv_slots(lw.name, slots)
        return k, v, k_positions
    d = shard.cfg.head_dim
    latent = ctx.cache.gather_flat_slots(lw.name, slots)  # [t, latent]
    kv = F.linear(latent, lw.w_ukv).view(-1, shard.num_q_heads, 2, d)  # type: ignore[arg-type]
    cos, sin = rope_cos_sin(k_positions, d, shard.cfg.rope_theta, latent.dtype)
    return apply_rope(kv[:, :, 0], cos, sin), kv[:, :, 1], k_positions
