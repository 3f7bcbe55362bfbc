"""Worker side of the connector (one per TP rank): registers the KV caches, turns each step's
plan into get/put sessions, runs the layerwise load and save jobs on two named threads, and
reports blocks whose load failed. Hooks are called on the engine's compute thread; the jobs run
on `layerkv-recv-<rank>` / `layerkv-send-<rank>`; shared state is guarded by `_lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from layerkv.config import LayerKVConfig
from layerkv.errors import StoreError, TransferError, TransferTimeout
from layerkv.header import Header
from layerkv.keys import block_keys, namespace_for, storage_placement
from layerkv.layout import CacheLayout
from layerkv.messages import Deployment, ReqId
from layerkv.plan import BlockSpec, StepPlan
from layerkv.session import SessionTracker
from layerkv.stats import WorkerStats
from layerkv.store.base import Code, KVStore, ObjectKey
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.save import SaveJob, SaveKey, SaveOutcome
from layerkv.transfer.staged import StagedLayers
from layerkv.transfer.thread import TransferThread

log = logging.getLogger(__name__)
# Answers that do not say whether the store applied the call: clean up as if it had.
_UNCERTAIN = frozenset({int(Code.MALFORMED), int(Code.RPC_FAIL)})


class WorkerConnector:
    """The worker hooks (see hooks.WorkerHooks) backed by a store (a CheckedStore: range calls
    pass `layer_idx=`).

    Failure semantics:
    * Get sessions live for one step: started in start_load_kv, ended by the receive thread
      after the job's last read returned (shared keys: once, after every owner released).
    * A start answer that does not say whether the store applied it (MALFORMED, RPC_FAIL) is
      cleaned up as if it had: such put starts are revoked, such get starts ended.
    * wait_for_layer_load timing out publishes every block of the step invalid, cancels the
      job and raises TransferTimeout; the stuck call's job closes its sessions when it returns.
    * read_layers_per_range > 1 with host caches: the receive thread reads layer 0, then groups
      of k layers, as one range per key into registered staging rows (at most
      max_transfer_blocks rows of the widest group span), and scatters them with numpy. Device
      caches ignore it and read each layer's entries directly (no host bounce).
    * `stats()` range calls count the calls layerkv makes (one per layer or group per chunk of
      staging rows per job); the
      CheckedStore's own stats count the chunks it sent to the backend.
    """

    def __init__(self, config: LayerKVConfig, deployment: Deployment, store: KVStore | None = None) -> None:
        from layerkv.store.factory import open_checked_store

        self.config = config
        self.deployment = deployment
        self.store = store if store is not None else open_checked_store(config)
        self.placement = storage_placement(deployment)
        self.namespace = namespace_for(deployment, config.tenant)
        self.tracker = SessionTracker()
        self.layout: CacheLayout | None = None
        self._header: Header | None = None
        self._lock = threading.Lock()
        self._stats = WorkerStats()  # guarded by _lock
        self._invalid_block_ids: set[int] = set()  # guarded by _lock
        self._tainted_reqs: set[ReqId] = set()  # guarded by _lock; requests that read bad KV this step
        self._plan: StepPlan | None = None  # compute thread only
        self._load: LoadJob | None = None  # compute thread only
        self._save: SaveJob | None = None  # compute thread only
        self._staging: dict[str, np.ndarray] = {}  # "load"/"save"/"groups" -> registered host rows
        self._staged: StagedLayers | None = None  # layer-group reads (read_layers_per_range > 1, host caches)
        self._regions: list[int] = []  # registered KV cache region pointers (unregistered on shutdown)
        self._unregistered: list[tuple[int, int]] = []  # regions the store refused so far (compute thread)
        self._next_register_s = 0.0  # compute thread: when to retry a refused registration
        rank = deployment.tp_rank
        self._recv = TransferThread(f"layerkv-recv-{rank}")
        self._send = TransferThread(f"layerkv-send-{rank}")

    # -- registration ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        self.layout = CacheLayout.from_caches(kv_caches, num_blocks, max_transfer_bytes=self.config.max_transfer_bytes)
        if self.layout.device_type != "cpu" and self.config.backend == "embedded":
            raise StoreError(
                f"the embedded store needs host memory; the KV caches live on {self.layout.device_type}. "
                "Use backend='mooncake' for device memory"
            )
        self._header = Header(self.namespace.digest, self.layout)
        if self.config.read_layers_per_range > 1:
            if self.layout.device_type == "cpu":
                self._staged = StagedLayers(self.layout, self.config.read_layers_per_range)
            else:  # device caches: no host bounce; each layer's entries are read directly
                log.info("layerkv: read_layers_per_range=%d ignored: KV caches live on %s (staging is host-only)",
                         self.config.read_layers_per_range, self.layout.device_type)
        self._unregistered = _memory_regions(kv_caches)
        self._register_regions()
        log.info("layerkv: rank %d registered %d layers, object %d bytes, namespace %s",
                 self.deployment.tp_rank, self.layout.num_layers, self.layout.object_nbytes, self.namespace.name)

    # -- per step -------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: Any) -> None:
        if meta is not None and not isinstance(meta, StepPlan):
            raise TypeError(f"layerkv worker got metadata of type {type(meta).__name__}, expected StepPlan")
        self._finish_step_jobs()
        self._plan = meta

    def start_load_kv(self) -> None:
        plan = self._plan
        if plan is None:
            return
        for req_id in plan.ended_req_ids:
            self.tracker.forget_request(req_id)
        if self.layout is None and (plan.loads or plan.saves):
            raise TransferError("layerkv: start_load_kv before register_kv_caches")
        with self._lock:
            self._stats.steps += 1
            self._tainted_reqs.clear()
        if (plan.loads or plan.saves) and not self._register_regions():
            # the store refused our memory (e.g. Mooncake's master is down): no transfers this
            # step; loads are reported failed so the engine recomputes, saves are skipped
            if plan.loads and self.deployment.role.loads:
                self._fail_specs(plan.loads, "the KV cache memory is not registered with the store")
            return
        if plan.loads and self.deployment.role.loads:
            self._load = self._start_loads(plan.loads)
        if plan.saves and self.deployment.role.saves and self.placement.writes:
            self._save = self._start_saves(plan.saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load
        if job is None or self.layout is None:
            return
        layer_idx = self.layout.layer_index(layer_name)
        start = time.perf_counter()
        job.wait_layer(layer_idx, self.config.load_timeout_s)
        with self._lock:
            self._stats.load_wait_s += time.perf_counter() - start

    def save_kv_layer(self, layer_name: str) -> None:
        job = self._save
        if job is None or self.layout is None:
            return
        event = None
        if self.layout.device_type == "cuda":  # pragma: no cover - no GPU here
            import torch

            event = torch.cuda.Event()
            event.record()
        job.hand_layer(self.layout.layer_index(layer_name), event)

    def wait_for_save(self) -> None:
        """End of the forward: loads must be done (their failures taint this step's saves),
        then the save job commits and this returns once every put session is closed."""
        if self._load is not None:
            self._load.wait_finished(self.config.load_timeout_s)
        if self._save is not None:
            with self._lock:
                tainted = frozenset(self._tainted_reqs)
            self._save.finalize(tainted)
            self._save.wait_finished(self.config.save_timeout_s)

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId] | None, set[ReqId] | None]:
        for req_id in finished_req_ids:
            self.tracker.forget_request(req_id)
        return None, None  # loads are synchronous, saves complete within the step

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def clear_connector_metadata(self) -> None:
        self._finish_step_jobs()
        self._plan = None

    def shutdown(self) -> None:
        try:
            self._finish_step_jobs()
        finally:
            self.tracker.forget_all_requests()
            self._recv.close()
            self._send.close()
            for ptr in [staging.ctypes.data for staging in self._staging.values()] + self._regions:
                self.store.unregister_buffer(ptr)
            self._staging.clear()
            self._regions.clear()

    def stats(self) -> WorkerStats:
        with self._lock:
            snapshot = WorkerStats()
            snapshot.add(self._stats)
        return snapshot

    # -- internals ------------------------------------------------------------------------
    def _finish_step_jobs(self) -> None:
        """Make sure the previous step's jobs are over: a save that was never finalized is
        revoked, a load the engine stopped waiting for is cancelled; both joined (bounded)."""
        load, save = self._load, self._save
        self._load = self._save = None
        for job, timeout_s in ((save, self.config.save_timeout_s), (load, self.config.load_timeout_s)):
            if job is None:
                continue
            if not job.finished:
                job.cancel()
            try:
                job.wait_finished(timeout_s)
            except TransferTimeout:
                # A store call is stuck; the job closes its sessions when it returns. The next
                # step's job queues behind it and its own waits are bounded.
                log.error("layerkv: %s still running after %.1f s; leaving it to the transfer thread", job.name, timeout_s)

    def _register_regions(self) -> bool:
        """Register the KV cache regions the store has not accepted yet; True when all are.
        A refusal (e.g. Mooncake's master unreachable) is retried at most once per
        `store_retry_interval_s`; meanwhile the worker serves without the pool."""
        if not self._unregistered:
            return True
        now = time.monotonic()
        if now < self._next_register_s:
            return False
        try:
            while self._unregistered:
                ptr, nbytes = self._unregistered[0]
                self.store.register_buffer(ptr, nbytes)
                self._regions.append(ptr)
                self._unregistered.pop(0)
        except StoreError as exc:
            self._next_register_s = now + self.config.store_retry_interval_s
            log.warning("layerkv: rank %d cannot register its KV cache with the store (%s); serving without "
                        "the pool, retrying in %.1f s", self.deployment.tp_rank, exc, self.config.store_retry_interval_s)
            return False
        return True

    def _load_keys(self, specs: tuple[BlockSpec, ...]) -> list[LoadKey]:
        """One LoadKey per distinct object: read into the first local block, copied to the rest."""
        by_key: dict[ObjectKey, tuple[bytes, list[int], set[ReqId]]] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.placement.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                entry = by_key.setdefault(key, (block_hash, [], set()))
                entry[1].append(block_id)
                entry[2].add(spec.req_id)
        return [LoadKey(key, h, ids[0], tuple(ids[1:]), frozenset(owners)) for key, (h, ids, owners) in by_key.items()]

    def _fail_specs(self, specs: tuple[BlockSpec, ...], reason: str) -> None:
        load_keys = self._load_keys(specs)
        with self._lock:
            self._stats.load_keys += len(load_keys)
            self._stats.load_blocks += sum(len(spec) for spec in specs)
        self._on_load_failed(load_keys, reason)

    def _start_loads(self, specs: tuple[BlockSpec, ...]) -> LoadJob | None:
        assert self.layout is not None and self._header is not None
        load_keys = self._load_keys(specs)
        try:
            if self._staged is not None:  # keys pass through in chunks of at most max_transfer_blocks
                rows = min(len(load_keys), self.config.max_transfer_blocks)
                staging = self._staging_rows("groups", rows, self._staged.row_nbytes)
            else:
                staging = self._staging_rows("load", len(load_keys))
        except StoreError as exc:
            self._fail_specs(specs, f"header staging buffer: {exc}")
            return None
        keys = [k.key for k in load_keys]
        self.tracker.acquire_gets({k.key: set(k.owners) for k in load_keys})
        results = self.store.batch_get_session_start(keys)
        ok = [k for k, code in zip(load_keys, results) if code == 0]
        failed = [k for k, code in zip(load_keys, results) if code != 0]
        uncertain = [k.key for k, code in zip(load_keys, results) if code in _UNCERTAIN]
        if uncertain:  # the store may have opened these sessions: end them (0 also for unknown keys)
            self.store.batch_get_session_end(uncertain)
        with self._lock:
            self._stats.load_keys += len(keys)
            self._stats.load_blocks += sum(len(spec) for spec in specs)
        if failed:
            codes = sorted({code for code in results if code != 0})
            self._on_load_failed(failed, f"get session start returned {codes}")
            self._release_gets(failed, end=False)
        if not ok:
            return None
        job = LoadJob(
            ok,
            store=self.store,
            layout=self.layout,
            header=self._header,
            staging=staging,
            prefetch_layers=self.config.prefetch_layers,
            on_done=lambda job: self._on_load_done(ok, job),
            on_failed=self._on_load_failed,
            staged=self._staged,
        )
        self._recv.submit(job)
        return job

    def _start_saves(self, specs: tuple[BlockSpec, ...]) -> SaveJob | None:
        assert self.layout is not None and self._header is not None
        by_key: dict[ObjectKey, tuple[bytes, int, set[ReqId]]] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.placement.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, (block_hash, block_id, set()))[2].add(spec.req_id)
        keys = list(by_key)
        try:
            staging = self._staging_rows("save", len(keys))
        except StoreError as exc:
            log.warning("layerkv: skipping this step's saves: header staging buffer: %s", exc)
            with self._lock:
                self._stats.save_failed_keys += len(keys)
            return None
        results = self.store.batch_put_session_start(keys, [self.layout.object_nbytes] * len(keys), self.config.placement)
        started = [key for key, code in zip(keys, results) if code == 0]
        existing = sum(1 for code in results if code == Code.OBJECT_EXISTS)
        uncertain = [key for key, code in zip(keys, results) if code in _UNCERTAIN]
        if uncertain:  # the store may have started these puts: never leave them PROCESSING
            self.store.batch_put_session_revoke(uncertain)
        with self._lock:
            self._stats.save_keys += len(started)
            self._stats.save_skipped_existing += existing
            self._stats.save_failed_keys += len(keys) - len(started) - existing
        if not started:
            return None
        self.tracker.open_puts({key: [(req, by_key[key][1]) for req in by_key[key][2]] for key in started})
        self._header.encode_into(staging, np.arange(len(started)), [by_key[key][0] for key in started])
        save_keys = [SaveKey(key, by_key[key][1], frozenset(by_key[key][2])) for key in started]
        job = SaveJob(save_keys, store=self.store, layout=self.layout, staging=staging, on_closed=self._on_save_closed)
        self._send.submit(job)
        return job

    def _on_load_failed(self, keys: list[Any], reason: str) -> None:
        """Called from either thread before the compute thread is woken."""
        blocks = {b for k in keys for b in (k.block_id, *k.extra_block_ids)}
        with self._lock:
            self._invalid_block_ids |= blocks
            for k in keys:
                self._tainted_reqs |= k.owners
            self._stats.load_failed_blocks += len(blocks)
        log.warning("layerkv: %d keys failed to load (%s); %d blocks will be recomputed", len(keys), reason, len(blocks))

    def _on_load_done(self, keys: list[LoadKey], job: LoadJob) -> None:
        """Receive thread, after the job's last read returned: end sessions, count."""
        try:
            self._release_gets(keys, end=True)
        finally:
            with self._lock:
                self._stats.loaded_bytes += job.loaded_bytes
                self._stats.load_range_calls += job.range_calls
                self._stats.transfer_errors += job.error is not None

    def _release_gets(self, keys: list[LoadKey], *, end: bool) -> None:
        """Drop the step's owners; end (exactly once) the sessions whose last owner left."""
        owners = {req for k in keys for req in k.owners}
        to_end = self.tracker.release_gets(owners, [k.key for k in keys])
        if end and to_end:
            self.store.batch_get_session_end(to_end)

    def _on_save_closed(self, outcome: SaveOutcome) -> None:
        self.tracker.close_puts(outcome.committed, committed=True)
        self.tracker.close_puts(outcome.revoked, committed=False)
        with self._lock:
            self._stats.committed_keys += len(outcome.committed)
            self._stats.revoked_keys += len(outcome.revoked)
            self._stats.tainted_keys += len(outcome.tainted)
            self._stats.save_failed_keys += len(outcome.failed)
            self._stats.saved_bytes += outcome.saved_bytes
            self._stats.save_range_calls += outcome.range_calls
            self._stats.transfer_errors += outcome.error is not None

    def _staging_rows(self, kind: str, num_rows: int, row_nbytes: int | None = None) -> np.ndarray:
        """Registered host rows for `num_rows` headers (or rows of `row_nbytes`), grown by
        doubling (wide rows: up to max_transfer_blocks), re-registered."""
        assert self.layout is not None
        staging = self._staging.get(kind)
        if staging is None or staging.shape[0] < num_rows:
            if staging is not None:
                self.store.unregister_buffer(staging.ctypes.data)
            first = 32 if row_nbytes is None else 1  # wide rows: no head start
            rows = max(num_rows, 2 * (staging.shape[0] if staging is not None else first))
            if row_nbytes is not None:  # wide rows serve one backend chunk of keys at a time
                rows = min(rows, max(num_rows, self.config.max_transfer_blocks))
            self._staging.pop(kind, None)
            width = self.layout.header_nbytes if row_nbytes is None else row_nbytes
            staging = np.zeros((rows, width), dtype=np.uint8)  # [rows, width]
            self.store.register_buffer(staging.ctypes.data, staging.nbytes)  # StoreError: caller degrades
            self._staging[kind] = staging
        return staging


def _memory_regions(kv_caches: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Distinct (ptr, nbytes) memory regions of the registered tensors / arrays. A torch view
    registers its whole storage from the storage's start (vLLM views every layer into one
    buffer: the view's own data_ptr plus the storage size would run past the allocation)."""
    regions: dict[int, int] = {}
    for value in kv_caches.values():
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(tensor, "data_ptr"):
                storage = tensor.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            else:
                ptr, nbytes = tensor.ctypes.data, tensor.nbytes
            regions[ptr] = max(regions.get(ptr, 0), nbytes)
    return sorted(regions.items())
