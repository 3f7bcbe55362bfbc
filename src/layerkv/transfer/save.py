"""One step's layerwise save: the send thread writes layer l's ranges for every open put
session as soon as the compute thread hands the layer over, revokes a key whose range failed
(the others go on), and after the last layer commits the rest — except keys owned by a request
that read bad KV in this step, which are revoked. Compute thread: hand_layer / finalize;
send thread: run. Shared state guarded by JobState.cond.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerkv.layout import CacheLayout
from layerkv.messages import ReqId
from layerkv.store.base import KVStore, ObjectKey
from layerkv.transfer.rows import KeyRows
from layerkv.transfer.thread import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveKey:
    key: ObjectKey
    block_id: int
    owners: frozenset[ReqId]


@dataclass(slots=True)
class SaveOutcome:
    committed: list[ObjectKey]
    revoked: list[ObjectKey]
    failed: list[ObjectKey]  # range or end failures (subset of revoked)
    tainted: list[ObjectKey]  # revoked because an owner read bad KV (subset of revoked)
    saved_bytes: int = 0
    range_calls: int = 0
    error: BaseException | None = None  # the send thread itself failed


class SaveJob(JobState):
    """Writes `keys` (put sessions open, headers encoded in `staging` rows 0..n-1)."""

    def __init__(
        self,
        keys: list[SaveKey],
        *,
        store: KVStore,
        layout: CacheLayout,
        staging: np.ndarray,
        on_closed: Callable[[SaveOutcome], None],
    ) -> None:
        super().__init__("layerkv save")
        self.keys = keys
        self._store = store
        self._layout = layout
        self._on_closed = on_closed
        self._rows = KeyRows([k.block_id for k in keys], layout, staging)
        self._handed: list[tuple[int, Any]] = []  # guarded by cond: (layer, device event or None)
        self._tainted_reqs: frozenset[ReqId] | None = None  # guarded by cond; set by finalize
        self.failed = np.zeros(len(keys), dtype=bool)  # send thread only until finished
        self.sent_layers: set[int] = set()  # send thread only
        self.saved_bytes = 0
        self.write_s = 0.0
        self.outcome = SaveOutcome([], [], [], [])

    # -- compute thread -------------------------------------------------------------------
    def hand_layer(self, layer_idx: int, event: Any = None) -> None:
        with self.cond:
            self._handed.append((layer_idx, event))
            self.cond.notify_all()

    def finalize(self, tainted_reqs: frozenset[ReqId]) -> None:
        """No more layers this step; commit what is complete and clean."""
        with self.cond:
            self._tainted_reqs = tainted_reqs
            self.cond.notify_all()

    # -- send thread ----------------------------------------------------------------------
    def run(self) -> None:
        open_rows = np.arange(len(self.keys))
        try:
            while True:
                item = self._next_layer()
                if item is None:
                    break
                layer_idx, event = item
                if event is not None:
                    event.synchronize()  # the layer's KV is written on the device before we read it
                self._write_layer(layer_idx)
            open_rows = self._commit()
        except BaseException as exc:  # noqa: BLE001 - published; keys revoked below
            log.exception("layerkv: save thread failed; revoking this step's put sessions")
            with self.cond:
                self.error = exc
            self.failed[:] = True
        finally:
            try:
                still_open = [i for i in open_rows.tolist() if self.keys[i].key not in self.outcome.committed]
                self._revoke(np.array(still_open, dtype=np.int64), failed=bool(self.error))
            finally:
                self.outcome.saved_bytes, self.outcome.error = self.saved_bytes, self.error
                self._on_closed(self.outcome)
                with self.cond:
                    self.finished = True
                    self.cond.notify_all()

    def _next_layer(self) -> tuple[int, Any] | None:
        with self.cond:
            while not self._handed and self._tainted_reqs is None and not self.cancelled:
                self.cond.wait(0.5)
            if self._handed:
                return self._handed.pop(0)
            return None

    def _write_layer(self, layer_idx: int) -> None:
        if layer_idx in self.sent_layers:
            return
        self.sent_layers.add(layer_idx)
        active = np.flatnonzero(~self.failed)
        if active.size == 0:
            return
        ranges = self._rows.ranges(layer_idx, active)
        expected = int(np.sum(ranges.sizes[0]))
        start = time.perf_counter()
        results = np.asarray(
            self._store.batch_put_from_multi_buffer_ranges(  # type: ignore[call-arg]
                [self.keys[i].key for i in active], ranges.ptrs, ranges.sizes, ranges.offsets, layer_idx=layer_idx
            ),
            dtype=np.int64,
        )
        self.write_s += time.perf_counter() - start
        self.outcome.range_calls += 1
        self.saved_bytes += expected * int(np.count_nonzero(results == expected))
        bad = active[results != expected]
        if bad.size:
            log.warning("layerkv: layer %d write failed for %d keys (%s); revoking them", layer_idx, bad.size,
                        sorted(set(results[results != expected].tolist())))
            self.failed[bad] = True
            self._revoke(bad, failed=True)

    def _commit(self) -> np.ndarray:
        """End the sessions of complete, untainted keys; revoke the rest. Returns rows still open."""
        with self.cond:
            tainted_reqs = self._tainted_reqs or frozenset()
            cancelled = self.cancelled
        rows = np.flatnonzero(~self.failed)
        complete = len(self.sent_layers) == self._layout.num_layers and not cancelled
        if not complete:
            log.warning("layerkv: %d of %d layers written this step; revoking %d keys",
                        len(self.sent_layers), self._layout.num_layers, rows.size)
            self._revoke(rows, failed=True)
            return np.array([], dtype=np.int64)
        tainted = np.array([i for i in rows.tolist() if self.keys[i].owners & tainted_reqs], dtype=np.int64)
        if tainted.size:
            self.outcome.tainted.extend(self.keys[i].key for i in tainted.tolist())
            self._revoke(tainted, failed=False)
        clean = np.setdiff1d(rows, tainted)
        if clean.size == 0:
            return clean
        results = np.asarray(self._store.batch_put_session_end([self.keys[i].key for i in clean]), dtype=np.int64)
        self.outcome.committed.extend(self.keys[i].key for i in clean[results == 0].tolist())
        bad = clean[results != 0]
        if bad.size:
            log.warning("layerkv: commit failed for %d keys (%s); revoking them", bad.size, sorted(set(results[results != 0].tolist())))
            self._revoke(bad, failed=True)
        return np.array([], dtype=np.int64)

    def _revoke(self, rows: np.ndarray, *, failed: bool) -> None:
        rows = np.array([i for i in rows.tolist() if self.keys[i].key not in self.outcome.revoked], dtype=np.int64)
        if rows.size == 0:
            return
        keys = [self.keys[i].key for i in rows.tolist()]
        self.failed[rows] = True
        self.outcome.revoked.extend(keys)
        if failed:
            self.outcome.failed.extend(keys)
        self._store.batch_put_session_revoke(keys)  # a failed revoke leaves PROCESSING to the store's timeout
