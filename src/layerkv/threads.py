"""A pool of named daemon threads, the one pool type of the package (transfer/calls.py's lanes
and store/bounded.py's bounded store calls run on it; it imports nothing of layerkv, so any
package may use it).

`submit(fn)` runs `fn` on a pool thread and returns its `Task` at once. Threads start on demand
up to `max_threads` and never end until `close()`. Each submitted task reserves an idle thread
of its own when it is submitted (not when a thread takes it): two tasks submitted at once never
count on the same idle thread, so below the cap a task never waits in the queue behind a stuck
one; a new thread starts when none is idle, and only at the cap do tasks queue (first in, first
out) for the first thread that frees up. Threads are named `<name>-<first>`, `<name>-<first+1>`,
... in start order. Thread-safe: any thread may submit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Task(Generic[T]):
    """One submitted call: `wait` for it, then `result` (what it returned, or re-raises what it raised)."""

    __slots__ = ("_fn", "_done", "_result", "_error")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the call returned or raised; False if `timeout_s` passed first."""
        return self._done.wait(timeout_s)

    def result(self) -> T:
        """Waits for the call (no bound), then returns what it returned or re-raises what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set by run() before done

    @property
    def error(self) -> BaseException | None:
        """What the call raised (None while it runs or if it returned)."""
        return self._error

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
            self._error = exc
        finally:
            self._done.set()


class NamedThreads:
    """Named daemon threads, started on demand up to `max_threads` (at least 1)."""

    def __init__(self, name: str, max_threads: int, *, first: int = 0) -> None:
        self.name = name
        self.max_threads = max(1, max_threads)
        self._first = first
        self._queue: queue.SimpleQueue[Task[Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # guarded by _lock
        # guarded by _lock: idle threads no submitted task has reserved, less (below zero, only
        # at the cap) the tasks queued with no thread of their own
        self._free = 0
        self._closed = False  # guarded by _lock

    def submit(self, fn: Callable[[], T]) -> Task[T]:
        """Runs `fn()` on a pool thread of its own (a reserved idle one, else a new one, else at
        the cap the first that frees up). Raises RuntimeError once closed."""
        task = Task(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"thread pool {self.name} is closed")
            if self._free <= 0 and len(self._threads) < self.max_threads:
                self._start_thread()  # the new thread is this task's
            else:
                self._free -= 1  # an idle thread reserved for it, or (at the cap) a place in the queue
        self._queue.put(task)
        return task

    def num_threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def close(self, join_timeout_s: float | None = None) -> None:
        """No more submits; each thread ends once the tasks queued before it ran. With
        `join_timeout_s`, waits up to that long for each thread to end."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        if join_timeout_s is not None:
            for thread in threads:
                thread.join(timeout=join_timeout_s)

    def _start_thread(self) -> None:  # caller holds _lock
        thread = threading.Thread(
            target=self._loop, name=f"{self.name}-{self._first + len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task.run()  # never raises: the task keeps what its call raised
            with self._lock:
                self._free += 1
