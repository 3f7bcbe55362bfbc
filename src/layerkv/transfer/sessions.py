"""The get sessions one load job holds: which of its keys have a session open, and the outage
epoch and time they were opened at (for the fence and the lease renewal). Receive thread only
(the job that owns it); no lock.
"""

from __future__ import annotations

import time

import numpy as np

from layerkv.store.base import UNCERTAIN_CODES, ObjectKey
from layerkv.store.checked import CheckedStore


class GetSessions:
    def __init__(self, store: CheckedStore, keys: list[ObjectKey]) -> None:
        self._store = store
        self._keys = keys
        self.open = np.zeros(len(keys), dtype=bool)  # started, not ended
        self._epoch = 0
        self._started_s = 0.0

    def start(self, rows: np.ndarray) -> np.ndarray:
        """Start sessions for `rows`; returns the store's code per row (0: open). Sessions an
        uncertain answer may have opened are ended at once."""
        self._epoch = self._store.outage_epoch
        self._started_s = time.monotonic()
        results = np.asarray(self._store.batch_get_session_start([self._keys[i] for i in rows]), dtype=np.int64)
        self.open[rows[results == 0]] = True
        uncertain = rows[np.isin(results, list(UNCERTAIN_CODES))]
        if uncertain.size:  # the store may have opened these: end them (0 also for unknown keys)
            self._store.batch_get_session_end([self._keys[i] for i in uncertain])
        return results

    def end(self, rows: np.ndarray | None = None) -> None:
        """End the open sessions of `rows` (default: all); each is ended once."""
        rows = np.flatnonzero(self.open) if rows is None else rows[self.open[rows]]
        if rows.size:
            self.open[rows] = False
            self._store.batch_get_session_end([self._keys[i] for i in rows.tolist()])

    def fenced(self) -> bool:
        """The store had an outage since the last start: those sessions may read memory a
        restarted master gave to other objects."""
        return self._store.outage_epoch != self._epoch

    def older_than(self, seconds: float) -> bool:
        return time.monotonic() - self._started_s >= seconds
