"""The reference engine's Llama-style model: config, deterministic weights (HF names), and one
tensor-parallel rank's shard (RMSNorm, RoPE, GQA or MLA attention, optional indexer bias,
SwiGLU MLP, optional MTP draft layers) as plain functions.
Worker side; runs on the engine's compute thread only. Shapes: n = tokens of one request in
this step, T = context tokens, H = hidden, hq/hkv = query/KV heads on a rank, d = head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from layerkv.engine.paged_cache import CPShare, RankKVCache
from layerkv.errors import ConfigError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Weights = dict[str, torch.Tensor]  # HF (Llama) parameter names -> tensors, [out, in] for linears


def attn_layer_name(layer_idx: int) -> str:
    """vLLM's attention layer name, the key of the layer's KV cache."""
    return f"model.layers.{layer_idx}.self_attn.attn"


def indexer_cache_name(attn_name: str) -> str:
    """The sparse-attention indexer cache of the layer whose attention is `attn_name`."""
    return attn_name.removesuffix(".attn") + ".indexer.k_cache"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"
    mla_latent_dim: int = 0  # > 0: MLA attention, one latent cache entry [latent] per token
    index_dim: int = 0  # > 0: a sparse-attention indexer cache whose keys bias the scores
    num_mtp_layers: int = 0  # MTP/draft layers after the main ones (named model.mtp.layers.N)

    def __post_init__(self) -> None:
        optional = ("mla_latent_dim", "index_dim", "num_mtp_layers")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("seed", "dtype"):
                continue
            bad_type = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad_type or value < 0 or (value == 0 and f.name not in optional):
                rule = ">= 0" if f.name in optional else "> 0"
                raise ConfigError(f"ModelConfig.{f.name}={value!r} must be a number {rule}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.dtype not in TORCH_DTYPES:
            raise ConfigError(f"ModelConfig.dtype={self.dtype!r} must be one of {sorted(TORCH_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim > 0

    @property
    def num_total_layers(self) -> int:
        return self.num_layers + self.num_mtp_layers

    def layer_prefix(self, layer_idx: int) -> str:
        """Weight-name prefix of layer `layer_idx` (main layers first, then MTP layers)."""
        if layer_idx < self.num_layers:
            return f"model.layers.{layer_idx}."
        return f"model.mtp.layers.{layer_idx - self.num_layers}."

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Attention layer names of every layer (main, then MTP): the names hooks are called with."""
        return tuple(self.layer_prefix(i) + "self_attn.attn" for i in range(self.num_total_layers))


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight `cfg` needs (HF names; linears [out, in]), in creation order."""
    H, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def layer(p: str) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, H),
        }
        if cfg.is_mla:
            shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (cfg.mla_latent_dim, H)
            shapes[p + "self_attn.kv_b_proj.weight"] = (cfg.num_heads * 2 * d, cfg.mla_latent_dim)  # [h, (k|v)]
        else:
            shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, H)
            shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, H)
        if cfg.index_dim:
            shapes[p + "self_attn.indexer.wq.weight"] = (cfg.index_dim, H)
            shapes[p + "self_attn.indexer.wk.weight"] = (cfg.index_dim, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, cfg.num_heads * d)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, H)
        shapes[p + "mlp.up_proj.weight"] = (inter, H)
        shapes[p + "mlp.down_proj.weight"] = (H, inter)
        return shapes

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        shapes.update(layer(cfg.layer_prefix(i)))
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers, cfg.num_total_layers):  # last: the main model is the same without MTP
        shapes.update(layer(cfg.layer_prefix(i)))
    return shapes


def init_weights(cfg: ModelConfig) -> Weights:
    """Random weights, a pure function of `cfg` (seeded torch.Generator, fixed creation order)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    weights: Weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name == "model.embed_tokens.weight":
            w = torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # norms
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        weights[name] = w.to(cfg.torch_dtype)
    return weights


# ---- stateless pieces -----------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # [n, H]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [d/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, d]  (HF rotate_half convention)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # x: [n, h, d]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """q [n, hq, d] at absolute `q_positions` [n]; k/v [T, hkv, d] for positions 0..T-1;
    `bias` [n, T] is added to every head's scores (the indexer's term)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [T, hq, d]
    v = v.repeat_interleave(group, dim=1)
    scores = q.transpose(0, 1).float() @ k.permute(1, 2, 0).float()  # [hq, n, T]
    scores = scores / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.float()[None]
    future = torch.arange(k.shape[0])[None, :] > q_positions[:, None]  # [n, T]
    scores = scores.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v.transpose(0, 1)).transpose(0, 1)  # [n, hq, d]


# ---- tensor-parallel shard ------------------------------------------------------------------


def kv_heads_of_rank(cfg: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """KV heads rank `tp_rank` holds; replicated (one head per rank) when tp_size > num_kv_heads."""
    if tp_size > cfg.num_kv_heads:
        return (tp_rank // (tp_size // cfg.num_kv_heads),)
    per_rank = cfg.num_kv_heads // tp_size
    return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    if tp_size <= 0:
        raise ConfigError(f"tp_size={tp_size} must be >= 1")
    if cfg.num_heads % tp_size or cfg.intermediate_size % tp_size:
        raise ConfigError(
            f"tp_size={tp_size} must divide num_heads={cfg.num_heads} and intermediate_size={cfg.intermediate_size}"
        )
    if not cfg.is_mla and cfg.num_kv_heads % tp_size and tp_size % cfg.num_kv_heads:
        raise ConfigError(f"tp_size={tp_size} and num_kv_heads={cfg.num_kv_heads}: one must divide the other")


def cache_shapes(
    cfg: ModelConfig, tp_rank: int, tp_size: int, num_blocks: int, block_size: int
) -> dict[str, tuple[int, ...]]:
    """Cache name -> tensor shape on one rank, in layer order (attention, then its indexer)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name in cfg.layer_names:
        if cfg.is_mla:  # the same latent on every rank
            shapes[name] = (num_blocks, block_size, cfg.mla_latent_dim)
        else:
            num_kv_heads = len(kv_heads_of_rank(cfg, tp_rank, tp_size))
            shapes[name] = (2, num_blocks, block_size, num_kv_heads, cfg.head_dim)
        if cfg.index_dim:
            shapes[indexer_cache_name(name)] = (num_blocks, block_size, cfg.index_dim)
    return shapes


@dataclass(frozen=True, slots=True)
class LayerShard:
    name: str  # the attention layer name (cache key)
    wq: torch.Tensor  # [hq*d, H]
    wk: torch.Tensor | None  # GQA: [hkv*d, H]
    wv: torch.Tensor | None  # GQA: [hkv*d, H]
    w_dkv: torch.Tensor | None  # MLA: [latent, H] (replicated)
    w_ukv: torch.Tensor | None  # MLA: [hq*2*d, latent] (k|v per head)
    w_iq: torch.Tensor | None  # indexer: [index_dim, H] (replicated)
    w_ik: torch.Tensor | None  # indexer: [index_dim, H] (replicated)
    wo: torch.Tensor  # [H, hq*d]
    w_gate: torch.Tensor  # [I/tp, H]
    w_up: torch.Tensor  # [I/tp, H]
    w_down: torch.Tensor  # [H, I/tp]


class RankShard:
    """One TP rank's slice of every layer; its partial outputs are summed over ranks."""

    def __init__(self, cfg: ModelConfig, weights: Weights, tp_rank: int, tp_size: int) -> None:
        check_tp(cfg, tp_size)
        self.cfg = cfg
        d = cfg.head_dim
        q_per_rank, i_per_rank = cfg.num_heads // tp_size, cfg.intermediate_size // tp_size
        q_rows = slice(tp_rank * q_per_rank * d, (tp_rank + 1) * q_per_rank * d)
        kv_heads = kv_heads_of_rank(cfg, tp_rank, tp_size)
        kv_rows = slice(kv_heads[0] * d, (kv_heads[-1] + 1) * d)
        i_rows = slice(tp_rank * i_per_rank, (tp_rank + 1) * i_per_rank)
        self.num_q_heads = q_per_rank
        self.num_kv_heads = q_per_rank if cfg.is_mla else len(kv_heads)
        self.layers: list[LayerShard] = []
        for i, name in enumerate(cfg.layer_names):
            p = cfg.layer_prefix(i)

            def get(key: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor | None:
                full = weights.get(p + key)
                return None if full is None else full[rows, cols].contiguous()

            self.layers.append(
                LayerShard(
                    name=name,
                    wq=get("self_attn.q_proj.weight", q_rows),  # type: ignore[arg-type]
                    wk=get("self_attn.k_proj.weight", kv_rows),
                    wv=get("self_attn.v_proj.weight", kv_rows),
                    w_dkv=get("self_attn.kv_a_proj_with_mqa.weight"),
                    w_ukv=get("self_attn.kv_b_proj.weight", slice(q_rows.start * 2, q_rows.stop * 2)),
                    w_iq=get("self_attn.indexer.wq.weight"),
                    w_ik=get("self_attn.indexer.wk.weight"),
                    wo=get("self_attn.o_proj.weight", slice(None), q_rows),  # type: ignore[arg-type]
                    w_gate=get("mlp.gate_proj.weight", i_rows),  # type: ignore[arg-type]
                    w_up=get("mlp.up_proj.weight", i_rows),  # type: ignore[arg-type]
                    w_down=get("mlp.down_proj.weight", slice(None), i_rows),  # type: ignore[arg-type]
                )
            )

    def attention(self, layer_idx: int, x: torch.Tensor, positions: torch.Tensor, ctx: CacheContext) -> torch.Tensor:
        """x [n, H] (normed) at `positions` [n]: write this step's cache entries, attend over the
        request's context (ctx.num_tokens = positions[-1] + 1), return the partial o_proj [n, H]."""
        lw, d, n = self.layers[layer_idx], self.cfg.head_dim, x.shape[0]
        cos, sin = rope_cos_sin(positions, d, self.cfg.rope_theta, x.dtype)
        q = apply_rope(F.linear(x, lw.wq).view(n, self.num_q_heads, d), cos, sin)
        if lw.w_dkv is not None:  # MLA: cache the latent, up-project K/V for the whole context
            ctx.cache.write_flat(lw.name, ctx.slots, F.linear(x, lw.w_dkv))
            latent = ctx.cache.gather_flat(lw.name, ctx.block_ids, ctx.num_tokens)  # [T, latent]
            kv = F.linear(latent, lw.w_ukv).view(ctx.num_tokens, self.num_q_heads, 2, d)  # type: ignore[arg-type]
            ctx_cos, ctx_sin = rope_cos_sin(torch.arange(ctx.num_tokens), d, self.cfg.rope_theta, x.dtype)
            k, v = apply_rope(kv[:, :, 0], ctx_cos, ctx_sin), kv[:, :, 1]
        else:
            k = apply_rope(F.linear(x, lw.wk).view(n, self.num_kv_heads, d), cos, sin)  # type: ignore[arg-type]
            v = F.linear(x, lw.wv).view(n, self.num_kv_heads, d)  # type: ignore[arg-type]
            ctx.cache.write_kv(lw.name, ctx.slots, k, v)
            k, v = ctx.cache.gather_kv(lw.name, ctx.block_ids, ctx.num_tokens)  # [T, hkv, d]
        bias = None
        if lw.w_ik is not None:  # indexer: cached index keys bias every head's scores
            index_name = indexer_cache_name(lw.name)
            ctx.cache.write_flat(index_name, ctx.slots, F.linear(x, lw.w_ik))
            index_keys = ctx.cache.gather_flat(index_name, ctx.block_ids, ctx.num_tokens)  # [T, index_dim]
            bias = F.linear(x, lw.w_iq) @ index_keys.T / math.sqrt(index_keys.shape[-1])  # type: ignore[arg-type]
        out = causal_attention(q, k, v, positions, bias)  # [n, hq, d]
        return F.linear(out.reshape(n, -1), lw.wo)

    def mlp(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] (normed) -> this rank's partial SwiGLU output [n, H]."""
        lw = self.layers[layer_idx]
        return F.linear(F.silu(F.linear(x, lw.w_gate)) * F.linear(x, lw.w_up), lw.w_down)


@dataclass(frozen=True, slots=True)
class CacheContext:
    """Where one request's tokens of this step live in one rank's paged cache."""

    cache: RankKVCache
    slots: torch.Tensor  # [n] flat slots of this step's tokens (PAD_SLOT: another CP rank's)
    block_ids: tuple[int, ...]  # all of the request's blocks
    num_tokens: int  # context length including this step's tokens
    share: CPShare = CPShare()  # the rank's share of every block (the whole block without DCP)
    # DCP: (slots [t], positions [t]) of the context tokens this share's cache holds (paged_cache.local_slots),
    # computed once per step for every layer; None without DCP
    held: tuple[torch.Tensor, torch.Tensor] | None = None


class SharedParams:
    """Replicated parameters: embedding, per-layer norms, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        layers = range(cfg.num_total_layers)
        self.input_norms = [weights[cfg.layer_prefix(i) + "input_layernorm.weight"] for i in layers]
        self.post_norms = [weights[cfg.layer_prefix(i) + "post_attention_layernorm.weight"] for i in layers]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]  # [V, H]

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """h_last [H] -> float32 logits [V]."""
        return F.linear(rms_norm(h_last[None], self.final_norm, self.cfg.rms_eps), self.lm_head)[0].float()
