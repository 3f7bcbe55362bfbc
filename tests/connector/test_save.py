"""Worker save path: put-start failures keep block/key alignment, a failed range or commit
revokes only its key, saves of a request that read bad KV in the step are revoked, malformed
answers fail the whole call, and only committed keys become readable."""

from __future__ import annotations

from layerkv.messages import KVRole
from layerkv.store.base import Code
from layerkv.store.faults import GET_RANGES, PUT_END, PUT_RANGES, PUT_REVOKE, PUT_START
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def test_partial_put_start_failure_keeps_block_key_alignment(make_rig) -> None:
    rig = make_rig()
    tokens = block_tokens(9, BLOCK_SIZE)
    a = Req("a", tokens)
    keys = rig.keys(a)
    rig.faults[0].fail(PUT_START, keys[4], code=Code.NO_SPACE, times=1)
    rig.run(a)
    assert rig.pool_exists(keys) == [1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert rig.workers[0].stats().save_failed_keys == 1
    skipped = rig.workers[0].stats().save_skipped_existing
    rig.run(Req("b", tokens))  # b hits blocks 0-3 and computes 4-8: only block 4 is written, the rest exist
    assert rig.faults[0].calls(PUT_START)[-1].keys == tuple(keys[4:])  # planned without asking the store
    assert rig.workers[0].stats().save_skipped_existing - skipped == 4
    assert rig.pool_exists(keys) == [1] * 9
    c = Req("c", tokens)
    ext, s = rig.admit(c)
    assert ext == 9 * BLOCK_SIZE
    rig.step([s])
    assert rig.wrong_blocks(c, range(9)) == []


def test_range_failure_revokes_only_that_key(make_rig) -> None:
    rig = make_rig()
    a = Req("a", block_tokens(6, BLOCK_SIZE))
    keys = rig.keys(a)
    rig.faults[0].fail(PUT_RANGES, keys[2], layer_idx=1)
    rig.run(a)
    assert rig.pool_exists(keys) == [1, 1, 0, 1, 1, 1]
    assert rig.faults[0].keys_sent(PUT_REVOKE) == [keys[2]]
    layer2 = [c for c in rig.faults[0].calls(PUT_RANGES) if c.layer_idx == 2]
    assert keys[2] not in {k for c in layer2 for k in c.keys}  # later layers skip it
    stats = rig.workers[0].stats()
    assert (stats.committed_keys, stats.save_failed_keys) == (5, 1)


def test_commit_failure_revokes_only_that_key(make_rig) -> None:
    rig = make_rig()
    a = Req("a", block_tokens(6, BLOCK_SIZE))
    keys = rig.keys(a)
    rig.faults[0].fail(PUT_END, keys[3], code=Code.RPC_FAIL)
    rig.run(a)
    assert rig.pool_exists(keys) == [1, 1, 1, 0, 1, 1]
    assert rig.faults[0].keys_sent(PUT_REVOKE) == [keys[3]]
    stats = rig.workers[0].stats()
    assert (stats.committed_keys, stats.commit_failed) == (5, 1)


def test_tainted_step_saves_are_revoked(make_rig) -> None:
    rig = make_rig()
    prefix = block_tokens(4, BLOCK_SIZE, extra=0)
    rig.run(Req("p", prefix + [7]))
    a = Req("a", prefix + block_tokens(3, BLOCK_SIZE, base=1000))  # loads 4 blocks, computes 3 new ones
    b = Req("b", block_tokens(3, BLOCK_SIZE, base=5000))  # fresh request in the same step
    ext_a, sa = rig.admit(a)
    _, sb = rig.admit(b)
    assert ext_a == 4 * BLOCK_SIZE
    rig.faults[0].fail(GET_RANGES, rig.keys(a, blocks=[1]), layer_idx=0, times=1)
    invalid = rig.step([sa, sb])
    assert invalid == {a.block_ids[1]}
    assert a.num_computed == BLOCK_SIZE  # rewound to the invalid block; recompute it
    rig.step([rig.chunk(a)])  # carries the verdict on the failed step
    rig.flush()  # commits run in the background
    assert rig.pool_exists(rig.keys(b)) == [1, 1, 1]
    assert rig.workers[0].stats().revoked_tainted == 3
    assert rig.wrong_blocks(a, range(7)) == []
    rig.settle()
    assert rig.pool_exists(rig.keys(a)) == [1] * 7


def test_malformed_put_answers_fail_the_whole_call(make_rig, backend) -> None:
    rig = make_rig(max_transfer_blocks=4)
    a = Req("a", block_tokens(6, BLOCK_SIZE))
    keys = rig.keys(a)
    # the first chunk of 4 put starts was applied by the store, but its answer is lost
    rig.faults[0].malformed(PUT_START, [0], forward=True, times=1)
    rig.run(a)
    assert rig.pool_exists(keys) == [0, 0, 0, 0, 1, 1]
    assert backend.processing_keys(keys) == []
    b = Req("b", block_tokens(6, BLOCK_SIZE, base=100))
    rig.faults[0].malformed(PUT_END, True, times=1)  # a bool for the first 4 commits
    rig.run(b)
    assert rig.pool_exists(rig.keys(b)) == [0, 0, 0, 0, 1, 1]
    assert backend.processing_keys(rig.keys(b)) == []


def test_a_step_run_without_the_layer_hooks_saves_from_the_cache_after_the_forward(make_rig) -> None:
    """A step vLLM replayed as one full CUDA graph calls no save_kv_layer (start_load_kv and
    wait_for_save run): every layer is handed at the end of the forward and copied from the
    cache then (connector/graphs.py). The objects are whole and correct: another engine loads
    them bit for bit; the step is counted."""
    rig = make_rig(role=KVRole.PRODUCER, call_save=False, transfer_plan="groups")
    a = Req("a", block_tokens(4, BLOCK_SIZE))
    rig.run(a)
    assert rig.pool_exists(rig.keys(a)) == [1, 1, 1, 1]
    stats = rig.workers[0].stats()
    assert (stats.save_after_forward_steps, stats.save_incomplete_steps, stats.committed_keys) == (1, 0, 4)
    consumer = make_rig(role=KVRole.CONSUMER)
    c = Req("c", block_tokens(4, BLOCK_SIZE))
    ext, s = consumer.admit(c)
    assert ext == 4 * BLOCK_SIZE
    consumer.poison(c)
    assert consumer.step([s]) == set()
    assert consumer.wrong_blocks(c, range(4)) == []
