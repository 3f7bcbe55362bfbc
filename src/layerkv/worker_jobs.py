"""Builds one worker's per-step transfer jobs once its KV caches are registered: the objects a
step's blocks map to (one per distinct key), the load plan (fixed knobs or the planner's choice),
staging rows, lanes. Compute thread only; the worker submits the jobs to its threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from layerkv.config import LayerKVConfig
from layerkv.errors import LayoutError, StoreError
from layerkv.header import Header
from layerkv.keys import Namespace, block_keys
from layerkv.layout import CacheLayout
from layerkv.plan import BlockSpec
from layerkv.stats import WorkerStats
from layerkv.store.base import ObjectKey, Placement
from layerkv.store.checked import CheckedStore
from layerkv.transfer.lanes import Lanes
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.pending import PendingPuts
from layerkv.transfer.planner import (GROUPS, LAYERS, WHOLE, Costs, Exploration, LoadPlan, StepShape, best_of_kinds,
                                     choose_lanes, fastest, simulate, transfer_s)
from layerkv.transfer.save import SaveJob, SaveKey
from layerkv.transfer.settle import SettleJob
from layerkv.transfer.staged import StagedLayers, layer_groups
from layerkv.transfer.staging import StagingPool
from layerkv.transfer.thread import TransferThread
from layerkv.transfer.views import CacheViews

log = logging.getLogger(__name__)
MAX_STAGING_NBYTES = 1 << 30  # staging rows of one job above this are refused (layouts: at startup)
PREPARED_STAGING_NBYTES = 256 << 20  # staging allocated at start-up, per kind (loads, saves), at most


@dataclass
class JobFactory:
    """Everything a step's jobs are built from; `stats` is the worker's (compute thread)."""

    config: LayerKVConfig
    store: CheckedStore
    namespace: Namespace
    storage_rank: int
    layout: CacheLayout
    header: Header
    views: CacheViews
    staged: StagedLayers | None  # host caches: staged group / whole-object reads, staged saves
    staging: StagingPool
    costs: Costs
    load_lanes: Lanes
    save_lanes: Lanes
    pending: PendingPuts
    writer: TransferThread  # staged saves' writes go there
    stats: WorkerStats
    exploration: Exploration = field(default_factory=Exploration)  # auto plans: which mode to try
    last_predictions: dict[str, float] = field(default_factory=dict)  # the last auto plan's best per kind (ms)

    def prepare_staging(self) -> None:
        """Allocate (and map) the staging rows of one full step's staged loads and saves now, at
        start-up: the first transfer into a fresh buffer was measured at 611 ms for 64 MiB in a
        vLLM CPU engine here, 106 ms once the buffer existed. Best effort (a refusal is logged;
        the first step then allocates, as it would anyway)."""
        if self.staged is None:
            return
        rows = min(self.config.max_transfer_blocks, max(1, PREPARED_STAGING_NBYTES // self.staged.row_nbytes))
        kinds = ("groups", "save-images") if self.config.transfer_plan != "layers" else ()
        try:
            for kind in kinds:
                self.staging.take(kind, rows, self.staged.row_nbytes)
        except StoreError as exc:
            log.warning("layerkv: staging buffers not prepared at start-up: %s", exc)

    def start_loads(self, specs: tuple[BlockSpec, ...], num_tokens: int) -> LoadJob | None:
        """One LoadKey per distinct object: read into the first local block, copied to the rest."""
        by_key: dict[ObjectKey, tuple[bytes, list[int]]] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, (block_hash, []))[1].append(block_id)
        load_keys = [LoadKey(key, h, ids[0], tuple(ids[1:])) for key, (h, ids) in by_key.items()]
        self.stats.load_keys += len(load_keys)
        self.stats.load_blocks += sum(len(spec) for spec in specs)
        plan, prefetch = self.load_plan(len(load_keys), num_tokens)
        try:
            if plan.mode == LAYERS:
                staging = self.staging.take("load", len(load_keys), self.layout.header_nbytes)
            else:  # keys pass through staging rows a wave at a time (bounded memory)
                assert self.staged is not None
                max_rows = max(1, MAX_STAGING_NBYTES // self.staged.row_nbytes)
                staging = self.staging.take("groups", min(len(load_keys), max_rows), self.staged.row_nbytes)
        except StoreError as exc:
            log.warning("layerkv: loads of this step fail: staging buffer: %s", exc)
            return None  # the worker reports the step's blocks invalid
        self.stats.count_plan(plan.mode)
        if self.store.audit is not None:
            self.store.audit.note("load_plan", plan=plan.label, keys=len(load_keys), tokens=num_tokens,
                                  predicted_ms=round(plan.predicted_s * 1e3, 3), explored=plan.explored,
                                  kinds_ms=self.last_predictions if plan.predicted_s else {})
        job = LoadJob(load_keys, store=self.store, layout=self.layout, header=self.header, staging=staging,
                      views=self.views, plan=plan, lanes=self.load_lanes, renew_after_s=self.config.lease_renew_after_s,
                      prefetch_layers=prefetch, staged=self.staged if plan.mode != LAYERS else None, costs=self.costs,
                      verify_checksums=self.config.verify_checksums)
        self.staging.lend(staging, job)
        return job

    def load_plan(self, num_keys: int, num_tokens: int) -> tuple[LoadPlan, int | None]:
        """This step's load plan and read-ahead cap: chosen from the running estimates
        (transfer_plan="auto"), or the fixed knobs."""
        lanes, mode, L = self.config.transfer_lanes, self.config.transfer_plan, self.layout.num_layers
        if mode != "auto" and (mode == "layers" or self.staged is None):  # device caches: no staging
            return LoadPlan(LAYERS, tuple(range(1, L + 1)), lanes or 1), self.config.prefetch_layers
        if mode == "groups":
            ends = tuple(g.end_layer for g in layer_groups(self.layout, self.config.read_layers_per_range))
            return LoadPlan(GROUPS, ends, lanes or 1), self.config.prefetch_layers
        if mode == "whole":
            return LoadPlan(WHOLE, (L,), lanes or choose_lanes(num_keys, 4)), None
        shape = self.step_shape(num_keys)
        costs = self.costs.snapshot()
        best = best_of_kinds(shape, costs, num_tokens, lanes=lanes or None)  # transfer_lanes set: only that many
        self.last_predictions = {f"{m}x{n}": round(p.predicted_s * 1e3, 3) for (m, n), p in best.items()}
        trying = self.exploration.kind_to_try({kind: p.predicted_s for kind, p in best.items()})
        plan = fastest(best.values())
        explored = trying is not None and trying != (plan.mode, plan.lanes)
        if trying is not None:
            plan = best[trying]
        self.exploration.used((plan.mode, plan.lanes))
        self.stats.load_plans_explored += explored
        return LoadPlan(plan.mode, plan.group_ends, plan.lanes, plan.predicted_s, explored), None

    def step_shape(self, num_keys: int) -> StepShape:
        return replace(self._shape, num_keys=num_keys)

    @cached_property
    def _shape(self) -> StepShape:
        """The layout's part of every step's shape (the layout never changes)."""
        layout = self.layout
        return StepShape(
            num_keys=0,
            num_layers=layout.num_layers,
            layer_nbytes=max(layout.layer_nbytes(l) for l in range(layout.num_layers)),
            header_nbytes=layout.header_nbytes,
            segments_per_layer=max(layout.template(l).num_segments for l in range(layout.num_layers)),
            staging_ok=self.staged is not None,
        )

    def observe_load(self, job: LoadJob, step_s: float = 0.0, num_tokens: int = 0) -> None:
        """An auto-planned load that read every layer: its kind's corrections (planner.Costs):
        its reads against the refitted model, then (`step_s`: start of the step to its last
        layer computed) the step against the refitted simulation, once compute has been
        measured without reads beside it (the prior would condemn the kind for its own error)."""
        plan = job.plan
        if plan.predicted_s <= 0:
            return
        kind, shape = (plan.mode, plan.lanes), self.step_shape(len(job.keys))
        if job.outcome.transfer_s > 0:
            self.costs.observe_transfer(kind, transfer_s(plan, shape, self.costs.snapshot()), job.outcome.transfer_s)
        if step_s > 0 and num_tokens > 0 and self.costs.measured("compute"):
            self.costs.observe_finish(kind, simulate(plan, shape, self.costs.snapshot(), num_tokens), step_s)

    def start_saves(self, step_seq: int, specs: tuple[BlockSpec, ...]) -> SaveJob | None:
        by_key: dict[ObjectKey, SaveKey] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, SaveKey(key, block_hash, block_id, spec.req_id))
        # staged (copy into object images, write later) unless the per-layer path is asked for or
        # the step's images would not fit the staging bound
        staged = self.staged if self.config.transfer_plan != "layers" else None
        if staged is not None and len(by_key) * staged.row_nbytes > MAX_STAGING_NBYTES:
            staged = None
        try:  # staged: one object image per key; direct: one header per key
            if staged is not None:
                staging = self.staging.take("save-images", len(by_key), staged.row_nbytes)
            else:
                staging = self.staging.take("save", len(by_key), self.layout.header_nbytes)
        except StoreError as exc:
            log.warning("layerkv: skipping this step's saves: staging buffer: %s", exc)
            self.stats.save_failed_keys += len(by_key)
            return None
        lanes = self.config.transfer_lanes or choose_lanes(len(by_key), 4)
        job = SaveJob(list(by_key.values()), step_seq, store=self.store, layout=self.layout, header=self.header,
                      staging=staging, views=self.views, placement=Placement.from_config(self.config), pending=self.pending,
                      staged=staged, lanes=self.save_lanes, num_lanes=lanes, writer=self.writer)
        self.staging.lend(staging, job)
        return job


def fold(stats: WorkerStats, job: LoadJob | SaveJob | SettleJob) -> None:
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


Job = LoadJob | SaveJob | SettleJob


class JobLedger:
    """Jobs whose outcome is not in the worker's counters yet: the current step's (passed in)
    and those of ended steps that are still running; each is folded in once, when it finished.
    Compute thread only."""

    def __init__(self, stats: WorkerStats) -> None:
        self.stats = stats
        self.later: list[Job] = []  # jobs of ended steps still running: folded in when they finish
        self._folded: set[int] = set()  # ids of current-step jobs already folded

    def collect(self, current: list[Job]) -> None:
        """Fold every finished job's outcome into the counters, once."""
        still = []
        for job in self.later:  # jobs of ended steps: never folded yet
            if job.finished:
                fold(self.stats, job)
            else:
                still.append(job)
        self.later = still
        for job in current:
            if job.finished and id(job) not in self._folded:
                fold(self.stats, job)
                self._folded.add(id(job))
        self._folded &= {id(j) for j in current}  # ids of jobs that are gone can be reused

    def end_step(self, current: list[Job]) -> None:
        """The step of `current` ended: what is still running is collected when it finishes."""
        self.collect(current)
        self.later.extend(j for j in current if id(j) not in self._folded)
        self._folded.clear()

    def stuck(self, kind: type[LoadJob] | type[SaveJob]) -> bool:
        """A job of `kind` from an earlier step was given up (timed out) and has not returned."""
        return any(isinstance(j, kind) and j.cancelled and not j.finished for j in self.later)

    def saves_in_flight(self) -> int:
        """Save jobs of earlier steps that have not finished (their writes and images)."""
        return sum(1 for j in self.later if isinstance(j, SaveJob) and not j.finished)


def check_block_size(layout: CacheLayout, block_size: int) -> None:
    """Every registered cache must hold `block_size` tokens per block (one of its per-block dims)."""
    for layer in layout.layers:
        for entry in layer:
            if block_size not in entry.block_shape:
                raise LayoutError(
                    f"cache {entry.layer_name!r} has per-block shape {list(entry.block_shape)}, but the engine's "
                    f"block_size={block_size} tokens appears in none of its dims: the registered caches do not "
                    "match the configured block size"
                )


def memory_regions(kv_caches: Mapping[str, Any]) -> list[tuple[int, int]]:
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


class CacheMemory:
    """The KV cache memory a worker registers with the store. A refusal (e.g. Mooncake's master
    unreachable) is retried at most once per `retry_interval_s`; meanwhile the worker serves
    without the pool. Compute thread."""

    def __init__(self, store: CheckedStore, retry_interval_s: float, who: str) -> None:
        self._store, self._retry_interval_s, self._who = store, retry_interval_s, who
        self._registered: list[int] = []
        self._unregistered: list[tuple[int, int]] = []
        self._next_try_s = 0.0

    def register(self, kv_caches: Mapping[str, Any]) -> bool:
        self._unregistered = memory_regions(kv_caches)
        return self.ready()

    def ready(self) -> bool:
        """Register what the store has not accepted yet; True when all of it is."""
        if not self._unregistered:
            return True
        now = time.monotonic()
        if now < self._next_try_s:
            return False
        try:
            while self._unregistered:
                ptr, nbytes = self._unregistered[0]
                self._store.register_buffer(ptr, nbytes)
                self._registered.append(ptr)
                self._unregistered.pop(0)
        except StoreError as exc:
            self._next_try_s = now + self._retry_interval_s
            log.warning("layerkv: %s cannot register its KV cache with the store (%s); serving without "
                        "the pool, retrying in %.1f s", self._who, exc, self._retry_interval_s)
            return False
        return True

    def unregister(self) -> None:
        for ptr in self._registered:
            try:
                self._store.unregister_buffer(ptr)
            except StoreError as exc:
                log.warning("layerkv: %s", exc)
        self._registered.clear()
