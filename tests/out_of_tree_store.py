"""An out-of-tree store backend, as a user would write one outside layerkv: `WrappedStore` meets
layerkv.store.base.StoreBackend by handing every protocol call to an embedded store client and
counting the calls. A config names it by module and class:
`{"backend": "tests.out_of_tree_store:WrappedStore"}` (tests/unit/test_store_registry.py,
tests/connector/test_out_of_tree_backend.py, tests/vllm/test_vllm_setup.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from layerkv.store.base import HitSource, KVStore, PoolScope
from layerkv.store.factory import open_store

SPEC = "tests.out_of_tree_store:WrappedStore"


class WrappedStore:
    """Every KVStore call goes to `inner` (an embedded client: one store per process, so the
    backend is PROCESS-scoped and reads hits from host memory)."""

    pool_scope = PoolScope.PROCESS
    hit_source = HitSource.HOST
    opened: ClassVar[list[WrappedStore]] = []  # every client `from_config` made, in order

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.name = f"wrapped({inner.name})"
        self.calls: collections.Counter[str] = collections.Counter()  # guarded by _lock
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Any) -> WrappedStore:
        store = cls(open_store(config.replace(backend="embedded")))
        cls.opened.append(store)
        return store

    @staticmethod
    def pool_address(config: Any) -> str:
        return "wrapped-in-this-process"


def _forward(method: str) -> Callable[..., Any]:
    def call(self: WrappedStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls[method] += 1
        return getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    return call


for _method in (
    "register_buffer",
    "unregister_buffer",
    "batch_is_exist",
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
    "batch_put_from",
    "batch_get_into",
    "batch_remove",
    "close",
):
    setattr(WrappedStore, _method, _forward(_method))


class SharedWrappedStore(WrappedStore):
    """The same store claiming a pool other processes share, read from disk (the integration's
    tests read these properties; nothing here is really shared)."""

    pool_scope = PoolScope.SHARED
    hit_source = HitSource.DISK
