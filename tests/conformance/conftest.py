"""The store contract suite's view of the test's `backend` (tests/backends.py, parametrised over
both backends for every test here): a `StoreHarness` adds a second client, a fresh store with
its own capacity and lease, a fresh store that releases unfinished puts, and registered buffers;
it closes what it made. A "mooncake" harness prefixes the test's keys on the shared master and
starts a fresh master for `make_store` / `make_releasing_store`."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from layerkv.store.base import STORE_CALLS, KVStore
from layerkv.store.mooncake_master import MasterPorts, MasterProcess
from tests.backends import BACKENDS, Backend, EmbeddedBackend

MiB = 1 << 20


class StoreHarness:
    """What a contract test may use. Subclasses make the stores.

    * `store`: a client of a default store (capacity >= 64 MiB, lease >= 10 s)
    * `new_client()`: a second, independent client of the same store as `store`
    * `make_store(capacity_bytes, lease_ttl_s)`: a new harness on a fresh store
    * `make_releasing_store(put_release_s)`: a new harness on a fresh store that frees the
      object of a put not ended within `put_release_s` (Mooncake's put_start_release_timeout_sec,
      the embedded store's put_timeout_s); its `new_client()` is a client of that store
    * `alloc(nbytes, store=None)`: a host buffer registered with `store` (default: self.store)
    * `let_time_pass(seconds)`: at least `seconds` pass for the store's leases
    """

    name: str  # the backend: "embedded" or "mooncake"
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

    def make_releasing_store(self, put_release_s: int) -> StoreHarness:
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
    """An EmbeddedBackend: its clock moves forward, so lease tests do not sleep."""

    name = "embedded"

    def __init__(self, backend: EmbeddedBackend) -> None:
        super().__init__()
        self.backend = backend
        self.lease_ttl_s = backend.root.lease_ttl_s
        self.store = backend.client()

    def new_client(self) -> KVStore:
        return self.backend.client()

    def make_store(self, capacity_bytes: int = 64 * MiB, lease_ttl_s: float = 10.0) -> StoreHarness:
        child = EmbeddedHarness(EmbeddedBackend(capacity_bytes, lease_ttl_s))
        self._children.append(child)
        return child

    def make_releasing_store(self, put_release_s: int) -> StoreHarness:
        backend = EmbeddedBackend()
        backend.root.put_timeout_s = float(put_release_s)  # before any client copies it
        child = EmbeddedHarness(backend)
        self._children.append(child)
        return child

    def let_time_pass(self, seconds: float) -> None:
        self.backend.let_time_pass(seconds)

    def close(self) -> None:
        super().close()
        self.backend.close()


class PrefixedKeys:
    """Forwards every call of a store with each key prefixed, so tests sharing one real master
    never see each other's objects (the contract suite uses short fixed key names)."""

    _KEYED = frozenset(STORE_CALLS)  # every batch call takes keys first

    def __init__(self, inner: KVStore, prefix: str) -> None:
        self.inner, self.prefix, self.name = inner, prefix, inner.name

    def __getattr__(self, attr: str):  # type: ignore[no-untyped-def]
        method = getattr(self.inner, attr)
        if attr not in self._KEYED:
            return method
        return lambda keys, *args, **kwargs: method([self.prefix + k for k in keys], *args, **kwargs)

    def close(self) -> None:
        """The shared session client stays open; per-test clients are closed by the harness."""


@dataclasses.dataclass
class ReleasingMaster(MasterProcess):
    """A mooncake_master that frees the space of a put not ended within `put_release_s` (>= 2)."""

    put_release_s: int = 600

    def argv(self, binary: Path) -> list[str]:
        # Mooncake requires the discard timeout (a put start of another client takes over) below it
        return [
            *MasterProcess.argv(self, binary),
            f"--put_start_release_timeout_sec={self.put_release_s}",
            f"--put_start_discard_timeout_sec={self.put_release_s - 1}",
        ]


class MooncakeContractHarness(StoreHarness):
    """A real mooncake_master: `store` is the session client (keys prefixed per test),
    `new_client()` a second client on the same master, `make_store` a fresh master. With
    `master` (a releasing store) it owns that master: its clients dial it, close stops it."""

    name = "mooncake"

    def __init__(
        self,
        inner: Any,
        prefix: str,
        lease_ttl_s: float = 10.0,
        store: KVStore | None = None,
        master: MasterProcess | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner  # tests.mooncake_master.MooncakeHarness
        self._prefix = prefix
        self._master = master
        self.lease_ttl_s = lease_ttl_s
        self.store = store if store is not None else PrefixedKeys(inner.store, prefix)  # type: ignore[assignment]

    def new_client(self) -> KVStore:
        if self._master is None:
            return PrefixedKeys(self._inner.new_client(), self._prefix)  # type: ignore[return-value]
        from tests.mooncake_master import connect_store

        client = connect_store(self._master, 0)  # no segment of its own: objects go to `store`'s
        self._stores.append(client)
        return client

    def make_releasing_store(self, put_release_s: int) -> StoreHarness:
        from tests.mooncake_master import connect_store

        fd, log_path = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
        os.close(fd)
        master = ReleasingMaster(MasterPorts.pick(), None, Path(log_path), put_release_s=put_release_s)
        try:
            master.start()
            store = connect_store(master, 64 * MiB)
        except BaseException:
            master.stop()
            raise
        child = MooncakeContractHarness(self._inner, self._prefix, store=store, master=master)
        child._stores.append(store)
        self._children.append(child)
        return child

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._master is not None:
                self._master.stop()

    def make_store(self, capacity_bytes: int = 64 * MiB, lease_ttl_s: float = 10.0) -> StoreHarness:
        child = MooncakeContractHarness(
            self._inner, self._prefix, lease_ttl_s, self._inner.make_store(capacity_bytes, lease_ttl_s)
        )
        self._children.append(child)
        return child


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "harness" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS, indirect=True)


@pytest.fixture
def harness(request: pytest.FixtureRequest, backend: Backend) -> Iterator[StoreHarness]:
    if isinstance(backend, EmbeddedBackend):
        h: StoreHarness = EmbeddedHarness(backend)
    else:
        inner = request.getfixturevalue("mooncake_harness")
        h = MooncakeContractHarness(inner, f"{backend.tag}-{uuid.uuid4().hex[:8]}-")
    try:
        yield h
    finally:
        h.close()
