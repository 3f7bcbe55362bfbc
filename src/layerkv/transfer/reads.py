"""The store reads of one load job: a wave of keys' range reads (a layer, a layer group) or
whole-object reads, split over the plan's lanes, timed, counted into the job's outcome and
recorded for the planner (`outcome.measured`). Receive thread only (the job that owns it). A read that moved fewer
bytes than asked is a failed row; the job decides what that means.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from layerkv.objects.ranges import RangeLists
from layerkv.store.base import ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.transfer.lanes import Lanes, split_rows
from layerkv.transfer.planner import Measured


class JobReads:
    def __init__(self, store: CheckedStore, keys: list[ObjectKey], lanes: Lanes, num_lanes: int, outcome: Any) -> None:
        """`outcome` has read_s, range_calls, loaded_bytes and measured (a LoadOutcome)."""
        self._store, self._keys, self._lanes, self._num_lanes = store, keys, lanes, num_lanes
        self._outcome = outcome
        self._measured: Measured = outcome.measured

    def ranges(self, rows: np.ndarray, ranges: Callable[[np.ndarray], RangeLists], layer_idx: int | None,
               what: str) -> tuple[np.ndarray, str]:
        """Range reads of `rows`; (mask of rows whose read moved every byte, why the others failed)."""
        parts = split_rows(rows, self._num_lanes)
        lists = [ranges(part) for part in parts]
        start = time.perf_counter()
        got = np.concatenate(self._lanes.run([functools.partial(self._call_ranges, part, rl, layer_idx)
                                              for part, rl in zip(parts, lists)]))
        elapsed = time.perf_counter() - start
        expected = int(np.sum(lists[0].sizes[0]))
        ok = got == expected
        self._count(elapsed, len(parts), expected * int(ok.sum()))
        self._measured.ranges.append((elapsed, len(parts), max(len(p) for p in parts) * lists[0].num_segments,
                                      expected * int(rows.size)))
        return ok, f"{what} read returned {sorted(set(got[~ok].tolist()))} (expected {expected} bytes)"

    def whole(self, rows: np.ndarray, ptr_of: Callable[[int], int], nbytes: int) -> tuple[np.ndarray, str]:
        """Whole-object reads of `rows` into `ptr_of(row)`; (mask of full reads, why the others failed)."""
        parts = split_rows(rows, self._num_lanes)

        def read(part: np.ndarray) -> np.ndarray:
            ptrs = [ptr_of(int(r)) for r in part.tolist()]
            return np.asarray(self._store.batch_get_into([self._keys[i] for i in part], ptrs, [nbytes] * len(part)),
                              dtype=np.int64)

        start = time.perf_counter()
        got = np.concatenate(self._lanes.run([functools.partial(read, part) for part in parts]))
        elapsed = time.perf_counter() - start
        ok = got == nbytes
        self._count(elapsed, len(parts), nbytes * int(ok.sum()))
        self._measured.wholes.append((elapsed, max(len(p) for p in parts), nbytes * int(rows.size)))
        return ok, f"whole-object read returned {sorted(set(got[~ok].tolist()))} (expected {nbytes} bytes)"

    def _call_ranges(self, rows: np.ndarray, ranges: RangeLists, layer_idx: int | None) -> np.ndarray:
        return np.asarray(self._store.batch_get_into_multi_buffer_ranges(
            [self._keys[i] for i in rows], ranges.ptrs, ranges.sizes, ranges.offsets, layer_idx=layer_idx), dtype=np.int64)

    def _count(self, elapsed_s: float, calls: int, nbytes: int) -> None:
        self._outcome.read_s += elapsed_s
        self._outcome.range_calls += calls
        self._outcome.loaded_bytes += nbytes
