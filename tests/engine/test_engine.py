"""Reference engine end to end: vLLM's hook order, bit-identical logits with KV copied from
another engine (TP 1/2/4), load-failure recovery, TP consistency."""

from __future__ import annotations

import pytest
import torch

from layerkv.engine import Engine, EngineConfig, ModelConfig, block_hashes
from layerkv.errors import ConfigError
from tests.engine.engine_doubles import CopyScheduler, CopyWorker, RecordingScheduler, RecordingWorker

BS = 4
CFG = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=3)
PREFIX = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]  # 3 full blocks
P1 = PREFIX + [1, 2, 3, 4, 5]
P2 = PREFIX + [201, 202, 203, 204, 205, 206]


def engine_config(tp_size: int = 1, **kw: int) -> EngineConfig:
    return EngineConfig(block_size=BS, num_blocks=32, max_num_batched_tokens=64, tp_size=tp_size, **kw)


def copy_engine(
    source: Engine, tp_size: int, fail_copy_idx: frozenset[int] = frozenset(), corrupt: str = "", cfg: ModelConfig = CFG
) -> Engine:
    workers = [CopyWorker(source.caches_for_rank(r), fail_copy_idx, corrupt) for r in range(tp_size)]
    return Engine(cfg, engine_config(tp_size), CopyScheduler(source, BS, max_blocks=3), workers)


def test_hook_call_order_matches_vllm() -> None:
    calls: list = []
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64)
    engine = Engine(cfg, engine_config(2), RecordingScheduler(calls), [RecordingWorker(r, calls) for r in range(2)])
    out = engine.generate([[1, 2, 3, 4, 5]], max_tokens=1)[0]
    engine.shutdown()
    l0, l1 = cfg.layer_names
    rid = out.req_id

    def tail(finished: frozenset) -> list:
        return [
            *[
                c
                for r in ("w0", "w1")
                for c in ((r, "wait_for_save"), (r, "get_finished", finished), (r, "get_block_ids_with_load_errors"))
            ],
            ("w0", "clear_connector_metadata"),
            ("w1", "clear_connector_metadata"),
            ("sched", "update_connector_output"),
        ]

    expected = [
        ("w0", "register_kv_caches", ((l0, l1), 32)),
        ("w1", "register_kv_caches", ((l0, l1), 32)),
        ("sched", "get_num_new_matched_tokens", (rid, 0)),
        ("sched", "update_state_after_alloc", (rid, 0)),
        ("sched", "build_connector_meta"),
        *[(r, name) for r in ("w0", "w1") for name in ("bind_connector_metadata", "start_load_kv")],
        *[
            (r, op, layer)
            for layer in (l0, l1)
            for r in ("w0", "w1")
            for op in ("wait_for_layer_load", "save_kv_layer")
        ],
        *tail(frozenset()),
        ("sched", "request_finished", rid),
        # vLLM runs one more (forward-less) step to tell the workers which requests finished
        ("sched", "build_connector_meta"),
        *[(r, name) for r in ("w0", "w1") for name in ("bind_connector_metadata", "start_load_kv")],
        *tail(frozenset({rid})),
        ("w0", "shutdown"),
        ("w1", "shutdown"),
    ]
    got = [c if len(e) == 3 else c[:2] for c, e in zip(calls, expected)]
    assert got == expected and len(calls) == len(expected)
    step0, step1 = [c[2] for c in calls if c[1] == "build_connector_meta"]
    assert [(r.req_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in step0.requests] == [(rid, 0, 5)]
    assert step0.requests[0].block_hashes == block_hashes([1, 2, 3, 4, 5], BS)
    assert step1.requests == () and step1.finished_req_ids == {rid}
    metas = [c[2] for c in calls if c[1] == "bind_connector_metadata"]
    assert metas[0] == metas[1] and metas[2] == metas[3] and metas[0] != metas[2]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_logits_bit_identical_with_kv_copied_from_another_engine(tp_size: int) -> None:
    local = Engine(CFG, engine_config(tp_size))
    local.generate([P1], max_tokens=3)
    out_local = local.generate([P2], max_tokens=4)[0]
    assert out_local.num_local_cached_tokens == 12 and out_local.num_external_tokens == 0

    remote = copy_engine(local, tp_size)
    out_remote = remote.generate([P2], max_tokens=4)[0]
    assert out_remote.num_local_cached_tokens == 0 and out_remote.num_external_tokens == 12
    assert remote.steps[0].requests[0].num_external_tokens == 12
    assert remote.steps[0].requests[0].num_scheduled_tokens == len(P2) - 12
    assert all(w.layers_loaded == list(CFG.layer_names) for w in remote.runner.worker_hooks)
    assert out_remote.token_ids == out_local.token_ids
    assert all(torch.equal(a, b) for a, b in zip(out_local.logits, out_remote.logits, strict=True))
    # loaded blocks entered the local prefix cache after the successful load
    assert len(remote.scheduler.block_pool.cached_prefix(block_hashes(PREFIX, BS))) == 3


def test_loaded_kv_is_really_used() -> None:
    """Control: the same flow with wrong KV bytes must change the logits."""
    local = Engine(CFG, engine_config())
    local.generate([P1], max_tokens=1)
    out_local = local.generate([P2], max_tokens=2)[0]
    for cache in local.caches_for_rank(0).values():
        cache[:, :, 1] += 0.5  # perturb one token slot of every block
    out_remote = copy_engine(local, 1).generate([P2], max_tokens=2)[0]
    assert not torch.equal(out_local.logits[0], out_remote.logits[0])


def test_failed_first_block_recomputes_everything_bit_identically() -> None:
    local = Engine(CFG, engine_config(2))
    local.generate([P1], max_tokens=1)
    cold = Engine(CFG, engine_config(2)).generate([P2], max_tokens=4)[0]

    remote = copy_engine(local, 2, fail_copy_idx=frozenset({0}))
    out = remote.generate([P2], max_tokens=4)[0]
    first, second = remote.steps[0], remote.steps[1]
    assert first.discarded_req_ids == {out.req_id} and len(first.invalid_block_ids) == 1
    assert (second.requests[0].num_computed_tokens, second.requests[0].num_scheduled_tokens) == (0, len(P2))
    assert out.token_ids == cold.token_ids and len(out.logits) == 4
    assert all(torch.equal(a, b) for a, b in zip(cold.logits, out.logits, strict=True))


def test_failed_middle_block_recomputes_from_it_and_is_never_cached() -> None:
    local = Engine(CFG, engine_config())
    local.generate([P1], max_tokens=1)
    cold = Engine(CFG, engine_config()).generate([P2], max_tokens=4)[0]

    remote = copy_engine(local, 1, fail_copy_idx=frozenset({1}))
    req_id = remote.add_request(P2, max_tokens=4)
    record = remote.step()
    hashes = block_hashes(PREFIX, BS)
    pool = remote.scheduler.block_pool
    (bad_block,) = record.invalid_block_ids
    assert record.discarded_req_ids == {req_id}
    assert pool.cached_block_id(hashes[0]) is not None  # loaded fine, before the failure
    assert pool.cached_block_id(hashes[1]) is None and pool.cached_block_id(hashes[2]) is None
    assert remote.scheduler.requests[req_id].output_token_ids == []  # the step's output was dropped
    record = remote.step()
    assert (record.requests[0].num_computed_tokens, record.requests[0].num_scheduled_tokens) == (4, len(P2) - 4)
    assert pool.cached_block_id(hashes[1]) == bad_block  # recomputed, now valid
    while remote.has_work():
        remote.step()
    out = remote.scheduler.requests[req_id].to_output()
    assert out.token_ids == cold.token_ids
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(cold.logits, out.logits, strict=True))


def test_tp1_and_tp2_give_the_same_tokens() -> None:
    prompts = [P1, P2, [9, 8, 7]]
    out1 = Engine(CFG, engine_config(1)).generate(prompts, max_tokens=6)
    out2 = Engine(CFG, engine_config(2)).generate(prompts, max_tokens=6)
    assert [o.token_ids for o in out1] == [o.token_ids for o in out2]
    assert all(torch.allclose(a, b, atol=1e-4) for o1, o2 in zip(out1, out2) for a, b in zip(o1.logits, o2.logits))


def test_outputs_report_timings_and_float32_logits() -> None:
    out = Engine(CFG, engine_config()).generate([P1], max_tokens=3)[0]
    assert len(out.token_ids) == 3 and out.arrival_time_s <= out.first_token_time_s <= out.finish_time_s
    assert out.ttft_s >= 0 and all(logit.dtype == torch.float32 and logit.shape == (256,) for logit in out.logits)
    assert out.token_ids == tuple(int(torch.argmax(logit)) for logit in out.logits)


def test_wrong_number_of_worker_hooks_is_rejected() -> None:
    with pytest.raises(ConfigError, match="worker_hooks has 1 entries; tp_size=2"):
        Engine(CFG, engine_config(2), worker_hooks=[RecordingWorker(0, [])])


def test_tp_size_that_does_not_divide_heads_is_rejected() -> None:
    with pytest.raises(ConfigError, match="tp_size=3 must divide num_heads=4"):
        Engine(CFG, engine_config(3))


VARIANT_CFG = ModelConfig(
    num_layers=3,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    seed=9,
    mla_latent_dim=24,
    index_dim=8,
    num_mtp_layers=1,
)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_mla_indexer_mtp_bit_identical_with_copied_caches(tp_size: int) -> None:
    local = Engine(VARIANT_CFG, engine_config(tp_size))
    names = list(local.caches_for_rank(0))
    assert names[:2] == ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"]
    assert names[-2:] == ["model.mtp.layers.0.self_attn.attn", "model.mtp.layers.0.self_attn.indexer.k_cache"]
    local.generate([P1], max_tokens=1)
    out_local = local.generate([P2], max_tokens=3)[0]
    assert out_local.num_local_cached_tokens == 12 and len(out_local.draft_token_ids) == 3

    remote = copy_engine(local, tp_size, cfg=VARIANT_CFG)
    out_remote = remote.generate([P2], max_tokens=3)[0]
    assert out_remote.num_external_tokens == 12
    assert remote.runner.worker_hooks[0].layers_loaded == list(VARIANT_CFG.layer_names)  # type: ignore[attr-defined]
    assert out_remote.token_ids == out_local.token_ids and out_remote.draft_token_ids == out_local.draft_token_ids
    pairs = [*zip(out_local.logits, out_remote.logits), *zip(out_local.draft_logits, out_remote.draft_logits)]
    assert len(pairs) == 6 and all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize(
    ("corrupt", "changes_main"),
    [("layers.1.self_attn.indexer", True), ("layers.2.self_attn.attn", True), ("mtp.layers.0.self_attn.attn", False)],
)
def test_every_cache_entry_matters(corrupt: str, changes_main: bool) -> None:
    """Wrong bytes in one cache (indexer, MLA latent, MTP) change what depends on it."""
    local = Engine(VARIANT_CFG, engine_config())
    local.generate([P1], max_tokens=1)
    out_local = local.generate([P2], max_tokens=1)[0]
    out = copy_engine(local, 1, corrupt=corrupt, cfg=VARIANT_CFG).generate([P2], max_tokens=1)[0]
    assert torch.equal(out.logits[0], out_local.logits[0]) is not changes_main
    assert not torch.equal(out.draft_logits[0], out_local.draft_logits[0])
