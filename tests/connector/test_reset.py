"""A cache reset (vLLM's reset_prefix_cache(reset_connector=True) after new weights): nothing
written before it is served again, by name (a new namespace epoch the workers take from the
plan), and a request that ran across it saves nothing more."""

from __future__ import annotations

from layerkv.objects.manifest import manifest_key
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens

NUM_BLOCKS = 6


def test_after_a_reset_nothing_written_before_is_served(make_rig, backend) -> None:
    rig = make_rig(tp_size=2, num_kv_heads=2)
    tokens = block_tokens(NUM_BLOCKS, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    old_keys = rig.keys(Req("x", tokens))
    old_namespace = rig.scheduler.namespace
    assert rig.scheduler.reset_cache() is True
    ext, invalid = rig.run(Req("b", tokens))  # recomputed (new weights), saved in the new epoch
    assert (ext, invalid) == (0, set())
    assert backend.exists(old_keys) == [1] * NUM_BLOCKS  # unreachable by name, not deleted
    new_keys = rig.keys(Req("x", tokens))
    assert set(new_keys).isdisjoint(old_keys)
    assert all(w.namespace == rig.scheduler.namespace for w in rig.workers)  # the plan's epoch
    c = Req("c", tokens)
    ext, s = rig.admit(c)
    assert ext == NUM_BLOCKS * BLOCK_SIZE  # what b wrote after the reset is served
    rig.poison(c)
    assert rig.step([s]) == set()
    assert rig.wrong_blocks(c, range(NUM_BLOCKS)) == []
    stats = rig.scheduler.stats()
    assert (stats.cache_resets, stats.save_skipped_reset) == (1, 0)
    assert rig.scheduler._manifest_task.wait(5.0)  # each epoch's namespace has its manifest (layerkv pool)
    assert backend.exists([manifest_key(old_namespace), manifest_key(rig.scheduler.namespace)]) == [1, 1]


def test_a_request_running_across_a_reset_saves_nothing_more(make_rig) -> None:
    rig = make_rig()
    tokens = block_tokens(NUM_BLOCKS, BLOCK_SIZE, base=100)
    a = Req("a", tokens)
    _, s = rig.admit(a, budget=2 * BLOCK_SIZE)
    rig.step([s])  # blocks 0-1 computed with the old weights
    rig.scheduler.reset_cache()
    while not a.done:  # its later blocks attend to the old weights' KV: never saved
        rig.step([rig.chunk(a, 2 * BLOCK_SIZE)])
    rig.settle()
    ext, _ = rig.admit(Req("b", tokens))
    assert ext == 0
    assert (
        rig.scheduler.stats().save_skipped_reset == 2
    )  # its 2 chunks after the reset that complete blocks (not the last token)
    rig.finish(a)
    rig.run(Req("d", tokens))  # a request that starts after the reset saves
    assert rig.admit(Req("e", tokens))[0] == NUM_BLOCKS * BLOCK_SIZE
