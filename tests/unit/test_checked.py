"""CheckedStore: chunking, validation, exception translation, stats and the range audit."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from layerkv.config import LayerKVConfig
from layerkv.store.audit import RangeAudit
from layerkv.store.base import Code, KVStore
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore

MiB = 1 << 20
MALFORMED = int(Code.MALFORMED)
RPC_FAIL = int(Code.RPC_FAIL)
NOT_SENT = int(Code.NOT_SENT)


class Faulty:
    """Delegates to a real store; `faults[(method, call_number)]` replaces that call's answer
    (a callable gets the real answer, an exception instance is raised)."""

    def __init__(self, backend: KVStore) -> None:
        self.backend = backend
        self.name = "faulty"
        self.calls: dict[str, int] = {}
        self.faults: dict[tuple[str, int], Any] = {}

    def __getattr__(self, method: str) -> Callable[..., Any]:
        real = getattr(self.backend, method)

        def call(*args: Any) -> Any:
            n = self.calls[method] = self.calls.get(method, 0) + 1
            fault = self.faults.get((method, n))
            if isinstance(fault, Exception):
                raise fault
            answer = real(*args)
            return fault(answer) if fault is not None else answer

        return call


@pytest.fixture
def backend() -> Iterator[Faulty]:
    store = EmbeddedStore(32 * MiB)
    yield Faulty(store)
    store.close()


def _keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def test_batches_are_split_into_chunks_and_results_concatenated(backend: Faulty) -> None:
    checked = CheckedStore(backend, max_batch_keys=3)
    keys = _keys(10)
    backend.backend.batch_put_session_start(["k4"], [100])  # this client already holds k4: -600 in chunk 2
    results = checked.batch_put_session_start(keys, [4096] * 10)
    assert results == [0] * 4 + [Code.INVALID_PARAMS] + [0] * 5
    assert backend.calls["batch_put_session_start"] == 4
    stats = checked.stats()["batch_put_session_start"]
    assert (stats.calls, stats.keys, stats.failed_keys) == (4, 10, 1)


def test_range_calls_count_bytes_and_take_a_layer(backend: Faulty) -> None:
    checked = CheckedStore(backend, max_batch_keys=2)
    keys = _keys(5)
    buf = np.arange(8192, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    assert checked.batch_put_session_start(keys, [8192] * 5) == [0] * 5
    got = checked.batch_put_from_multi_buffer_ranges(
        keys, [[ptr, ptr + 4096]] * 5, [[4096, 4096]] * 5, [[0, 4096]] * 5, layer_idx=3
    )
    assert got == [8192] * 5
    stats = checked.stats()["batch_put_from_multi_buffer_ranges"]
    assert (stats.calls, stats.keys, stats.nbytes) == (3, 5, 5 * 8192)
    checked.reset_stats()
    assert checked.stats() == {}


def test_a_malformed_chunk_fails_only_its_own_keys(backend: Faulty, caplog: pytest.LogCaptureFixture) -> None:
    checked = CheckedStore(backend, max_batch_keys=2)
    backend.faults[("batch_put_session_start", 2)] = lambda answer: answer[:1]  # one result short
    with caplog.at_level(logging.ERROR, logger="layerkv"):
        results = checked.batch_put_session_start(_keys(5), [4096] * 5)
    assert results == [0, 0, MALFORMED, MALFORMED, 0]
    assert "batch_put_session_start returned a malformed result for 2 keys" in caplog.text


def test_a_raising_backend_fails_its_chunk_with_rpc_fail(backend: Faulty, caplog: pytest.LogCaptureFixture) -> None:
    checked = CheckedStore(backend, max_batch_keys=2)
    backend.faults[("batch_is_exist", 1)] = RuntimeError("master went away")
    with caplog.at_level(logging.ERROR, logger="layerkv"):
        assert checked.batch_is_exist(_keys(3)) == [RPC_FAIL, RPC_FAIL, 0]
    assert "batch_is_exist on faulty raised for 2 keys (first 'k0'): RuntimeError('master went away')" in caplog.text


def test_get_session_end_is_one_int_over_all_chunks(backend: Faulty, caplog: pytest.LogCaptureFixture) -> None:
    checked = CheckedStore(backend, max_batch_keys=2)
    assert checked.batch_get_session_end(_keys(5)) == 0
    assert backend.calls["batch_get_session_end"] == 3
    backend.faults[("batch_get_session_end", 5)] = lambda answer: [answer]
    assert checked.batch_get_session_end(_keys(5)) == MALFORMED
    backend.faults[("batch_get_session_end", 7)] = OSError("boom")
    with caplog.at_level(logging.ERROR, logger="layerkv"):
        assert checked.batch_get_session_end(_keys(3)) == RPC_FAIL
    assert "batch_get_session_end on faulty raised for 2 keys: OSError('boom')" in caplog.text


def test_a_malformed_batch_answers_invalid_params_per_key_and_sends_nothing(
    backend: Faulty, caplog: pytest.LogCaptureFixture
) -> None:
    """As Mooncake and both bare stores answer it (issue 29): one int per key, never an exception."""
    checked = CheckedStore(backend, max_batch_keys=4)
    with caplog.at_level(logging.ERROR, logger="layerkv"):
        assert checked.batch_put_session_start(["a", "b"], [1]) == [-600, -600]
        assert checked.batch_put_from_multi_buffer_ranges(["a", "b"], [[1]], [[1]], [[0]]) == [-600, -600]
        assert checked.batch_get_into(["a", "b", "c"], [1, 2, 3], [4]) == [-600, -600, -600]
    assert "batch_put_session_start: 2 keys but an argument has 1 entries" in caplog.text
    assert not any(name.startswith(("batch_put", "batch_get")) for name in backend.calls)
    assert checked.stats()["batch_put_session_start"].failed_keys == 2
    with pytest.raises(ValueError, match="max_batch_keys=0 must be >= 1"):
        CheckedStore(backend, max_batch_keys=0)


def test_audit_writes_one_json_line_per_range_commit_and_whole_object_call(backend: Faulty, tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    config = LayerKVConfig.from_dict({"range_debug_path": str(path)}, env={"LAYERKV_RANGE_DEBUG": "1"})
    audit = RangeAudit.from_config(config)
    assert audit is not None
    checked = CheckedStore(backend, max_batch_keys=2, audit=audit)
    buf = np.zeros(3 * 4096, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    keys = _keys(3)
    checked.batch_put_session_start(keys, [4096] * 3)  # not audited
    checked.batch_put_from_multi_buffer_ranges(keys, [[ptr]] * 3, [[4096]] * 2 + [[8192]], [[0]] * 3, layer_idx=7)
    checked.batch_put_session_end(keys[:2])
    checked.batch_put_from(["w"], [ptr], [4096])
    audit.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["call"], x["direction"], x["layer"], x["num_keys"]) for x in lines] == [
        ("batch_put_from_multi_buffer_ranges", "put", 7, 2),
        ("batch_put_from_multi_buffer_ranges", "put", 7, 1),
        ("batch_put_session_end", "put", None, 2),
        ("batch_put_from", "put", None, 1),
    ]
    assert lines[0]["bytes"] == 8192 and lines[0]["offsets"] == {"first": [0, 0], "count": 2}
    assert lines[1]["results"] == {"first": [int(Code.INVALID_PARAMS)], "num_failed": 1}
    assert lines[3]["bytes"] == 4096 and isinstance(lines[0]["ts"], float)
    assert RangeAudit.from_config(LayerKVConfig.from_dict({}, env={})) is None


class RaisingHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("disk on fire")


def test_a_failing_audit_never_affects_results(backend: Faulty, caplog: pytest.LogCaptureFixture) -> None:
    audit = RangeAudit(handler=RaisingHandler())
    checked = CheckedStore(backend, max_batch_keys=2, audit=audit)
    buf = np.zeros(4096, dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="layerkv"):
        assert checked.batch_put_from(["a", "b", "c"], [int(buf.ctypes.data)] * 3, [4096] * 3) == [0, 0, 0]
        assert checked.batch_get_into(["a", "zz"], [int(buf.ctypes.data)] * 2, [4096] * 2) == [
            4096,
            Code.OBJECT_NOT_FOUND,
        ]
    assert audit.num_failures == 3
    assert caplog.text.count("range audit failed to write a line (RuntimeError('disk on fire'))") == 1
    audit.close()


def test_an_unwritable_audit_path_falls_back_to_stderr(
    backend: Faulty, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "missing-dir" / "audit.jsonl"
    with caplog.at_level(logging.WARNING, logger="layerkv"):
        audit = RangeAudit(str(bad))
    assert f"range_debug_path={str(bad)!r} cannot be opened" in caplog.text
    checked = CheckedStore(backend, max_batch_keys=8, audit=audit)
    buf = np.zeros(4096, dtype=np.uint8)
    assert checked.batch_put_from(["s"], [int(buf.ctypes.data)], [4096]) == [0]
    audit.close()
    assert '"call":"batch_put_from"' in capsys.readouterr().err


def test_checked_store_is_a_kvstore(backend: Faulty) -> None:
    checked = CheckedStore(backend.backend, max_batch_keys=4)
    assert isinstance(checked, KVStore) and checked.name == "embedded"


def test_outage_short_circuits_metadata_calls_until_the_retry_interval() -> None:
    from layerkv.store.faults import IS_EXIST, PUT_START, FaultyStore

    now = [100.0]
    faulty = FaultyStore(EmbeddedStore(32 << 20))
    store = CheckedStore(faulty, max_batch_keys=4, retry_interval_s=5.0, clock=lambda: now[0])
    outage = faulty.fail([IS_EXIST, PUT_START], code=-900)
    assert store.batch_is_exist(["a", "b"]) == [-900, -900]
    assert store.is_down()
    seen = len(faulty.calls())
    # while down: answered at once, the backend is not called
    assert store.batch_is_exist(["a"]) == [NOT_SENT]
    assert store.batch_put_session_start(["a"], [4096]) == [NOT_SENT]
    assert len(faulty.calls()) == seen
    # session releases still reach the backend (they need no master)
    assert store.batch_get_session_end(["a"]) == 0
    now[0] += 5.0  # the interval passed: one probe goes through and fails again
    assert store.batch_is_exist(["a"]) == [-900]
    assert len(faulty.calls(IS_EXIST)) == 2 and store.is_down()
    faulty.remove(outage)
    now[0] += 5.0
    assert store.batch_is_exist(["a"]) == [0]
    assert not store.is_down()
    assert store.batch_put_session_start(["a"], [4096]) == [0]


def test_a_put_start_is_never_the_probe_after_an_outage() -> None:
    """A put start Mooncake's client answers -901 may be executed when the master resumes, with
    no session left to revoke it: after an outage an exists call probes first, and the put start
    goes out only once an answer cleared the outage."""
    from layerkv.store.faults import IS_EXIST, PUT_START, FaultyStore

    now = [100.0]
    faulty = FaultyStore(EmbeddedStore(32 << 20))
    store = CheckedStore(faulty, max_batch_keys=4, retry_interval_s=5.0, clock=lambda: now[0])
    assert store.batch_put_session_start(["a"], [4096]) == [0] and faulty.calls(IS_EXIST) == []  # no probe
    assert store.batch_put_session_revoke(["a"]) == [0]
    outage = faulty.fail([IS_EXIST, PUT_START], code=int(Code.RPC_TIMEOUT))
    assert store.batch_put_session_start(["b"], [4096]) == [-901]  # the call that meets the hang
    now[0] += 5.0  # the interval passed: the next put start's probe is an exists call, and it meets the hang
    assert store.batch_put_session_start(["c"], [4096]) == [NOT_SENT]
    assert [list(c.keys) for c in faulty.calls(PUT_START)] == [["a"], ["b"]] and len(faulty.calls(IS_EXIST)) == 1
    assert store.is_down()
    faulty.remove(outage)
    now[0] += 5.0
    assert store.batch_put_session_start(["c"], [4096]) == [0]  # probed (answered), then sent
    assert len(faulty.calls(IS_EXIST)) == 2 and not store.is_down()
    assert store.batch_put_session_start(["d"], [4096]) == [0] and len(faulty.calls(IS_EXIST)) == 2
    assert store.batch_put_session_revoke(["c", "d"]) == [0, 0]


def test_a_single_failing_key_is_not_an_outage() -> None:
    from layerkv.store.faults import IS_EXIST, FaultyStore

    faulty = FaultyStore(EmbeddedStore(32 << 20))
    store = CheckedStore(faulty, max_batch_keys=4)
    faulty.fail(IS_EXIST, keys="a", code=-900)
    assert store.batch_is_exist(["a", "b"]) == [-900, 0]
    assert not store.is_down()


def test_rpc_timeout_is_an_outage_and_bumps_the_epoch() -> None:
    from layerkv.store.faults import GET_START, FaultyStore

    faulty = FaultyStore(EmbeddedStore(32 << 20))
    store = CheckedStore(faulty, max_batch_keys=4, retry_interval_s=60.0)
    assert store.outage_epoch == 0
    faulty.fail(GET_START, code=int(Code.RPC_TIMEOUT), times=1)  # a hung master: Mooncake's -901
    assert store.batch_get_session_start(["a", "b"]) == [-901, -901]
    assert store.is_down() and store.outage_epoch == 1
    assert store.batch_is_exist(["a"]) == [NOT_SENT]  # short-circuited: no 30 s per call


def test_a_metadata_call_past_its_bound_answers_rpc_timeout_and_a_late_start_is_undone() -> None:
    import time

    from layerkv.store.faults import PUT_START, FaultyStore
    from tests.store_probes import processing_keys

    root = EmbeddedStore(32 << 20)
    faulty = FaultyStore(root)
    store = CheckedStore(faulty, max_batch_keys=4, retry_interval_s=60.0, call_timeout_s=0.3)
    stall = faulty.delay(PUT_START, 30.0, times=1)
    start = time.monotonic()
    assert store.batch_put_session_start(["a", "b"], [4096, 4096]) == [-901, -901]
    assert time.monotonic() - start < 2.0  # the bound, not the 30 s stall
    assert store.is_down() and store.outage_epoch == 1
    faulty.release()  # the master answers after all: the put start ran, its sessions are revoked
    deadline = time.monotonic() + 5.0
    while faulty.fired(stall) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    probe = root.client()
    assert faulty.fired(stall) == 1
    assert _eventually(
        lambda: processing_keys(probe, ["a", "b"]) == [] and faulty.keys_sent("batch_put_session_revoke") == ["a", "b"]
    )


def _eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """`check()` becomes true within `timeout_s` (a pool thread finishes a cleanup)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
