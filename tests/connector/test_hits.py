"""Scheduler side: a hit needs every storage rank, stops at the first miss, is asked in
windows that stop early, leaves the engine at least one token, and is never made of a
malformed exists answer."""

from __future__ import annotations

from layerkv.store.faults import IS_EXIST
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def test_hit_needs_every_storage_rank(make_rig, backend) -> None:
    rig = make_rig(tp_size=2, num_kv_heads=2)
    tokens = block_tokens(8, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    ext, _ = rig.admit(Req("b", tokens))
    assert ext == 8 * BLOCK_SIZE
    assert backend.remove(rig.keys(Req("x", tokens), rank=1, blocks=[0])) == [0]
    ext, _ = rig.admit(Req("c", tokens))
    assert ext == 0  # rank 0's key of block 0 alone is not a hit
    assert rig.scheduler.stats().hit_blocks == 8


def test_hit_stops_at_the_first_miss(make_rig, backend) -> None:
    rig = make_rig()
    tokens = block_tokens(8, BLOCK_SIZE)
    a = Req("a", tokens)
    rig.run(a)
    assert backend.remove(rig.keys(a, blocks=[3])) == [0]
    b = Req("b", tokens)
    ext, s = rig.admit(b)
    assert ext == 3 * BLOCK_SIZE  # blocks 4..7 are in the pool but come after the miss
    assert rig.step([s]) == set()
    assert rig.wrong_blocks(b, range(8)) == []  # 0..2 loaded, 3..7 computed


def test_windowed_queries_stop_at_the_first_window_with_a_miss(make_rig) -> None:
    rig = make_rig(exists_window_blocks=4)
    rig.run(Req("a", block_tokens(5, BLOCK_SIZE)))
    rig.sched_faults.clear_calls()
    ext, _ = rig.admit(Req("b", block_tokens(40, BLOCK_SIZE)))
    assert ext == 5 * BLOCK_SIZE
    calls = rig.sched_faults.calls(IS_EXIST)
    assert [len(c.keys) for c in calls] == [4, 8]  # blocks 0-3, then a doubled window 4-11 (miss at 5)
    assert rig.scheduler.stats().exists_calls >= 2


def test_full_hit_leaves_at_least_one_token(make_rig) -> None:
    rig = make_rig()
    aligned = block_tokens(6, BLOCK_SIZE, extra=0)
    rig.run(Req("a", aligned))
    ext, s = rig.admit(Req("b", aligned))
    assert ext == 5 * BLOCK_SIZE and s.num_scheduled_tokens == BLOCK_SIZE  # last block recomputed
    rig.step([s])
    ext, s = rig.admit(Req("c", aligned + [999]))
    assert ext == 6 * BLOCK_SIZE and s.num_scheduled_tokens == 1
    rig.step([s])


def test_malformed_exists_answer_is_a_miss_not_a_hit(make_rig) -> None:
    rig = make_rig()
    tokens = block_tokens(4, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    rig.sched_faults.malformed(IS_EXIST, [1], times=1)  # one int for 4 keys
    ext, _ = rig.admit(Req("b", tokens))
    assert ext == 0
    assert rig.scheduler.stats().lookup_errors >= 1
    ext, _ = rig.admit(Req("c", tokens))
    assert ext == 4 * BLOCK_SIZE


def test_pipeline_parallel_hit_needs_every_stage() -> None:
    """With pp_size 2 each stage writes its own layers under its own namespace; the scheduler
    (stage 0's view) counts a block only when both stages' objects are COMPLETE."""
    import dataclasses

    from layerkv.config import LayerKVConfig
    from layerkv.connector.scheduler import SchedulerConnector
    from layerkv.messages import Deployment, RequestView
    from layerkv.objects.keys import block_keys, namespace_for
    from layerkv.store.checked import CheckedStore
    from layerkv.store.embedded import EmbeddedStore

    store = CheckedStore(EmbeddedStore(32 << 20), max_batch_keys=64)
    base = Deployment(model_id="m", kv_dtype="float16", block_size=4, num_kv_heads=2, pp_size=2, kv_signature="s")
    scheduler = SchedulerConnector(LayerKVConfig.from_dict({}, env={}), base, store)
    hashes = tuple(bytes([i]) * 8 for i in range(3))
    view = RequestView("r", 13, 13, hashes)

    def commit(stage: int, blocks: range) -> None:
        keys = block_keys(
            namespace_for(dataclasses.replace(base, pp_rank=stage), "default"), [hashes[b] for b in blocks], 0
        )
        assert store.batch_put_session_start(keys, [64] * len(keys)) == [0] * len(keys)
        assert store.batch_put_session_end(keys) == [0] * len(keys)

    commit(0, range(3))
    assert scheduler.get_num_new_matched_tokens(view, 0) == (0, False)  # stage 1 has nothing
    commit(1, range(2))
    assert scheduler.get_num_new_matched_tokens(view, 0) == (8, False)  # both stages hold blocks 0-1


def test_a_long_full_hit_doubles_the_window(make_rig) -> None:
    rig = make_rig(exists_window_blocks=2, num_blocks=128)
    tokens = block_tokens(30, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    rig.sched_faults.clear_calls()
    ext, _ = rig.admit(Req("b", tokens))
    assert ext == 30 * BLOCK_SIZE
    # 2 + 4 + 8 + 16 blocks: four queries for 30 blocks instead of fifteen windows of 2
    assert [len(c.keys) for c in rig.sched_faults.calls(IS_EXIST)] == [2, 4, 8, 16]


def test_may_hit_asks_one_block_and_answers_what_the_pool_holds(make_rig, backend) -> None:
    """The cheap hint vLLM 0.34 asks for as a request arrives (connector/hybrid.py
    may_load_async): one exists query of the first block (every storage rank's key)."""
    rig = make_rig(tp_size=2, num_kv_heads=2)
    tokens = block_tokens(4, BLOCK_SIZE)
    assert rig.scheduler.may_hit(Req("a", tokens).view()) is False  # an empty pool
    rig.run(Req("a", tokens))
    rig.sched_faults.clear_calls()
    assert rig.scheduler.may_hit(Req("b", tokens).view()) is True
    assert [len(c.keys) for c in rig.sched_faults.calls(IS_EXIST)] == [2]  # block 0 on both storage ranks
    assert rig.scheduler.may_hit(Req("c", block_tokens(4, BLOCK_SIZE, base=1000)).view()) is False  # another prompt
    assert rig.scheduler.may_hit(Req("d", tokens[:BLOCK_SIZE]).view()) is False  # no full block before its last token
    assert backend.remove(rig.keys(Req("x", tokens), rank=1, blocks=[0])) == [0]
    assert rig.scheduler.may_hit(Req("e", tokens).view()) is False  # one storage rank's key is not a block
