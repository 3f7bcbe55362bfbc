"""The embedded store: an in-process backend with Mooncake's batch session semantics and codes.
Any side; thread-safe: one lock guards objects, sessions and the arena (copies run under it so
an object can never be freed mid-copy). `client()` gives another handle on the same objects with
its own put/get sessions, as a second Mooncake client would have.

    object lifecycle:  put start -> PROCESSING --put end--> COMPLETE --evict/remove--> gone
                                        |  revoke / put_timeout_s (the owner keeps a released
                                        v  put session: put end -704 until it revokes)
                                      gone

Where Mooncake 0.3.13 would move freed memory (a read under a force-removed object, a write into
a released put), this store answers -704 instead (docs/data-safety.md, tests/conformance).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from layerkv.errors import ConfigError, StoreError
from layerkv.store.arena import HostRegions, check_ranges, copy_ranges, is_index
from layerkv.store.base import Code, HitSource, ObjectKey, Placement, PoolScope
from layerkv.store.object_table import ClientId, ObjectState, ObjectTable, StoredObject
from layerkv.store.process_stores import shared_root

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig

GiB = 1 << 30
_OK = int(Code.OK)
_INVALID = int(Code.INVALID_PARAMS)
_NOT_FOUND = int(Code.OBJECT_NOT_FOUND)
_EXISTS = int(Code.OBJECT_EXISTS)
_NOT_READY = int(Code.REPLICA_NOT_READY)
_NO_SPACE = int(Code.NO_SPACE)


class EmbeddedStore:
    """In-process `KVStore`. Every batch call returns one int per key (Mooncake's codes), except
    `batch_get_session_end` (one int). Pointers are raw host addresses; device memory cannot
    be detected from an int (the worker refuses device caches with this backend). With
    `strict_buffers` (what a worker's config opens), a range or buffer that is not inside memory
    this handle registered fails its key with -600, as a transfer from unregistered memory
    fails on Mooncake: the tests see any path that hands the store memory it must not reach.

    Calls on a closed handle raise `StoreError`.
    """

    pool_scope = PoolScope.PROCESS  # the objects live in this process
    hit_source = HitSource.HOST

    def __init__(
        self,
        capacity_bytes: int = 1 * GiB,
        lease_ttl_s: float = 10.0,
        put_timeout_s: float = 600.0,
        name: str = "embedded",
        *,
        clock: Callable[[], float] = time.monotonic,
        strict_buffers: bool = False,
    ) -> None:
        if lease_ttl_s <= 0 or put_timeout_s <= 0:
            raise ConfigError(f"lease_ttl_s={lease_ttl_s} and put_timeout_s={put_timeout_s} must be > 0")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.lease_ttl_s = lease_ttl_s
        self.put_timeout_s = put_timeout_s
        self.strict_buffers = strict_buffers
        self._table = ObjectTable(capacity_bytes, clock)
        self._attach()

    @classmethod
    def from_config(cls, config: LayerKVConfig) -> EmbeddedStore:
        """A new handle (strict_buffers) on this process's store for the config's capacity, lease
        and put timeout (store/process_stores.py): the scheduler side and every worker side of
        one process see the same objects. Close it when done; the objects live until
        `close_shared_stores`."""
        settings = (config.embedded_capacity_bytes, config.embedded_lease_ttl_s, config.embedded_put_timeout_s)
        root = shared_root(("embedded", *settings), lambda: cls(*settings, strict_buffers=True))
        return root.client()

    @staticmethod
    def pool_address(config: LayerKVConfig) -> str:
        return "this-process"

    def client(self) -> EmbeddedStore:
        """Another handle on the same objects with its own put and get sessions (like a second
        Mooncake client). Close it on its own; the memory goes when the last handle closes."""
        other = object.__new__(EmbeddedStore)
        other.name, other.capacity_bytes = self.name, self.capacity_bytes
        other.lease_ttl_s, other.put_timeout_s = self.lease_ttl_s, self.put_timeout_s
        other.strict_buffers = self.strict_buffers
        other._table = self._table
        other._attach()
        return other

    def _attach(self) -> None:
        table = self._table
        with table.lock:
            if table.closed:
                raise StoreError(f"embedded store {self.name!r} is closed")
            self._client_id: ClientId = next(table.client_ids)
            self._closed = False
            self._buffers = HostRegions()  # guarded by table.lock: what this handle registered
            table.num_handles += 1
            table.get_sessions[self._client_id] = {}

    # ---- bookkeeping -------------------------------------------------------------------------
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Host memory this handle may move bytes from and into (checked with strict_buffers)."""
        if not is_index(ptr) or not is_index(nbytes) or ptr <= 0 or nbytes <= 0:
            raise StoreError(f"embedded store: register_buffer(ptr={ptr!r}, nbytes={nbytes!r}): both must be > 0")
        with self._table.lock:
            self._buffers.add(ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> None:
        with self._table.lock:
            self._buffers.remove(ptr)

    def _registered(self, ptr: int, nbytes: int) -> bool:  # under lock
        """[ptr, ptr + nbytes) lies inside one registered region (always, without strict_buffers)."""
        return not self.strict_buffers or self._buffers.holds(ptr, nbytes)

    @property
    def used_bytes(self) -> int:
        with self._table.lock:
            return self._table.arena.used_bytes

    def close(self) -> None:
        """Revoke this handle's put sessions, drop its get sessions; free the arena when this
        was the last handle. Idempotent."""
        table = self._table
        with table.lock:
            if self._closed:
                return
            self._closed = True
            for key, obj in list(table.processing.items()):
                if obj.owner == self._client_id:
                    self._table.drop(key, obj)
            table.end_gets(self._client_id)
            table.released_puts.pop(self._client_id, None)
            table.num_handles -= 1
            if table.num_handles == 0:
                table.close()

    @contextlib.contextmanager
    def _open_table(self, reclaim: bool = True) -> Iterator[ObjectTable]:
        """The table under its lock, after checking this handle is open and (`reclaim`)
        dropping put sessions older than put_timeout_s (Mooncake's put-start discard)."""
        table = self._table
        with table.lock:
            if self._closed or table.closed:
                raise StoreError(f"embedded store {self.name!r} is closed")
            if reclaim:
                table.reclaim_stale_puts(self.put_timeout_s)
            yield table

    # ---- exists / put sessions ---------------------------------------------------------------
    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]:
        with self._open_table() as table:
            return [
                1 if (o := table.objects.get(k)) is not None and o.state is ObjectState.COMPLETE else 0 for k in keys
            ]

    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        """0 per reserved key; -600 zero size / this client already holds it; -705 committed or
        another client holds it; -200 no space even after evicting unleased committed objects."""
        if len(sizes) != len(keys):
            return [_INVALID] * len(keys)
        with self._open_table():
            started: set[ObjectKey] = set()  # a key again in the same batch: -705, as Mooncake answers
            results = []
            for key, nbytes in zip(keys, sizes):
                results.append(_EXISTS if key in started else self._start_put(key, nbytes))
                started.add(key)
            return results

    def _start_put(self, key: ObjectKey, nbytes: int, *, whole: bool = False) -> int:  # under lock
        """A put start of `key`; `whole` (batch_put_from): this client's put sessions on it,
        open or released, do not matter (-705 if the key exists, as for any other writer)."""
        table = self._table
        if isinstance(nbytes, bool) or not is_index(nbytes) or nbytes <= 0:
            return _INVALID
        nbytes = int(nbytes)
        if not whole and key in table.released_puts.get(self._client_id, ()):
            return _INVALID  # this client still holds the released put session
        existing = table.objects.get(key)
        if existing is not None:
            if not whole and existing.state is ObjectState.PROCESSING and existing.owner == self._client_id:
                return _INVALID
            return _EXISTS
        offset = self._table.alloc_evicting(nbytes)
        if offset is None:
            return _NO_SPACE
        obj = StoredObject(offset, nbytes, ObjectState.PROCESSING, self._client_id, table.clock())
        table.objects[key] = obj
        table.processing[key] = obj
        return _OK

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Bytes written per key; -600 without this client's put session or for a range outside
        the object (then nothing of that key is written); -704 for a released put session
        (deliberate: Mooncake writes into the released space)."""
        return self._copy_ranges(keys, ptrs, sizes, dst_offsets, to_store=True)

    def batch_put_session_end(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Commit: 0, or -600 when this client holds no put session on the key; a key again in
        the same batch after its commit: 0, as Mooncake answers. A put session whose object
        put_timeout_s released: -704, and the session stays until revoked (ObjectTable)."""
        with self._open_table() as table:
            results: list[int] = []
            ended: set[ObjectKey] = set()
            for key in keys:
                obj = self._own_put(key)
                if obj is None:
                    released = table.end_released_put(self._client_id, key, revoke=False)
                    results.append(_OK if key in ended else _INVALID if released is None else released)
                    continue
                ended.add(key)
                obj.state = ObjectState.COMPLETE
                del table.processing[key]
                table.lru[key] = None
                results.append(_OK)
            return results

    def batch_put_session_revoke(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Abandon: 0, or -600 when this client holds no put session on the key (a released
        put session: see ObjectTable.end_released_put)."""
        with self._open_table() as table:
            results = []
            for key in keys:
                obj = self._own_put(key)
                if obj is None:
                    released = table.end_released_put(self._client_id, key, revoke=True)
                    results.append(_INVALID if released is None else released)
                    continue
                self._table.drop(key, obj)
                results.append(_OK)
            return results

    def _own_put(self, key: ObjectKey) -> StoredObject | None:  # under lock
        obj = self._table.processing.get(key)
        return obj if obj is not None and obj.owner == self._client_id else None

    # ---- get sessions ------------------------------------------------------------------------
    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]:
        """0 and a lease of lease_ttl_s; -704 missing; -703 still PROCESSING. A failed start
        drops this client's old session on the key (its reads then answer -600), as Mooncake's."""
        with self._open_table() as table:
            return [table.start_get(self._client_id, key, self.lease_ttl_s) for key in keys]

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Bytes read per key; -600 no session / range outside the object; -707 the lease
        expired (the session is dropped, so the next read is -600); -704 the object is gone."""
        return self._copy_ranges(keys, ptrs, sizes, src_offsets, to_store=False)

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int:
        """Drop this client's get sessions on `keys`; 0 (also for keys without a session)."""
        with self._open_table(reclaim=False) as table:
            sessions = table.get_sessions[self._client_id]
            for key in keys:
                session = sessions.pop(key, None)
                if session is not None:
                    session.obj.num_leases -= 1
            return _OK

    # ---- ranges ------------------------------------------------------------------------------
    def _copy_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
        *,
        to_store: bool,
    ) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes) == len(offsets):
            return [_INVALID] * len(keys)
        with self._open_table() as table:
            base = table.arena.base_ptr
            results: list[int] = []
            host: list[int] = []
            arena: list[int] = []
            nbytes: list[int] = []
            for key, key_ptrs, key_sizes, key_offsets in zip(keys, ptrs, sizes, offsets):
                obj = self._own_put(key) if to_store else table.live_get(self._client_id, key)
                if obj is None and to_store and key in table.released_puts.get(self._client_id, ()):
                    obj = _NOT_FOUND  # deliberate: Mooncake writes into the released space
                if isinstance(obj, int):
                    results.append(obj)
                    continue
                if obj is None:
                    results.append(_INVALID)
                    continue
                total = check_ranges(key_ptrs, key_sizes, key_offsets, obj.nbytes)
                if total > 0 and not all(self._registered(p, n) for p, n in zip(key_ptrs, key_sizes)):
                    total = _INVALID
                results.append(total)
                if total > 0:
                    host.extend(key_ptrs)
                    arena.extend(base + obj.offset + off for off in key_offsets)
                    nbytes.extend(key_sizes)
            if to_store:
                copy_ranges(arena, host, nbytes)
            else:
                copy_ranges(host, arena, nbytes)
            return results

    # ---- whole objects -----------------------------------------------------------------------
    def batch_put_from(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        """Start, write and commit each object in one step: 0 or the put start error. A key
        that exists (committed, or any client's put session) answers 0 and nothing is written,
        as Mooncake's "already exists"; a key again in the batch: its last bytes are kept."""
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID] * len(keys)
        with self._open_table() as table:
            results = []
            written: dict[ObjectKey, StoredObject] = {}  # by this batch (no other call sees it yet)
            for key, ptr, nbytes in zip(keys, ptrs, sizes):
                code = (
                    _INVALID
                    if not ptr or not self._registered(ptr, nbytes)
                    else self._start_put(key, nbytes, whole=True)
                )
                obj = table.processing.pop(key) if code == _OK else written.get(key)
                if code in (_OK, _EXISTS) and obj is not None and obj.nbytes == nbytes:
                    copy_ranges([table.arena.base_ptr + obj.offset], [ptr], [nbytes])
                    obj.state = ObjectState.COMPLETE
                    table.lru[key] = None
                    written[key] = obj
                results.append(_OK if code == _EXISTS else code)
            return results

    def batch_get_into(self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Bytes read per key; -704 missing, -703 PROCESSING, -600 buffer smaller than the object."""
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID] * len(keys)
        with self._open_table() as table:
            results = []
            for key, ptr, nbytes in zip(keys, ptrs, sizes):
                obj = table.objects.get(key)
                if obj is None:
                    results.append(_NOT_FOUND)
                elif obj.state is ObjectState.PROCESSING:
                    results.append(_NOT_READY)
                elif not ptr or nbytes < obj.nbytes or not self._registered(ptr, obj.nbytes):
                    results.append(_INVALID)
                else:
                    copy_ranges([ptr], [table.arena.base_ptr + obj.offset], [obj.nbytes])
                    table.lru.move_to_end(key)
                    results.append(obj.nbytes)
            return results

    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Remove committed objects (leases notwithstanding, like Mooncake's force remove):
        0, -704 missing, -703 PROCESSING (revoke it instead)."""
        with self._open_table(reclaim=False) as table:
            results = []
            for key in keys:
                obj = table.objects.get(key)
                if obj is None:
                    results.append(_NOT_FOUND)
                elif obj.state is ObjectState.PROCESSING:
                    results.append(_NOT_READY)
                else:
                    self._table.drop(key, obj)
                    results.append(_OK)
            return results
