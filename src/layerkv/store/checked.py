"""CheckedStore: the one wrapper every layerkv call to a backend goes through. It splits batches
into chunks of at most `max_batch_keys`, validates every answer, turns a backend exception into
a per-key failure, writes the range audit and counts calls / keys / bytes. Any side, any
thread: stats and the outage state are guarded by one lock; the backend provides its own
thread-safety.

Outages: when a chunk answers RPC_FAIL / RPC_TIMEOUT for every key (master unreachable or
hung), metadata calls (exists, put/get start, put end, whole-object calls, remove) answer
NOT_SENT at once for `retry_interval_s` instead of reaching the backend (nothing to undo) — Mooncake spends ~4.4 s
reconnecting on each such call while its master is down, ~30 s when it is hung. Range calls on
open sessions and session releases still go through. After the interval one call probes the
backend again, never a put: until an answer clears the outage, a put start (or whole-object put)
is preceded by an exists call of a probe key, and answered NOT_SENT if that meets the outage
again (a put start Mooncake's client answers -901 itself may still be executed once the master
resumes, and no session is held to revoke it). The engine meanwhile serves without the pool:
misses, no saves. Every outage answer bumps `outage_epoch`: jobs stop using sessions opened
before it (they may touch memory a restarted master gave to other objects).

Bounds: with `call_timeout_s`, every call that talks to the master (all but the range calls) runs
on a bounded pool thread and answers RPC_TIMEOUT after that many seconds; what such a call does
when it returns late is undone (a late put start is revoked, a late get start ended).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from layerkv.errors import ConfigError, StoreError
from layerkv.store.audit import RangeAudit
from layerkv.store.base import (
    OUTAGE_CODES,
    STORE_CALLS,
    Code,
    KVStore,
    ObjectKey,
    Placement,
    validate_results,
    validate_single,
)
from layerkv.store.bounded import BoundedCaller

log = logging.getLogger(__name__)
_RPC_FAIL = int(Code.RPC_FAIL)
_RPC_TIMEOUT = int(Code.RPC_TIMEOUT)
_NOT_SENT = int(Code.NOT_SENT)


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
        call_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_keys < 1:
            raise ConfigError(f"max_batch_keys={max_batch_keys} must be >= 1 (config max_transfer_blocks)")
        self.backend = backend
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._caller = BoundedCaller("store", call_timeout_s) if call_timeout_s is not None else None
        self._down_until = 0.0  # guarded by _stats_lock: metadata calls short-circuit before this time
        self._epoch = 0  # guarded by _stats_lock: outage answers seen
        self.name = backend.name
        self.max_batch_keys = max_batch_keys
        self.audit = audit
        self._pass_layer_idx = getattr(backend, "accepts_layer_idx", False) is True
        self._stats_lock = threading.Lock()
        self._stats: dict[str, CallStats] = {}  # guarded by _stats_lock
        self._buffers: dict[int, int] = {}  # guarded by _stats_lock: registered ptr -> registrations
        self._registering = threading.Lock()  # one (un)registration at a time: check and call stay one step

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
        """Call `call` chunk by chunk with keys and each per-key argument sliced alike. A batch
        whose per-key arguments do not match its keys is answered INVALID_PARAMS per key (as
        Mooncake and both bare stores answer it), nothing sent: always one int per key."""
        if not self._matches(call, keys, per_key):
            return [int(Code.INVALID_PARAMS)] * len(keys)
        method = getattr(self.backend, call)
        kwargs = {"layer_idx": layer_idx} if self._pass_layer_idx and layer_idx is not None else {}
        results: list[int] = []
        for start in range(0, len(keys), self.max_batch_keys):
            part = slice(start, start + self.max_batch_keys)
            chunk = keys[part]
            if not self._may_send(call):  # answered here: nothing reached the store
                self._count(call, len(chunk), 0, len(chunk))
                results.extend([_NOT_SENT] * len(chunk))
                continue
            got = self._chunk(call, method, (chunk, *(arg[part] for arg in per_key), *extra), kwargs)
            nbytes = moved(got, part) if moved is not None else 0
            self._count(call, len(chunk), nbytes, sum(1 for r in got if r < 0))
            if self.audit is not None and audit_as is not None:
                part_offsets = offsets[part] if offsets is not None else None
                self.audit.record(call, audit_as, chunk, got, layer_idx=layer_idx, nbytes=nbytes, offsets=part_offsets)
            results.extend(got)
        return results

    def _matches(self, call: str, keys: Sequence[ObjectKey], per_key: Sequence[Sequence[Any]]) -> bool:
        """Every per-key argument has one entry per key; else the call is logged and counted as
        failed for every key (the caller answers INVALID_PARAMS)."""
        short = next((len(arg) for arg in per_key if len(arg) != len(keys)), None)
        if short is None:
            return True
        log.error(
            "layerkv: %s: %d keys but an argument has %d entries: answered %d per key, nothing sent",
            call,
            len(keys),
            short,
            int(Code.INVALID_PARAMS),
        )
        self._count(call, len(keys), 0, len(keys))
        return False

    def _chunk(self, call: str, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
        """One chunk's call (`args[0]`: its keys): one int per key, validated; a raise is
        RPC_FAIL and a call past its bound RPC_TIMEOUT for every key. Notes outages."""
        chunk = args[0]
        try:
            answered, raw = self._call(call, method, args, kwargs)
        except Exception as exc:  # the one place backend exceptions become codes
            log.error(
                "layerkv: %s on %s raised for %d keys (first %r): %r",
                call,
                self.name,
                len(chunk),
                chunk[0],
                exc,
                exc_info=exc,
            )
            return [_RPC_FAIL] * len(chunk)
        got = validate_results(raw, len(chunk), call) if answered else [_RPC_TIMEOUT] * len(chunk)
        if call in _OUTAGE_CHECKED:  # the store said it is unreachable (not a raise): outage
            self._note_health(call, got)
        return got

    def _call(
        self, call: str, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """(answered in time?, raw result). Calls that talk to the master are bounded."""
        if self._caller is None or call not in _BOUNDED:
            return True, method(*args, **kwargs)
        undo = self._undo_late(call, args[0])
        return self._caller.call(lambda: method(*args, **kwargs), on_late=undo)

    def _undo_late(self, call: str, keys: Sequence[ObjectKey]) -> Callable[[Any], None] | None:
        """What to do when a timed-out call returns after all: undo sessions it opened."""
        if call == "batch_put_session_start":
            release = self.backend.batch_put_session_revoke
        elif call == "batch_get_session_start":
            release = self.backend.batch_get_session_end  # type: ignore[assignment]
        else:
            return None

        def undo(raw: Any) -> None:
            opened = [k for k, code in zip(keys, raw if isinstance(raw, (list, tuple)) else ()) if code == 0]
            if opened:
                log.warning("layerkv: %s answered after its bound; releasing %d sessions it opened", call, len(opened))
                release(opened)

        return undo

    # ---- outages -----------------------------------------------------------------------------
    @property
    def outage_epoch(self) -> int:
        """Bumped on every outage answer; sessions started before a bump must not be used."""
        with self._stats_lock:
            return self._epoch

    def is_down(self) -> bool:
        """True while metadata calls short-circuit after an RPC failure of a whole chunk."""
        with self._stats_lock:
            return self._clock() < self._down_until

    def _may_send(self, call: str) -> bool:
        """No while an outage short-circuits `call`. A put after an outage that no answer has
        cleared yet: an exists call of a probe key asks first (a put is never the probe), and its
        answer decides. Range calls on open sessions always go (no lock taken: the per-layer path)."""
        if call not in _GATED:
            return True
        with self._stats_lock:
            down_until = self._down_until
        if call in _NEEDS_MASTER and self._clock() < down_until:
            return False
        if call not in _PUTS or down_until == 0.0:
            return True
        got = self._chunk("batch_is_exist", self.backend.batch_is_exist, ([_PROBE_KEY],), {})
        self._count("batch_is_exist", 1, 0, sum(1 for r in got if r < 0))
        return not self.is_down()

    def _note_health(self, call: str, got: list[int]) -> None:
        down = bool(got) and all(code in OUTAGE_CODES for code in got)
        with self._stats_lock:
            was_down = self._down_until > 0.0
            self._down_until = self._clock() + self.retry_interval_s if down else 0.0
            self._epoch += down
        if down and not was_down:
            log.warning(
                "layerkv: %s unreachable (%s answered %s); serving without the pool, retrying every %.1f s",
                self.name,
                call,
                sorted(set(got)),
                self.retry_interval_s,
            )
        elif was_down and not down:
            log.warning("layerkv: %s reachable again; using the pool", self.name)

    # ---- KVStore -----------------------------------------------------------------------------
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register `ptr` with the backend once, however many callers register it (the per-group
        workers of a hybrid model share cache tensors, and may register from their own threads);
        each call needs its unregister."""
        with self._registering:
            with self._stats_lock:
                if ptr in self._buffers:
                    self._buffers[ptr] += 1
                    return
            try:
                self.backend.register_buffer(ptr, nbytes)
            except Exception as exc:
                raise StoreError(f"{self.name}: register_buffer(ptr={ptr:#x}, nbytes={nbytes}) failed: {exc}") from exc
            with self._stats_lock:
                self._buffers[ptr] = self._buffers.get(ptr, 0) + 1

    def unregister_buffer(self, ptr: int) -> None:
        with self._registering:
            with self._stats_lock:
                count = self._buffers.get(ptr, 0)
                if count > 1:
                    self._buffers[ptr] = count - 1
                    return
                self._buffers.pop(ptr, None)
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
            "batch_put_from_multi_buffer_ranges",
            keys,
            (ptrs, sizes, dst_offsets),
            audit_as="put",
            layer_idx=layer_idx,
            offsets=dst_offsets,
            moved=_positive,
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
            "batch_get_into_multi_buffer_ranges",
            keys,
            (ptrs, sizes, src_offsets),
            audit_as="get",
            layer_idx=layer_idx,
            offsets=src_offsets,
            moved=_positive,
        )

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int:
        """One int: 0, or the first non-zero chunk answer (RPC_FAIL if a chunk raised)."""
        call = "batch_get_session_end"
        worst = 0
        for start in range(0, len(keys), self.max_batch_keys):
            chunk = keys[start : start + self.max_batch_keys]
            try:
                answered, raw = self._call(call, self.backend.batch_get_session_end, (chunk,), {})
                code = validate_single(raw, call) if answered else _RPC_TIMEOUT
            except Exception as exc:
                log.error("layerkv: %s on %s raised for %d keys: %r", call, self.name, len(chunk), exc, exc_info=exc)
                code = _RPC_FAIL
            self._count(call, len(chunk), 0, len(chunk) if code < 0 else 0)
            worst = worst or code
        return worst

    def batch_put_from(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int], placement: Placement | None = None
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
        if self._caller is not None:
            self._caller.close()
        self.backend.close()


# Derived from the protocol's method table (store/base.py).
_NEEDS_MASTER = frozenset(name for name, call in STORE_CALLS.items() if call.needs_master)
_BOUNDED = frozenset(name for name, call in STORE_CALLS.items() if call.bounded)
_OUTAGE_CHECKED = frozenset(name for name, call in STORE_CALLS.items() if call.talks_to_master)
_PUTS = frozenset({"batch_put_session_start", "batch_put_from"})  # what a -901 answer can leave unrevocable
_GATED = _NEEDS_MASTER | _PUTS
_PROBE_KEY = "layerkv-outage-probe"  # asked after an outage (never written)


def _positive(got: list[int], part: slice) -> int:
    return sum(r for r in got if r > 0)
