"""Backends for the connector tests and the per-test leak check. `store_factory` is parametrised
over every backend (add "mooncake" to BACKENDS once the real-master fixture is merged); `make_rig`
builds rigs on it and, after the test, drains them and asserts: no session left, no PROCESSING
object of ours, transfer threads joined."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from layerkv.store.base import KVStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import PUT_START
from tests.connector.rig import Rig
from tests.store_probes import processing_keys

BACKENDS = ["embedded", "mooncake"]  # + "mooncake" (uses the session `mooncake_store` fixture)
_tags = itertools.count()


class StoreBackend:
    """Raw store clients for one test; `tag` makes this test's namespace unique (a shared
    Mooncake master keeps objects across tests)."""

    name = "base"

    def __init__(self) -> None:
        self.tag = f"t{next(_tags)}"

    def client(self) -> KVStore:
        raise NotImplementedError

    def processing_keys(self, keys: list[str]) -> list[str]:
        """Keys of `keys` that are PROCESSING (a get start answers -703)."""
        return processing_keys(self.client(), keys)

    def remove(self, keys: list[str]) -> list[int]:
        return self.client().batch_remove(keys)

    def close(self) -> None:
        pass


class EmbeddedBackend(StoreBackend):
    name = "embedded"

    def __init__(self) -> None:
        super().__init__()
        self.root = EmbeddedStore(64 << 20, lease_ttl_s=10.0)
        self._clients: list[EmbeddedStore] = []

    def client(self) -> KVStore:
        client = self.root.client()
        self._clients.append(client)
        return client

    def processing_keys(self, keys: list[str]) -> list[str]:
        with self.root._table.lock:  # the reference backend: look at the table itself
            table_processing = list(self.root._table.processing)
        return sorted(set(table_processing) | set(super().processing_keys(keys)))

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.root.close()


class MooncakeBackend(StoreBackend):
    """Every rig shares the session's Mooncake client (closing one takes 1-2 s)."""

    name = "mooncake"

    def __init__(self, store: KVStore) -> None:
        super().__init__()
        self.store = store

    def client(self) -> KVStore:
        return self.store


def _make_backend(request: pytest.FixtureRequest) -> StoreBackend:
    if request.param == "embedded":
        return EmbeddedBackend()
    if request.param == "mooncake":
        return MooncakeBackend(request.getfixturevalue("mooncake_store"))
    raise AssertionError(f"no connector test backend {request.param!r}")


@pytest.fixture(params=BACKENDS)
def store_factory(request: pytest.FixtureRequest) -> Iterator[StoreBackend]:
    backend = _make_backend(request)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def make_rig(store_factory: StoreBackend) -> Iterator[Any]:
    """`make_rig(**kwargs)` -> Rig on this test's backend. Teardown: release stalls, drain every
    rig (finish its requests through the hooks), then check for leaks and shut down."""
    rigs: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        rig = Rig(store_factory, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    problems: list[str] = []
    for rig in rigs:
        for faulty in (rig.sched_faults, *rig.faults):
            faulty.clear_rules()
            faulty.release()
        rig.drain()
        for rank, worker in enumerate(rig.workers):
            if not worker.is_idle(5.0):
                problems.append(f"rank {rank} sessions left: {worker.open_sessions()}")
        started = sorted({k for f in rig.faults for k in f.keys_sent(PUT_START)})
        stuck = store_factory.processing_keys(started)
        if stuck:
            problems.append(f"PROCESSING objects left: {stuck[:4]} ({len(stuck)})")
        rig.shutdown()
        alive = [name for w in rig.workers for name in w.threads_alive()]
        if alive:
            problems.append(f"threads still alive after shutdown: {alive}")
    assert not problems, "; ".join(problems)
