"""A bound on the wall time of one store call: the call runs on a small pool of named daemon
threads (grown on demand up to 8) and the caller waits at most `timeout_s`. A call that answers late is not lost: its
result goes to an `on_late` callback on the pool thread (used to undo what a late put / get
start did). Any thread may call; the pool is the only shared state (thread-safe).

Why: a hung Mooncake master (stopped, no TCP reset) answers each call after ~30 s (-901), far
past any TTFT budget; the bound turns it into an outage answer at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
_MAX_THREADS = 8  # calls stuck at once before new ones queue (each is bounded by the store's own timeout)


class BoundedCaller:
    def __init__(self, name: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # guarded by _lock
        self._idle = 0  # guarded by _lock: threads waiting for work that no queued call has claimed
        self._closed = False  # guarded by _lock

    def call(self, fn: Callable[..., Any], *args: Any, on_late: Callable[[Any], None] | None = None) -> tuple[bool, Any]:
        """(True, result) if `fn(*args)` returned within the bound (re-raises what fn raised),
        else (False, None); then `on_late(result)` runs on the pool thread when fn returns."""
        job = _Call(fn, args, on_late)
        self._submit(job)
        if not job.done.wait(self.timeout_s):
            with job.lock:
                if not job.finished:
                    job.abandoned = True
                    return False, None
        if job.error is not None:
            raise job.error
        return True, job.result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)

    def _submit(self, job: _Call) -> None:
        """Queue `job` for a thread of its own: an idle thread is reserved for it (counted at
        submit time, not when the thread takes it: two calls submitted at once never share one
        idle thread, so a stuck call cannot hold a quick one in the queue), else a new thread
        starts, else (at the cap) it waits for the first thread that frees up."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} store call pool is closed")
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < _MAX_THREADS:
                thread = threading.Thread(target=self._loop, name=f"layerkv-{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            # else: at the cap the call waits for the first thread that frees up (threads never
            # end, so from here on `_idle` only has to say "none free": it may run ahead)
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.run()
            finally:
                with self._lock:
                    self._idle += 1


class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], on_late: Callable[[Any], None] | None) -> None:
        self.fn, self.args, self.on_late = fn, args, on_late
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.finished = False  # guarded by lock
        self.abandoned = False  # guarded by lock: the caller stopped waiting
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.error = exc
        with self.lock:
            self.finished = True
            late = self.abandoned
        self.done.set()
        if late and self.on_late is not None and self.error is None:
            try:
                self.on_late(self.result)
            except Exception:  # noqa: BLE001 - a cleanup must never kill the pool thread
                log.exception("layerkv: cleanup after a late store answer failed")
