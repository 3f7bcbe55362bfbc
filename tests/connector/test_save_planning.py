"""Save planning without the store (connector/saved.py): the scheduler side never asks which
blocks exist before planning saves; it skips what this engine committed itself, the worker's put
start skips what someone else wrote, and a block the pool lost is saved again once a lookup
misses it."""

from __future__ import annotations

import pytest

from layerkv.connector.saved import SavedBlocks
from layerkv.messages import KVRole
from layerkv.store.faults import IS_EXIST, PUT_START
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def test_saves_are_planned_with_the_scheduler_store_unreachable(make_rig, backend) -> None:
    """After the lookup, every exists call of the scheduler side would hang: the request's
    chunks still plan their saves at once, and the pool holds them."""
    rig = make_rig()
    a = Req("a", block_tokens(4, BLOCK_SIZE))
    ext, s = rig.admit(a, budget=2 * BLOCK_SIZE)
    assert ext == 0
    asked = len(rig.sched_faults.calls(IS_EXIST))
    rig.sched_faults.delay(IS_EXIST, 60.0)  # a call would hang (bounded by the store's call timeout)
    try:
        rig.step([s])
        while not a.done:
            rig.step([rig.chunk(a, 2 * BLOCK_SIZE)])
        rig.settle()
    finally:
        rig.sched_faults.release()
    assert len(rig.sched_faults.calls(IS_EXIST)) == asked
    assert backend.exists(rig.keys(a)) == [1] * 4
    assert rig.scheduler.stats().save_blocks == 4


def test_a_producer_does_not_plan_again_what_it_committed(make_rig) -> None:
    """A kv_producer never looks up: the same prompt computed again plans no save (its blocks
    were committed by this engine) and the worker starts no put."""
    rig = make_rig(role=KVRole.PRODUCER)
    tokens = block_tokens(4, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    puts = len(rig.faults[0].calls(PUT_START))
    rig.run(Req("b", tokens))
    assert len(rig.faults[0].calls(PUT_START)) == puts
    stats = rig.scheduler.stats()
    assert (stats.save_blocks, stats.save_skipped_existing) == (4, 4)


def test_a_block_the_pool_lost_is_saved_again_once_a_lookup_misses_it(make_rig, backend) -> None:
    rig = make_rig()
    tokens = block_tokens(4, BLOCK_SIZE)
    a = Req("a", tokens)
    rig.run(a)
    keys = rig.keys(a)
    assert backend.remove([keys[2]]) == [0]  # evicted behind the engine's back
    b = Req("b", tokens)
    ext, _ = rig.run(b)
    assert ext == 2 * BLOCK_SIZE  # the hit stops at the lost block; b computes blocks 2 and 3
    assert rig.faults[0].calls(PUT_START)[-1].keys == tuple(keys[2:])
    assert backend.exists(keys) == [1] * 4


def test_saved_blocks_keep_the_newest_up_to_capacity_and_forget_on_demand() -> None:
    saved = SavedBlocks(capacity=3)
    saved.add([b"a", b"b", b"c"])
    saved.add([b"a", b"d"])  # a becomes the newest; b, the oldest, is dropped
    assert [h for h in (b"a", b"b", b"c", b"d") if h in saved] == [b"a", b"c", b"d"]
    saved.forget([b"c", b"x"])
    assert len(saved) == 2 and b"c" not in saved
    saved.clear()
    assert len(saved) == 0
    with pytest.raises(ValueError):
        SavedBlocks(capacity=0)
