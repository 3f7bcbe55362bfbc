"""The store calls of one transfer job, in one place:

* `KeyRows`, the one range builder: for each key of a job its local block and its staging slot,
  turned into the range lists a store call moves (a layer's segments in the cache, the header
  slot, the header slot followed by layer 0, or a layer group's span through staging slots).
* `Lanes`: a job splits a read or write over `n` concurrent calls (Mooncake's TCP transport runs
  the ranges of one call one after another, but separate calls may use separate connections).
  The caller's thread runs the first part, the pool's named daemon threads (layerkv/threads.py;
  `<name>-1`, `<name>-2`, ..., up to `max_lanes - 1` of them) the rest; `run` returns when every
  part returned. A worker has two pools, one per direction (load lanes for its reads, save lanes
  for its writes), so a stuck write never holds up a read, nor the reverse. Thread-safe.
* `JobReads`: a load's range reads (a layer, a layer group) or whole-object reads of a wave of
  keys, split over the lanes, timed, counted into the job's outcome and recorded for the planner
  (`outcome.measured`). A read that moved fewer bytes than asked is a failed row; the job decides
  what that means.

KeyRows is built on the compute thread, then read-only; the rest runs on the job's thread.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges
from layerkv.store.base import ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.threads import NamedThreads
from layerkv.transfer.groups import LayerGroup
from layerkv.transfer.planner import Measured


class KeyRows:
    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        layout: CacheLayout,
        staging: np.ndarray,
        slots: np.ndarray | None = None,
    ) -> None:
        """`staging`: uint8 [rows, >= header_nbytes], registered with the store; row
        `slots[i]` (default i) holds key i's header."""
        self.layout = layout
        self._staging = staging
        self.block_ids = np.array(block_ids, dtype=np.int64)  # [keys]
        self._slots = np.arange(len(self.block_ids), dtype=np.int64) if slots is None else slots[: len(self.block_ids)]
        self._header = layout.header_template(staging.ctypes.data, staging.shape[0], staging.strides[0])

    def layer(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """`layer_idx`'s ranges for the keys at `rows` (one inner list per row)."""
        return self.layout.template(layer_idx).ranges(self.block_ids[rows])

    def header(self, rows: np.ndarray) -> RangeLists:
        """The header slot of each key at `rows` <-> object bytes [0, header_nbytes)."""
        return self._header.ranges(self._slots[rows])

    def header_and_layer(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """Header slot ranges followed by `layer_idx`'s ranges, per key (a load's first read)."""
        return join_ranges((self._header, self._slots[rows]), (self.layout.template(layer_idx), self.block_ids[rows]))

    def step(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """What a layerwise transfer moves for `layer_idx`: layer 0 carries the header."""
        return self.header_and_layer(0, rows) if layer_idx == 0 else self.layer(layer_idx, rows)

    def span(self, group: LayerGroup, slots: np.ndarray) -> RangeLists:
        """`group`'s span of the object <-> staging slot `slots[i]`, one inner list per slot; the
        span is split into pieces of at most max_transfer_bytes."""
        staging = self._staging
        if (slots.size and int(slots.max()) >= staging.shape[0]) or group.span_nbytes > staging.shape[1]:
            raise LayoutError(
                f"staging {list(staging.shape)} is too small for slots up to {int(slots.max())} x "
                f"{group.span_nbytes} bytes"
            )
        piece = self.layout.max_transfer_bytes
        starts = np.arange(0, group.span_nbytes, piece, dtype=np.int64)  # [pieces]
        sizes_row = np.minimum(piece, group.span_nbytes - starts).tolist()
        offsets_row = (group.span_start + starts).tolist()
        slot_ptrs = staging.ctypes.data + slots.astype(np.int64) * staging.strides[0]
        ptrs = (slot_ptrs[:, None] + starts[None, :]).tolist()  # [slots, pieces]
        return RangeLists(ptrs, [sizes_row] * len(slots), [offsets_row] * len(slots), len(sizes_row))


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


class JobReads:
    def __init__(
        self,
        store: CheckedStore,
        keys: list[ObjectKey],
        lanes: Lanes,
        num_lanes: int,
        outcome: Any,
        fail: Callable[[np.ndarray, str], None],
    ) -> None:
        """`outcome` has read_s, range_calls, loaded_bytes and measured (a LoadOutcome); `fail`
        marks the rows whose read moved fewer bytes than asked (the job's, with the reason)."""
        self._store, self._keys, self._lanes, self._num_lanes = store, keys, lanes, num_lanes
        self._outcome = outcome
        self._measured: Measured = outcome.measured
        self._fail = fail

    def ranges(
        self, rows: np.ndarray, ranges: Callable[[np.ndarray], RangeLists], layer_idx: int | None, what: str
    ) -> np.ndarray:
        """Range reads of `rows`; the rows whose read moved every byte (the others failed)."""
        parts = split_rows(rows, self._num_lanes)
        lists = [ranges(part) for part in parts]
        start = time.perf_counter()
        got = np.concatenate(
            self._lanes.run(
                [functools.partial(self._call_ranges, part, rl, layer_idx) for part, rl in zip(parts, lists)]
            )
        )
        elapsed = time.perf_counter() - start
        expected = int(np.sum(lists[0].sizes[0]))
        ok = got == expected
        self._count(elapsed, len(parts), expected * int(ok.sum()))
        self._measured.ranges.append(
            (elapsed, len(parts), max(len(p) for p in parts) * lists[0].num_segments, expected * int(rows.size))
        )
        if not ok.all():
            self._fail(rows[~ok], f"{what} read returned {sorted(set(got[~ok].tolist()))} (expected {expected} bytes)")
        return rows[ok]

    def whole(self, rows: np.ndarray, ptr_of: Callable[[int], int], nbytes: int) -> np.ndarray:
        """Whole-object reads of `rows` into `ptr_of(row)`; the rows read in full (the others failed)."""
        parts = split_rows(rows, self._num_lanes)

        def read(part: np.ndarray) -> np.ndarray:
            ptrs = [ptr_of(int(r)) for r in part.tolist()]
            return np.asarray(
                self._store.batch_get_into([self._keys[i] for i in part], ptrs, [nbytes] * len(part)), dtype=np.int64
            )

        start = time.perf_counter()
        got = np.concatenate(self._lanes.run([functools.partial(read, part) for part in parts]))
        elapsed = time.perf_counter() - start
        ok = got == nbytes
        self._count(elapsed, len(parts), nbytes * int(ok.sum()))
        self._measured.wholes.append((elapsed, max(len(p) for p in parts), nbytes * int(rows.size)))
        if not ok.all():
            self._fail(
                rows[~ok], f"whole-object read returned {sorted(set(got[~ok].tolist()))} (expected {nbytes} bytes)"
            )
        return rows[ok]

    def _call_ranges(self, rows: np.ndarray, ranges: RangeLists, layer_idx: int | None) -> np.ndarray:
        return np.asarray(
            self._store.batch_get_into_multi_buffer_ranges(
                [self._keys[i] for i in rows], ranges.ptrs, ranges.sizes, ranges.offsets, layer_idx=layer_idx
            ),
            dtype=np.int64,
        )

    def _count(self, elapsed_s: float, calls: int, nbytes: int) -> None:
        self._outcome.read_s += elapsed_s
        self._outcome.range_calls += calls
        self._outcome.loaded_bytes += nbytes
