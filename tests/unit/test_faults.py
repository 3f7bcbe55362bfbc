"""FaultyStore: rules fire deterministically, one-shot rules fire once, the call log is exact,
and under CheckedStore the layer index reaches the rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from layerkv.store.base import Code
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import GET_END, GET_RANGES, GET_START, IS_EXIST, PUT_END, PUT_RANGES, PUT_START, FaultyStore

N = 64  # bytes per test object


@pytest.fixture
def faulty():
    store = FaultyStore(EmbeddedStore(16 << 20))
    yield store
    store.close()


def _put(store, keys: list[str], buf: np.ndarray) -> list[int]:
    assert store.batch_put_session_start(keys, [N] * len(keys)) == [0] * len(keys)
    ptr = buf.ctypes.data
    got = store.batch_put_from_multi_buffer_ranges(keys, [[ptr]] * len(keys), [[N]] * len(keys), [[0]] * len(keys))
    return got


def test_no_rules_forwards_unchanged_and_logs_calls(faulty) -> None:
    buf = np.arange(N, dtype=np.uint8)
    assert _put(faulty, ["a", "b"], buf) == [N, N]
    assert faulty.batch_put_session_end(["a", "b"]) == [0, 0]
    assert faulty.batch_is_exist(["a", "b", "c"]) == [1, 1, 0]
    assert [c.method for c in faulty.calls()] == [PUT_START, PUT_RANGES, PUT_END, IS_EXIST]
    record = faulty.calls(IS_EXIST)[0]
    assert record.keys == ("a", "b", "c") and record.result == [1, 1, 0] and record.enter_seq < record.exit_seq
    assert faulty.keys_sent(PUT_START) == ["a", "b"]


def test_fail_key_is_not_forwarded_and_others_are(faulty) -> None:
    faulty.fail(PUT_START, "b", code=Code.NO_SPACE)
    assert faulty.batch_put_session_start(["a", "b", "c"], [N] * 3) == [0, int(Code.NO_SPACE), 0]
    assert faulty.batch_put_session_revoke(["a", "b", "c"]) == [0, int(Code.INVALID_PARAMS), 0]  # b never started


def test_one_shot_rule_fires_once_and_persistent_rule_keeps_firing(faulty) -> None:
    once = faulty.fail(IS_EXIST, lambda k: k.startswith("x"), code=-800, times=1)
    always = faulty.fail(IS_EXIST, ["y"], code=-900)
    assert faulty.batch_is_exist(["x1", "y"]) == [-800, -900]
    assert faulty.batch_is_exist(["x1", "y"]) == [0, -900]
    assert faulty.fired(once) == 1 and faulty.fired(always) == 2
    faulty.remove(always)
    assert faulty.batch_is_exist(["y"]) == [0]


def test_layer_rule_sees_the_layer_through_checked_store(faulty) -> None:
    checked = CheckedStore(faulty, max_batch_keys=8)
    buf = np.arange(N, dtype=np.uint8)
    faulty.fail(PUT_RANGES, "a", layer_idx=1)
    ptr = buf.ctypes.data
    args = ([[ptr]], [[N // 2]], [[0]])
    assert checked.batch_put_session_start(["a"], [N]) == [0]
    assert checked.batch_put_from_multi_buffer_ranges(["a"], *args, layer_idx=0) == [N // 2]
    assert checked.batch_put_from_multi_buffer_ranges(["a"], *args, layer_idx=1) == [int(Code.TRANSFER_FAIL)]
    assert [c.layer_idx for c in faulty.calls(PUT_RANGES)] == [0, 1]
    assert checked.batch_put_session_revoke(["a"]) == [0]


@pytest.mark.parametrize(
    "bad", [[0], [True, True], None, "x", [1 << 64, 1]], ids=["short", "bool", "none", "str", "past int64"]
)
def test_malformed_answers_become_malformed_codes_in_checked_store(faulty, bad) -> None:
    checked = CheckedStore(faulty, max_batch_keys=8)
    faulty.malformed(IS_EXIST, bad, times=1)
    assert checked.batch_is_exist(["a", "b"]) == [int(Code.MALFORMED)] * 2
    assert checked.batch_is_exist(["a", "b"]) == [0, 0]


def test_raise_with_forward_applies_the_call_first(faulty) -> None:
    faulty.raise_in(PUT_START, ValueError("boom"), forward=True, times=1)
    with pytest.raises(ValueError, match="boom"):
        faulty.batch_put_session_start(["a"], [N])
    assert faulty.batch_put_session_revoke(["a"]) == [0]  # the inner store did start it
    faulty.raise_in(GET_START)
    with pytest.raises(RuntimeError, match="injected fault: batch_get_session_start raised"):
        faulty.batch_get_session_start(["a"])
    assert faulty.calls(GET_START)[0].result is None


def test_expire_lease_returns_707_then_the_session_is_gone(faulty) -> None:
    buf = np.arange(N, dtype=np.uint8)
    _put(faulty, ["a"], buf)
    faulty.batch_put_session_end(["a"])
    assert faulty.batch_get_session_start(["a"]) == [0]
    out = np.zeros(N, dtype=np.uint8)
    args = ([[out.ctypes.data]], [[N]], [[0]])
    faulty.expire_lease("a", times=1)
    assert faulty.batch_get_into_multi_buffer_ranges(["a"], *args) == [int(Code.LEASE_EXPIRED)]
    assert faulty.batch_get_into_multi_buffer_ranges(["a"], *args) == [int(Code.INVALID_PARAMS)]
    assert faulty.batch_get_session_end(["a"]) == 0
    assert [c.method for c in faulty.calls()][-3:] == [GET_RANGES, GET_RANGES, GET_END]  # internal end not logged


def test_delay_is_cut_short_by_release(faulty) -> None:
    faulty.delay(IS_EXIST, 30.0)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (faulty.batch_is_exist(["a"]), done.set()), name="test-delayed")
    thread.start()
    assert not done.wait(0.2)
    faulty.release()
    assert done.wait(5.0)
    thread.join(5.0)


def test_delay_after_waits_for_the_other_rule_s_call_to_enter(faulty) -> None:
    gate = faulty.delay(GET_START, 0.5, times=1)  # its call enters, then sleeps 0.5 s
    faulty.delay(IS_EXIST, 30.0, times=1, after=gate)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (faulty.batch_is_exist(["a"]), done.set()), name="test-after")
    waiter.start()
    assert not done.wait(0.3)  # the gate's call has not entered yet
    faulty.batch_get_session_start(["a"])
    assert done.wait(5.0)
    waiter.join(5.0)
    exist, start = faulty.calls(IS_EXIST)[0], faulty.calls(GET_START)[0]
    assert start.enter_seq < exist.exit_seq < start.exit_seq  # released on entry, not on exit


def test_unknown_method_is_rejected(faulty) -> None:
    with pytest.raises(ValueError, match="unknown \\['batch_nope'\\]"):
        faulty.fail("batch_nope")
    with pytest.raises(ValueError, match="times=0 must be >= 1"):
        faulty.fail(IS_EXIST, times=0)
