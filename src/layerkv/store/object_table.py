"""The embedded store's shared state: objects by key, their arena extents, the LRU of committed
objects, get sessions per client, and allocation with eviction and stale-put reclaim. Any side;
every method and field is used under `ObjectTable.lock`, which the embedded store's handles hold.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from layerkv.store.arena import Arena
from layerkv.store.base import ObjectKey

ClientId = int


class ObjectState(Enum):
    PROCESSING = "processing"  # reserved by one client's put session, not readable
    COMPLETE = "complete"  # committed, readable, evictable when no live lease


@dataclass(slots=True, eq=False)
class StoredObject:
    offset: int  # in the arena
    nbytes: int
    state: ObjectState
    owner: ClientId  # the client holding the put session (meaningful while PROCESSING)
    started_s: float
    num_leases: int = 0  # get sessions on this object not yet ended or seen expired
    lease_until_s: float = 0.0  # the latest lease expiry handed out

    def evictable(self, now_s: float) -> bool:
        return self.num_leases <= 0 or now_s >= self.lease_until_s


@dataclass(slots=True, eq=False)
class GetSession:
    obj: StoredObject
    expires_s: float


class ObjectTable:
    """State shared by every client handle of one embedded store."""

    def __init__(self, capacity_bytes: int, clock: Callable[[], float]) -> None:
        self.lock = threading.Lock()
        self.clock = clock
        self.arena = Arena(capacity_bytes)  # guarded by lock
        self.objects: dict[ObjectKey, StoredObject] = {}  # guarded by lock
        self.processing: dict[ObjectKey, StoredObject] = {}  # guarded by lock; oldest put start first
        self.lru: OrderedDict[ObjectKey, None] = OrderedDict()  # guarded by lock; COMPLETE, oldest first
        self.get_sessions: dict[ClientId, dict[ObjectKey, GetSession]] = {}  # guarded by lock
        self.client_ids = itertools.count(1)
        self.num_handles = 0  # guarded by lock
        self.closed = False  # guarded by lock

    def alloc_evicting(self, nbytes: int) -> int | None:
        """An arena offset for `nbytes`, evicting unleased COMPLETE objects oldest first; None
        if that cannot make room (and then nothing is evicted when it could never be enough)."""
        arena = self.arena
        if nbytes > arena.capacity_bytes:
            return None
        offset = arena.alloc(nbytes)
        if offset is not None:
            return offset
        now_s = self.clock()
        victims = [k for k in self.lru if self.objects[k].evictable(now_s)]
        if arena.free_bytes + sum(self.objects[k].nbytes for k in victims) < nbytes:
            return None
        for key in victims:
            self.drop(key, self.objects[key])
            offset = arena.alloc(nbytes)
            if offset is not None:
                return offset
        return None  # fragmentation by PROCESSING / leased objects

    def reclaim_stale_puts(self, put_timeout_s: float) -> None:
        """Drop PROCESSING objects whose put started more than `put_timeout_s` ago."""
        if not self.processing:
            return
        deadline_s = self.clock() - put_timeout_s
        for key, obj in list(self.processing.items()):
            if obj.started_s > deadline_s:
                break  # insertion order is start order
            self.drop(key, obj)

    def drop(self, key: ObjectKey, obj: StoredObject) -> None:
        """Forget `key` and free its extent (sessions on it see it gone)."""
        del self.objects[key]
        self.processing.pop(key, None)
        self.lru.pop(key, None)
        self.arena.free(obj.offset, obj.nbytes)

    def close(self) -> None:
        self.closed = True
        self.objects.clear()
        self.processing.clear()
        self.lru.clear()
        self.get_sessions.clear()
        self.arena.close()
