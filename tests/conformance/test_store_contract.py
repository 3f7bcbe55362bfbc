"""The store contract: every backend returns the same code in the same situation (SPEC §2).
Sizes respect Mooncake's limits (segments >= 16 MiB); lease tests use a ~1 s lease."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from layerkv.store.base import Code, KVStore

if TYPE_CHECKING:
    from conftest import StoreHarness

MiB = 1 << 20
KiB = 1 << 10
OK = int(Code.OK)
NO_SPACE = int(Code.NO_SPACE)
INVALID = int(Code.INVALID_PARAMS)
NOT_READY = int(Code.REPLICA_NOT_READY)
NOT_FOUND = int(Code.OBJECT_NOT_FOUND)
EXISTS = int(Code.OBJECT_EXISTS)
EXPIRED = int(Code.LEASE_EXPIRED)
EVICTION_DEADLINE_S = 15.0  # Mooncake evicts in the background (~2 s observed)


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def _assert_int_results(results: object, num_keys: int) -> list[int]:
    assert isinstance(results, list) and len(results) == num_keys, results
    assert all(type(r) is int for r in results), results
    return results


def _put(h: StoreHarness, store: KVStore, keys: list[str], nbytes: int, seed: int = 0) -> np.ndarray:
    """Write and commit `keys`, each `nbytes` of distinct random data; returns [len(keys), nbytes]."""
    data = np.random.default_rng(seed).integers(0, 256, (len(keys), nbytes), dtype=np.uint8)
    buf, ptr = h.alloc(data.nbytes, store)
    buf[:] = data.reshape(-1)
    assert store.batch_put_session_start(keys, [nbytes] * len(keys)) == [OK] * len(keys)
    ptrs = [[ptr + i * nbytes] for i in range(len(keys))]
    assert store.batch_put_from_multi_buffer_ranges(keys, ptrs, [[nbytes]] * len(keys), [[0]] * len(keys)) == [
        nbytes
    ] * len(keys)
    assert store.batch_put_session_end(keys) == [OK] * len(keys)
    return data


def _read(h: StoreHarness, store: KVStore, key: str, nbytes: int) -> tuple[int, np.ndarray]:
    buf, ptr = h.alloc(nbytes, store)
    result = store.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[nbytes]], [[0]])[0]
    return result, buf


def _put_start_eventually(store: KVStore, keys: list[str], sizes: list[int]) -> list[int]:
    """Put start that may wait for background eviction: -200 now is allowed if a bounded retry
    of the -200 keys succeeds (embedded evicts synchronously, Mooncake in the background)."""
    deadline = time.monotonic() + EVICTION_DEADLINE_S
    results = store.batch_put_session_start(keys, sizes)
    while NO_SPACE in results and time.monotonic() < deadline:
        time.sleep(0.2)  # polling an external process's background eviction, with a deadline
        retry = [i for i, r in enumerate(results) if r == NO_SPACE]
        for i, r in zip(retry, store.batch_put_session_start([keys[i] for i in retry], [sizes[i] for i in retry])):
            results[i] = r
    return results


def test_ranges_round_trip_across_many_keys_and_layers(harness: StoreHarness) -> None:
    store = harness.store
    num_layers, num_entries, block_nbytes, num_blocks = 4, 2, 4 * KiB, 80  # more keys than one chunk
    object_nbytes = num_layers * num_entries * block_nbytes
    # object layout: [layer][entry(K,V)][block_nbytes]
    rng = np.random.default_rng(1)
    caches = [
        [rng.integers(0, 256, (num_blocks, block_nbytes), dtype=np.uint8) for _ in range(num_entries)]
        for _ in range(num_layers)
    ]
    keys = _keys("rt", num_blocks)
    assert store.batch_put_session_start(keys, [object_nbytes] * num_blocks) == [OK] * num_blocks
    for layer_idx, layer in enumerate(caches):
        ptrs = [[int(layer[e][b].ctypes.data) for e in range(num_entries)] for b in range(num_blocks)]
        offsets = [[(layer_idx * num_entries + e) * block_nbytes for e in range(num_entries)]] * num_blocks
        sizes = [[block_nbytes] * num_entries] * num_blocks
        for layer_buf in layer:
            store.register_buffer(int(layer_buf.ctypes.data), layer_buf.nbytes)
        got = store.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets)
        assert got == [num_entries * block_nbytes] * num_blocks
    assert store.batch_put_session_end(keys) == [OK] * num_blocks
    assert store.batch_is_exist(keys) == [1] * num_blocks

    # read back into other caches, blocks in reverse order, layer by layer
    out = [[np.zeros((num_blocks, block_nbytes), np.uint8) for _ in range(num_entries)] for _ in range(num_layers)]
    assert store.batch_get_session_start(keys) == [OK] * num_blocks
    for layer_idx, layer in enumerate(out):
        for layer_buf in layer:
            store.register_buffer(int(layer_buf.ctypes.data), layer_buf.nbytes)
        ptrs = [[int(layer[e][num_blocks - 1 - b].ctypes.data) for e in range(num_entries)] for b in range(num_blocks)]
        offsets = [[(layer_idx * num_entries + e) * block_nbytes for e in range(num_entries)]] * num_blocks
        sizes = [[block_nbytes] * num_entries] * num_blocks
        got = store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)
        assert got == [num_entries * block_nbytes] * num_blocks
    assert store.batch_get_session_end(keys) == OK
    for layer_idx in range(num_layers):
        for e in range(num_entries):
            assert np.array_equal(out[layer_idx][e][::-1], caches[layer_idx][e]), (layer_idx, e)
    for layer in caches + out:
        for layer_buf in layer:
            store.unregister_buffer(int(layer_buf.ctypes.data))


def test_object_is_not_readable_before_put_end(harness: StoreHarness) -> None:
    store = harness.store
    buf, ptr = harness.alloc(4096)
    assert store.batch_put_session_start(["pending"], [4096]) == [OK]
    assert store.batch_put_from_multi_buffer_ranges(["pending"], [[ptr]], [[4096]], [[0]]) == [4096]
    assert store.batch_is_exist(["pending"]) == [0]
    assert store.batch_get_session_start(["pending"]) == [NOT_READY]
    assert store.batch_put_session_end(["pending"]) == [OK]
    assert store.batch_is_exist(["pending"]) == [1]
    assert store.batch_get_session_start(["pending"]) == [OK]
    assert store.batch_get_session_end(["pending"]) == OK


def test_revoke_leaves_nothing_readable_and_frees_the_key(harness: StoreHarness) -> None:
    store = harness.store
    _, ptr = harness.alloc(4096)
    assert store.batch_put_session_start(["gone"], [4096]) == [OK]
    assert store.batch_put_from_multi_buffer_ranges(["gone"], [[ptr]], [[4096]], [[0]]) == [4096]
    assert store.batch_put_session_revoke(["gone"]) == [OK]
    assert store.batch_is_exist(["gone"]) == [0]
    assert store.batch_get_session_start(["gone"]) == [NOT_FOUND]
    assert store.batch_put_session_end(["gone"]) == [INVALID]  # no session any more
    assert store.batch_put_session_start(["gone"], [4096]) == [OK]  # the key is free again
    assert store.batch_put_session_revoke(["gone"]) == [OK]


def test_end_and_revoke_without_a_session_are_invalid(harness: StoreHarness) -> None:
    assert harness.store.batch_put_session_revoke(["never"]) == [INVALID]
    assert harness.store.batch_put_session_end(["never"]) == [INVALID]


def test_duplicate_put_start_on_the_same_client(harness: StoreHarness) -> None:
    store = harness.store
    assert store.batch_put_session_start(["dup"], [4096]) == [OK]
    assert store.batch_put_session_start(["dup"], [4096]) == [INVALID]
    assert store.batch_put_session_revoke(["dup"]) == [OK]


def test_the_same_key_twice_in_one_put_start_is_exists(harness: StoreHarness) -> None:
    store = harness.store
    assert store.batch_put_session_start(["twice", "twice"], [4096, 4096]) == [OK, EXISTS]
    assert store.batch_put_session_revoke(["twice"]) == [OK]


def test_the_same_key_twice_in_one_put_end_commits_once(harness: StoreHarness) -> None:
    store = harness.store
    buf, ptr = harness.alloc(4096, store)
    buf[:] = 7
    assert store.batch_put_session_start(["twice-end"], [4096]) == [OK]
    assert store.batch_put_from_multi_buffer_ranges(["twice-end"], [[ptr]], [[4096]], [[0]]) == [4096]
    assert store.batch_put_session_end(["twice-end", "twice-end"]) == [OK, OK]
    assert store.batch_is_exist(["twice-end"]) == [1]
    assert store.batch_get_session_start(["twice-end"]) == [OK]
    result, got = _read(harness, store, "twice-end", 4096)
    assert result == 4096 and (got == 7).all()
    assert store.batch_get_session_end(["twice-end"]) == OK


def test_second_client_cannot_take_a_processing_key(harness: StoreHarness) -> None:
    first, second = harness.store, harness.new_client()
    _, ptr = harness.alloc(4096, second)
    assert first.batch_put_session_start(["race"], [4096]) == [OK]
    assert second.batch_put_session_start(["race"], [4096]) == [EXISTS]
    assert second.batch_put_from_multi_buffer_ranges(["race"], [[ptr]], [[4096]], [[0]]) == [INVALID]
    assert second.batch_put_session_end(["race"]) == [INVALID]
    assert first.batch_put_session_revoke(["race"]) == [OK]


def test_put_start_of_a_committed_object_exists(harness: StoreHarness) -> None:
    _put(harness, harness.store, ["done"], 4096)
    assert harness.store.batch_put_session_start(["done"], [4096]) == [EXISTS]
    assert harness.new_client().batch_put_session_start(["done"], [4096]) == [EXISTS]


def test_zero_size_put_start_is_invalid(harness: StoreHarness) -> None:
    assert harness.store.batch_put_session_start(["empty"], [0]) == [INVALID]
    assert harness.store.batch_is_exist(["empty"]) == [0]


def test_range_beyond_the_object_is_invalid(harness: StoreHarness) -> None:
    store = harness.store
    buf, ptr = harness.alloc(8192)
    assert store.batch_put_session_start(["small"], [4096]) == [OK]
    assert store.batch_put_from_multi_buffer_ranges(["small"], [[ptr]], [[4096]], [[1]]) == [INVALID]
    assert store.batch_put_from_multi_buffer_ranges(["small"], [[ptr]], [[8192]], [[0]]) == [INVALID]
    assert store.batch_put_from_multi_buffer_ranges(["small"], [[ptr]], [[4096]], [[0]]) == [4096]
    assert store.batch_put_session_end(["small"]) == [OK]
    assert store.batch_get_session_start(["small"]) == [OK]
    assert store.batch_get_into_multi_buffer_ranges(["small"], [[ptr]], [[2048]], [[2049]]) == [INVALID]
    assert store.batch_get_into_multi_buffer_ranges(["small"], [[ptr]], [[2048]], [[2048]]) == [2048]
    assert store.batch_get_session_end(["small"]) == OK


def test_range_calls_without_a_session_are_invalid(harness: StoreHarness) -> None:
    store = harness.store
    _, ptr = harness.alloc(4096)
    assert store.batch_put_from_multi_buffer_ranges(["nosession"], [[ptr]], [[4096]], [[0]]) == [INVALID]
    _put(harness, store, ["committed"], 4096)
    assert store.batch_get_into_multi_buffer_ranges(["committed"], [[ptr]], [[4096]], [[0]]) == [INVALID]
    assert store.batch_get_into_multi_buffer_ranges(["nosession"], [[ptr]], [[4096]], [[0]]) == [INVALID]


def test_get_start_of_a_missing_key(harness: StoreHarness) -> None:
    assert harness.store.batch_get_session_start(["missing"]) == [NOT_FOUND]
    assert harness.store.batch_is_exist(["missing"]) == [0]


def test_expired_lease_fails_the_read_then_the_session_is_gone(harness: StoreHarness) -> None:
    short = harness.make_store(capacity_bytes=64 * MiB, lease_ttl_s=1.0)
    data = _put(short, short.store, ["leased"], 4096)
    assert short.store.batch_get_session_start(["leased"]) == [OK]
    result, buf = _read(short, short.store, "leased", 4096)
    assert result == 4096 and np.array_equal(buf, data[0])
    short.let_time_pass(1.5 * short.lease_ttl_s)
    assert _read(short, short.store, "leased", 4096)[0] == EXPIRED
    assert _read(short, short.store, "leased", 4096)[0] == INVALID
    assert short.store.batch_get_session_start(["leased"]) == [OK]  # a new session reads again
    assert _read(short, short.store, "leased", 4096)[0] == 4096


def test_object_larger_than_capacity_is_no_space(harness: StoreHarness) -> None:
    small = harness.make_store(capacity_bytes=16 * MiB)
    assert small.store.batch_put_session_start(["huge"], [32 * MiB]) == [NO_SPACE]
    assert small.store.batch_is_exist(["huge"]) == [0]
    assert small.store.batch_get_session_start(["huge"]) == [NOT_FOUND]


def test_exhausted_capacity_is_no_space_and_nothing_half_written(harness: StoreHarness) -> None:
    small = harness.make_store(capacity_bytes=16 * MiB)
    store = small.store
    held = _keys("held", 3)  # PROCESSING objects can never be evicted
    assert store.batch_put_session_start(held, [4 * MiB] * 3) == [OK] * 3
    _, ptr = small.alloc(8 * MiB)
    results = store.batch_put_session_start(["fits", "too-big"], [1 * MiB, 8 * MiB])
    assert results == [OK, NO_SPACE]
    assert store.batch_put_from_multi_buffer_ranges(["too-big"], [[ptr]], [[8 * MiB]], [[0]]) == [INVALID]
    assert store.batch_put_session_end(["too-big"]) == [INVALID]
    assert store.batch_is_exist(["too-big", "fits"]) == [0, 0]
    assert store.batch_get_session_start(["too-big"]) == [NOT_FOUND]
    assert store.batch_put_session_revoke(held + ["fits"]) == [OK] * 4


def test_full_store_makes_room_by_evicting_committed_objects(harness: StoreHarness) -> None:
    small = harness.make_store(capacity_bytes=16 * MiB)
    store = small.store
    old = _keys("old", 3)
    for key in old:
        _put(small, store, [key], 4 * MiB)
    assert _put_start_eventually(store, ["new"], [8 * MiB]) == [OK]
    assert store.batch_put_session_revoke(["new"]) == [OK]
    assert 0 in store.batch_is_exist(old)  # something had to go


def test_eviction_never_removes_a_leased_object(harness: StoreHarness) -> None:
    small = harness.make_store(capacity_bytes=16 * MiB, lease_ttl_s=60.0)
    store = small.store
    data = _put(small, store, ["pinned"], 4 * MiB, seed=7)
    assert store.batch_get_session_start(["pinned"]) == [OK]
    for i in range(8):  # 32 MiB more through a 16 MiB store; "pinned" is the oldest after 3
        results = _put_start_eventually(store, [f"churn-{i}"], [4 * MiB])
        if results == [OK]:
            assert store.batch_put_session_end([f"churn-{i}"]) == [OK]  # committed garbage is fine here
    assert store.batch_is_exist(["pinned"]) == [1]
    result, buf = _read(small, store, "pinned", 4 * MiB)
    assert result == 4 * MiB and np.array_equal(buf, data[0])
    assert store.batch_get_session_end(["pinned"]) == OK


def test_one_failing_key_does_not_fail_the_others(harness: StoreHarness) -> None:
    store = harness.store
    _put(harness, store, ["exists"], 4096)
    assert store.batch_put_session_start(["a", "exists", "zero", "b"], [4096, 4096, 0, 4096]) == [
        OK,
        EXISTS,
        INVALID,
        OK,
    ]
    _, ptr = harness.alloc(8192)
    got = store.batch_put_from_multi_buffer_ranges(
        ["a", "b", "zero"], [[ptr], [ptr], [ptr]], [[4096], [8192], [4096]], [[0], [0], [0]]
    )
    assert got == [4096, INVALID, INVALID]
    assert store.batch_put_session_end(["a", "zero", "b"]) == [OK, INVALID, OK]
    assert store.batch_get_session_start(["a", "missing", "exists"]) == [OK, NOT_FOUND, OK]
    got = store.batch_get_into_multi_buffer_ranges(
        ["a", "b", "exists"], [[ptr]] * 3, [[4096], [4096], [4096]], [[0], [0], [1]]
    )
    assert got == [4096, INVALID, INVALID]
    assert store.batch_get_session_end(["a", "exists"]) == OK


def test_results_are_one_int_per_key(harness: StoreHarness) -> None:
    store = harness.store
    keys = ["i0", "i1", "i2"]
    _, ptr = harness.alloc(4096)
    _assert_int_results(store.batch_put_session_start(keys, [4096, 0, 4096]), 3)
    _assert_int_results(store.batch_put_from_multi_buffer_ranges(keys, [[ptr]] * 3, [[4096]] * 3, [[0]] * 3), 3)
    _assert_int_results(store.batch_put_session_end(keys), 3)
    _assert_int_results(store.batch_is_exist(keys + ["nope"]), 4)
    _assert_int_results(store.batch_get_session_start(keys), 3)
    _assert_int_results(store.batch_get_into_multi_buffer_ranges(keys, [[ptr]] * 3, [[4096]] * 3, [[0]] * 3), 3)
    _assert_int_results(store.batch_put_session_revoke(keys), 3)
    end = store.batch_get_session_end(keys)
    assert type(end) is int and end == OK


def test_get_session_end_is_one_int_also_for_unknown_keys(harness: StoreHarness) -> None:
    end = harness.store.batch_get_session_end(["unknown-1", "unknown-2"])
    assert type(end) is int and end == OK


def test_whole_object_put_get_and_remove(harness: StoreHarness) -> None:
    store = harness.store
    nbytes = 64 * KiB
    src, src_ptr = harness.alloc(2 * nbytes)
    src[:] = np.random.default_rng(3).integers(0, 256, 2 * nbytes, dtype=np.uint8)
    keys = ["whole-0", "whole-1"]
    assert store.batch_put_from(keys, [src_ptr, src_ptr + nbytes], [nbytes, nbytes]) == [OK, OK]
    assert store.batch_is_exist(keys) == [1, 1]
    dst, dst_ptr = harness.alloc(2 * nbytes)
    got = store.batch_get_into(keys[::-1] + ["whole-missing"], [dst_ptr, dst_ptr + nbytes, dst_ptr], [nbytes] * 3)
    assert got[:2] == [nbytes, nbytes] and got[2] < 0
    assert np.array_equal(dst[:nbytes], src[nbytes:]) and np.array_equal(dst[nbytes:], src[:nbytes])
    assert store.batch_remove(keys) == [OK, OK]
    assert store.batch_is_exist(keys) == [0, 0]
