"""The one store backend of a test: the embedded store or the session's real `mooncake_master`.

`backend` (a fixture, registered by tests/conftest.py) yields a `Backend`: raw store clients for
the test's rigs / engines, a `tag` that makes the test's namespace unique on a shared master, and
the probes leak checks use. It is embedded unless parametrised: `@BOTH_BACKENDS` on a test, or a
`pytest_generate_tests` that parametrises `backend` for a whole directory (tests/connector).
`BACKENDS` is every built-in backend of the store registry: a new one fails here until it has
a rig in `_RIGS`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from layerkv.store.base import KVStore, ObjectKey
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.registry import BUILTIN_BACKENDS
from tests.store_probes import processing_keys

BACKENDS = list(BUILTIN_BACKENDS)
BOTH_BACKENDS = pytest.mark.parametrize("backend", BACKENDS, indirect=True)
_tags = itertools.count()


class Backend:
    """Raw store clients of one test."""

    name = "base"

    def __init__(self) -> None:
        self.tag = f"t{next(_tags)}"

    def client(self, rank: int = 0) -> KVStore:
        """A client for TP rank `rank`'s connector (the scheduler's: rank 0)."""
        raise NotImplementedError

    def processing_keys(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Keys of `keys` that are PROCESSING (a get start answers -703)."""
        return processing_keys(self.client(), keys)

    def exists(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self.client().batch_is_exist(list(keys)))

    def remove(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self.client().batch_remove(list(keys))) if keys else []

    def let_time_pass(self, seconds: float) -> None:
        """At least `seconds` pass for the store's leases (a real master: its wall clock)."""
        time.sleep(seconds)

    def close(self, written: Sequence[ObjectKey] = ()) -> None:
        """End of the test; `written`: objects it wrote (removed from a shared master)."""


class EmbeddedBackend(Backend):
    """A fresh embedded store whose clock `let_time_pass` moves forward (no sleeping)."""

    name = "embedded"

    def __init__(self, capacity: int = 64 << 20, lease_ttl_s: float = 10.0) -> None:
        super().__init__()
        self._skew_s = 0.0
        self.root = EmbeddedStore(
            capacity, lease_ttl_s=lease_ttl_s, clock=lambda: time.monotonic() + self._skew_s, strict_buffers=True
        )
        self._clients: list[EmbeddedStore] = []

    def let_time_pass(self, seconds: float) -> None:
        self._skew_s += seconds

    def client(self, rank: int = 0) -> KVStore:
        client = self.root.client()
        self._clients.append(client)
        return client

    def processing_keys(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        with self.root._table.lock:  # the reference backend: look at the table itself too
            table_processing = list(self.root._table.processing)
        return sorted(set(table_processing) | set(super().processing_keys(keys)))

    def close(self, written: Sequence[ObjectKey] = ()) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self.root.close()


class MooncakeBackend(Backend):
    """Rank r's connectors use `clients(r)`: TP ranks are processes with their own client (ranks
    reading the same key must not share one, or one rank's session end would end the other's).
    Objects the test says it wrote are removed at the end."""

    name = "mooncake"

    def __init__(self, clients: Callable[[int], KVStore]) -> None:
        super().__init__()
        self._clients = clients

    @classmethod
    def of(cls, store: KVStore) -> MooncakeBackend:
        """Every rank on one client."""
        return cls(lambda rank: store)

    def client(self, rank: int = 0) -> KVStore:
        return self._clients(rank)

    def close(self, written: Sequence[ObjectKey] = ()) -> None:
        self.remove(sorted(set(written)))


@pytest.fixture(scope="session")
def mooncake_rank_clients(mooncake_master: Any, mooncake_store: Any) -> Iterator[Callable[[int], Any]]:
    """rank -> a Mooncake client: rank 0 the shared session client, others clients without a
    segment of their own (made once per run; closing a client takes 1-2 s)."""
    from tests.mooncake_master import connect_store

    clients: dict[int, Any] = {0: mooncake_store}

    def client(rank: int) -> Any:
        if rank not in clients:
            clients[rank] = connect_store(mooncake_master, 0)
        return clients[rank]

    yield client
    for rank, store in clients.items():
        if rank:
            store.close()


# registry name -> the test's raw store clients on that backend
_RIGS: dict[str, Callable[[pytest.FixtureRequest], Backend]] = {
    "embedded": lambda request: EmbeddedBackend(),
    "mooncake": lambda request: MooncakeBackend(request.getfixturevalue("mooncake_rank_clients")),
}


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name = getattr(request, "param", "embedded")
    if name not in _RIGS:
        raise AssertionError(f"no test rig for backend {name!r}: add one to tests/backends.py _RIGS")
    made = _RIGS[name](request)
    try:
        yield made
    finally:
        if isinstance(made, EmbeddedBackend):
            made.close()  # a Mooncake backend is closed by its user, with what it wrote
