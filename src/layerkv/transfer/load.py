"""One step's layerwise load. The job owns its get sessions from start to end: on the receive
thread it starts them, reads layer l's ranges for every key at most `prefetch_layers` layers ahead
of the layer the compute thread works on, verifies the header with layer 0 and every layer's
tag before the compute thread may use it, fans a shared key out to every local block that
wants it, renews the sessions when the step outlives `renew_after_s`, and ends them after its
last read returned. Objects whose bytes fail their tag (or whose header is wrong) are
removed from the pool. LAYERS plans (only with the KV cache itself registered) read each layer
straight into the cache blocks (transfer/direct.py). GROUPS / WHOLE plans (the default) read
groups of layers (or whole objects) as one range per key into the job's staging slots and copy
them into the cache, verified where no peer can change them any more (in the cache for host
caches, in a private copy for device caches; transfer/staged.py). More keys than staging slots
stream through the slots a wave at a time, and their get sessions are opened for one wave and
ended behind it: the sessions and staging a step holds are bounded whatever the prompt length.
A job that gave up touches nothing any more: no copy into the cache, no verification, no removal
of objects.

    compute:  start ── wait(0) ─ attn 0 ─ wait(1) ─ attn 1 ─ wait(2) ─ attn 2 ...
    receive:  start sessions ─ read 0 ─ read 1 ─ read 2 ── read 3 ────── read 4 ... end sessions

Device caches: the copies into the cache run on a side stream after the step's start marker,
and wait(l) makes the compute stream wait for layer l's copies (transfer/device.py).

Touched by the compute thread (wait_layer, failed_block_ids) and the receive thread (run);
shared state guarded by JobState.cond. Failures never raise into the compute thread: they are
rows marked failed, whose blocks the engine recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from layerkv.errors import LayoutError
from layerkv.messages import BlockHash
from layerkv.objects.header import Header
from layerkv.objects.ranges import RangeLists
from layerkv.store.base import ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.transfer.caches import LentSlots, RegisteredCaches
from layerkv.transfer.calls import JobReads, KeyRows, Lanes
from layerkv.transfer.checks import ObjectChecks
from layerkv.transfer.device import Marker
from layerkv.transfer.direct import DirectLayers
from layerkv.transfer.groups import LayerGroup, groups_of
from layerkv.transfer.planner import GROUPS, LAYERS, WHOLE, LoadPlan, Measured
from layerkv.transfer.sessions import GetSessions
from layerkv.transfer.thread import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadKey:
    """One remote object to read: into `block_id`, then copied to `extra_block_ids`."""

    key: ObjectKey
    block_hash: BlockHash  # as named in the key and header: Namespace.block_id of the engine's hash
    block_id: int
    extra_block_ids: tuple[int, ...] = ()
    generation: int = 0  # the tenant key it is named and sealed under (0: the current one; LoadJob's headers)


@dataclass(slots=True)
class LoadOutcome:
    """What a finished load did (receive thread writes, compute thread reads after `finished`)."""

    loaded_bytes: int = 0
    range_calls: int = 0  # range calls made (the store may split each into chunks)
    read_s: float = 0.0
    transfer_s: float = 0.0  # from the start of the job to its last layer read (0: not every layer read)
    copy_s: float = 0.0  # staging: verifying and copying into the cache (receive thread)
    copied_bytes: int = 0  # staging: bytes copied into the cache (fan-out copies included)
    header_failures: int = 0
    checksum_failures: int = 0
    fenced_keys: int = 0  # failed because the store had an outage after their session started
    lease_renewals: int = 0
    removed_keys: list[ObjectKey] = field(default_factory=list)  # bad objects removed from the pool
    measured: Measured = field(default_factory=Measured)  # the calls, for the planner (Planner.observe)
    error: BaseException | None = None


class LoadJob(JobState):
    def __init__(
        self,
        keys: list[LoadKey],
        *,
        store: CheckedStore,
        caches: RegisteredCaches,
        headers: tuple[Header, ...],  # one per key generation (LoadKey.generation), the current first
        staging: LentSlots,  # LAYERS: header slots (width >= header_nbytes, >= len(keys) slots); else
        # object slots (>= 1 slot; keys stream through the slots a wave at a time)
        plan: LoadPlan,
        lanes: Lanes,
        renew_after_s: float,
        prefetch_layers: int | None = None,  # read at most this far ahead of compute (None: no cap)
        start_marker: Marker = None,  # device caches: the compute stream at the step's start (device.py)
    ) -> None:
        super().__init__("layerkv load")
        self.keys = keys
        self._store = store
        self._layout = layout = caches.layout
        self._staging = staging.array
        self._slots = slots = staging.slots
        self._views = views = caches.views
        self.plan = plan
        self._lanes = lanes
        self._prefetch = prefetch_layers
        self._renew_after_s = renew_after_s
        self._staged = caches.staged if plan.mode != LAYERS else None  # GROUPS / WHOLE plans
        if slots.size < (len(keys) if plan.mode == LAYERS else min(1, len(keys))):
            raise LayoutError(f"{slots.size} staging slots for a {plan.mode} load of {len(keys)} keys")
        self._rows = KeyRows([k.block_id for k in keys], layout, staging.array, slots if plan.mode == LAYERS else None)
        # held while this job copies into the cache; give_up takes it after cancelling
        self._cache_writes = threading.Lock()
        # fan-out targets (row, block) beyond each key's first block
        self._extra_rows = np.array([i for i, k in enumerate(keys) for _ in k.extra_block_ids], dtype=np.int64)
        self._extra_blocks = np.array([b for k in keys for b in k.extra_block_ids], dtype=np.int64)
        self._start_marker = start_marker
        # device copies queued into the cache: (end layer of their group, marker), in order; guarded by cond
        self._markers: list[tuple[int, Marker]] = []
        self.failed = np.zeros(len(keys), dtype=bool)  # guarded by cond
        self.layers_done = 0  # guarded by cond
        self.compute_layer = 0  # guarded by cond: the layer the compute thread waits for
        self.outcome = LoadOutcome()  # receive thread; read after finished
        object_keys = [k.key for k in keys]
        self._sessions = GetSessions(store, object_keys)  # receive thread
        self._reads = JobReads(store, object_keys, lanes, plan.lanes, self.outcome, self._fail)  # receive thread
        self._checks = ObjectChecks(
            headers, object_keys, [k.block_hash for k in keys], layout.num_layers, [k.generation for k in keys]
        )  # receive thread
        self._direct: DirectLayers | None = None  # receive thread: LAYERS plans read straight into the cache
        if plan.mode == LAYERS:
            fan_out = (self._extra_rows, self._extra_blocks)
            self._direct = DirectLayers(self._rows, views, self._reads, self._checks, fan_out, self._fail)

    # -- compute thread -------------------------------------------------------------------
    def wait_layer(self, layer_idx: int, timeout_s: float) -> bool:
        """Let the receive thread run ahead to layer_idx + prefetch, then wait for layer_idx.
        False on timeout: every block of the job is then failed and the job cancelled (a stuck
        store call ends its sessions when it returns)."""
        with self.cond:
            if self.cancelled:  # given up: every row failed already, nothing to wait for
                return False
            if layer_idx > self.compute_layer:
                self.compute_layer = layer_idx
                self.cond.notify_all()
        if self.wait_for(lambda: self.layers_done > layer_idx or self.finished, timeout_s):
            self._views.copies.compute_wait(self._ready_marker(layer_idx))  # the layer's device copies land first
            return True
        self.give_up(f"layer {layer_idx} not read within {timeout_s:.1f} s")
        return False

    def _ready_marker(self, layer_idx: int) -> Marker:
        """The marker of the last device copy of the group that holds `layer_idx` (None: none queued)."""
        with self.cond:
            ends = [end for end, _ in self._markers if end > layer_idx]
            return [m for end, m in self._markers if end == ends[0]][-1] if ends else None

    def order_compute(self) -> None:
        """Compute thread: later compute waits for every device copy this job queued (a give-up,
        the step's end): no copy it queued lands in a block after the engine reuses it."""
        with self.cond:
            last = self._markers[-1][1] if self._markers else None
        self._views.copies.compute_wait(last)

    def give_up(self, reason: str) -> None:
        """Fail every row still good and cancel (compute thread, on a timeout). Returns once no
        copy into the cache is in progress: after it, this job writes no cache block (only a
        store call already inside the store may, with register_kv_cache and the direct per-layer
        plan; docs/data-safety.md)."""
        with self.cond:
            rows = np.flatnonzero(~self.failed)
        self._fail(rows, reason)
        self.cancel()
        with self._cache_writes:  # a scatter / fan-out that began before the cancel ends first
            pass
        self.order_compute()  # device copies already queued land before any later compute

    def settled(self) -> bool:
        """No more failures can come: every layer was read (or the job gave up / ended)."""
        with self.cond:
            return self.finished or self.cancelled or self.layers_done >= self._layout.num_layers

    def failed_block_ids(self) -> set[int]:
        """Local blocks of failed rows (first block and fan-out targets)."""
        with self.cond:
            rows = np.flatnonzero(self.failed).tolist()
        return {b for i in rows for b in (self.keys[i].block_id, *self.keys[i].extra_block_ids)}

    # -- receive thread -------------------------------------------------------------------
    def run(self) -> None:
        start = time.perf_counter()
        try:
            whole = self.plan.mode == WHOLE  # whole-object reads need no session
            # more keys than staging slots: each wave opens its own sessions and ends them
            in_waves = self.plan.mode == GROUPS and len(self.keys) > self._slots.size
            if not self.cancelled and (whole or in_waves or self._start_sessions(np.arange(len(self.keys)))):
                for group in groups_of(self._layout, self.plan.group_ends):
                    if not self._wait_allowed(group.first_layer):  # prefetch counts layers, not groups
                        self._fail(self._active(), "cancelled before all layers were read")
                        break
                    if not (whole or in_waves):
                        self._fence()
                        self._maybe_renew()
                    if self.plan.mode == LAYERS:
                        self._read_layer(group.first_layer)
                    else:
                        self._read_staged(group, in_waves)
                    with self.cond:
                        self.layers_done = group.end_layer
                        self.cond.notify_all()
                if self.layers_done == self._layout.num_layers:
                    self.outcome.transfer_s = time.perf_counter() - start
        except BaseException as exc:  # noqa: BLE001 - published to the compute thread
            log.exception("layerkv: load thread failed; every block of this step is invalid")
            self.outcome.error = exc
            self._fail(self._active(), f"transfer thread error: {exc!r}")
        finally:
            try:
                self._end_sessions()
            finally:
                with self.cond:
                    self.finished = True
                    self.cond.notify_all()

    def _active(self) -> np.ndarray:
        with self.cond:
            return np.flatnonzero(~self.failed)

    def _start_sessions(self, rows: np.ndarray) -> bool:
        """Start get sessions for `rows`; failed starts fail their rows. True if any opened."""
        results = self._sessions.start(rows)
        ok = results == 0
        if not ok.all():
            self._fail(rows[~ok], f"get session start returned {sorted(set(results[~ok].tolist()))}")
        return bool(ok.any())

    def _end_sessions(self) -> None:
        self.outcome.header_failures = self._checks.header_failures
        self.outcome.checksum_failures = self._checks.checksum_failures
        self._sessions.end()
        # every check ran on bytes this job owned (checks and copies stop at a give-up, under
        # the cache-writes lock): what failed one is bad in the pool
        bad = [self.keys[i].key for i in np.flatnonzero(self._checks.bad).tolist()]
        if bad:  # never fail every later hit on the same bad bytes
            self._store.batch_remove(bad)
            self.outcome.removed_keys.extend(bad)
            log.warning("layerkv: removed %d objects that failed verification from the pool", len(bad))

    def _fence(self, rows: np.ndarray | None = None) -> None:
        """After a store outage, sessions opened before it may read memory the store has given
        to other objects: stop reading them (their blocks are recomputed). `rows`: only those
        (a wave's, whose sessions are the ones just opened); default every active row."""
        if self._sessions.fenced():
            rows = self._active() if rows is None else rows[~self._failed_snapshot()[rows]]
            self.outcome.fenced_keys += int(rows.size)
            self._fail(rows, "the store had an outage after these get sessions started")

    def _maybe_renew(self) -> None:
        """A step that outlives `renew_after_s` restarts its sessions (end + start) so the
        lease cannot expire mid-step; tags re-verify every later layer against the header
        read with layer 0, so a replaced object is caught."""
        if not self._sessions.older_than(self._renew_after_s):
            return
        rows = np.flatnonzero(self._sessions.open & ~self._failed_snapshot())
        if rows.size == 0:
            return
        self._sessions.end(rows)
        self.outcome.lease_renewals += 1
        self._start_sessions(rows)

    def _failed_snapshot(self) -> np.ndarray:
        with self.cond:
            return self.failed.copy()

    def _wait_allowed(self, layer_idx: int) -> bool:
        with self.cond:
            # read ahead: while compute works on layer c, layers up to c + prefetch may be read
            while self._prefetch is not None and layer_idx > self.compute_layer + self._prefetch and not self.cancelled:
                self.cond.wait(0.5)
            return not self.cancelled

    def _read_layer(self, layer_idx: int) -> None:
        """One layer straight into the cache blocks (transfer/direct.py), then verified there."""
        active = self._active()
        if active.size == 0:
            return
        assert self._direct is not None
        good = self._direct.read(layer_idx, active)
        with self._cache_writes:  # the blocks are ours only until a give-up
            if self.cancelled:
                return
            if layer_idx == 0:
                good = good[self._verify_headers(good, self._slots[good])]
            self._direct.publish(layer_idx, good)

    def _read_staged(self, group: LayerGroup, in_waves: bool = False) -> None:
        """`group`'s span of every active key (a whole object with WHOLE plans) through this
        job's staging slots, a wave of rows at a time, each wave split over the lanes; then the
        header check and the copy into the cache (`_publish`). `in_waves`: each wave opens its
        get sessions first and ends them after its read (its sessions open and end wave by wave)."""
        slots = self._slots
        for begin in range(0, len(self.keys), slots.size):
            if self.cancelled:  # given up: no new reads, nothing more into the cache
                return
            wave = np.arange(begin, min(len(self.keys), begin + slots.size), dtype=np.int64)
            wave = wave[~self._failed_snapshot()[wave]]
            if wave.size == 0:
                continue
            if in_waves:
                if not self._start_sessions(wave):
                    continue
                self._fence(wave)
                opened = wave[self._sessions.open[wave] & ~self._failed_snapshot()[wave]]
                if opened.size == 0:
                    self._sessions.end(wave)
                    continue
                wave = opened
            slot_of = {int(row): int(slot) for row, slot in zip(wave.tolist(), slots.tolist())}

            def ranges(rows: np.ndarray, group: LayerGroup = group) -> RangeLists:
                return self._rows.span(group, np.array([slot_of[int(r)] for r in rows.tolist()], dtype=np.int64))

            try:
                if self.plan.mode == WHOLE:
                    good = self._reads.whole(
                        wave,
                        lambda r: self._staging.ctypes.data + slot_of[r] * self._staging.strides[0],
                        self._layout.object_nbytes,
                    )
                else:
                    good = self._reads.ranges(wave, ranges, group.first_layer, group.label)
            finally:
                if in_waves:
                    self._sessions.end(wave)  # behind the window's read
            if self.cancelled:  # the read returned after a give-up: its bytes stay in staging
                return
            good_slots = np.array([slot_of[int(r)] for r in good.tolist()], dtype=np.int64)
            copy_start = time.perf_counter()  # header / tag checks and the copies
            if group.first_layer == 0:
                checked = self._verify_headers(good, good_slots)  # parsed now: later writes to staging change nothing
                good, good_slots = good[checked], good_slots[checked]
            copied = self._publish(group, good, good_slots)
            if copied < 0:
                return  # given up meanwhile
            copy_s = time.perf_counter() - copy_start
            self.outcome.copy_s += copy_s
            self.outcome.copied_bytes += copied
            self.outcome.measured.copies.append((copy_s, int(good.size) * group.span_nbytes))

    def _publish(self, group: LayerGroup, rows: np.ndarray, slots: np.ndarray) -> int:
        """Copy `group` of `rows` (read into staging `slots`) into their cache blocks, verified
        where no peer can change them any more (StagedLayers.publish); under the cache-writes
        lock, and not at all once the job gave up (-1): blocks it no longer owns are neither
        written nor checked. Returns bytes copied."""
        assert self._staged is not None
        with self._cache_writes:
            if self.cancelled:
                return -1
            copied, bad, marker = self._staged.publish(
                group,
                self._staging,
                rows,
                slots,
                self._rows.block_ids,
                (self._extra_rows, self._extra_blocks),
                self._checks,
                after=self._start_marker,
            )
            if marker is not None:
                with self.cond:
                    self._markers.append((group.end_layer, marker))
        if bad.size:
            self._fail(bad, "layer tag mismatch")
        return copied

    def _verify_headers(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose header (in staging slot `slots[i]`) matches; the others fail."""
        ok, failures = self._checks.headers(rows, self._staging[slots, : self._layout.header_nbytes])
        for row, reason in failures:
            self._fail(np.array([row]), reason)
        return ok

    def _fail(self, rows: np.ndarray, reason: str) -> None:
        """Publish failed rows before waking the compute thread."""
        with self.cond:
            new = rows[~self.failed[rows]]
            self.failed[new] = True
            self.cond.notify_all()
        if new.size:
            log.warning("layerkv: %d keys failed to load (%s); their blocks will be recomputed", new.size, reason)
