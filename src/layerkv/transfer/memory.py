"""What a worker registers with the store: its staging areas, and its live KV cache only with
`register_kv_cache: true` (a peer that reaches the store's transfer ports can read and write
every registered byte). Registered once at start-up on the compute thread; a refusal (Mooncake's
master unreachable) is retried on a transfer thread, never on the compute thread, at most once
per `retry_interval_s`; meanwhile the worker serves without the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from layerkv.errors import StoreError
from layerkv.store.checked import CheckedStore
from layerkv.transfer.thread import JobState, StepJob

log = logging.getLogger(__name__)


def memory_regions(kv_caches: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Distinct (ptr, nbytes) memory regions of the registered tensors / arrays. A torch view
    registers its whole storage from the storage's start (vLLM views every layer into one
    buffer: the view's own data_ptr plus the storage size would run past the allocation)."""
    regions: dict[int, int] = {}
    for value in kv_caches.values():
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(tensor, "data_ptr"):
                storage = tensor.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            else:
                ptr, nbytes = tensor.ctypes.data, tensor.nbytes
            regions[ptr] = max(regions.get(ptr, 0), nbytes)
    return sorted(regions.items())


class RegisteredMemory:
    """The regions this worker registers. `register` at start-up (compute thread, before the
    first step); `ready` from the compute thread each step (never calls the store itself)."""

    def __init__(
        self, store: CheckedStore, retry_interval_s: float, who: str, submit: Callable[[StepJob], None]
    ) -> None:
        self._store, self._retry_interval_s, self._who, self._submit = store, retry_interval_s, who, submit
        self._lock = threading.Lock()
        self._registered: list[int] = []  # guarded by _lock
        self._unregistered: list[tuple[int, int]] = []  # guarded by _lock
        self._closed = False  # guarded by _lock: unregister() ran; a late retry undoes what it registers
        self._next_try_s = 0.0  # compute thread
        self._retry: _Retry | None = None  # compute thread: the retry in flight

    def register(self, regions: list[tuple[int, int]]) -> bool:
        """Register `regions` now (start-up); True when the store accepted all of them."""
        with self._lock:
            self._unregistered.extend(regions)
        return self._register_pending()

    def ready(self) -> bool:
        """True when every region is registered; otherwise (re)queues one bounded retry on a
        transfer thread when one is due and answers False (serve without the pool)."""
        with self._lock:
            if not self._unregistered:
                return True
        if self._retry is not None and not self._retry.finished:
            return False
        now = time.monotonic()
        if now >= self._next_try_s:
            self._next_try_s = now + self._retry_interval_s
            self._retry = _Retry(self._register_pending)
            try:
                self._submit(self._retry)
            except RuntimeError:  # the thread is closed (shutdown)
                self._retry = None
        return False

    def regions(self) -> list[int]:
        """Pointers registered with the store now."""
        with self._lock:
            return list(self._registered)

    def unregister(self) -> None:
        with self._lock:
            registered, self._registered = self._registered, []
            self._unregistered.clear()
            self._closed = True
        for ptr in registered:
            try:
                self._store.unregister_buffer(ptr)
            except StoreError as exc:
                log.warning("layerkv: %s", exc)

    def _register_pending(self) -> bool:
        while True:
            with self._lock:
                if not self._unregistered or self._closed:
                    return not self._closed
                ptr, nbytes = self._unregistered[0]
            try:
                self._store.register_buffer(ptr, nbytes)
            except StoreError as exc:
                log.warning(
                    "layerkv: %s cannot register its staging memory with the store (%s); serving without "
                    "the pool, retrying every %.1f s",
                    self._who,
                    exc,
                    self._retry_interval_s,
                )
                return False
            with self._lock:
                closed = self._closed
                if not closed:
                    self._unregistered.pop(0)
                    self._registered.append(ptr)
            if closed:  # shut down while this call was in the store: undo it
                try:
                    self._store.unregister_buffer(ptr)
                except StoreError as exc:
                    log.warning("layerkv: %s", exc)
                return False


class _Retry(JobState):
    """One registration attempt on a transfer thread."""

    def __init__(self, attempt: Callable[[], bool]) -> None:
        super().__init__("layerkv register")
        self._attempt = attempt

    def run(self) -> None:
        try:
            if not self.cancelled:
                self._attempt()
        except BaseException:  # noqa: BLE001 - a failed retry is retried later
            log.exception("layerkv: registering memory failed")
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()
