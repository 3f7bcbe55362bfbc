"""The backend harnesses the store contract suite runs against. Each harness owns the stores it
makes and closes them; `params` lists every backend (a "mooncake" harness starts a real master)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from layerkv.store.base import KVStore
from layerkv.store.embedded import EmbeddedStore

MiB = 1 << 20


class StoreHarness:
    """What a contract test may use. Subclasses make the stores.

    * `store`: a client of a default store (capacity >= 64 MiB, lease >= 10 s)
    * `new_client()`: a second, independent client of the same store as `store`
    * `make_store(capacity_bytes, lease_ttl_s)`: a new harness on a fresh store
    * `alloc(nbytes, store=None)`: a host buffer registered with `store` (default: self.store)
    * `let_time_pass(seconds)`: at least `seconds` pass for the store's leases
    """

    lease_ttl_s: float
    store: KVStore

    def __init__(self) -> None:
        self._buffers: list[tuple[KVStore, np.ndarray]] = []
        self._stores: list[KVStore] = []
        self._children: list[StoreHarness] = []

    def new_client(self) -> KVStore:
        raise NotImplementedError

    def make_store(self, capacity_bytes: int = 64 * MiB, lease_ttl_s: float = 10.0) -> StoreHarness:
        raise NotImplementedError

    def let_time_pass(self, seconds: float) -> None:
        time.sleep(seconds)  # real backends: leases run on the master's wall clock

    def alloc(self, nbytes: int, store: KVStore | None = None) -> tuple[np.ndarray, int]:
        store = store or self.store
        buf = np.zeros(nbytes, dtype=np.uint8)  # [nbytes]
        ptr = int(buf.ctypes.data)
        store.register_buffer(ptr, nbytes)
        self._buffers.append((store, buf))
        return buf, ptr

    def close(self) -> None:
        for child in self._children:
            child.close()
        for store, buf in self._buffers:
            store.unregister_buffer(int(buf.ctypes.data))
        for store in reversed(self._stores):
            store.close()


class EmbeddedHarness(StoreHarness):
    """Embedded store whose clock can be moved forward, so lease tests do not sleep."""

    def __init__(self, capacity_bytes: int = 64 * MiB, lease_ttl_s: float = 10.0) -> None:
        super().__init__()
        self._skew_s = 0.0
        self.lease_ttl_s = lease_ttl_s
        self.store = EmbeddedStore(capacity_bytes, lease_ttl_s, clock=lambda: time.monotonic() + self._skew_s)
        self._stores.append(self.store)

    def new_client(self) -> KVStore:
        assert isinstance(self.store, EmbeddedStore)
        client = self.store.client()
        self._stores.append(client)
        return client

    def make_store(self, capacity_bytes: int = 64 * MiB, lease_ttl_s: float = 10.0) -> StoreHarness:
        child = EmbeddedHarness(capacity_bytes, lease_ttl_s)
        self._children.append(child)
        return child

    def let_time_pass(self, seconds: float) -> None:
        self._skew_s += seconds


def _make_harness(backend: str) -> StoreHarness:
    if backend == "embedded":
        return EmbeddedHarness()
    raise AssertionError(f"no harness for backend {backend!r}")


@pytest.fixture(params=["embedded"])
def harness(request: pytest.FixtureRequest) -> Iterator[StoreHarness]:
    h = _make_harness(request.param)
    try:
        yield h
    finally:
        h.close()
