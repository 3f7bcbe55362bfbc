"""Builds one worker's per-step transfer jobs once its KV caches are registered: the objects a
step's blocks map to (one per distinct key), the load plan (fixed knobs or the planner's choice),
staging rows (lent from the fixed staging areas; never allocated here), lanes. Compute thread
only; the worker submits the jobs to its threads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from layerkv.config import LayerKVConfig
from layerkv.errors import LayoutError
from layerkv.objects.header import Header
from layerkv.objects.keys import Namespace, block_keys
from layerkv.objects.layout import CacheLayout
from layerkv.metadata import BlockSpec
from layerkv.objects.seal import sealers_for
from layerkv.connector.stats import WorkerStats
from layerkv.store.base import ObjectKey, Placement
from layerkv.store.checked import CheckedStore
from layerkv.objects.tenant_key import TenantKeys
from layerkv.transfer.lanes import Lanes
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.commit import CommitJob, PendingPuts
from layerkv.transfer.planner import (GROUPS, LAYERS, WHOLE, Costs, Exploration, LoadPlan, StepShape, best_of_kinds,
                                     choose_lanes, fastest, simulate, transfer_s)
from layerkv.transfer.save import SaveJob, SaveKey
from layerkv.transfer.staged import StagedLayers, layer_groups
from layerkv.transfer.staging import StagingAreas
from layerkv.transfer.thread import TransferThread
from layerkv.transfer.views import CacheViews

log = logging.getLogger(__name__)


def headers_for(namespaces: tuple[Namespace, ...], layout: CacheLayout, keys: TenantKeys | None,
                encrypt: bool) -> tuple[Header, ...]:
    """The header codec of each key generation (parallel to `namespaces`: tenant_namespaces)."""
    return tuple(Header(ns.digest, layout.digest, layout.num_layers, layout.object_nbytes, sealer)
                 for ns, sealer in zip(namespaces, sealers_for(keys, encrypt), strict=True))


@dataclass
class JobFactory:
    """Everything a step's jobs are built from; `stats` is the worker's (compute thread)."""

    config: LayerKVConfig
    store: CheckedStore
    namespaces: tuple[Namespace, ...]  # one per tenant key, the current (which writes) first
    storage_rank: int
    layout: CacheLayout
    headers: tuple[Header, ...]  # parallel to namespaces
    views: CacheViews
    staged: StagedLayers  # staged group / whole-object reads, staged saves
    areas: StagingAreas
    costs: Costs
    load_lanes: Lanes
    save_lanes: Lanes
    pending: PendingPuts
    writer: TransferThread  # staged saves' writes go there
    stats: WorkerStats
    exploration: Exploration = field(default_factory=Exploration)  # auto plans: which mode to try

    @property
    def namespace(self) -> Namespace:
        return self.namespaces[0]

    @property
    def header(self) -> Header:
        return self.headers[0]

    @property
    def direct(self) -> bool:
        """Per-layer transfers straight into / out of the cache: only a registered host cache
        (register_kv_cache; a device cache's layers could not be tagged on the host) and plaintext
        objects (encrypt_objects decrypts in private memory)."""
        return self.config.register_kv_cache and self.views.on_host and not self.config.encrypt_objects
    last_predictions: dict[str, float] = field(default_factory=dict)  # the last auto plan's best per kind (ms)

    def start_loads(self, specs: tuple[BlockSpec, ...], num_tokens: int) -> LoadJob | None:
        """One LoadKey per distinct object: read into the first local block, copied to the rest.
        None when no staging row is free (every one held by earlier jobs still in the store):
        the worker reports the step's blocks invalid."""
        by_key: dict[ObjectKey, tuple[bytes, int, list[int]]] = {}
        for spec in specs:
            for gen, block_hash, block_id in zip(spec.generations or [0] * len(spec), spec.block_hashes, spec.block_ids):
                if gen >= len(self.namespaces):  # the scheduler found it under a key this worker lacks
                    log.error("layerkv: a pool hit under tenant key %d of the key file, which holds %d here: this "
                              "step's loads are recomputed (give every process the same tenant_key_file)",
                              gen + 1, len(self.namespaces))
                    return None
                namespace = self.namespaces[gen]
                key = block_keys(namespace, (block_hash,), self.storage_rank)[0]
                by_key.setdefault(key, (namespace.block_id(block_hash), gen, []))[2].append(block_id)
        load_keys = [LoadKey(key, h, ids[0], tuple(ids[1:]), gen) for key, (h, gen, ids) in by_key.items()]
        self.stats.load_keys += len(load_keys)
        self.stats.load_blocks += sum(len(spec) for spec in specs)
        plan, prefetch = self.load_plan(len(load_keys), num_tokens)
        area = self.areas.headers if plan.mode == LAYERS else self.areas.loads
        assert area is not None, "direct per-layer plans only with register_kv_cache"
        slots = area.take(len(load_keys))  # staged plans stream through fewer rows than keys
        if slots.size == 0 or (plan.mode == LAYERS and slots.size < len(load_keys)):
            log.warning("layerkv: loads of this step are recomputed: %d of %d %s staging rows free", slots.size,
                        area.num_rows, area.name)
            self.stats.load_skipped_staging += 1
            return None
        self.stats.count_plan(plan.mode)
        if self.store.audit is not None:
            self.store.audit.note("load_plan", plan=plan.label, keys=len(load_keys), tokens=num_tokens,
                                  predicted_ms=round(plan.predicted_s * 1e3, 3), explored=plan.explored,
                                  kinds_ms=self.last_predictions if plan.predicted_s else {})
        job = LoadJob(load_keys, store=self.store, layout=self.layout, header=self.headers, staging=area.array,
                      slots=slots, views=self.views, plan=plan, lanes=self.load_lanes,
                      renew_after_s=self.config.lease_renew_after_s, prefetch_layers=prefetch,
                      staged=self.staged if plan.mode != LAYERS else None, costs=self.costs)
        area.lend(slots, job)
        return job

    def load_plan(self, num_keys: int, num_tokens: int) -> tuple[LoadPlan, int | None]:
        """This step's load plan and read-ahead cap: chosen from the running estimates
        (transfer_plan="auto"), or the fixed knobs."""
        lanes, mode, L = self.config.transfer_lanes, self.config.transfer_plan, self.layout.num_layers
        if mode == "layers":  # straight into the cache only where the cache is registered
            kind = LAYERS if self.direct else GROUPS
            return LoadPlan(kind, tuple(range(1, L + 1)), lanes or 1), self.config.prefetch_layers
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
            staging_ok=True,
            direct_ok=self.direct,
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
        """Staged (object images in staging rows) unless register_kv_cache and the per-layer
        plan ask for direct writes. Keys beyond the free staging rows are not saved this step
        (counted): wait_for_save never waits for the store to free rows."""
        by_key: dict[ObjectKey, SaveKey] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, self.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, SaveKey(key, self.namespace.block_id(block_hash), block_id, spec.req_id))
        direct = self.config.transfer_plan == "layers" and self.direct
        area = self.areas.headers if direct else self.areas.saves
        assert area is not None
        slots = area.take(len(by_key))
        save_keys = list(by_key.values())[: slots.size]  # in block order: the saved part is a prefix
        if len(save_keys) < len(by_key):
            skipped = len(by_key) - len(save_keys)
            self.stats.save_skipped_staging += skipped
            log.info("layerkv: %d of %d keys of this step not saved: %d of %d %s staging rows free", skipped, len(by_key),
                     slots.size, area.num_rows, area.name)
        if not save_keys:
            return None
        lanes = self.config.transfer_lanes or choose_lanes(len(save_keys), 4)
        job = SaveJob(save_keys, step_seq, store=self.store, layout=self.layout, header=self.header,
                      staging=area.array, slots=slots, views=self.views, placement=Placement.from_config(self.config),
                      pending=self.pending, staged=None if direct else self.staged, lanes=self.save_lanes,
                      num_lanes=lanes, writer=self.writer)
        area.lend(slots, job)
        return job


def fold(stats: WorkerStats, job: LoadJob | SaveJob | CommitJob) -> None:
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
        stats.load_copy_s += o.copy_s
        stats.load_copied_bytes += o.copied_bytes
        stats.transfer_errors += o.error is not None
    elif isinstance(job, SaveJob):
        s = job.outcome
        stats.save_keys += s.started
        stats.saved_bytes += s.saved_bytes
        stats.save_range_calls += s.range_calls
        stats.save_skipped_existing += s.skipped_existing
        stats.save_copy_s += s.copy_s
        stats.save_failed_keys += s.start_failed + s.revoked
        stats.fenced_keys += s.fenced_keys
        stats.transfer_errors += s.error is not None
    else:
        t = job.outcome
        stats.committed_keys += t.committed
        stats.revoked_tainted += t.revoked_tainted
        stats.commit_failed += t.commit_failed
        stats.transfer_errors += t.error is not None


Job = LoadJob | SaveJob | CommitJob


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
