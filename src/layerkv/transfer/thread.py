"""A named daemon thread that runs one step job at a time, and the job base class with the
condition that the compute thread and the transfer thread share. Each job's state is guarded
by its own condition; the thread's queue by its own lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)
_POLL_S = 0.5  # how often an idle thread re-checks for close


class StepJob(Protocol):
    def run(self) -> None: ...

    def cancel(self) -> None: ...


class JobState:
    """The part every job shares: a condition, done/finished/cancelled flags, an error."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.cancelled = False  # guarded by cond
        self.finished = False  # guarded by cond: run() returned, every store call has returned
        self.error: BaseException | None = None  # guarded by cond

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def wait_finished(self, timeout_s: float) -> bool:
        """Block until run() has returned; False if it has not after `timeout_s`."""
        return self.wait_for(lambda: self.finished, timeout_s)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (under cond) until `predicate()`; False after `timeout_s`. Never raises."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(remaining)
            return True


class TransferThread:
    """Runs submitted jobs in order on one named daemon thread (`layerkv-recv-0`, ...)."""

    def __init__(self, name: str, on_idle: Callable[[], None] | None = None) -> None:
        """`on_idle` runs on this thread whenever it has waited `_POLL_S` with nothing queued."""
        self._on_idle = on_idle
        self._queue: queue.Queue[StepJob | None] = queue.Queue()
        self._closed = threading.Event()
        self._current: StepJob | None = None  # only read for cancel on close
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    def submit(self, job: StepJob) -> None:
        if self._closed.is_set():
            raise RuntimeError(f"{self.name} is closed")
        self._queue.put(job)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the running job, stop the thread and join it (bounded)."""
        self._closed.set()
        current = self._current
        if current is not None:
            current.cancel()
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("layerkv: %s did not stop within %.1f s", self.name, timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                job = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._on_idle is not None:
                    try:
                        self._on_idle()
                    except BaseException:  # noqa: BLE001 - an idle chore must not kill the thread
                        log.exception("layerkv: %s: idle task raised", self.name)
                continue
            if job is None:
                break
            self._current = job
            try:
                job.run()  # jobs catch their own errors; this is a last resort
            except BaseException:  # noqa: BLE001 - a transfer thread must never die silently
                log.exception("layerkv: %s: job raised", self.name)
            finally:
                self._current = None
        # drain: cancel whatever is still queued so waiters are released
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.run()
