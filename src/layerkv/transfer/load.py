"""One step's layerwise load: the receive thread reads layer l's ranges for every key, at most
`prefetch_layers` layers ahead of the layer the compute thread works on, verifies headers with
layer 0, fans a shared key out to every local block that wants it, and ends the get sessions
only after its last read returned. With `staged` (host caches, read_layers_per_range > 1) it
reads groups of layers as one range per key into staging and scatters them (transfer/staged.py);
layer 0 is always read alone. Touched by the compute thread (wait_layer) and the receive
thread (run); shared state guarded by JobState.cond.

    compute:  start ── wait(0) ─ attn 0 ─ wait(1) ─ attn 1 ─ wait(2) ─ attn 2 ...
    receive:  read 0 ─ read 1 ─ read 2 ── read 3 ────────── read 4 ...          (prefetch 2)
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from layerkv.errors import HeaderError, TransferTimeout
from layerkv.header import Header
from layerkv.layout import CacheLayout
from layerkv.messages import BlockHash, ReqId
from layerkv.store.base import KVStore, ObjectKey
from layerkv.ranges import RangeLists
from layerkv.transfer.rows import KeyRows
from layerkv.transfer.staged import LayerGroup, StagedLayers, layer_groups
from layerkv.transfer.thread import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadKey:
    """One remote object to read: into `block_id`, then copied to `extra_block_ids`."""

    key: ObjectKey
    block_hash: BlockHash
    block_id: int
    extra_block_ids: tuple[int, ...]
    owners: frozenset[ReqId]


class LoadJob(JobState):
    """Reads `keys` (whose get sessions are open) layer by layer. Failures are published as
    invalid block ids / tainted requests before the compute thread is woken."""

    def __init__(
        self,
        keys: list[LoadKey],
        *,
        store: KVStore,
        layout: CacheLayout,
        header: Header,
        staging: np.ndarray,  # uint8 registered rows: [>= len(keys), header_nbytes], or with
        # `staged`: [>= 1, staged.row_nbytes] (keys are read through it in chunks of its rows)
        prefetch_layers: int,
        on_done: Callable[[LoadJob], None],
        on_failed: Callable[[list[LoadKey], str], None],
        staged: StagedLayers | None = None,
    ) -> None:
        super().__init__("layerkv load")
        self.keys = keys
        self._store = store
        self._layout = layout
        self._header = header
        self._staging = staging
        self._prefetch = prefetch_layers
        self._on_done = on_done
        self._on_failed = on_failed
        self._rows = KeyRows([k.block_id for k in keys], layout, staging)
        self._staged = staged
        # fan-out targets (row, block) beyond each key's first block, for the staged scatter
        self._extra_rows = np.array([i for i, k in enumerate(keys) for _ in k.extra_block_ids], dtype=np.int64)
        self._extra_blocks = np.array([b for k in keys for b in k.extra_block_ids], dtype=np.int64)
        self.failed = np.zeros(len(keys), dtype=bool)  # guarded by cond
        self.layers_done = 0  # guarded by cond
        self.compute_layer = 0  # guarded by cond: the layer the compute thread waits for
        self.loaded_bytes = 0  # receive thread only, read after finished
        self.range_calls = 0  # receive thread only: range calls made (the store may split each)
        self.read_s = 0.0  # receive thread only

    # -- compute thread -------------------------------------------------------------------
    def wait_layer(self, layer_idx: int, timeout_s: float) -> None:
        """Let the receive thread run ahead to layer_idx + prefetch, then wait for layer_idx.
        On timeout every block of the job is published invalid and the job is cancelled before
        TransferTimeout is raised (the stalled call ends the sessions when it returns)."""
        with self.cond:
            if layer_idx > self.compute_layer:
                self.compute_layer = layer_idx
                self.cond.notify_all()
        try:
            self.wait_until(lambda: self.layers_done > layer_idx or self.finished, timeout_s, f"layer {layer_idx}")
        except TransferTimeout as exc:
            with self.cond:
                rows = np.flatnonzero(~self.failed)
            self._fail(rows, f"layer {layer_idx} not read within {timeout_s:.1f} s")
            self.cancel()
            raise exc

    # -- receive thread -------------------------------------------------------------------
    def run(self) -> None:
        try:
            groups = self._staged.groups if self._staged is not None else layer_groups(self._layout, 1)
            for group in groups:
                if not self._wait_allowed(group.first_layer):  # prefetch counts layers, not groups
                    self._fail(np.flatnonzero(~self.failed), "cancelled before all layers were read")
                    break
                if self._staged is not None:
                    self._read_group(group)
                else:
                    self._read_layer(group.first_layer)
                with self.cond:
                    self.layers_done = group.end_layer
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - published to the compute thread
            log.exception("layerkv: load thread failed; every block of this step is invalid")
            self._fail(np.flatnonzero(~self.failed), f"transfer thread error: {exc!r}", exc)
        finally:
            try:
                self._on_done(self)  # every read of this job has returned: sessions may end
            finally:
                with self.cond:
                    self.finished = True
                    self.cond.notify_all()

    def _wait_allowed(self, layer_idx: int) -> bool:
        with self.cond:
            # read ahead: while compute works on layer c, layers up to c + prefetch may be read
            while layer_idx > self.compute_layer + self._prefetch and not self.cancelled:
                self.cond.wait(0.5)
            return not self.cancelled

    def _read_layer(self, layer_idx: int) -> None:
        with self.cond:
            active = np.flatnonzero(~self.failed)
        if active.size == 0:
            return
        ok = self._get(active, self._rows.ranges(layer_idx, active), layer_idx, f"layer {layer_idx}")
        good = active[ok]
        if layer_idx == 0:
            good = good[self._verify_headers(good, good)]
        self._fan_out(layer_idx, good)

    def _read_group(self, group: LayerGroup) -> None:
        """Read `group`'s span of every active key through the staging rows (a chunk of keys
        per call), verify headers with layer 0, scatter to every block wanting the key."""
        assert self._staged is not None
        with self.cond:
            active = np.flatnonzero(~self.failed)
        slot_of_row = np.full(len(self.keys), -1, dtype=np.int64)
        for begin in range(0, active.size, self._staging.shape[0]):
            chunk = active[begin : begin + self._staging.shape[0]]
            slots = np.arange(chunk.size, dtype=np.int64)
            ok = self._get(chunk, self._staged.ranges(group, self._staging, chunk.size), group.first_layer, group.label)
            good, good_slots = chunk[ok], slots[ok]
            if group.first_layer == 0:
                checked = self._verify_headers(good, good_slots)
                good, good_slots = good[checked], good_slots[checked]
            slot_of_row[good] = good_slots  # -1 everywhere else
            extra = slot_of_row[self._extra_rows] >= 0 if self._extra_rows.size else np.zeros(0, dtype=bool)
            targets = np.concatenate([self._rows.block_ids[good], self._extra_blocks[extra]])
            sources = np.concatenate([good_slots, slot_of_row[self._extra_rows[extra]]])
            self._staged.scatter(group, self._staging, sources, targets)
            slot_of_row[chunk] = -1

    def _get(self, rows: np.ndarray, ranges: RangeLists, layer_idx: int, what: str) -> np.ndarray:
        """One range call for the keys at `rows`; publishes short reads as failed and returns
        the mask of rows whose read moved every byte."""
        expected = int(np.sum(ranges.sizes[0]))
        keys = [self.keys[i].key for i in rows]
        start = time.perf_counter()
        results = np.asarray(
            self._store.batch_get_into_multi_buffer_ranges(keys, ranges.ptrs, ranges.sizes, ranges.offsets, layer_idx=layer_idx),  # type: ignore[call-arg]
            dtype=np.int64,
        )
        self.read_s += time.perf_counter() - start
        self.range_calls += 1
        ok = results == expected
        if not ok.all():
            codes = sorted(set(results[~ok].tolist()))
            self._fail(rows[~ok], f"{what} read returned {codes} (expected {expected} bytes)")
        self.loaded_bytes += expected * int(ok.sum())
        return ok

    def _verify_headers(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose header (in staging slot `slots[i]`) matches; the others fail."""
        ok = np.ones(rows.size, dtype=bool)
        for i, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
            try:
                self._header.verify(self._staging[slot, : self._layout.header_nbytes], self.keys[row].block_hash)
            except HeaderError as exc:
                ok[i] = False
                self._fail(np.array([row]), str(exc))
        return ok

    def _fan_out(self, layer_idx: int, rows: np.ndarray) -> None:
        """Copy the layer from the block it was read into to the other blocks wanting the key."""
        template = self._layout.template(layer_idx)
        for row in rows.tolist():
            extra = self.keys[row].extra_block_ids
            if not extra:
                continue
            src, sizes, _ = template.columns(np.array([self.keys[row].block_id]))
            dst, _, _ = template.columns(np.array(extra))
            for target in dst:
                for s_ptr, d_ptr, nbytes in zip(src[0].tolist(), target.tolist(), sizes[0].tolist()):
                    ctypes.memmove(d_ptr, s_ptr, nbytes)

    def _fail(self, rows: np.ndarray, reason: str, exc: BaseException | None = None) -> None:
        """Publish failed rows (invalid blocks, tainted requests) before waking the compute thread."""
        with self.cond:
            new = rows[~self.failed[rows]]
            self.failed[new] = True
            if exc is not None:
                self.error = exc
        if new.size:
            self._on_failed([self.keys[i] for i in new.tolist()], reason)
        with self.cond:
            self.cond.notify_all()
