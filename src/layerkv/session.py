"""Session tracker: which put sessions are open for which (request, block) owners, which keys
this worker committed, and which get sessions are open for which requests (reference-counted
across requests sharing a key). Worker side; guarded by one lock, so the compute thread and
the transfer threads may call it concurrently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerkv.messages import ReqId
from layerkv.store.base import ObjectKey


@dataclass(slots=True)
class _PutSession:
    owners: set[tuple[ReqId, int]] = field(default_factory=set)  # (request, local block id)


class SessionTracker:
    """Bookkeeping only: it never calls the store. Callers end/revoke what it hands back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._puts: dict[ObjectKey, _PutSession] = {}  # guarded by _lock
        self._committed: dict[ReqId, set[ObjectKey]] = {}  # guarded by _lock
        self._gets: dict[ObjectKey, set[ReqId]] = {}  # guarded by _lock

    # -- put sessions ---------------------------------------------------------------------
    def open_puts(self, owners: dict[ObjectKey, list[tuple[ReqId, int]]]) -> None:
        """Record put sessions that were started (key -> its (request, block) owners)."""
        with self._lock:
            for key, key_owners in owners.items():
                self._puts.setdefault(key, _PutSession()).owners.update(key_owners)

    def put_owners(self, key: ObjectKey) -> set[ReqId]:
        with self._lock:
            session = self._puts.get(key)
            return {req for req, _ in session.owners} if session else set()

    def close_puts(self, keys: Iterable[ObjectKey], *, committed: bool) -> None:
        """Forget put sessions that were ended (committed=True) or revoked."""
        with self._lock:
            for key in keys:
                session = self._puts.pop(key, None)
                if committed and session is not None:
                    for req, _ in session.owners:
                        self._committed.setdefault(req, set()).add(key)

    def open_put_keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._puts)

    def committed_keys(self, req_id: ReqId) -> set[ObjectKey]:
        """Keys this request committed in earlier steps (a later chunk may load them)."""
        with self._lock:
            return set(self._committed.get(req_id, ()))

    # -- get sessions ---------------------------------------------------------------------
    def acquire_gets(self, owners: dict[ObjectKey, set[ReqId]]) -> list[ObjectKey]:
        """Add owners to get sessions; return the keys that had no open session (to start)."""
        with self._lock:
            new = [key for key in owners if key not in self._gets]
            for key, reqs in owners.items():
                self._gets.setdefault(key, set()).update(reqs)
            return new

    def release_gets(self, req_ids: Iterable[ReqId], keys: Iterable[ObjectKey] | None = None) -> list[ObjectKey]:
        """Drop these requests' ownership (of `keys`, or of all their keys); return the keys
        whose last owner left (their get session must now be ended, exactly once)."""
        reqs = set(req_ids)
        with self._lock:
            candidates = list(self._gets) if keys is None else [k for k in keys if k in self._gets]
            ended = []
            for key in candidates:
                owners = self._gets[key]
                owners -= reqs
                if not owners:
                    del self._gets[key]
                    ended.append(key)
            return ended

    def open_get_keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._gets)

    # -- request lifecycle ----------------------------------------------------------------
    def forget_request(self, req_id: ReqId) -> None:
        """Finish / abort / preemption: the request's committed-key memory goes. Open sessions
        are released by the caller through release_gets / close_puts (they need store calls)."""
        with self._lock:
            self._committed.pop(req_id, None)

    def forget_all_requests(self) -> None:
        with self._lock:
            self._committed.clear()

    def is_empty(self) -> bool:
        with self._lock:
            return not self._puts and not self._gets and not self._committed

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"open_puts": len(self._puts), "open_gets": len(self._gets), "requests_with_commits": len(self._committed)}
