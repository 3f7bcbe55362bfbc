"""A store that stalls never costs more than one bound, never writes KV into blocks the engine
reuses, never reports a failure twice and never leaks: the holes a review found (each test fails
on the code before its fix). Embedded store with FaultyStore delays; single worker."""

from __future__ import annotations

import time

from layerkv.store.base import Code
from layerkv.store.faults import (
    GET_END,
    GET_INTO,
    GET_RANGES,
    GET_START,
    IS_EXIST,
    PUT_END,
    PUT_FROM,
    PUT_RANGES,
    PUT_REVOKE,
    PUT_START,
    REMOVE,
)
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens

STUCK_S = 8.0  # a read held this long (or until the test releases it): the stall a bound is compared with


def test_a_given_up_load_writes_nothing_into_the_cache_afterwards(make_rig) -> None:
    rig = make_rig(num_layers=3, read_layers_per_range=2, load_timeout_s=0.3)
    tokens = block_tokens(3, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", list(tokens))
    rig.faults[0].delay(GET_RANGES, 1.0, layer_idx=1, times=1)  # the group [1, 3) read is late
    _, s = rig.admit(b)
    invalid, _ = rig.worker_step([s])
    loaded = b.block_ids[:3]
    assert invalid == set(loaded)
    for cache in rig.caches[0].values():  # the engine reuses the blocks
        cache[:, loaded] = -7.0
    assert rig.workers[0].is_idle(5.0)  # the late read returned; the job ended
    for layer_idx in range(3):
        assert {float(rig.block_values(0, layer_idx, blk).flatten()[0]) for blk in loaded} == {-7.0}


def test_loads_while_an_earlier_load_is_stuck_are_recomputed_at_once(make_rig) -> None:
    rig = make_rig(num_layers=3, transfer_plan="whole", load_timeout_s=0.3)
    a_tokens, b_tokens = block_tokens(2, BLOCK_SIZE, base=0), block_tokens(2, BLOCK_SIZE, base=500)
    rig.run(Req("pa", a_tokens))
    rig.run(Req("pb", b_tokens))
    a = Req("a", list(a_tokens))
    rig.faults[0].delay(GET_INTO, STUCK_S, keys=rig.keys(a)[0], times=1)
    _, s = rig.admit(a)
    assert rig.worker_step([s])[0] == set(a.block_ids[:2])
    timeouts = rig.workers[0].stats().load_timeouts  # A's
    b = Req("b", list(b_tokens))
    _, s = rig.admit(b)
    start = time.monotonic()
    assert rig.worker_step([s])[0] == set(b.block_ids[:2])  # no new read into staging A's late copy may hit
    stats = rig.workers[0].stats()
    assert (stats.load_skipped_stuck, stats.load_timeouts) == (1, timeouts)  # skipped, not waited out
    assert time.monotonic() - start < STUCK_S / 4
    rig.faults[0].release()
    assert rig.workers[0].is_idle(5.0)
    c = Req("c", list(b_tokens))
    _, s = rig.admit(c)
    rig.poison(c)
    assert rig.worker_step([s])[0] == set() and rig.wrong_blocks(c, range(2)) == []


def test_each_load_failure_is_reported_once_in_the_speculative_decoding_hook_order(make_rig) -> None:
    rig = make_rig(num_layers=3)
    tokens = block_tokens(3, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", list(tokens))
    rig.faults[0].fail(GET_RANGES, rig.keys(b, blocks=[1])[0], code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)
    _, s = rig.admit(b)
    invalid, steps = rig.worker_step([s], deferred=True)
    assert invalid == {b.block_ids[1]} and len(steps) == 1
    c = Req("c", block_tokens(2, BLOCK_SIZE, base=300))
    _, s = rig.admit(c)
    invalid, steps = rig.worker_step([s], deferred=True)
    assert invalid == set() and len(steps) == 1  # not the same failure again


def test_a_step_whose_load_settled_after_the_error_report_is_held_back(make_rig) -> None:
    """Speculative decoding's order: load errors, then the step report, then wait_for_save. A
    load that settles (with a late failure) between the first two must not have its step
    reported with the errors read before it: the verdict would commit the saves of a request
    whose load failed. The step is held until its failures were reported."""
    rig = make_rig(num_layers=2)
    tokens = block_tokens(3, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", list(tokens))
    key = rig.keys(b, blocks=[1])[0]
    rig.faults[0].delay(GET_RANGES, 0.5, key, layer_idx=1, times=1)
    rig.faults[0].fail(GET_RANGES, key, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)
    _, s = rig.admit(b)
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    worker.wait_for_layer_load(rig.layer_name(0))
    assert worker.get_block_ids_with_load_errors() == set()  # layer 1's read still waits in the store
    assert worker.flush(5.0)  # ... and now it failed
    assert worker.report_steps() == ()  # held: its failure was not in the report just made
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == {b.block_ids[1]}
    assert len(worker.report_steps()) == 1
    worker.clear_connector_metadata()


def test_shutdown_with_a_slow_write_leaves_nothing_processing(make_rig, backend) -> None:
    rig = make_rig(num_layers=3, transfer_plan="auto")
    rig.faults[0].delay(PUT_RANGES, 7.0, times=1)
    a = Req("a", block_tokens(3, BLOCK_SIZE))
    _, s = rig.admit(a)
    rig.worker_step([s])  # returns once the layers are copied; the write goes on
    rig.workers[0].shutdown()
    assert rig.workers[0].commits.pending.num_keys() == 0
    assert backend.processing_keys(rig.keys(a)) == []
    rig.finished.add("a")


def test_a_stuck_write_stalls_neither_loads_nor_later_steps(make_rig) -> None:
    rig = make_rig(num_layers=2, transfer_plan="auto", transfer_lanes=2, load_timeout_s=1.0, save_timeout_s=1.0)
    pre = block_tokens(4, BLOCK_SIZE, base=100, extra=0)
    rig.run(Req("p", pre + [1]))
    r1 = Req("r1", block_tokens(8, BLOCK_SIZE, base=200))
    rig.faults[0].delay(PUT_RANGES, 60.0, keys=rig.keys(r1, blocks=[7])[0], times=1)  # in the second lane's part
    _, s = rig.admit(r1)
    rig.worker_step([s])
    c = Req("c", pre + block_tokens(2, BLOCK_SIZE, base=400))
    _, s = rig.admit(c)
    rig.poison(c)
    start = time.monotonic()
    invalid, _ = rig.worker_step([s])
    # a load queued behind the write would have given up after load_timeout_s: its blocks invalid
    assert invalid == set() and rig.workers[0].stats().load_timeouts == 0, "the load waited behind the stuck write"
    assert time.monotonic() - start < 60.0 / 4
    assert rig.wrong_blocks(c, range(4)) == []
    rig.faults[0].release()


def test_a_hung_master_costs_one_bound_not_one_per_step(make_rig) -> None:
    rig = make_rig(num_layers=2, transfer_plan="auto", store_call_timeout_s=0.5, store_retry_interval_s=30.0)
    meta = [IS_EXIST, PUT_START, PUT_END, PUT_REVOKE, GET_START, GET_END, GET_INTO, REMOVE, PUT_FROM]
    for faulty in (rig.sched_faults, *rig.faults):
        faulty.delay(meta, 60.0)  # the master hangs (no TCP reset)
    times = []
    for i in range(4):
        r = Req(f"r{i}", block_tokens(5, BLOCK_SIZE, base=100 + 50 * i))
        start = time.monotonic()
        _, s = rig.admit(r)
        rig.worker_step([s])
        times.append(time.monotonic() - start)
    assert max(times[1:]) < 0.2, times  # after the first bound the pool is skipped at once
    assert rig.scheduler.stats().save_blocks == 0  # no saves planned while the store is down
    for faulty in (rig.sched_faults, *rig.faults):
        faulty.release()


def test_a_stalled_save_shows_its_staging_bytes_in_the_gauges_until_it_ends(make_rig) -> None:
    rig = make_rig(num_layers=3, transfer_plan="whole")  # saves gather the cache into staging
    worker = rig.workers[0]
    assert worker.gauges()["staging_bytes_in_use"] == 0
    rig.faults[0].delay((PUT_RANGES, PUT_FROM), 1.0, times=1)  # the save's write holds its staging slots
    a = Req("a", block_tokens(2, BLOCK_SIZE))
    _, s = rig.admit(a)
    rig.step([s])  # wait_for_save does not wait for the write
    held = worker.gauges()
    assert held["running_jobs"] >= 1 and held["staging_bytes_in_use"] >= 2 * worker.layout.object_nbytes
    rig.settle()
    assert worker.gauges() == {"pending_puts": 0, "running_jobs": 0, "staging_bytes_in_use": 0}
