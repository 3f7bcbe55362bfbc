"""Concurrent store calls for one transfer: a job splits a read or write over `n` lanes (Mooncake's
TCP transport runs the ranges of one call one after another, but separate calls may use
separate connections). The caller's thread runs the first part, the pool's named daemon threads
(layerkv/threads.py; `<name>-1`, `<name>-2`, ..., up to `max_lanes - 1` of them) the rest; `run`
returns when every part returned. A worker has two pools, one per transfer direction (load lanes
for its reads, save lanes for its writes), so a stuck write never holds up a read, nor the
reverse. Thread-safe: runs on one pool from several threads each get idle lanes of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from layerkv.threads import NamedThreads

T = TypeVar("T")


class Lanes:
    def __init__(self, name: str, max_lanes: int) -> None:
        self.max_lanes = max(1, max_lanes)
        # the caller runs the first part: max_lanes - 1 threads (at least one, so any split runs);
        # parts beyond that wait for the first lane that frees up
        self._threads = NamedThreads(name, self.max_lanes - 1, first=1)

    def run(self, parts: Sequence[Callable[[], T]]) -> list[T]:
        """Results of every part, in order; re-raises the first part's exception after all ran."""
        if len(parts) <= 1:
            return [p() for p in parts]
        tasks = [self._threads.submit(part) for part in parts[1:]]
        first: list[Any] = []
        error: BaseException | None = None
        try:
            first.append(parts[0]())
        except BaseException as exc:  # noqa: BLE001 - re-raised once every lane returned
            error = exc
        for task in tasks:
            task.wait()
            if error is None and task.error is not None:
                error = task.error
        if error is not None:
            raise error
        return [first[0], *(task.result() for task in tasks)]

    def close(self) -> None:
        self._threads.close(join_timeout_s=5.0)


def split_rows(rows: Any, lanes: int) -> list[Any]:
    """`rows` (a 1-D numpy array) in up to `lanes` contiguous, non-empty parts."""
    import numpy as np

    n = min(lanes, len(rows))
    return [part for part in np.array_split(rows, max(1, n)) if len(part)]
