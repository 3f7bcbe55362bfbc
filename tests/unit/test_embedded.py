"""Embedded store internals the contract suite cannot see: reclaim, LRU order, the allocator,
handles and the shared factory, thread-safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import StoreError
from layerkv.store.arena import ALIGN_BYTES, Arena, copy_ranges
from layerkv.store.base import Code, KVStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.factory import open_store
from layerkv.store.process_stores import close_shared_stores

MiB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _store(capacity_bytes: int = 16 * MiB, **kw: float) -> tuple[EmbeddedStore, FakeClock]:
    clock = FakeClock()
    return EmbeddedStore(capacity_bytes, clock=clock, **kw), clock  # type: ignore[arg-type]


def _commit(store: EmbeddedStore, keys: list[str], nbytes: int) -> None:
    assert store.batch_put_session_start(keys, [nbytes] * len(keys)) == [0] * len(keys)
    assert store.batch_put_session_end(keys) == [0] * len(keys)


def test_embedded_store_implements_the_protocol() -> None:
    store, _ = _store()
    assert isinstance(store, KVStore)
    store.close()


def test_processing_object_is_reclaimed_after_put_timeout() -> None:
    owner, clock = _store(put_timeout_s=5.0)
    other = owner.client()
    assert owner.batch_put_session_start(["slow"], [MiB]) == [0]
    clock.now_s += 4.9
    assert other.batch_put_session_start(["slow"], [MiB]) == [Code.OBJECT_EXISTS]
    clock.now_s += 0.2
    assert other.batch_put_session_start(["slow"], [MiB]) == [0]  # reclaimed, key free again
    # the owner keeps its released put session; the key is another client's now (tests/conformance)
    assert owner.batch_put_session_end(["slow"]) == [Code.ILLEGAL_CLIENT]
    assert other.batch_put_session_end(["slow"]) == [0]
    assert owner.used_bytes == MiB
    other.close()
    owner.close()


def test_lru_evicts_the_least_recently_used_object_first() -> None:
    store, _ = _store(16 * MiB)
    _commit(store, ["a", "b", "c", "d"], 4 * MiB)  # full
    assert store.batch_get_session_start(["a"]) == [0]  # a becomes the most recent
    assert store.batch_get_session_end(["a"]) == 0
    assert store.batch_put_session_start(["e"], [4 * MiB]) == [0]
    assert store.batch_is_exist(["a", "b", "c", "d"]) == [1, 0, 1, 1]
    assert store.batch_put_session_start(["f"], [8 * MiB]) == [0]  # c, d next; a survives
    assert store.batch_is_exist(["a", "c", "d"]) == [1, 0, 0]
    store.close()


def test_an_expired_lease_no_longer_protects_from_eviction() -> None:
    store, clock = _store(16 * MiB, lease_ttl_s=2.0)
    _commit(store, ["a", "b", "c", "d"], 4 * MiB)
    assert store.batch_get_session_start(["a", "b", "c", "d"]) == [0] * 4  # never ended
    assert store.batch_put_session_start(["e"], [4 * MiB]) == [Code.NO_SPACE]
    assert store.batch_is_exist(["a", "b", "c", "d"]) == [1] * 4  # nothing evicted in vain
    clock.now_s += 2.0
    assert store.batch_put_session_start(["e"], [4 * MiB]) == [0]
    assert store.batch_is_exist(["a", "b", "c", "d"]) == [0, 1, 1, 1]
    store.close()


def test_arena_first_fit_and_coalescing() -> None:
    arena = Arena(3 * MiB)
    a, b, c = (arena.alloc(MiB) for _ in range(3))
    assert (a, b, c) == (0, MiB, 2 * MiB) and arena.alloc(1) is None
    arena.free(a, MiB)
    arena.free(c, MiB)
    assert arena.free_bytes == 2 * MiB and arena.alloc(2 * MiB) is None  # fragmented
    arena.free(b, MiB)
    assert arena.free_extents() == [(0, 3 * MiB)]  # merged both ways
    assert arena.alloc(3 * MiB) == 0


def test_arena_rounds_to_alignment_and_reuses_the_first_hole() -> None:
    arena = Arena(MiB)
    x = arena.alloc(1)
    y = arena.alloc(100)
    assert (x, y) == (0, ALIGN_BYTES)
    arena.free(x, 1)
    assert arena.alloc(ALIGN_BYTES) == 0
    assert arena.used_bytes == ALIGN_BYTES + 128


def test_copy_ranges_merges_adjacent_ranges_and_keeps_others() -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    # 16 adjacent ranges of 64 bytes (merged into one), then 16 scattered ones
    dst_ptrs = [d + 64 * i for i in range(16)] + [d + 2048 + 128 * i for i in range(16)]
    src_ptrs = [s + 64 * i for i in range(16)] + [s + 3000 - 64 * i for i in range(16)]
    assert copy_ranges(dst_ptrs, src_ptrs, [64] * 32) == 32 * 64
    assert np.array_equal(dst[:1024], src[:1024])
    for i in range(16):
        assert np.array_equal(dst[2048 + 128 * i : 2048 + 128 * i + 64], src[3000 - 64 * i : 3064 - 64 * i])


def test_numpy_integer_sizes_are_accepted() -> None:
    store, _ = _store()
    assert store.batch_put_session_start(["n"], [np.int64(4096)]) == [0]
    assert store.batch_put_session_start(["m"], [True]) == [Code.INVALID_PARAMS]
    store.close()


def test_closing_a_client_revokes_its_puts_and_drops_its_sessions() -> None:
    root, _ = _store()
    client = root.client()
    assert client.batch_put_session_start(["mine"], [4096]) == [0]
    client.close()
    client.close()  # idempotent
    assert root.batch_put_session_start(["mine"], [4096]) == [0]
    with pytest.raises(StoreError, match="embedded store 'embedded' is closed"):
        client.batch_is_exist(["mine"])
    root.close()
    with pytest.raises(StoreError, match="is closed"):
        root.client()


def test_open_store_shares_objects_between_clients_of_one_process() -> None:
    config = LayerKVConfig.from_dict({"embedded_capacity_bytes": 32 * MiB}, env={})
    scheduler_side, worker_side = open_store(config), open_store(config)
    try:
        assert scheduler_side is not worker_side
        assert worker_side.batch_put_session_start(["shared"], [4096]) == [0]
        assert scheduler_side.batch_put_session_start(["shared"], [4096]) == [Code.OBJECT_EXISTS]
        assert worker_side.batch_put_session_end(["shared"]) == [0]
        assert scheduler_side.batch_is_exist(["shared"]) == [1]
        other = open_store(
            config.replace(embedded_lease_ttl_s=3.0, lease_renew_after_s=1.0)
        )  # other settings, other store
        assert other.batch_is_exist(["shared"]) == [0]
        other.close()
    finally:
        scheduler_side.close()
        worker_side.close()
        close_shared_stores()
    fresh = open_store(config)
    assert fresh.batch_is_exist(["shared"]) == [0]
    fresh.close()
    close_shared_stores()


def test_threads_hammering_one_store_keep_it_consistent() -> None:
    store, _ = _store(16 * MiB)
    num_threads, rounds, nbytes = 4, 60, 64 * 1024
    errors: list[str] = []

    def work(thread_idx: int) -> None:
        client = store.client()
        rng = np.random.default_rng(thread_idx)
        src = np.empty(nbytes, np.uint8)
        dst = np.empty(nbytes, np.uint8)
        for r in range(rounds):
            src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            key = f"t{thread_idx}-{r}"
            shared = f"shared-{r}"  # all threads race for this one
            got = client.batch_put_session_start([key, shared], [nbytes, nbytes])
            keys = [k for k, g in zip([key, shared], got) if g == 0]
            n = len(keys)
            client.batch_put_from_multi_buffer_ranges(keys, [[int(src.ctypes.data)]] * n, [[nbytes]] * n, [[0]] * n)
            client.batch_put_session_end(keys)
            if client.batch_get_session_start([key]) == [0]:  # may have been evicted already
                read = client.batch_get_into_multi_buffer_ranges([key], [[int(dst.ctypes.data)]], [[nbytes]], [[0]])
                if read == [nbytes] and not np.array_equal(src, dst):
                    errors.append(f"{key}: bytes differ")
                client.batch_get_session_end([key])
        client.close()

    threads = [threading.Thread(target=work, args=(i,), name=f"layerkv-test-{i}") for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    live = [f"t{i}-{r}" for i in range(num_threads) for r in range(rounds)] + [f"shared-{r}" for r in range(rounds)]
    exists = store.batch_is_exist(live)
    assert store.batch_remove(live) == [0 if e else Code.OBJECT_NOT_FOUND for e in exists]
    assert store.used_bytes == 0
    assert store._table.arena.free_extents() == [(0, 16 * MiB)]  # every extent came back, merged
    store.close()
