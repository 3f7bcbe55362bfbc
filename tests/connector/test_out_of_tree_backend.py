"""An out-of-tree store backend named by config ("module:Class") serves the connectors: every
store client of the rig comes from the factory, a prompt saved by one request is loaded byte for
byte by the next, and every call went through the out-of-tree class."""

from __future__ import annotations

from collections.abc import Sequence

from layerkv.config import LayerKVConfig
from layerkv.store.base import KVStore, ObjectKey
from layerkv.store.factory import open_store
from layerkv.store.process_stores import close_shared_stores
from tests.backends import Backend
from tests.connector.rig import BLOCK_SIZE, Req, Rig
from tests.out_of_tree_store import SPEC, WrappedStore


class FactoryBackend(Backend):
    """Raw store clients as layerkv opens them: `open_store(config)` for each."""

    name = "factory"

    def __init__(self, config: LayerKVConfig) -> None:
        super().__init__()
        self.config = config
        self.clients: list[KVStore] = []

    def client(self, rank: int = 0) -> KVStore:
        store = open_store(self.config)
        self.clients.append(store)
        return store

    def close(self, written: Sequence[ObjectKey] = ()) -> None:
        for store in self.clients:
            store.close()
        close_shared_stores()


def test_an_out_of_tree_backend_serves_a_save_then_load_roundtrip() -> None:
    backend = FactoryBackend(LayerKVConfig.from_dict({"backend": SPEC}, env={}))
    rig = Rig(backend)  # the rig's connectors get their stores from the backend: the factory
    try:
        assert all(isinstance(store, WrappedStore) for store in backend.clients) and len(backend.clients) == 2
        tokens = list(range(6 * BLOCK_SIZE + 1))
        assert rig.run(Req("a", tokens)) == (0, set())
        b = Req("b", tokens)
        ext, s = rig.admit(b)
        assert ext == 6 * BLOCK_SIZE
        assert rig.step([s]) == set()
        assert rig.wrong_blocks(b, range(6)) == []
        assert rig.workers[0].stats().load_blocks == 6 and rig.scheduler.stats().hit_blocks == 6
        sched, worker = backend.clients
        assert sched.calls["batch_is_exist"] >= 1  # type: ignore[attr-defined]
        assert worker.calls["batch_put_session_end"] >= 1  # type: ignore[attr-defined]
        assert worker.calls["batch_get_into_multi_buffer_ranges"] >= 1  # type: ignore[attr-defined]
        rig.drain()
        assert rig.workers[0].is_idle(5.0)
    finally:
        rig.shutdown()
        backend.close()
