"""CheckedStore: the one wrapper every layerkv call to a backend goes through. It splits batches
into chunks of at most `max_batch_keys`, validates every answer, turns a backend exception into
a per-key failure, writes the range audit and counts calls / keys / bytes. Any side, any
thread: stats and the outage state are guarded by one lock; the backend provides its own
thread-safety.

Outages: when a chunk fails with RPC_FAIL for every key (master unreachable), metadata calls
(exists, put/get start, put end, whole-object calls, remove) answer RPC_FAIL at once for
`retry_interval_s` instead of reaching the backend — Mooncake spends ~4.4 s reconnecting on each
such call while its master is down. Range calls on open sessions and session releases still go
through (they do not need the master). After the interval one call probes the backend again.
The engine meanwhile serves without the pool: misses, no saves.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from layerkv.errors import StoreError
from layerkv.store.audit import RangeAudit
from layerkv.store.base import Code, KVStore, ObjectKey, Placement, validate_results, validate_single

log = logging.getLogger(__name__)
_RPC_FAIL = int(Code.RPC_FAIL)


@dataclass(slots=True)
class CallStats:
    """Per method: backend calls made (chunks), keys sent, bytes moved, keys that failed."""

    calls: int = 0
    keys: int = 0
    nbytes: int = 0
    failed_keys: int = 0


class CheckedStore:
    """Implements `KVStore` over `backend`. Results are always one int per key (the backend's
    code, `Code.MALFORMED` for an untrustworthy chunk, `Code.RPC_FAIL` for a chunk whose call
    raised). Range calls and commits take an optional `layer_idx` for the audit line; it is
    also passed on (as `layer_idx=`) to a backend that sets `accepts_layer_idx = True`, such as
    the fault-injecting `FaultyStore`."""

    def __init__(
        self,
        backend: KVStore,
        *,
        max_batch_keys: int,
        audit: RangeAudit | None = None,
        retry_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_keys < 1:
            raise ValueError(f"max_batch_keys={max_batch_keys} must be >= 1 (config max_transfer_blocks)")
        self.backend = backend
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_until = 0.0  # guarded by _stats_lock: metadata calls short-circuit before this time
        self.name = backend.name
        self.max_batch_keys = max_batch_keys
        self.audit = audit
        self._pass_layer_idx = getattr(backend, "accepts_layer_idx", False) is True
        self._stats_lock = threading.Lock()
        self._stats: dict[str, CallStats] = {}  # guarded by _stats_lock

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> dict[str, CallStats]:
        """A snapshot copy: method name -> CallStats."""
        with self._stats_lock:
            return {name: dataclasses.replace(s) for name, s in self._stats.items()}

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats.clear()

    def _count(self, call: str, num_keys: int, nbytes: int, num_failed: int) -> None:
        with self._stats_lock:
            s = self._stats.setdefault(call, CallStats())
            s.calls += 1
            s.keys += num_keys
            s.nbytes += nbytes
            s.failed_keys += num_failed

    # ---- the chunk loop ----------------------------------------------------------------------
    def _run(
        self,
        call: str,
        keys: Sequence[ObjectKey],
        per_key: Sequence[Sequence[Any]] = (),
        *,
        extra: tuple[Any, ...] = (),
        audit_as: str | None = None,
        layer_idx: int | None = None,
        offsets: Sequence[Any] | None = None,
        moved: Callable[[list[int], slice], int] | None = None,
    ) -> list[int]:
        """Call `call` chunk by chunk with keys and each per-key argument sliced alike."""
        for arg in per_key:
            if len(arg) != len(keys):
                raise ValueError(f"{call}: {len(keys)} keys but an argument has {len(arg)} entries")
        method = getattr(self.backend, call)
        kwargs = {"layer_idx": layer_idx} if self._pass_layer_idx and layer_idx is not None else {}
        results: list[int] = []
        for start in range(0, len(keys), self.max_batch_keys):
            part = slice(start, start + self.max_batch_keys)
            chunk = keys[part]
            if call in _NEEDS_MASTER and self.is_down():
                self._count(call, len(chunk), 0, len(chunk))
                results.extend([_RPC_FAIL] * len(chunk))
                continue
            try:
                raw = method(chunk, *(arg[part] for arg in per_key), *extra, **kwargs)
            except Exception as exc:  # the one place backend exceptions become codes
                log.error("layerkv: %s on %s raised for %d keys (first %r): %r", call, self.name, len(chunk), chunk[0], exc, exc_info=exc)
                got = [_RPC_FAIL] * len(chunk)
            else:
                got = validate_results(raw, len(chunk), call)
                if call in _NEEDS_MASTER:  # the backend itself said RPC_FAIL (not a raise): outage
                    self._note_health(call, got)
            nbytes = moved(got, part) if moved is not None else 0
            self._count(call, len(chunk), nbytes, sum(1 for r in got if r < 0))
            if self.audit is not None and audit_as is not None:
                self.audit.record(
                    call, audit_as, chunk, got, layer_idx=layer_idx, nbytes=nbytes,
                    offsets=offsets[part] if offsets is not None else None,
                )
            results.extend(got)
        return results

    # ---- outages -----------------------------------------------------------------------------
    def is_down(self) -> bool:
        """True while metadata calls short-circuit after an RPC failure of a whole chunk."""
        with self._stats_lock:
            return self._clock() < self._down_until

    def _note_health(self, call: str, got: list[int]) -> None:
        down = bool(got) and all(code == _RPC_FAIL for code in got)
        with self._stats_lock:
            was_down = self._down_until > 0.0
            self._down_until = self._clock() + self.retry_interval_s if down else 0.0
        if down and not was_down:
            log.warning("layerkv: %s unreachable (%s answered RPC_FAIL); serving without the pool, retrying every %.1f s",
                        self.name, call, self.retry_interval_s)
        elif was_down and not down:
            log.warning("layerkv: %s reachable again; using the pool", self.name)

    # ---- KVStore -----------------------------------------------------------------------------
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        try:
            self.backend.register_buffer(ptr, nbytes)
        except Exception as exc:
            raise StoreError(f"{self.name}: register_buffer(ptr={ptr:#x}, nbytes={nbytes}) failed: {exc}") from exc

    def unregister_buffer(self, ptr: int) -> None:
        try:
            self.backend.unregister_buffer(ptr)
        except Exception as exc:
            raise StoreError(f"{self.name}: unregister_buffer(ptr={ptr:#x}) failed: {exc}") from exc

    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._run("batch_is_exist", keys)

    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        return self._run("batch_put_session_start", keys, (sizes,), extra=(placement,))

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
        layer_idx: int | None = None,
    ) -> list[int]:
        return self._run(
            "batch_put_from_multi_buffer_ranges", keys, (ptrs, sizes, dst_offsets),
            audit_as="put", layer_idx=layer_idx, offsets=dst_offsets, moved=_positive,
        )

    def batch_put_session_end(self, keys: Sequence[ObjectKey], layer_idx: int | None = None) -> list[int]:
        return self._run("batch_put_session_end", keys, audit_as="put", layer_idx=layer_idx)

    def batch_put_session_revoke(self, keys: Sequence[ObjectKey], layer_idx: int | None = None) -> list[int]:
        return self._run("batch_put_session_revoke", keys, audit_as="put", layer_idx=layer_idx)

    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._run("batch_get_session_start", keys)

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
        layer_idx: int | None = None,
    ) -> list[int]:
        return self._run(
            "batch_get_into_multi_buffer_ranges", keys, (ptrs, sizes, src_offsets),
            audit_as="get", layer_idx=layer_idx, offsets=src_offsets, moved=_positive,
        )

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int:
        """One int: 0, or the first non-zero chunk answer (RPC_FAIL if a chunk raised)."""
        call = "batch_get_session_end"
        worst = 0
        for start in range(0, len(keys), self.max_batch_keys):
            chunk = keys[start : start + self.max_batch_keys]
            try:
                code = validate_single(self.backend.batch_get_session_end(chunk), call)
            except Exception as exc:
                log.error("layerkv: %s on %s raised for %d keys: %r", call, self.name, len(chunk), exc, exc_info=exc)
                code = _RPC_FAIL
            self._count(call, len(chunk), 0, len(chunk) if code < 0 else 0)
            worst = worst or code
        return worst

    def batch_put_from(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        placement: Placement | None = None,
    ) -> list[int]:
        def written(got: list[int], part: slice) -> int:
            return sum(int(n) for r, n in zip(got, sizes[part]) if r == 0)

        return self._run("batch_put_from", keys, (ptrs, sizes), extra=(placement,), audit_as="put", moved=written)

    def batch_get_into(self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._run("batch_get_into", keys, (ptrs, sizes), audit_as="get", moved=_positive)

    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._run("batch_remove", keys)

    def close(self) -> None:
        """Close the backend (the audit belongs to whoever made it)."""
        self.backend.close()


# Calls that need the master (Mooncake): short-circuited during an outage.
_NEEDS_MASTER = frozenset({
    "batch_is_exist", "batch_put_session_start", "batch_put_session_end", "batch_get_session_start",
    "batch_put_from", "batch_get_into", "batch_remove",
})


def _positive(got: list[int], part: slice) -> int:
    return sum(r for r in got if r > 0)
