"""Decode context parallelism in the reference engine: vLLM's slot mapping, the partial
attention and its log-sum-exp combine, the config refusals, each rank caching only its share,
the hook order over a DCP group (KV copied at wait_for_layer_load gives bit-identical logits),
and DCP 2 close to DCP 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from layerkv.engine import Engine, EngineConfig, ModelConfig
from layerkv.engine.context_parallel import combine, partial_attention
from layerkv.engine.model import causal_attention
from layerkv.engine.paged_cache import PAD_SLOT, CPShare, cp_slot_mapping, local_slots, slot_mapping
from layerkv.errors import ConfigError
from tests.engine.engine_doubles import CopyScheduler, CopyWorker, RecordingScheduler, RecordingWorker

BS = 4
GQA = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=3)
MLA = dataclasses.replace(GQA, seed=4, mla_latent_dim=24, num_mtp_layers=1)
PREFIX = list(range(100, 124))  # 3 engine blocks of 8 (dcp 2)
P1, P2 = PREFIX + [1, 2, 3, 4, 5], PREFIX + [201, 202, 203, 204, 205, 206, 207, 208, 209]


def engine_config(tp_size: int, dcp_size: int = 1, cp_interleave: int = 1, **kw: int) -> EngineConfig:
    return EngineConfig(
        block_size=BS,
        num_blocks=32,
        max_num_batched_tokens=64,
        tp_size=tp_size,
        dcp_size=dcp_size,
        cp_interleave=cp_interleave,
        **kw,
    )


def vllm_slot(p: int, block_table: list[int], block_size: int, dcp: int, interleave: int, cp_rank: int) -> int:
    """vLLM's DCP slot-mapping formula for one position (design §1.4), scalar."""
    virtual_block, offset = divmod(p, block_size * dcp)
    if (offset // interleave) % dcp != cp_rank:
        return -1
    local_offset = (offset // (interleave * dcp)) * interleave + offset % interleave
    return block_table[virtual_block] * block_size + local_offset


@pytest.mark.parametrize("interleave", [1, 2, BS])
@pytest.mark.parametrize("dcp", [2, 4])
def test_cp_slot_mapping_is_vllms_formula(dcp: int, interleave: int) -> None:
    table = [5, 0, 3, 7]
    positions = torch.arange(len(table) * BS * dcp)
    slots = {r: cp_slot_mapping(table, positions, BS, CPShare(dcp, r, interleave)) for r in range(dcp)}
    for r in range(dcp):
        assert slots[r].tolist() == [vllm_slot(int(p), table, BS, dcp, interleave, r) for p in positions]
        mine = slots[r][slots[r] != PAD_SLOT]
        assert sorted(mine.tolist()) == sorted(b * BS + o for b in table for o in range(BS))  # each slot once
    owners = torch.stack([slots[r] != PAD_SLOT for r in range(dcp)]).sum(0)
    assert torch.equal(owners, torch.ones_like(owners))  # every position on exactly one rank
    if interleave == BS:  # rank r holds the contiguous slice [r*B, (r+1)*B) of every engine block
        assert (slots[1][BS : 2 * BS] == table[0] * BS + torch.arange(BS)).all()
    got, where = local_slots(table, 21, BS, CPShare(dcp, 1, interleave))
    assert torch.equal(where, positions[:21][slots[1][:21] != PAD_SLOT]) and torch.equal(got, slots[1][where])


def test_without_dcp_the_slot_mapping_is_the_plain_one() -> None:
    """block_id * block_size + offset of every position, none padded."""
    table, bs = [3, 1, 2], 4
    want = [3 * bs + 2, 3 * bs + 3, 1 * bs, 1 * bs + 1, 1 * bs + 2, 1 * bs + 3, 2 * bs, 2 * bs + 1, 2 * bs + 2]
    assert cp_slot_mapping(table, torch.arange(2, 11), bs, CPShare()).tolist() == want
    assert slot_mapping(table, 2, 11, bs).tolist() == want


def _qkv(n: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 100 + t)
    return torch.randn(n, 4, 8, generator=gen), torch.randn(t, 2, 8, generator=gen), torch.randn(t, 2, 8, generator=gen)


@pytest.mark.parametrize("dcp", [2, 3])
def test_combined_shares_equal_full_causal_attention(dcp: int) -> None:
    q, k, v = _qkv(5, 13)
    q_pos, k_pos = torch.arange(8, 13), torch.arange(13)
    owner = (k_pos // 2) % dcp  # interleave 2; some queries see no key of some share
    parts = [partial_attention(q, k[owner == r], v[owner == r], q_pos, k_pos[owner == r]) for r in range(dcp)]
    got = combine([o for o, _ in parts], [lse for _, lse in parts])
    torch.testing.assert_close(got, causal_attention(q, k, v, q_pos), atol=1e-5, rtol=1e-5)
    # one share holding every key: the partial is the attention, and combine leaves it bit for bit
    out, lse = partial_attention(q, k, v, q_pos, k_pos)
    torch.testing.assert_close(out, causal_attention(q, k, v, q_pos), atol=1e-5, rtol=1e-5)
    assert torch.equal(combine([out], [lse]), out)


def test_an_empty_share_is_minus_infinity_and_adds_nothing() -> None:
    q, k, v = _qkv(3, 6)
    q_pos = torch.arange(3)
    empty_out, empty_lse = partial_attention(q, k[:0], v[:0], q_pos, torch.arange(0))
    assert torch.equal(empty_out, torch.zeros(3, 4, 8)) and bool((empty_lse == float("-inf")).all())
    late_out, late_lse = partial_attention(q, k[3:], v[3:], q_pos, torch.arange(3, 6))  # keys after every query
    assert torch.equal(late_out, torch.zeros(3, 4, 8)) and bool((late_lse == float("-inf")).all())
    out, lse = partial_attention(q, k[:3], v[:3], q_pos, torch.arange(3))
    assert torch.equal(combine([out, empty_out, late_out], [lse, empty_lse, late_lse]), out)
    garbage = torch.full_like(lse, float("nan")), torch.full_like(lse, float("inf"))
    assert torch.equal(combine([out, out * 7, out * 9], [lse, *garbage]), out)  # NaN / +inf: an empty share


@pytest.mark.parametrize(
    ("model", "kw", "message"),
    [
        (GQA, {"tp_size": 2, "dcp_size": 4}, "dcp_size=4 must divide tp_size=2"),
        (GQA, {"tp_size": 2, "dcp_size": 2, "cp_interleave": 3}, "cp_interleave=3 must divide block_size=4"),
        (GQA, {"tp_size": 2, "dcp_size": 0}, "dcp_size=0 must be a positive int"),
        (GQA, {"tp_size": 2, "dcp_size": 2}, "tp_size must exceed num_kv_heads"),
        (dataclasses.replace(GQA, num_heads=8), {"tp_size": 8, "dcp_size": 8}, "must be a multiple of dcp_size"),
        (dataclasses.replace(MLA, index_dim=8), {"tp_size": 2, "dcp_size": 2}, "indexer"),
    ],
)
def test_dcp_refusals_name_the_rule(model: ModelConfig, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Engine(model, engine_config(**kw))


@pytest.mark.parametrize(("model", "tp_size"), [(MLA, 2), (GQA, 4)], ids=["mla-tp2", "gqa-tp4"])
def test_each_rank_caches_only_its_share(model: ModelConfig, tp_size: int) -> None:
    engine = Engine(model, engine_config(tp_size, dcp_size=2, cp_interleave=2))
    req_id = engine.add_request(P1, max_tokens=2)
    engine.step()  # the prompt, computed; its blocks still held
    block_ids = engine.scheduler.requests[req_id].block_ids
    name = model.layer_names[1]
    for rank in range(tp_size):
        cache = engine.caches_for_rank(rank)[name]
        if cache.dim() == 5:  # [2, num_blocks, block_size, heads, d] -> a row per slot
            cache = cache.permute(1, 2, 0, 3, 4)
        flat = cache.reshape(cache.shape[0] * BS, -1)  # [slots, entries of a token]
        slots = cp_slot_mapping(block_ids, torch.arange(len(P1)), BS, CPShare(2, rank % 2, 2))
        mine = slots[slots != PAD_SLOT]
        written = flat.abs().sum(-1) != 0  # [slots]
        assert written[mine].all() and int(written.sum()) == len(mine), f"rank {rank}"


def test_hook_order_waits_for_every_member_of_a_dcp_group_then_saves() -> None:
    """Per layer and DCP group: every member's wait_for_layer_load, then every member's save (that
    the attention runs between them is what the copied-KV test below proves)."""
    calls: list = []
    workers = [RecordingWorker(r, calls) for r in range(4)]
    engine = Engine(GQA, engine_config(4, dcp_size=2), RecordingScheduler(calls), workers)
    engine.generate([P1[:9]], max_tokens=1)
    layer_calls = [(who, op) for who, op, name in calls if name == GQA.layer_names[1]]
    waits_saves = [(w, "wait_for_layer_load") for w in ("w0", "w1")] + [(w, "save_kv_layer") for w in ("w0", "w1")]
    group2 = [(w.replace("0", "2").replace("1", "3"), op) for w, op in waits_saves]
    assert layer_calls == waits_saves + group2


@pytest.mark.parametrize(
    ("model", "tp_size", "interleave"),
    [(MLA, 2, 1), (MLA, 2, BS), (GQA, 4, 1), (MLA, 4, 2)],
    ids=["mla-tp2-i1", "mla-tp2-i4", "gqa-tp4-i1", "mla-tp4-i2"],
)
def test_logits_bit_identical_with_kv_copied_from_another_dcp_engine(
    model: ModelConfig, tp_size: int, interleave: int
) -> None:
    """Every rank's KV arrives in its wait_for_layer_load: a member's attention that read another
    member's cache before that member's load would see zeros."""
    config = engine_config(tp_size, dcp_size=2, cp_interleave=interleave)
    local = Engine(model, config)
    local.generate([P1], max_tokens=3)
    out_local = local.generate([P2], max_tokens=4)[0]
    assert out_local.num_local_cached_tokens == len(PREFIX)
    workers = [CopyWorker(local.caches_for_rank(r)) for r in range(tp_size)]
    remote = Engine(model, config, CopyScheduler(local, config.scheduler_block_size, max_blocks=3), workers)
    out_remote = remote.generate([P2], max_tokens=4)[0]
    assert out_remote.num_external_tokens == len(PREFIX) and out_remote.num_local_cached_tokens == 0
    assert out_remote.token_ids == out_local.token_ids
    pairs = [*zip(out_local.logits, out_remote.logits), *zip(out_local.draft_logits, out_remote.draft_logits)]
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize(("model", "tp_size"), [(MLA, 2), (GQA, 4)], ids=["mla-tp2", "gqa-tp4"])
@pytest.mark.parametrize("interleave", [1, BS])
def test_dcp2_is_close_to_dcp1(model: ModelConfig, tp_size: int, interleave: int) -> None:
    prompts = [P1, P2[:13], [9, 8, 7]]
    base = Engine(model, engine_config(tp_size)).generate(prompts, max_tokens=4)
    got = Engine(model, engine_config(tp_size, dcp_size=2, cp_interleave=interleave)).generate(prompts, max_tokens=4)
    for b, g in zip(base, got, strict=True):
        assert g.token_ids == b.token_ids
        for x, y in zip(b.logits, g.logits, strict=True):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
