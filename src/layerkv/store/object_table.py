"""The embedded store's shared state: objects by key, their arena extents, the LRU of committed
objects, get sessions and released put sessions per client, allocation with eviction and
stale-put reclaim. Any side; every method and field is used under `ObjectTable.lock`, which the
embedded store's handles hold.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from layerkv.store.arena import Arena
from layerkv.store.base import Code, ObjectKey

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
        # guarded by lock; put sessions whose object reclaim freed: the client still holds them
        self.released_puts: dict[ClientId, set[ObjectKey]] = {}
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
        """Free PROCESSING objects whose put started more than `put_timeout_s` ago; their owners
        keep the put session (`released_puts`), as Mooncake's clients do after its release."""
        if not self.processing:
            return
        deadline_s = self.clock() - put_timeout_s
        for key, obj in list(self.processing.items()):
            if obj.started_s > deadline_s:
                break  # insertion order is start order
            self.released_puts.setdefault(obj.owner, set()).add(key)
            self.drop(key, obj)

    def end_released_put(self, client: ClientId, key: ObjectKey, *, revoke: bool) -> int | None:
        """Mooncake 0.3.13's answer to `client`'s put end / revoke of a released put session
        (None: `key` is none of its released sessions). The object gone: end -704 (the session
        stays), revoke 0 (it goes); another client's object on the key: -601 (it stays); the
        client's own whole put committed it: end 0 (it goes), revoke -700 (it stays)."""
        released = self.released_puts.get(client)
        if released is None or key not in released:
            return None
        obj = self.objects.get(key)
        if obj is None:
            code = int(Code.OK) if revoke else int(Code.OBJECT_NOT_FOUND)
        elif obj.owner != client or obj.state is ObjectState.PROCESSING:
            return int(Code.ILLEGAL_CLIENT)
        else:
            code = int(Code.INVALID_WRITE) if revoke else int(Code.OK)
        if code == int(Code.OK):
            released.discard(key)
        return code

    def start_get(self, client: ClientId, key: ObjectKey, lease_ttl_s: float) -> int:
        """Open (or renew) `client`'s get session on `key` with a lease: 0, or -704 missing /
        -703 PROCESSING, and then an old session on the key is dropped (as Mooncake's client
        drops it when a restart fails)."""
        sessions = self.get_sessions[client]
        obj = self.objects.get(key)
        old = sessions.pop(key, None)
        if old is not None:
            old.obj.num_leases -= 1
        if obj is None:
            return int(Code.OBJECT_NOT_FOUND)
        if obj.state is ObjectState.PROCESSING:
            return int(Code.REPLICA_NOT_READY)
        now_s = self.clock()
        sessions[key] = GetSession(obj, now_s + lease_ttl_s)
        obj.num_leases += 1
        obj.lease_until_s = max(obj.lease_until_s, now_s + lease_ttl_s)
        self.lru.move_to_end(key)
        return int(Code.OK)

    def live_get(self, client: ClientId, key: ObjectKey) -> StoredObject | int | None:
        """The object `client`'s get session on `key` reads: None without a session, -707 the
        lease expired, -704 the object was removed under it (both drop the session)."""
        sessions = self.get_sessions[client]
        session = sessions.get(key)
        if session is None:
            return None
        if self.clock() >= session.expires_s:
            del sessions[key]
            session.obj.num_leases -= 1
            return int(Code.LEASE_EXPIRED)
        if self.objects.get(key) is not session.obj:  # removed (force) under the session
            del sessions[key]
            return int(Code.OBJECT_NOT_FOUND)
        return session.obj

    def end_gets(self, client: ClientId) -> dict[ObjectKey, GetSession]:
        """Forget every get session of `client` (closing); returns them."""
        sessions = self.get_sessions.pop(client, {})
        for session in sessions.values():
            session.obj.num_leases -= 1
        return sessions

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
        self.released_puts.clear()
        self.arena.close()
