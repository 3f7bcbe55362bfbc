"""Reference model pieces: config validation, deterministic weights, TP shards that sum to the
full layer, head mapping, paged cache writes and gathers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from layerkv.engine.model import (
    CacheContext,
    ModelConfig,
    RankShard,
    apply_rope,
    cache_shapes,
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
    a, b, c = init_weights(CFG), init_weights(CFG), init_weights(dataclasses.replace(CFG, seed=2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert a["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"dtype": "int8"}, "dtype='int8' must be one of"),
        ({"index_dim": -1}, "index_dim=-1 must be a number >= 0"),
        ({"num_layers": 0}, "num_layers=0 must be a number > 0"),
    ],
)
def test_bad_model_config_names_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kw)


def test_kv_heads_split_or_replicated_over_ranks() -> None:
    assert [kv_heads_of_rank(CFG, r, 1) for r in range(1)] == [(0, 1)]
    assert [kv_heads_of_rank(CFG, r, 2) for r in range(2)] == [(0,), (1,)]
    assert [kv_heads_of_rank(CFG, r, 4) for r in range(4)] == [(0,), (0,), (1,), (1,)]


def _attention_partial(cfg: ModelConfig, shard: RankShard, rank: int, tp_size: int, x: torch.Tensor) -> torch.Tensor:
    """Layer 1 attention of 5 tokens: 3 of an earlier step, then 2 (partials of the second step)."""
    cache = RankKVCache(cache_shapes(cfg, rank, tp_size, num_blocks=4, block_size=4), 4, torch.float32)
    blocks = (3, 1)
    for start, end in ((0, 3), (3, 5)):
        ctx = CacheContext(cache, slot_mapping(blocks, start, end, 4), blocks, end)
        out = shard.attention(1, x[start:end], torch.arange(start, end), ctx)
    return out


VARIANTS = {"gqa": {}, "mla": {"mla_latent_dim": 12}, "indexer": {"index_dim": 6}, "mtp": {"num_mtp_layers": 1}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_partials_sum_to_the_unsharded_layer(tp_size: int, variant: str) -> None:
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    weights = init_weights(cfg)
    full = RankShard(cfg, weights, 0, 1)
    shards = [RankShard(cfg, weights, r, tp_size) for r in range(tp_size)]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    expected = _attention_partial(cfg, full, 0, 1, x)
    got = reduce_ranks([_attention_partial(cfg, s, r, tp_size, x) for r, s in enumerate(shards)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduce_ranks([s.mlp(0, x) for s in shards]), full.mlp(0, x), atol=1e-5, rtol=1e-5)


def test_cache_shapes_per_variant() -> None:
    names = CFG.layer_names
    assert names == ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    assert cache_shapes(CFG, 1, 2, 10, 4) == {n: (2, 10, 4, 1, 8) for n in names}
    mla = dataclasses.replace(CFG, mla_latent_dim=12, index_dim=6, num_mtp_layers=1)
    shapes = cache_shapes(mla, 3, 4, 10, 4)
    assert list(shapes) == [
        "model.layers.0.self_attn.attn",
        "model.layers.0.self_attn.indexer.k_cache",
        "model.layers.1.self_attn.attn",
        "model.layers.1.self_attn.indexer.k_cache",
        "model.mtp.layers.0.self_attn.attn",
        "model.mtp.layers.0.self_attn.indexer.k_cache",
    ]
    assert shapes["model.layers.1.self_attn.attn"] == (10, 4, 12)
    assert shapes["model.mtp.layers.0.self_attn.indexer.k_cache"] == (10, 4, 6)


def test_mtp_layers_do_not_change_the_main_weights() -> None:
    base, mtp = init_weights(CFG), init_weights(dataclasses.replace(CFG, num_mtp_layers=1))
    assert all(torch.equal(base[k], mtp[k]) for k in base)
    assert "model.mtp.layers.0.self_attn.q_proj.weight" in mtp


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
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed,
    )  # [hq, n, d]
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rope_rotates_pairs_and_keeps_norm() -> None:
    x = torch.randn(3, 2, 8)
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 7]), 8, 10000.0, torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0: identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_paged_cache_layout_write_and_gather() -> None:
    name = "model.layers.0.self_attn.attn"
    cache = RankKVCache({name: (2, 6, 4, 2, 8), "flat": (6, 4, 3)}, block_size=4, dtype=torch.float32)
    tensor = cache.tensors[name]
    block_ids = [5, 2]
    slots = slot_mapping(block_ids, 2, 7, 4)
    assert slots.tolist() == [22, 23, 8, 9, 10]
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cache.write_kv(name, slots, k, v)
    assert torch.equal(tensor[0, 5, 2], k[0]) and torch.equal(tensor[1, 2, 2], v[4])
    k_all, v_all = cache.gather_kv(name, block_ids, 7)
    assert k_all.shape == (7, 2, 8) and torch.equal(k_all[2:], k) and torch.equal(v_all[2:], v)
    latent = torch.randn(5, 3)
    cache.write_flat("flat", slots, latent)
    assert torch.equal(cache.tensors["flat"][2, 0], latent[2])
    assert torch.equal(cache.gather_flat("flat", block_ids, 7)[2:], latent)


def test_import_layerkv_does_not_import_torch() -> None:
    code = "import sys, layerkv, layerkv.connector.hooks, layerkv.messages; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_hf_checkpoint_round_trip_gives_the_same_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from layerkv.engine import Engine
    from layerkv.engine.checkpoint import load_hf_checkpoint, save_hf_checkpoint

    cfg = dataclasses.replace(CFG, rope_theta=500000.0, rms_eps=1e-5)
    save_hf_checkpoint(cfg, init_weights(cfg), tmp_path)
    loaded_cfg, weights = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(cfg, seed=0)  # the seed is not part of a checkpoint
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = Engine(cfg).generate([prompt], max_tokens=3)[0]
    theirs = Engine(loaded_cfg, weights=weights).generate([prompt], max_tokens=3)[0]
    assert ours.token_ids == theirs.token_ids
    assert all(torch.equal(a, b) for a, b in zip(ours.logits, theirs.logits, strict=True))


def test_hf_checkpoint_with_a_missing_tensor_names_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    from layerkv.engine.checkpoint import load_hf_checkpoint, save_hf_checkpoint

    weights = init_weights(CFG)
    save_hf_checkpoint(CFG, weights, tmp_path)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_checkpoint(tmp_path)
