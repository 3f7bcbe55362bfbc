"""One step's layerwise save. The job owns its put sessions until it hands them over to
`PendingPuts` (committed or revoked later by the scheduler's verdict for this step, commit.py);
anything else (cancelled, incomplete, an exception) revokes every session it started.

Staged (the default, and the only way unless the KV cache itself is registered): as the compute
thread hands each layer over, the send thread copies it into the key's staging slot (the object's
image: the store never reads the cache) and tags it (layerkv.objects.seal: with a tenant key a keyed MAC,
bound to the key and this write's random nonce); once every layer is
copied the compute thread is released (`released`), and the write thread then starts the put
sessions and writes one range per key of the whole image (header included), split over the
lanes: the store's latency never reaches the forward pass, nor the next step's copies.

    compute:  attn 0 ─ hand(0) ─ attn 1 ─ hand(1) ─ ... ─ hand(L-1) ─ finalize ─ wait (released)
    send:     copy 0 ───────── copy 1 ... ─ copy L-1 ─ headers ─┤
    (device caches: each copy runs on a side stream after the layer's compute marker, and the
    send thread waits for that copy alone: transfer/device.py)
    write:                                                      put start ─ write images ─> pending

Direct (register_kv_cache: true, per-layer writes): put start, then each layer's ranges straight
from the cache as it is handed over, then the headers; released when the last write returned.

Compute thread: hand_layer / finalize / wait; the send thread runs staged copies, the write
thread the writes (direct saves: all of `run`). Shared state guarded by JobState.cond. Never raises into the compute
thread.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from layerkv.messages import BlockHash, ReqId
from layerkv.objects.header import Header
from layerkv.objects.seal import NONCE_NBYTES, TAG_NBYTES, context
from layerkv.store.base import UNCERTAIN_CODES, Code, ObjectKey, Placement
from layerkv.store.checked import CheckedStore
from layerkv.transfer.caches import LentSlots, RegisteredCaches
from layerkv.transfer.calls import KeyRows, Lanes, split_rows
from layerkv.transfer.commit import Commits, PendingPut
from layerkv.transfer.groups import LayerGroup
from layerkv.transfer.thread import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveKey:
    key: ObjectKey
    block_hash: BlockHash  # as named in the key and header: Namespace.block_id of the engine's hash
    block_id: int
    owner: ReqId  # the request whose block this object is written from


@dataclass(slots=True)
class SaveOutcome:
    """What a finished save did (the send and write threads write, the compute thread reads after `finished`)."""

    started: int = 0
    skipped_existing: int = 0  # put start answered OBJECT_EXISTS (written by someone else)
    start_failed: int = 0
    pending: int = 0  # handed to PendingPuts, waiting for the step's verdict
    revoked: int = 0  # revoked by this job (range / header failure, incomplete step, error)
    fenced_keys: int = 0
    saved_bytes: int = 0
    range_calls: int = 0
    write_s: float = 0.0
    copy_s: float = 0.0  # staged: copying the cache into the images and tagging them (send thread)
    incomplete: bool = False  # fewer than all layers were handed over (not cancelled): nothing saved
    revoked_keys: list[ObjectKey] = field(default_factory=list)
    error: BaseException | None = None


class SaveJob(JobState):
    def __init__(
        self,
        keys: list[SaveKey],
        step_seq: int,
        *,
        store: CheckedStore,
        caches: RegisteredCaches,
        header: Header,
        staging: LentSlots,  # >= len(keys) slots, key i in slots[i]: object images (staged) or headers
        placement: Placement,
        commits: Commits,  # its sessions wait there for the step's verdict; staged writes run on its thread
        lanes: Lanes,
        num_lanes: int = 1,
        staged: bool = True,  # False: per-layer writes straight from the cache (register_kv_cache)
    ) -> None:
        super().__init__("layerkv save")
        self.keys = keys
        self.step_seq = step_seq
        self._store = store
        self._layout = layout = caches.layout
        self._header = header
        self._staging = staging.array
        self._slots = staging.slots[: len(keys)]
        if self._slots.size < len(keys):
            raise ValueError(f"{staging.slots.size} staging slots for {len(keys)} keys")
        self._views = caches.views
        self._placement = placement
        self._pending = commits.pending
        self._staged = caches.staged if staged else None
        self._lanes = lanes
        self._num_lanes = num_lanes
        self._writer = commits.writer
        self._rows = KeyRows([k.block_id for k in keys], layout, staging.array, self._slots)
        self._handed: list[tuple[int, Any]] = []  # guarded by cond: (layer, its compute marker or None)
        self._finalized = False  # guarded by cond
        self.released = False  # guarded by cond: the job no longer reads the KV cache memory
        self._open = np.zeros(len(keys), dtype=bool)  # write thread: started, not yet handed over / revoked
        self._sent_layers: set[int] = set()  # the thread that runs `run` (send: staged, write: direct)
        self._tags = np.zeros((len(keys), layout.num_layers, TAG_NBYTES), dtype=np.uint8)  # likewise
        # one random nonce per object write: tags of an earlier write (or another object) never verify
        self._nonces = np.frombuffer(secrets.token_bytes(NONCE_NBYTES * len(keys)), dtype=np.uint8).reshape(
            -1, NONCE_NBYTES
        )
        self._contexts = [context(k.key, self._nonces[i].tobytes()) for i, k in enumerate(keys)]
        self._epoch = 0
        self.outcome = SaveOutcome()

    # -- compute thread -------------------------------------------------------------------
    def hand_layer(self, layer_idx: int, marker: Any = None) -> None:
        with self.cond:
            self._handed.append((layer_idx, marker))
            self.cond.notify_all()

    @property
    def is_staged(self) -> bool:
        """Staged: copies into object images on the submitting thread, store writes on the writer."""
        return self._staged is not None

    def finalize(self) -> None:
        """No more layers this step."""
        with self.cond:
            self._finalized = True
            self.cond.notify_all()

    # -- send thread (staged) / write thread (direct) --------------------------------------
    def run(self) -> None:
        """Staged (on the send thread): the copies; the writes then run on the write thread
        (`write_images`), so the next step's copies never wait for this step's store. Direct
        (on the write thread, after this step's commits): the whole job."""
        if self._staged is not None:
            try:
                complete = self._copy_layers()
            except BaseException as exc:  # noqa: BLE001 - published; nothing was started
                log.exception("layerkv: save thread failed while copying; nothing saved this step")
                self.outcome.error = exc
                complete = False
            if complete:
                try:
                    # queued before the compute thread is released: the next step's verdict on
                    # this step (queued on the same thread) must come after these writes
                    self._writer.submit(_WritePhase(self.write_images, self.cancel))
                    with self.cond:
                        self.released = True
                        self.cond.notify_all()
                    return  # the write phase finishes the job
                except RuntimeError:  # the write thread is closed (shutdown)
                    pass
            self._finish()
            return
        try:
            self._run_direct()
        except BaseException as exc:  # noqa: BLE001 - published; sessions revoked below
            log.exception("layerkv: save thread failed; revoking this step's put sessions")
            self.outcome.error = exc
        finally:
            self._finish()

    def write_images(self) -> None:
        """Write thread: put starts, one write per key of its whole object image (split over the
        lanes), then the sessions wait for the step's verdict (PendingPuts)."""
        try:
            if not self.cancelled:
                self._start_sessions()
                self._fence()
                active = np.flatnonzero(self._open)
                if active.size:
                    whole = LayerGroup(0, self._layout.num_layers, 0, self._layout.object_nbytes)
                    parts = split_rows(active, self._num_lanes)
                    writes = [
                        functools.partial(self._put, part, self._rows.span(whole, self._slots[part]), None)
                        for part in parts
                    ]
                    ok = np.concatenate(self._lanes.run(writes))
                    if not ok.all():
                        self._revoke(active[~ok], "object write failed")
                    if not self.cancelled:  # shut down while writing: nobody will commit these (_finish revokes)
                        self._hand_to_pending(active[ok])
        except BaseException as exc:  # noqa: BLE001 - published; sessions revoked below
            log.exception("layerkv: write thread failed; revoking this step's put sessions")
            self.outcome.error = exc
        finally:
            self._finish()

    def _finish(self) -> None:
        try:
            self._revoke(np.flatnonzero(self._open), "not handed over")
        finally:
            with self.cond:
                self.released = self.finished = True
                self.cond.notify_all()

    def _run_direct(self) -> None:
        if not self.cancelled:
            self._start_sessions()
        while self._open.any():
            item = self._next_layer()
            if item is None:
                break
            layer_idx, marker = item
            if marker is not None:
                marker.synchronize()  # the layer's KV is written on the device before we read it
            self._fence()
            self._write_layer(layer_idx)
        self._hand_over()

    def _copy_layers(self) -> bool:
        """Copy every handed layer into the staging images, then release the compute thread.
        True if every layer was copied (the images may be written)."""
        assert self._staged is not None
        rows = self._slots
        while True:
            item = self._next_layer()
            if item is None:
                break
            layer_idx, marker = item
            if layer_idx not in self._sent_layers:
                start = time.perf_counter()
                self._sent_layers.add(layer_idx)
                # device caches: copied on the side stream once the layer's compute marker is reached
                self._tags[:, layer_idx] = self._staged.gather_sealed(
                    layer_idx,
                    self._staging,
                    rows,
                    self._rows.block_ids,
                    self._contexts,
                    self._header.sealer,
                    after=marker,
                )
                self.outcome.copy_s += time.perf_counter() - start
        with self.cond:
            complete = len(self._sent_layers) == self._layout.num_layers and not self.cancelled
        if not complete:
            self.outcome.incomplete = not self.cancelled
            log.info(
                "layerkv: %d of %d layers handed over this step; nothing saved",
                len(self._sent_layers),
                self._layout.num_layers,
            )
            return False
        self._header.encode_into(
            self._staging, rows, [k.block_hash for k in self.keys], [k.key for k in self.keys], self._nonces, self._tags
        )
        return True

    def _start_sessions(self) -> None:
        self._epoch = self._store.outage_epoch
        keys = [k.key for k in self.keys]
        results = np.asarray(
            self._store.batch_put_session_start(keys, [self._layout.object_nbytes] * len(keys), self._placement),
            dtype=np.int64,
        )
        ok = results == 0
        self._open[ok] = True
        self.outcome.started = int(ok.sum())
        self.outcome.skipped_existing = int(np.count_nonzero(results == int(Code.OBJECT_EXISTS)))
        self.outcome.start_failed = len(keys) - self.outcome.started - self.outcome.skipped_existing
        uncertain = [keys[i] for i in np.flatnonzero(np.isin(results, list(UNCERTAIN_CODES))).tolist()]
        if uncertain:  # the store may have started these puts: never leave them PROCESSING
            self._store.batch_put_session_revoke(uncertain)

    def _next_layer(self) -> tuple[int, Any] | None:
        with self.cond:
            while not self._handed and not self._finalized and not self.cancelled:
                self.cond.wait(0.5)
            if self.cancelled:
                return None
            return self._handed.pop(0) if self._handed else None

    def _fence(self) -> None:
        """After a store outage, sessions started before it may write into memory the store has
        given to other objects: revoke them instead of writing on."""
        if self._store.outage_epoch != self._epoch:
            rows = np.flatnonzero(self._open)
            self.outcome.fenced_keys += int(rows.size)
            self._revoke(rows, "the store had an outage after these put sessions started")

    def _write_layer(self, layer_idx: int) -> None:
        if layer_idx in self._sent_layers:
            return
        self._sent_layers.add(layer_idx)
        active = np.flatnonzero(self._open)
        if active.size == 0:
            return
        ok = self._put(active, self._rows.layer(layer_idx, active), layer_idx)
        written = active[ok]
        if written.size:
            self._tags[written, layer_idx] = self._views.tags(
                layer_idx,
                self._rows.block_ids[written],
                [self._contexts[i] for i in written.tolist()],
                self._header.sealer,
            )
        if not ok.all():
            self._revoke(active[~ok], f"layer {layer_idx} write failed")

    def _hand_over(self) -> None:
        """All layers written: headers (with the tags) go last, then the sessions wait for
        the step's verdict. An incomplete step revokes."""
        with self.cond:
            cancelled = self.cancelled
        rows = np.flatnonzero(self._open)
        if rows.size == 0:
            return
        if cancelled or len(self._sent_layers) != self._layout.num_layers:
            self.outcome.incomplete = not cancelled
            self._revoke(rows, f"{len(self._sent_layers)} of {self._layout.num_layers} layers written")
            return
        self._fence()
        rows = np.flatnonzero(self._open)
        if rows.size == 0:
            return
        self._header.encode_into(
            self._staging,
            self._slots[rows],
            [self.keys[i].block_hash for i in rows.tolist()],
            [self.keys[i].key for i in rows.tolist()],
            self._nonces[rows],
            self._tags[rows],
        )
        ok = self._put(rows, self._rows.header(rows), None)
        if not ok.all():
            self._revoke(rows[~ok], "header write failed")
        self._hand_to_pending(rows[ok])

    def _hand_to_pending(self, handed: np.ndarray) -> None:
        """Every byte of `handed` is written: their sessions wait for the step's verdict."""
        self._pending.add(self.step_seq, [PendingPut(self.keys[i].key, self.keys[i].owner) for i in handed.tolist()])
        self._open[handed] = False
        self.outcome.pending = int(handed.size)

    def _put(self, rows: np.ndarray, ranges: Any, layer_idx: int | None) -> np.ndarray:
        expected = int(np.sum(ranges.sizes[0]))
        start = time.perf_counter()
        results = np.asarray(
            self._store.batch_put_from_multi_buffer_ranges(
                [self.keys[i].key for i in rows], ranges.ptrs, ranges.sizes, ranges.offsets, layer_idx=layer_idx
            ),
            dtype=np.int64,
        )
        ok = results == expected
        with self.cond:  # lanes call this concurrently
            self.outcome.write_s += time.perf_counter() - start
            self.outcome.range_calls += 1
            self.outcome.saved_bytes += expected * int(ok.sum())
        if not ok.all():
            what = "object" if self._staged is not None else "header" if layer_idx is None else f"layer {layer_idx}"
            log.warning(
                "layerkv: %s write failed for %d keys (%s)", what, int((~ok).sum()), sorted(set(results[~ok].tolist()))
            )
        return ok

    def _revoke(self, rows: np.ndarray, reason: str) -> None:
        rows = rows[self._open[rows]]
        if rows.size == 0:
            return
        self._open[rows] = False
        keys = [self.keys[i].key for i in rows.tolist()]
        self.outcome.revoked += len(keys)
        self.outcome.revoked_keys.extend(keys)
        log.info("layerkv: revoking %d put sessions: %s", len(keys), reason)
        self._store.batch_put_session_revoke(keys)  # a failed revoke leaves PROCESSING to the store's timeout


class _WritePhase(NamedTuple):
    """The write phase of a staged SaveJob, queued on the write thread (a StepJob)."""

    run: Callable[[], None]
    cancel: Callable[[], None]
