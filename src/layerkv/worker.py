"""Worker side of the connector (one per TP rank and pipeline stage): registers the KV caches,
turns each step's plan into a load job (receive thread `layerkv-recv-<rank>`), a save job (its
copies on the send thread `layerkv-send-<rank>`, its store writes on the write thread
`layerkv-write-<rank>`) and the commits of earlier steps (write thread), and reports which blocks
failed to load and which step it ran. Hooks are called on the engine's compute thread; the jobs
own their sessions and publish outcomes the compute thread reads once they finished. Never raises
into the engine because of the store: a late layer is recomputed, a late save revoked.

Commit protocol (SPEC §9): a step's saves are written during the step and left open
(`PendingPuts`); the scheduler side commits them in a later step's plan (`StepVerdict`) once
every worker reported the step, revoking what requests that attended to a failed block wrote.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any


from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError, LayoutError, StoreError, TransferError
from layerkv.header import Header
from layerkv.keys import block_keys, namespace_for, storage_placement
from layerkv.layout import CacheLayout
from layerkv.messages import Deployment
from layerkv.plan import BlockSpec, StepPlan
from layerkv.stats import WorkerStats
from layerkv.store.base import ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.transfer.lanes import Lanes
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.planner import GROUPS, LAYERS, WHOLE, Costs, LoadPlan, StepShape, choose_lanes, choose_plan
from layerkv.transfer.pending import PendingPuts
from layerkv.transfer.save import SaveJob, SaveKey
from layerkv.transfer.settle import SettleJob, revoke_all
from layerkv.transfer.staged import StagedLayers, layer_groups
from layerkv.transfer.staging import StagingPool
from layerkv.transfer.thread import TransferThread
from layerkv.transfer.views import CacheViews

log = logging.getLogger(__name__)
MAX_STAGING_NBYTES = 1 << 30  # read_layers_per_range staging above this is refused at startup
# Save jobs of earlier steps still writing in the background (each holds its own staging images);
# with this many, a step's saves are skipped: a write that does not return (a stalled segment
# holder) must not make every later step queue a job and allocate new images.
MAX_SAVES_IN_FLIGHT = 2


class WorkerConnector:
    """The worker hooks (see hooks.WorkerHooks) over a CheckedStore.

    * Loads: one LoadJob per step; it starts, renews and ends its get sessions on the receive
      thread. wait_for_layer_load returns when the layer is readable or, after
      `load_timeout_s`, with every block of the job reported invalid.
    * Saves: one SaveJob per step (put start, layer writes, headers with checksums); its
      sessions then wait in `pending` for the step's verdict. wait_for_save returns when every
      layer is written or, after `save_timeout_s`, with the job cancelled (it revokes).
    * Verdicts in a plan run first on the send thread (SettleJob); a step whose verdict never
      arrives is revoked after `commit_timeout_s`; shutdown revokes what is pending.
    * read_layers_per_range > 1 with host caches: the receive thread reads layer 0, then groups
      of k layers, as one range per key into registered staging rows and scatters them.
    """

    def __init__(self, config: LayerKVConfig, deployment: Deployment, store: CheckedStore) -> None:
        if not isinstance(store, CheckedStore):
            raise TypeError(f"WorkerConnector needs a CheckedStore (store.factory.open_checked_store), got {type(store).__name__}")
        self.config = config
        self.deployment = deployment
        self.store = store
        self.placement = storage_placement(deployment)
        self.namespace = namespace_for(deployment, config.tenant, model_fingerprint=config.model_fingerprint)
        self.pending = PendingPuts()
        self.layout: CacheLayout | None = None
        self._header: Header | None = None
        self._views: CacheViews | None = None
        self._staged: StagedLayers | None = None
        self._names_per_layer: list[int] = []  # registered cache names of each layer
        self._lock = threading.Lock()
        self._expired = 0  # guarded by _lock: pending puts revoked after commit_timeout_s (send thread)
        self._stats = WorkerStats()  # compute thread only
        self._plan: StepPlan | None = None  # compute thread only, from here on
        self._load: LoadJob | None = None
        self._save: SaveJob | None = None
        self._settle: SettleJob | None = None
        self._collect_later: list[Any] = []  # jobs of ended steps still running: folded in when they finish
        self._folded: set[int] = set()  # ids of current-step jobs already folded into _stats
        self._invalid_block_ids: set[int] = set()
        self._reported_steps: list[int] = []
        self._saved_names: dict[int, int] = {}  # layer -> names saved this step
        self._handed: set[int] = set()  # layers handed to the save job this step
        self._handed_invalid: set[int] = set()  # load failures of this step already reported
        self._staging = StagingPool(store, MAX_STAGING_NBYTES)  # registered host rows, one job at a time
        self._regions: list[int] = []
        self._unregistered: list[tuple[int, int]] = []
        self._next_register_s = 0.0
        self._closed = False  # compute thread: shutdown() ran
        rank = f"{deployment.pp_rank}-{deployment.tp_rank}" if deployment.pp_size > 1 else str(deployment.tp_rank)
        self.costs = Costs()  # running transfer / compute estimates for the planner (any thread)
        # one lane pool per transfer thread: a stuck write never holds up a read (or the reverse)
        self._load_lanes = Lanes(f"layerkv-rlane-{rank}", max_lanes=8)
        self._save_lanes = Lanes(f"layerkv-slane-{rank}", max_lanes=8)
        self._step_start_s = 0.0  # compute thread: when this step's forward began
        self._step_wait_s = 0.0  # compute thread: time this step waited for layers
        self._recv = TransferThread(f"layerkv-recv-{rank}")
        self._send = TransferThread(f"layerkv-send-{rank}")
        # staged saves' writes and the commits: never ahead of the copies a step needs
        self._write = TransferThread(f"layerkv-write-{rank}", on_idle=self._expire_pending)

    # -- registration ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks!r} must be a positive int")
        self.layout = CacheLayout.from_caches(kv_caches, num_blocks, max_transfer_bytes=self.config.max_transfer_bytes)
        _check_block_size(self.layout, self.deployment.block_size)
        if self.layout.device_type != "cpu" and self.config.backend == "embedded":
            raise ConfigError(
                f"backend='embedded' needs host memory; the KV caches live on {self.layout.device_type}. "
                "Use backend='mooncake' for device memory"
            )
        self._header = Header(self.namespace.digest, self.layout.digest, self.layout.num_layers, self.layout.object_nbytes)
        self._views = CacheViews(self.layout, kv_caches)
        self._names_per_layer = [len({e.layer_name for e in layer}) for layer in self.layout.layers]
        if self._views.on_host:  # staged group / whole-object reads (device caches: straight in)
            self._staged = StagedLayers(self._views)
            if self.layout.object_nbytes > MAX_STAGING_NBYTES:
                raise ConfigError(
                    f"one object of this layout is {self.layout.object_nbytes} bytes, more than the "
                    f"{MAX_STAGING_NBYTES >> 20} MiB staging bound; lower the block size (tokens per block)"
                )
        elif self.config.read_layers_per_range > 1:
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
        self._end_step()
        self._plan = meta
        self._saved_names, self._handed = {}, set()
        self._handed_invalid = set()
        if meta is not None:
            self._reported_steps.append(meta.step_seq)

    def start_load_kv(self) -> None:
        plan = self._plan
        if plan is None:
            return
        self._step_start_s, self._step_wait_s = time.perf_counter(), 0.0
        if self._closed:  # after shutdown: no transfers; loads are recomputed
            self._invalid_block_ids |= {b for spec in plan.loads for b in spec.block_ids}
            return
        self._stats.steps += 1
        self._invalid_block_ids |= plan.reinvalidate  # the engine recomputes them (see StepPlan)
        if self.layout is None and (plan.loads or plan.saves):
            raise TransferError("layerkv: start_load_kv before register_kv_caches")
        if plan.verdicts:
            self._settle = SettleJob(plan.verdicts, store=self.store, pending=self.pending)
            self._write.submit(self._settle)
        if not (plan.loads or plan.saves):
            return
        if not self._register_regions():
            # the store refused our memory (e.g. Mooncake's master is down): no transfers this
            # step; loads are reported failed so the engine recomputes, saves are skipped
            if plan.loads and self.deployment.role.loads:
                self._invalid_block_ids |= {b for spec in plan.loads for b in spec.block_ids}
            return
        if plan.loads and self.deployment.role.loads:
            if self._stuck(LoadJob):  # an earlier load is still inside the store: recompute, don't queue
                self._invalid_block_ids |= {b for spec in plan.loads for b in spec.block_ids}
                self._stats.load_skipped_stuck += 1
            else:
                self._load = self._start_loads(plan.loads, plan.num_tokens)
        if plan.saves and self.deployment.role.saves and self.placement.writes:
            if self._stuck(SaveJob) or self.store.is_down() or self._saves_in_flight() >= MAX_SAVES_IN_FLIGHT:
                self._stats.save_skipped_steps += 1
            else:
                self._save = self._start_saves(plan.step_seq, plan.saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layout is None:
            return
        layer_idx = self.layout.layer_index(layer_name)
        self._hand_layers_before(layer_idx)
        job = self._load
        if job is None or job.cancelled:
            return
        start = time.perf_counter()
        if not job.wait_layer(layer_idx, self.config.load_timeout_s):
            self._stats.load_timeouts += 1
            log.warning("layerkv: layer %d not loaded within %.1f s; this step's loaded blocks will be recomputed",
                        layer_idx, self.config.load_timeout_s)
        waited = time.perf_counter() - start
        self._stats.load_wait_s += waited
        self._step_wait_s += waited

    def save_kv_layer(self, layer_name: str) -> None:
        if self.layout is None or self._save is None:
            return
        layer_idx = self.layout.layer_index(layer_name)
        self._hand_layers_before(layer_idx)
        self._saved_names[layer_idx] = self._saved_names.get(layer_idx, 0) + 1
        if self._saved_names[layer_idx] >= self._names_per_layer[layer_idx]:
            self._hand_layer(layer_idx)

    def wait_for_save(self) -> None:
        """End of the forward: loads must be over (their failures go to the scheduler) and the
        save must no longer read the KV cache (staged: every layer copied; direct: written).
        Remote writes of staged saves and the plan's commits go on in the background. Bounded."""
        load, save = self._load, self._save
        plan = self._plan
        if plan is not None and self.layout is not None and self._step_start_s:
            compute_s = time.perf_counter() - self._step_start_s - self._step_wait_s
            self.costs.observe_compute(compute_s, self.layout.num_layers, plan.num_tokens)
        if load is not None and not load.cancelled and not load.wait_finished(self.config.load_timeout_s):
            load.give_up(f"still running after {self.config.load_timeout_s:.1f} s")
            self._stats.load_timeouts += 1
        if save is not None:
            if self.layout is not None:
                self._hand_layers_before(self.layout.num_layers)
            save.finalize()
            if not save.wait_for(lambda: save.released, self.config.save_timeout_s):
                save.cancel()  # it revokes its sessions when the stuck call returns
                self._stats.save_timeouts += 1
                log.warning("layerkv: saves not copied / written within %.1f s; revoking them", self.config.save_timeout_s)
        if load is not None:
            self._invalid_block_ids |= load.failed_block_ids() - self._handed_invalid
        settle = self._settle
        if settle is not None and plan is not None and not (plan.loads or plan.saves):
            # a step with nothing of ours but verdicts is what an engine runs when it would
            # otherwise go idle: its commits finish here, so they are in the pool (and in this
            # step's stats) before the engine stops stepping. Bounded; a late one finishes alone.
            settle.wait_finished(self.config.save_timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads are synchronous; a save never holds the engine's blocks

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed, each reported once (vLLM's speculative decoding asks before
        the draft layers ran and wait_for_save; later failures are reported the next time)."""
        if self._load is not None:
            self._invalid_block_ids |= self._load.failed_block_ids() - self._handed_invalid
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        self._handed_invalid |= invalid
        return invalid

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every transfer this worker started has finished (background writes and
        commits included); True if it did within `timeout_s` (default save_timeout_s). The
        reference engine calls it when `generate` returns, so its saves are readable then."""
        deadline = time.monotonic() + (self.config.save_timeout_s if timeout_s is None else timeout_s)
        jobs = [j for j in (self._load, self._save, self._settle, *self._collect_later) if j is not None]
        return all(job.wait_finished(max(0.0, deadline - time.monotonic())) for job in jobs)

    def report_steps(self) -> tuple[int, ...]:
        """The step numbers this worker ran since the last call (normally the current one). A
        step whose load is still running (vLLM's speculative decoding reports before its draft
        layers loaded) is held back until a later call, so its late failures count for it."""
        held = self._load is not None and not self._load.settled() and bool(self._reported_steps)
        steps = self._reported_steps[:-1] if held else self._reported_steps
        self._reported_steps = self._reported_steps[-1:] if held else []
        return tuple(steps)

    def clear_connector_metadata(self) -> None:
        self._end_step()
        self._plan = None

    def shutdown(self) -> None:
        """Stop the transfer threads (running jobs close their sessions), revoke every put
        session still waiting for a verdict, unregister memory. Idempotent; hooks called
        afterwards do nothing."""
        self._closed = True
        try:
            self._end_step()
        finally:
            self._recv.close()
            self._send.close()
            self._write.close()
            self._load_lanes.close()
            self._save_lanes.close()
            self._stats.revoked_on_shutdown += revoke_all(self.store, self.pending.pop_all(), "shutdown")
            # a job still running after the threads' join revokes what it holds when it returns
            # (it is cancelled); wait for it within save_timeout_s, then drain once more
            self.flush()
            self._stats.revoked_on_shutdown += revoke_all(self.store, self.pending.pop_all(), "shutdown")
            self._collect()
            for error in self._staging.close():
                log.warning("layerkv: %s", error)
            for ptr in self._regions:
                try:
                    self.store.unregister_buffer(ptr)
                except StoreError as exc:
                    log.warning("layerkv: %s", exc)
            self._regions.clear()

    def stats(self) -> WorkerStats:
        self._collect()
        snapshot = WorkerStats()
        snapshot.add(self._stats)
        with self._lock:
            snapshot.revoked_unsettled += self._expired
        return snapshot

    def threads_alive(self) -> list[str]:
        """Names of this worker's transfer threads still running (none after shutdown)."""
        return [t.name for t in (self._recv, self._send, self._write) if t.is_alive]

    def is_idle(self, timeout_s: float = 0.0) -> bool:
        """No put session waits for a verdict and no job is running (after a drained engine);
        waits up to `timeout_s` for running jobs to finish."""
        deadline = time.monotonic() + timeout_s
        for job in [j for j in (self._load, self._save, self._settle, *self._collect_later) if j is not None]:
            job.wait_finished(max(0.0, deadline - time.monotonic()))
        return self.open_sessions() == {"pending_puts": 0, "running_jobs": 0}

    def open_sessions(self) -> dict[str, int]:
        """Sessions this worker holds now: put sessions waiting for a verdict, jobs running."""
        jobs = [j for j in (self._load, self._save, self._settle, *self._collect_later) if j is not None]
        return {"pending_puts": self.pending.num_keys(), "running_jobs": sum(1 for j in jobs if not j.finished)}

    # -- internals ------------------------------------------------------------------------
    def _hand_layer(self, layer_idx: int) -> None:
        """Give layer `layer_idx` to the save job once, with a device completion event."""
        if self._save is None or layer_idx in self._handed or layer_idx not in self._saved_names:
            return
        assert self.layout is not None
        self._handed.add(layer_idx)
        self._save.hand_layer(layer_idx, _completion_event(self.layout.device_type))

    def _hand_layers_before(self, layer_idx: int) -> None:
        """The compute thread moved past every layer < layer_idx: those whose save was asked
        for (by at least one of their cache names) are complete now."""
        for earlier in sorted(l for l in self._saved_names if l < layer_idx):
            self._hand_layer(earlier)

    def _stuck(self, kind: type[LoadJob] | type[SaveJob]) -> bool:
        """A job of `kind` from an earlier step was given up (timed out) and has not returned."""
        return any(isinstance(j, kind) and j.cancelled and not j.finished for j in self._collect_later)

    def _saves_in_flight(self) -> int:
        """Save jobs of earlier steps that have not finished (their writes and images)."""
        return sum(1 for j in self._collect_later if isinstance(j, SaveJob) and not j.finished)

    def _end_step(self) -> None:
        """Forget this step's jobs (collecting what they did); a job still running is collected
        when it finishes. A step abandoned before wait_for_save cancels its jobs: its loads are
        not used, its saves are revoked."""
        if self._load is not None and not self._load.finished:
            self._load.give_up("the step ended before its loads finished")
        if self._save is not None and not self._save.released:
            self._save.cancel()
        self._collect()
        for job in (self._load, self._save, self._settle):
            if job is not None and id(job) not in self._folded:
                self._collect_later.append(job)
        self._load = self._save = self._settle = None
        self._folded.clear()

    def _collect(self) -> None:
        """Fold every finished job's outcome into the counters, once (compute thread)."""
        still = []
        for job in (*self._collect_later, self._load, self._save, self._settle):
            if job is None or id(job) in self._folded:
                continue
            if job.finished:
                _fold(self._stats, job)
                self._folded.add(id(job))
            elif job in self._collect_later:
                still.append(job)
        current = {id(j) for j in (self._load, self._save, self._settle) if j is not None}
        self._folded &= current  # ids of jobs that are gone can be reused
        self._collect_later = still

    def _expire_pending(self) -> None:
        """Send thread, when idle: revoke puts whose verdict never came."""
        puts = self.pending.pop_older_than(self.config.commit_timeout_s)
        if puts:
            n = revoke_all(self.store, puts, f"no commit verdict within {self.config.commit_timeout_s:.0f} s")
            with self._lock:
                self._expired += n

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

    def _start_loads(self, specs: tuple[BlockSpec, ...], num_tokens: int) -> LoadJob | None:
        """One LoadKey per distinct object: read into the first local block, copied to the rest."""
        assert self.layout is not None and self._header is not None and self._views is not None
        by_key: dict[ObjectKey, tuple[bytes, list[int]]] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.placement.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, (block_hash, []))[1].append(block_id)
        load_keys = [LoadKey(key, h, ids[0], tuple(ids[1:])) for key, (h, ids) in by_key.items()]
        self._stats.load_keys += len(load_keys)
        self._stats.load_blocks += sum(len(spec) for spec in specs)
        plan, prefetch = self._load_plan(len(load_keys), num_tokens)
        try:
            if plan.mode == LAYERS:
                staging = self._staging.take("load", len(load_keys), self.layout.header_nbytes)
            else:  # keys pass through staging rows a wave at a time (bounded memory)
                assert self._staged is not None
                max_rows = max(1, MAX_STAGING_NBYTES // self._staged.row_nbytes)
                staging = self._staging.take("groups", min(len(load_keys), max_rows), self._staged.row_nbytes)
        except StoreError as exc:
            log.warning("layerkv: loads of this step fail: staging buffer: %s", exc)
            self._invalid_block_ids |= {b for spec in specs for b in spec.block_ids}
            return None
        self._stats.count_plan(plan.mode)
        if self.store.audit is not None:
            self.store.audit.note("load_plan", plan=plan.label, keys=len(load_keys), tokens=num_tokens,
                                  predicted_ms=round(plan.predicted_s * 1e3, 3))
        job = LoadJob(load_keys, store=self.store, layout=self.layout, header=self._header, staging=staging,
                      views=self._views, plan=plan, lanes=self._load_lanes, renew_after_s=self.config.lease_renew_after_s,
                      prefetch_layers=prefetch, staged=self._staged if plan.mode != LAYERS else None, costs=self.costs,
                      verify_checksums=self.config.verify_checksums)
        self._staging.lend(staging, job)
        self._recv.submit(job)
        return job

    def _load_plan(self, num_keys: int, num_tokens: int) -> tuple[LoadPlan, int | None]:
        """This step's load plan and read-ahead cap: chosen from the running estimates
        (transfer_plan="auto"), or the fixed knobs."""
        assert self.layout is not None
        lanes, mode, L = self.config.transfer_lanes, self.config.transfer_plan, self.layout.num_layers
        if mode != "auto" and (mode == "layers" or self._staged is None):  # device caches: no staging
            return LoadPlan(LAYERS, tuple(range(1, L + 1)), lanes or 1), self.config.prefetch_layers
        if mode == "groups":
            ends = tuple(g.end_layer for g in layer_groups(self.layout, self.config.read_layers_per_range))
            return LoadPlan(GROUPS, ends, lanes or 1), self.config.prefetch_layers
        if mode == "whole":
            return LoadPlan(WHOLE, (L,), lanes or choose_lanes(num_keys, 4)), None
        shape = StepShape(
            num_keys=num_keys,
            num_layers=self.layout.num_layers,
            layer_nbytes=max(self.layout.layer_nbytes(l) for l in range(self.layout.num_layers)),
            header_nbytes=self.layout.header_nbytes,
            segments_per_layer=max(self.layout.template(l).num_segments for l in range(self.layout.num_layers)),
            staging_ok=self._staged is not None,
        )
        costs = self.costs.snapshot()
        if lanes:  # a fixed lane count, the rest chosen
            plan = choose_plan(shape, costs, num_tokens, max_lanes=lanes)
            return LoadPlan(plan.mode, plan.group_ends, lanes, plan.predicted_s), None
        return choose_plan(shape, costs, num_tokens), None

    def _start_saves(self, step_seq: int, specs: tuple[BlockSpec, ...]) -> SaveJob | None:
        assert self.layout is not None and self._header is not None and self._views is not None
        by_key: dict[ObjectKey, SaveKey] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.placement.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, SaveKey(key, block_hash, block_id, spec.req_id))
        # staged (copy into object images, write later) unless the per-layer path is asked for or
        # the step's images would not fit the staging bound
        staged = self._staged if self.config.transfer_plan != "layers" else None
        if staged is not None and len(by_key) * staged.row_nbytes > MAX_STAGING_NBYTES:
            staged = None
        try:  # staged: one object image per key; direct: one header per key
            if staged is not None:
                staging = self._staging.take("save-images", len(by_key), staged.row_nbytes)
            else:
                staging = self._staging.take("save", len(by_key), self.layout.header_nbytes)
        except StoreError as exc:
            log.warning("layerkv: skipping this step's saves: staging buffer: %s", exc)
            self._stats.save_failed_keys += len(by_key)
            return None
        lanes = self.config.transfer_lanes or choose_lanes(len(by_key), 4)
        job = SaveJob(list(by_key.values()), step_seq, store=self.store, layout=self.layout, header=self._header,
                      staging=staging, views=self._views, placement=self.config.placement, pending=self.pending,
                      staged=staged, lanes=self._save_lanes, num_lanes=lanes, writer=self._write)
        self._staging.lend(staging, job)
        # staged: copies on the send thread, writes on the write thread; direct: all on the write
        # thread, after this step's verdicts (a revoke always precedes a re-save of the key)
        (self._send if staged is not None else self._write).submit(job)
        return job

def _fold(stats: WorkerStats, job: LoadJob | SaveJob | SettleJob) -> None:
    """Add a finished job's outcome to the worker's counters (compute thread)."""
    if isinstance(job, LoadJob):
        o = job.outcome
        stats.loaded_bytes += o.loaded_bytes
        stats.load_range_calls += o.range_calls
        stats.load_failed_blocks += len(job.failed_block_ids())
        stats.header_failures += o.header_failures
        stats.checksum_failures += o.checksum_failures
        stats.removed_objects += len(o.removed_keys)
        stats.fenced_keys += o.fenced_keys
        stats.lease_renewals += o.lease_renewals
        stats.transfer_errors += o.error is not None
    elif isinstance(job, SaveJob):
        s = job.outcome
        stats.save_keys += s.started
        stats.saved_bytes += s.saved_bytes
        stats.save_range_calls += s.range_calls
        stats.save_skipped_existing += s.skipped_existing
        stats.save_failed_keys += s.start_failed + s.revoked
        stats.fenced_keys += s.fenced_keys
        stats.transfer_errors += s.error is not None
    else:
        t = job.outcome
        stats.committed_keys += t.committed
        stats.revoked_tainted += t.revoked_tainted
        stats.commit_failed += t.commit_failed
        stats.transfer_errors += t.error is not None


def _completion_event(device_type: str) -> Any:
    """A marker the send thread waits on before it reads a layer the device just wrote: a
    device event on any accelerator (CUDA, NPU, XPU, ...), None for host memory."""
    if device_type == "cpu":
        return None
    import torch  # pragma: no cover - no accelerator here

    event = torch.Event(device=device_type)
    event.record()
    return event


def _check_block_size(layout: CacheLayout, block_size: int) -> None:
    """Every registered cache must hold `block_size` tokens per block (one of its per-block dims)."""
    for layer in layout.layers:
        for entry in layer:
            if block_size not in entry.block_shape:
                raise LayoutError(
                    f"cache {entry.layer_name!r} has per-block shape {list(entry.block_shape)}, but the engine's "
                    f"block_size={block_size} tokens appears in none of its dims: the registered caches do not "
                    "match the configured block size"
                )


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
