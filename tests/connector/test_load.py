"""Worker load path: a shared key is read once and its failure reaches every request using
it, get sessions end exactly once and never during a read, a failed/expired/malformed read
marks exactly its blocks invalid, and a thread exception or a stalled store never hangs."""

from __future__ import annotations

import time

import pytest

from layerkv.store.faults import GET_END, GET_RANGES, GET_START
from tests.connector.rig import BLOCK_SIZE, Req, assert_get_sessions_well_formed
from tests.tokens import block_tokens


def _two_sharing(rig, shared_blocks: int = 4):
    """Save a prefix, then admit two requests that both load it; returns (a, b, [sa, sb])."""
    prefix = block_tokens(shared_blocks, BLOCK_SIZE, extra=0)
    rig.run(Req("p", prefix + [1]))
    a, b = (
        Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100)),
        Req("b", prefix + block_tokens(2, BLOCK_SIZE, base=200)),
    )
    (ext_a, sa), (ext_b, sb) = rig.admit(a), rig.admit(b)
    assert ext_a == ext_b == shared_blocks * BLOCK_SIZE
    return a, b, [sa, sb]


def test_shared_load_key_is_read_once(make_rig) -> None:
    rig = make_rig()
    a, b, scheduled = _two_sharing(rig)
    rig.faults[0].clear_calls()
    assert rig.step(scheduled) == set()
    for layer in range(rig.num_layers):
        rows = [k for c in rig.faults[0].calls(GET_RANGES) if c.layer_idx == layer for k in c.keys]
        assert sorted(rows) == sorted(rig.keys(a, blocks=range(4)))  # 4 rows per layer, not 8
    assert rig.faults[0].keys_sent(GET_START) == rig.keys(a, blocks=range(4))
    assert rig.wrong_blocks(a, range(5)) == [] and rig.wrong_blocks(b, range(6)) == []
    assert rig.workers[0].stats().load_blocks == 8
    assert_get_sessions_well_formed(rig.faults[0])


def test_shared_key_failure_fans_out_to_every_request(make_rig) -> None:
    rig = make_rig()
    a, b, scheduled = _two_sharing(rig)
    rig.faults[0].fail(GET_RANGES, rig.keys(a, blocks=[2]), layer_idx=1, times=1)
    invalid = rig.step(scheduled)
    assert invalid == {a.block_ids[2], b.block_ids[2]}
    assert rig.workers[0].get_block_ids_with_load_errors() == set()  # reported once
    assert rig.scheduler.stats().load_failures == 2
    assert a.num_computed == b.num_computed == 2 * BLOCK_SIZE
    rig.step([rig.chunk(a), rig.chunk(b)])
    assert rig.wrong_blocks(a, range(5)) == [] and rig.wrong_blocks(b, range(6)) == []
    assert_get_sessions_well_formed(rig.faults[0])


def test_get_session_end_exactly_once_and_never_during_a_read(make_rig) -> None:
    rig = make_rig(prefetch_layers=2)
    _, _, scheduled = _two_sharing(rig)
    rig.faults[0].delay(GET_RANGES, 0.02)  # reads take a while: an early end would overlap
    rig.faults[0].clear_calls()
    rig.step(scheduled)
    assert len(rig.faults[0].calls(GET_END)) >= 1
    assert_get_sessions_well_formed(rig.faults[0])


@pytest.mark.parametrize("fault", ["fail", "expire", "raise", "malformed"])
def test_read_fault_marks_exactly_its_blocks_invalid(make_rig, fault) -> None:
    rig = make_rig(max_transfer_blocks=4)
    tokens = block_tokens(8, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", tokens)
    ext, s = rig.admit(b)
    keys = rig.keys(b)
    f = rig.faults[0]
    if fault == "fail":
        f.fail(GET_RANGES, keys[5], layer_idx=1, times=1)
        bad = {5}
    elif fault == "expire":
        f.expire_lease(keys[5], layer_idx=1, times=1)
        bad = {5}
    elif fault == "raise":  # CheckedStore turns it into RPC_FAIL for the chunk (keys 4..7)
        f.raise_in(GET_RANGES, keys=keys[5], layer_idx=1, times=1)
        bad = {4, 5, 6, 7}
    else:
        f.malformed(GET_RANGES, [1, 2], keys=keys[0], layer_idx=0, times=1)  # chunk of keys 0..3
        bad = {0, 1, 2, 3}
    invalid = rig.step([s])
    assert invalid == {b.block_ids[i] for i in bad}
    assert rig.workers[0].stats().load_failed_blocks == len(bad)
    first_layer_after = [c for c in f.calls(GET_RANGES) if c.layer_idx == rig.num_layers - 1]
    assert not {keys[i] for i in bad} & {k for c in first_layer_after for k in c.keys}  # later layers skip
    rig.step([rig.chunk(b)])  # recompute from the first invalid block
    assert rig.wrong_blocks(b, range(8)) == []
    assert_get_sessions_well_formed(f)


class _Boom(BaseException):
    """Escapes CheckedStore's `except Exception`: reaches the receive thread itself."""


def test_exception_in_the_receive_thread_does_not_hang(make_rig) -> None:
    rig = make_rig()
    tokens = block_tokens(4, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", tokens)
    _, s = rig.admit(b)
    rig.faults[0].raise_in(GET_RANGES, _Boom("thread dies"), layer_idx=1, times=1)
    invalid = rig.step([s])
    assert invalid == set(b.block_ids[:4])
    assert rig.workers[0].stats().transfer_errors == 1
    assert_get_sessions_well_formed(rig.faults[0])


def test_stalled_store_is_a_recompute_within_the_timeout_never_an_exception(make_rig) -> None:
    rig = make_rig(load_timeout_s=0.5)
    tokens = block_tokens(4, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", tokens)
    _, s = rig.admit(b)
    rig.faults[0].delay(GET_RANGES, 60.0, layer_idx=0)
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    start = time.monotonic()
    for layer_idx in range(rig.num_layers):  # returns: the engine goes on computing
        worker.wait_for_layer_load(rig.layer_name(layer_idx))
    worker.wait_for_save()
    assert time.monotonic() - start < 5.0  # bounded: not the 60 s stall
    assert worker.get_block_ids_with_load_errors() == set(b.block_ids[:4])
    assert worker.stats().load_timeouts == 1
    rig.faults[0].release()
    rig.end_step([s])
    assert worker.is_idle(5.0)
    assert_get_sessions_well_formed(rig.faults[0])


@pytest.mark.parametrize("prefetch", [1, 2])
def test_receive_thread_reads_exactly_prefetch_layers_ahead_of_compute(make_rig, prefetch) -> None:
    from layerkv.messages import SchedulerStep

    rig = make_rig(num_layers=5, prefetch_layers=prefetch)
    tokens = block_tokens(4, BLOCK_SIZE)
    rig.run(Req("a", tokens))
    b = Req("b", tokens)
    _, scheduled = rig.admit(b)
    worker, faulty = rig.workers[0], rig.faults[0]
    faulty.clear_calls()

    def layers_read() -> list[int]:
        return sorted({c.layer_idx for c in faulty.calls(GET_RANGES) if c.exit_seq is not None})

    def wait_for(expected: list[int]) -> None:
        deadline = time.monotonic() + 10
        while layers_read() != expected and time.monotonic() < deadline:
            time.sleep(0.005)  # polling the receive thread's progress, bounded
        assert layers_read() == expected

    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(SchedulerStep((scheduled,))))
    worker.start_load_kv()
    wait_for(list(range(prefetch + 1)))  # before compute starts: layer 0 and `prefetch` layers ahead
    worker.wait_for_layer_load(rig.layer_name(0))
    assert layers_read() == list(range(prefetch + 1))  # it stops there until compute moves on
    worker.wait_for_layer_load(rig.layer_name(1))
    wait_for(list(range(prefetch + 2)))
    for layer in range(2, 5):
        worker.wait_for_layer_load(rig.layer_name(layer))
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
