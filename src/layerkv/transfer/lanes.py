"""Concurrent store calls for one transfer: a job splits a read or write over `n` lanes (Mooncake's
TCP transport runs the ranges of one call one after another, but separate calls may use
separate connections). The caller's thread runs the first part, named daemon threads the rest;
`run` returns when every part returned. One pool per worker, shared by its receive and send
threads; thread-safe.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class Lanes:
    def __init__(self, name: str, max_lanes: int) -> None:
        self.max_lanes = max(1, max_lanes)
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], _Slot] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # guarded by _lock
        self._closed = False  # guarded by _lock

    def run(self, parts: Sequence[Callable[[], T]]) -> list[T]:
        """Results of every part, in order; re-raises the first part's exception after all ran."""
        if len(parts) <= 1:
            return [p() for p in parts]
        self._ensure_threads(len(parts) - 1)
        slots = [_Slot() for _ in parts[1:]]
        for part, slot in zip(parts[1:], slots):
            self._queue.put((part, slot))
        first: list[Any] = []
        error: BaseException | None = None
        try:
            first.append(parts[0]())
        except BaseException as exc:  # noqa: BLE001 - re-raised once every lane returned
            error = exc
        for slot in slots:
            slot.done.wait()
            if error is None and slot.error is not None:
                error = slot.error
        if error is not None:
            raise error
        return [first[0], *(slot.result for slot in slots)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(timeout=5.0)

    def _ensure_threads(self, n: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} lanes are closed")
            while len(self._threads) < n:
                thread = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads) + 1}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            part, slot = item
            try:
                slot.result = part()
            except BaseException as exc:  # noqa: BLE001 - handed to run()
                slot.error = exc
            finally:
                slot.done.set()


class _Slot:
    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


def split_rows(rows: Any, lanes: int) -> list[Any]:
    """`rows` (a 1-D numpy array) in up to `lanes` contiguous, non-empty parts."""
    import numpy as np

    n = min(lanes, len(rows))
    return [part for part in np.array_split(rows, max(1, n)) if len(part)]
