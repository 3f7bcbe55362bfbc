"""The stores that live inside this process, one root per settings key, shared by every side of
the process: an in-process backend (`PoolScope.PROCESS`: the embedded store, or an out-of-tree
one) opens its clients on the root here, so the scheduler side and every worker side of one
process see the same objects. Any thread: one lock guards the table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar, cast


class _Closeable(Protocol):
    def close(self) -> None: ...


_Root = TypeVar("_Root", bound=_Closeable)
_lock = threading.Lock()
_roots: dict[Hashable, _Closeable] = {}  # guarded by _lock; the root handle of each store


def shared_root(key: Hashable, make: Callable[[], _Root]) -> _Root:
    """The root store under `key` (e.g. the backend's name and settings), made by `make()` (under
    the lock) the first time, or again after `close_shared_stores`. Callers hand out clients of
    it, never the root itself; an exception from `make` leaves no entry."""
    with _lock:
        root = _roots.get(key)
        if root is None:
            root = _roots[key] = make()
        return cast("_Root", root)  # one key, one maker: the type `make` returns


def close_shared_stores() -> None:
    """Close every shared root (tests, benchmark runs). Stores whose client handles are all
    closed free their memory now; the next open starts an empty store."""
    with _lock:
        roots = list(_roots.values())
        _roots.clear()
    for root in roots:
        root.close()
