"""Reference model pieces: config validation, deterministic weights, TP shards that sum to the
full layer, head mapping, paged cache writes and gathers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from layerkv.engine.model import (
    ModelConfig,
    RankShard,
    apply_rope,
    causal_attention,
    init_weights,
    kv_heads_of_rank,
    rope_cos_sin,
)
from layerkv.engine.paged_cache import RankKVCache, slot_mapping
from layerkv.engine.runner import reduce_ranks
from layerkv.errors import ConfigError

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, seed=1)


def test_weights_are_a_function_of_the_seed() -> None:
    a, b, c = init_weights(CFG), init_weights(CFG), init_weights(ModelConfig(**{**_fields(CFG), "seed": 2}))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert a["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)


def _fields(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"dtype": "int8"}, "dtype='int8' must be one of"),
        ({"num_layers": 0}, "num_layers=0 must be a positive number"),
    ],
)
def test_bad_model_config_names_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kw)


def test_kv_heads_split_or_replicated_over_ranks() -> None:
    assert [kv_heads_of_rank(CFG, r, 1) for r in range(1)] == [(0, 1)]
    assert [kv_heads_of_rank(CFG, r, 2) for r in range(2)] == [(0,), (1,)]
    assert [kv_heads_of_rank(CFG, r, 4) for r in range(4)] == [(0,), (0,), (1,), (1,)]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_partials_sum_to_the_unsharded_layer(tp_size: int) -> None:
    weights = init_weights(CFG)
    full = RankShard(CFG, weights, 0, 1)
    shards = [RankShard(CFG, weights, r, tp_size) for r in range(tp_size)]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(3, 8)

    def attention(shard: RankShard) -> torch.Tensor:
        q, k, v = shard.qkv(1, x, pos)
        # context: positions 0..2 are random keys, 3..7 the new tokens
        k_ctx = torch.cat([torch.ones(3, shard.num_kv_heads, 8), k])
        v_ctx = torch.cat([torch.ones(3, shard.num_kv_heads, 8), v])
        return shard.attn_out(1, causal_attention(q, k_ctx, v_ctx, pos))

    torch.testing.assert_close(reduce_ranks([attention(s) for s in shards]), attention(full), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduce_ranks([s.mlp(0, x) for s in shards]), full.mlp(0, x), atol=1e-5, rtol=1e-5)


def test_causal_attention_ignores_future_keys() -> None:
    q, k, v = torch.randn(2, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    pos = torch.tensor([2, 3])
    out = causal_attention(q, k, v, pos)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = 100.0, 100.0  # positions after the last query
    assert torch.equal(out, causal_attention(q, k2, v2, pos))
    k2[3] = 100.0  # visible to the second query only
    changed = causal_attention(q, k2, v, pos)
    assert torch.equal(changed[0], out[0]) and not torch.equal(changed[1], out[1])
    allowed = torch.arange(6)[None, :] <= pos[:, None]  # [n, T]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=allowed
    )  # [hq, n, d]
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rope_rotates_pairs_and_keeps_norm() -> None:
    x = torch.randn(3, 2, 8)
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 7]), 8, 10000.0, torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0: identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_paged_cache_layout_write_and_gather() -> None:
    cache = RankKVCache(["model.layers.0.self_attn.attn"], num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tensor = cache.tensors["model.layers.0.self_attn.attn"]
    assert tensor.shape == (2, 6, 4, 2, 8)
    block_ids = [5, 2]
    slots = slot_mapping(block_ids, 2, 7, 4)
    assert slots.tolist() == [22, 23, 8, 9, 10]
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cache.write("model.layers.0.self_attn.attn", slots, k, v)
    assert torch.equal(tensor[0, 5, 2], k[0]) and torch.equal(tensor[1, 2, 2], v[4])
    k_all, v_all = cache.gather("model.layers.0.self_attn.attn", block_ids, 7)
    assert k_all.shape == (7, 2, 8) and torch.equal(k_all[2:], k) and torch.equal(v_all[2:], v)


def test_import_layerkv_does_not_import_torch() -> None:
    code = "import sys, layerkv, layerkv.hooks, layerkv.messages; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
