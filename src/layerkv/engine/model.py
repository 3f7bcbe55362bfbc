"""The reference engine's Llama-style model: config, deterministic weights (HF names), and one
tensor-parallel rank's shard (RMSNorm, RoPE, GQA attention, SwiGLU MLP) as plain functions.
Worker side; runs on the engine's compute thread only. Shapes: n = tokens of one request in
this step, T = context tokens, H = hidden, hq/hkv = query/KV heads on a rank, d = head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from layerkv.errors import ConfigError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Weights = dict[str, torch.Tensor]  # HF (Llama) parameter names -> tensors, [out, in] for linears


def attn_layer_name(layer_idx: int) -> str:
    """vLLM's attention layer name, the key of the layer's KV cache."""
    return f"model.layers.{layer_idx}.self_attn.attn"


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("seed", "dtype"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"ModelConfig.{f.name}={value!r} must be a positive number")
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
    def layer_names(self) -> tuple[str, ...]:
        return tuple(attn_layer_name(i) for i in range(self.num_layers))


def init_weights(cfg: ModelConfig) -> Weights:
    """Random weights, a pure function of `cfg` (seeded torch.Generator, fixed creation order)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    H, d, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
        return w.to(cfg.torch_dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(H, generator=gen)).to(cfg.torch_dtype)

    w: Weights = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, H, generator=gen).to(cfg.torch_dtype)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(cfg.num_heads * d, H)
        w[p + "self_attn.k_proj.weight"] = linear(cfg.num_kv_heads * d, H)
        w[p + "self_attn.v_proj.weight"] = linear(cfg.num_kv_heads * d, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, cfg.num_heads * d)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(I, H)
        w[p + "mlp.up_proj.weight"] = linear(I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = linear(cfg.vocab_size, H)
    return w


# ---- stateless pieces -----------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # [n, H]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [d/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, d]  (HF rotate_half convention)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # x: [n, h, d]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """q [n, hq, d] at absolute `q_positions` [n]; k/v [T, hkv, d] for positions 0..T-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [T, hq, d]
    v = v.repeat_interleave(group, dim=1)
    scores = q.transpose(0, 1).float() @ k.permute(1, 2, 0).float()  # [hq, n, T]
    scores = scores / math.sqrt(q.shape[-1])
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
    if cfg.num_kv_heads % tp_size and tp_size % cfg.num_kv_heads:
        raise ConfigError(f"tp_size={tp_size} and num_kv_heads={cfg.num_kv_heads}: one must divide the other")


@dataclass(frozen=True, slots=True)
class LayerShard:
    wq: torch.Tensor  # [hq*d, H]
    wk: torch.Tensor  # [hkv*d, H]
    wv: torch.Tensor  # [hkv*d, H]
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
        self.num_q_heads, self.num_kv_heads = q_per_rank, len(kv_heads)
        self.layers: list[LayerShard] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerShard(
                    wq=weights[p + "self_attn.q_proj.weight"][q_rows].contiguous(),
                    wk=weights[p + "self_attn.k_proj.weight"][kv_rows].contiguous(),
                    wv=weights[p + "self_attn.v_proj.weight"][kv_rows].contiguous(),
                    wo=weights[p + "self_attn.o_proj.weight"][:, q_rows].contiguous(),
                    w_gate=weights[p + "mlp.gate_proj.weight"][i_rows].contiguous(),
                    w_up=weights[p + "mlp.up_proj.weight"][i_rows].contiguous(),
                    w_down=weights[p + "mlp.down_proj.weight"][:, i_rows].contiguous(),
                )
            )

    def qkv(self, layer_idx: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [n, H] (normed) -> q [n, hq, d], k/v [n, hkv, d] with RoPE applied to q and k."""
        lw, d = self.layers[layer_idx], self.cfg.head_dim
        q = F.linear(x, lw.wq).view(-1, self.num_q_heads, d)
        k = F.linear(x, lw.wk).view(-1, self.num_kv_heads, d)
        v = F.linear(x, lw.wv).view(-1, self.num_kv_heads, d)
        cos, sin = rope_cos_sin(positions, d, self.cfg.rope_theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attn_out(self, layer_idx: int, attn: torch.Tensor) -> torch.Tensor:
        """attn [n, hq, d] -> this rank's partial o_proj output [n, H]."""
        return F.linear(attn.reshape(attn.shape[0], -1), self.layers[layer_idx].wo)

    def mlp(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] (normed) -> this rank's partial SwiGLU output [n, H]."""
        lw = self.layers[layer_idx]
        return F.linear(F.silu(F.linear(x, lw.w_gate)) * F.linear(x, lw.w_up), lw.w_down)


class SharedParams:
    """Replicated parameters: embedding, per-layer norms, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        self.input_norms = [weights[f"model.layers.{i}.input_layernorm.weight"] for i in range(cfg.num_layers)]
        self.post_norms = [weights[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(cfg.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]  # [V, H]

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """h_last [H] -> float32 logits [V]."""
        return F.linear(rms_norm(h_last[None], self.final_norm, self.cfg.rms_eps), self.lm_head)[0].float()
