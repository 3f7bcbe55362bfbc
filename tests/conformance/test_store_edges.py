"""Edge cases of the session contract, as a real Mooncake 0.3.13.post1 master answers them: a
failed get restart, a whole-object put of a key that exists, a put whose space the store released
before its end. Where Mooncake's answer would hand layerkv freed memory, the embedded store
answers otherwise on purpose: those tests expect one answer per backend, each marked
"deliberate:" with the reason (docs/data-safety.md lists them)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

from layerkv.store.base import Code, KVStore

if TYPE_CHECKING:
    from conftest import StoreHarness

OK = int(Code.OK)
INVALID = int(Code.INVALID_PARAMS)
ILLEGAL_CLIENT = int(Code.ILLEGAL_CLIENT)
INVALID_WRITE = int(Code.INVALID_WRITE)
NOT_READY = int(Code.REPLICA_NOT_READY)
NOT_FOUND = int(Code.OBJECT_NOT_FOUND)
NBYTES = 4096
PUT_RELEASE_S = 2  # Mooncake's put_start_release_timeout_sec of a releasing store (its minimum: 2)
RELEASE_DEADLINE_S = 20.0  # Mooncake releases in the background (~1-2 s after the timeout observed)


def _per_backend(h: StoreHarness, *, mooncake: object, embedded: object) -> object:
    """The answer `h`'s backend must give where the embedded store differs on purpose."""
    return embedded if h.name == "embedded" else mooncake


def _commit(h: StoreHarness, store: KVStore, key: str, fill: int) -> None:
    buf, ptr = h.alloc(NBYTES, store)
    buf[:] = fill
    assert store.batch_put_session_start([key], [NBYTES]) == [OK]
    assert store.batch_put_from_multi_buffer_ranges([key], [[ptr]], [[NBYTES]], [[0]]) == [NBYTES]
    assert store.batch_put_session_end([key]) == [OK]


def _read(h: StoreHarness, store: KVStore, key: str) -> tuple[int, np.ndarray]:
    """One ranged read of the whole object in `store`'s open get session."""
    buf, ptr = h.alloc(NBYTES, store)
    return store.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[NBYTES]], [[0]])[0], buf


def _content(h: StoreHarness, store: KVStore, key: str) -> np.ndarray:
    assert store.batch_get_session_start([key]) == [OK]
    result, buf = _read(h, store, key)
    assert store.batch_get_session_end([key]) == OK and result == NBYTES
    return buf


def _wait_released(h: StoreHarness, probe: KVStore, key: str) -> None:
    """Until `key`'s unfinished put is gone: a get start answers -704 instead of -703."""
    h.let_time_pass(PUT_RELEASE_S + 0.5)
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while (code := probe.batch_get_session_start([key])[0]) == NOT_READY and time.monotonic() < deadline:
        time.sleep(0.2)  # polling an external process's background release, with a deadline
    assert code == NOT_FOUND


# ---- get sessions ------------------------------------------------------------------------------
@pytest.mark.parametrize("reput", [False, True], ids=["removed", "removed-and-put-again"])
def test_a_failed_get_restart_drops_the_old_session(harness: StoreHarness, reput: bool) -> None:
    store, other = harness.store, harness.new_client()
    _commit(harness, store, "restart", 3)
    assert store.batch_get_session_start(["restart"]) == [OK]
    assert other.batch_remove(["restart"]) == [OK]
    if reput:
        assert other.batch_put_session_start(["restart"], [NBYTES]) == [OK]
    assert store.batch_get_session_start(["restart"]) == [NOT_READY if reput else NOT_FOUND]
    assert _read(harness, store, "restart")[0] == INVALID  # no session any more
    assert store.batch_get_session_end(["restart"]) == OK
    if reput:
        assert other.batch_put_session_revoke(["restart"]) == [OK]


def test_reading_an_object_removed_under_the_session(harness: StoreHarness) -> None:
    store, other = harness.store, harness.new_client()
    _commit(harness, store, "pulled", 9)
    assert store.batch_get_session_start(["pulled"]) == [OK]
    assert other.batch_remove(["pulled"]) == [OK]
    reads = [_read(harness, store, "pulled")[0] for _ in range(2)]
    # deliberate: Mooncake keeps reading the removed object's freed memory (whatever is there
    # now); the embedded store answers -704 once, then the session is gone (-600)
    assert reads == _per_backend(harness, mooncake=[NBYTES, NBYTES], embedded=[NOT_FOUND, INVALID])
    assert store.batch_get_session_end(["pulled"]) == OK


# ---- whole-object puts ---------------------------------------------------------------------------
@pytest.mark.parametrize("holder", ["own-put-session", "other-put-session", "committed"])
def test_a_whole_put_of_an_existing_key_answers_ok_and_writes_nothing(harness: StoreHarness, holder: str) -> None:
    store, other = harness.store, harness.new_client()
    writer = store if holder == "own-put-session" else other
    src, src_ptr = harness.alloc(NBYTES, store)
    src[:] = 5
    if holder == "committed":
        _commit(harness, writer, "held", 8)
    else:
        assert writer.batch_put_session_start(["held"], [NBYTES]) == [OK]
    assert store.batch_put_from(["held"], [src_ptr], [NBYTES]) == [OK]  # "already exists" is success
    if holder != "committed":  # the put session is untouched: its writer writes and commits
        buf, ptr = harness.alloc(NBYTES, writer)
        buf[:] = 8
        assert writer.batch_put_from_multi_buffer_ranges(["held"], [[ptr]], [[NBYTES]], [[0]]) == [NBYTES]
        assert writer.batch_put_session_end(["held"]) == [OK]
    assert (_content(harness, store, "held") == 8).all()


def test_the_same_key_twice_in_one_whole_put_keeps_the_last(harness: StoreHarness) -> None:
    store = harness.store
    src, src_ptr = harness.alloc(2 * NBYTES, store)
    src[:NBYTES], src[NBYTES:] = 1, 2
    assert store.batch_put_from(["twice-whole"] * 2, [src_ptr, src_ptr + NBYTES], [NBYTES] * 2) == [OK, OK]
    assert (_content(harness, store, "twice-whole") == 2).all()


# ---- put sessions whose space the store released -------------------------------------------------
def test_a_put_end_after_the_store_released_the_put_keeps_the_session(harness: StoreHarness) -> None:
    h = harness.make_releasing_store(PUT_RELEASE_S)
    store, probe = h.store, h.new_client()
    assert store.batch_put_session_start(["slow", "slow-2"], [NBYTES] * 2) == [OK, OK]
    _wait_released(h, probe, "slow")
    assert store.batch_put_session_end(["slow", "never"]) == [NOT_FOUND, INVALID]
    assert store.batch_put_session_end(["slow"]) == [NOT_FOUND]  # the session is still there
    assert store.batch_put_session_start(["slow"], [NBYTES]) == [INVALID]  # held by this client
    assert store.batch_put_session_revoke(["slow", "slow-2"]) == [OK, OK]  # revoke lets it go
    assert store.batch_put_session_end(["slow"]) == [INVALID]
    assert store.batch_put_session_revoke(["slow"]) == [INVALID]
    assert store.batch_put_session_start(["slow"], [NBYTES]) == [OK]
    assert store.batch_put_session_revoke(["slow"]) == [OK]


def test_a_released_put_another_client_took_over_is_illegal_client(harness: StoreHarness) -> None:
    h = harness.make_releasing_store(PUT_RELEASE_S)
    store, other = h.store, h.new_client()
    assert store.batch_put_session_start(["taken", "taken-done"], [NBYTES] * 2) == [OK, OK]
    _wait_released(h, other, "taken")
    assert other.batch_put_session_start(["taken"], [NBYTES]) == [OK]
    src, src_ptr = h.alloc(NBYTES, other)
    assert other.batch_put_from(["taken-done"], [src_ptr], [NBYTES]) == [OK]
    assert store.batch_put_session_end(["taken", "taken-done"]) == [ILLEGAL_CLIENT] * 2
    assert store.batch_put_session_revoke(["taken", "taken-done"]) == [ILLEGAL_CLIENT] * 2
    assert other.batch_put_session_end(["taken"]) == [OK]
    assert store.batch_is_exist(["taken", "taken-done"]) == [1, 1]


def test_a_whole_put_over_the_clients_own_released_put(harness: StoreHarness) -> None:
    h = harness.make_releasing_store(PUT_RELEASE_S)
    store, probe = h.store, h.new_client()
    src, src_ptr = h.alloc(NBYTES, store)
    src[:] = 4
    assert store.batch_put_session_start(["mine", "mine-2"], [NBYTES] * 2) == [OK, OK]
    _wait_released(h, probe, "mine")
    assert store.batch_put_from(["mine", "mine-2"], [src_ptr] * 2, [NBYTES] * 2) == [OK, OK]  # gone: written
    assert store.batch_put_session_revoke(["mine"]) == [INVALID_WRITE]  # committed: cannot revoke
    assert store.batch_put_session_start(["mine"], [NBYTES]) == [INVALID]  # the session is still there
    assert store.batch_put_session_end(["mine", "mine-2"]) == [OK, OK]  # ends it
    assert store.batch_put_session_revoke(["mine"]) == [INVALID]
    assert (_content(h, store, "mine") == 4).all()


def test_writing_into_a_released_put(harness: StoreHarness) -> None:
    h = harness.make_releasing_store(PUT_RELEASE_S)
    store, probe = h.store, h.new_client()
    _, ptr = h.alloc(NBYTES, store)
    assert store.batch_put_session_start(["freed"], [NBYTES]) == [OK]
    _wait_released(h, probe, "freed")
    written = store.batch_put_from_multi_buffer_ranges(["freed"], [[ptr]], [[NBYTES]], [[0]])
    # deliberate: Mooncake writes into the released space (which another object may hold by
    # now); the embedded store writes nothing and answers -704, as the put end does
    assert written == _per_backend(harness, mooncake=[NBYTES], embedded=[NOT_FOUND])
    assert store.batch_put_session_revoke(["freed"]) == [OK]
