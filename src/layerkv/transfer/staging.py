"""Registered host staging buffers, handed to one job at a time: a buffer whose last job has not
finished is never handed out again (a store call that outlived its job, or a background write,
may still read or write it), so concurrent jobs get different buffers and a buffer is reused
only once its job is over. Compute thread only (jobs are created there); the buffers stay
registered with the store until `close`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from layerkv.store.checked import CheckedStore


@dataclass(slots=True)
class _Buffer:
    kind: str
    array: np.ndarray  # uint8 [rows, width]
    user: Any = None  # the job that got it last (has `.finished`)


class StagingPool:
    def __init__(self, store: CheckedStore, max_nbytes: int) -> None:
        self._store = store
        self._max_nbytes = max_nbytes
        self._buffers: list[_Buffer] = []

    def take(self, kind: str, num_rows: int, width: int) -> np.ndarray:
        """A free buffer of `kind` with >= num_rows rows of `width` bytes (reused, or allocated
        with room to grow: doubling, within the staging bound). StoreError if the store refuses
        to register a new one. Call `lend` with the job that will use it."""
        free = [b for b in self._buffers if b.kind == kind and b.array.shape[1] == width and b.array.shape[0] >= num_rows
                and (b.user is None or b.user.finished)]
        if free:
            return min(free, key=lambda b: b.array.shape[0]).array
        largest = max((b.array.shape[0] for b in self._buffers if b.kind == kind and b.array.shape[1] == width), default=0)
        rows = max(num_rows, 2 * largest, 32 if width < 4096 else 1)
        rows = min(rows, max(num_rows, self._max_nbytes // width))
        array = np.empty((rows, width), dtype=np.uint8)  # [rows, width]
        array.fill(0)  # every page mapped now, not inside the first transfer into it
        self._store.register_buffer(array.ctypes.data, array.nbytes)
        self._buffers.append(_Buffer(kind, array))
        return array

    def lend(self, array: np.ndarray, job: Any) -> None:
        """`job` uses `array` until it finishes."""
        for buffer in self._buffers:
            if buffer.array is array:
                buffer.user = job
                return
        raise KeyError("not a buffer of this pool")

    def nbytes(self) -> int:
        return sum(b.array.nbytes for b in self._buffers)

    def close(self) -> list[str]:
        """Unregister every buffer; returns the errors (shutdown logs them)."""
        errors = []
        for buffer in self._buffers:
            try:
                self._store.unregister_buffer(buffer.array.ctypes.data)
            except Exception as exc:  # noqa: BLE001 - shutdown goes on
                errors.append(str(exc))
        self._buffers.clear()
        return errors
