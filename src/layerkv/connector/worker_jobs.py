"""Builds one worker's per-step transfer jobs once its KV caches are registered: the objects a
step's blocks map to (one per distinct key), the load plan (fixed knobs or the planner's choice),
staging slots (lent from the fixed staging areas; never allocated here), lanes; and keeps the
jobs whose outcomes are not in the worker's counters yet (JobLedger). Compute thread only; the
worker submits the jobs to its threads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from layerkv.config import LayerKVConfig, PlanMode
from layerkv.connector.stats import LOAD_BYTES, LOAD_TRANSFER_S, SAVE_BYTES, SAVE_TRANSFER_S, Samples, WorkerStats
from layerkv.errors import LayoutError
from layerkv.messages import Deployment
from layerkv.metadata import BlockSpec
from layerkv.objects.header import Header
from layerkv.objects.keys import Namespace, block_keys, tenant_namespaces
from layerkv.objects.layout import CacheLayout
from layerkv.objects.seal import sealers_for
from layerkv.objects.tenant_key import TenantKeys
from layerkv.store.base import ObjectKey, Placement
from layerkv.store.checked import CheckedStore
from layerkv.transfer.caches import LentSlots, RegisteredCaches
from layerkv.transfer.calls import Lanes
from layerkv.transfer.commit import CommitJob, Commits
from layerkv.transfer.groups import layer_groups
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.planner import Planner, StepShape, choose_lanes
from layerkv.transfer.save import SaveJob, SaveKey

log = logging.getLogger(__name__)


def namespaces_for(
    config: LayerKVConfig, deployment: Deployment, keys: TenantKeys | None, epoch: str
) -> tuple[Namespace, ...]:
    """A worker's namespaces in `epoch` (the scheduler's, StepPlan.epoch), the current key's first."""
    return tenant_namespaces(deployment, config.tenant, config.model_fingerprint, keys, config.encrypt_objects, epoch)


def headers_for(
    namespaces: tuple[Namespace, ...], layout: CacheLayout, keys: TenantKeys | None, encrypt: bool
) -> tuple[Header, ...]:
    """The header codec of each key generation (parallel to `namespaces`: tenant_namespaces)."""
    return tuple(
        Header(ns.digest, layout.digest, layout.num_layers, layout.object_nbytes, sealer)
        for ns, sealer in zip(namespaces, sealers_for(keys, encrypt), strict=True)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class JobContext:
    """What every job a worker builds shares, fixed for the worker's life (built in its
    constructor, before its KV caches are registered)."""

    config: LayerKVConfig
    store: CheckedStore
    storage_rank: int  # the shard of each block this worker stores
    load_lanes: Lanes  # the receive thread's lane pool
    save_lanes: Lanes  # the send and write threads' lane pool
    commits: Commits  # where a save job's sessions wait for their step's verdict
    stats: WorkerStats  # the worker's counters (compute thread)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFactory:
    """Everything a step's jobs are built from: the worker's fixed parts, its registered caches
    and planner (once registered), and the namespaces of the current epoch."""

    context: JobContext
    caches: RegisteredCaches
    planner: Planner
    namespaces: tuple[Namespace, ...]  # one per tenant key, the current (which writes) first
    headers: tuple[Header, ...]  # parallel to namespaces

    @classmethod
    def over(
        cls, context: JobContext, caches: RegisteredCaches, namespaces: tuple[Namespace, ...], keys: TenantKeys | None
    ) -> JobFactory:
        """The factory of a worker whose KV caches were just registered as `caches`, with its
        planner (planner_for) and the header codecs of `namespaces` (headers_for)."""
        headers = headers_for(namespaces, caches.layout, keys, context.config.encrypt_objects)
        planner = planner_for(context.config, caches)
        return cls(context=context, caches=caches, planner=planner, namespaces=namespaces, headers=headers)

    @property
    def namespace(self) -> Namespace:
        return self.namespaces[0]

    def renamed(self, namespaces: tuple[Namespace, ...], keys: TenantKeys | None) -> JobFactory:
        """This factory with other namespaces (a cache reset's epoch); jobs it started keep theirs."""
        headers = headers_for(namespaces, self.caches.layout, keys, self.context.config.encrypt_objects)
        return dataclasses.replace(self, namespaces=namespaces, headers=headers)

    def start_loads(self, specs: tuple[BlockSpec, ...], num_tokens: int) -> LoadJob | None:
        """One LoadKey per distinct object: read into the first local block, copied to the rest.
        None when no staging slot is free (every one held by earlier jobs still in the store):
        the worker reports the step's blocks invalid."""
        ctx = self.context
        load_keys = self._load_keys(specs)
        if load_keys is None:
            return None
        ctx.stats.load_keys += len(load_keys)
        ctx.stats.load_blocks += sum(len(spec) for spec in specs)
        plan, prefetch = self.planner.choose(len(load_keys), num_tokens)
        areas = self.caches.areas
        area = areas.headers if plan.mode == PlanMode.LAYERS else areas.loads
        assert area is not None, "direct per-layer plans only with register_kv_cache"
        slots = area.take(len(load_keys))  # staged plans stream through fewer slots than keys
        if slots.size == 0 or (plan.mode == PlanMode.LAYERS and slots.size < len(load_keys)):
            log.warning(
                "layerkv: loads of this step are recomputed: %d of %d %s staging slots free",
                slots.size,
                area.num_slots,
                area.name,
            )
            ctx.stats.load_skipped_staging += 1
            return None
        ctx.stats.count_plan(plan.mode)
        ctx.stats.load_plans_explored += plan.explored
        if ctx.store.audit is not None:
            ctx.store.audit.note(
                "load_plan",
                plan=plan.label,
                keys=len(load_keys),
                tokens=num_tokens,
                predicted_ms=round(plan.predicted_s * 1e3, 3),
                explored=plan.explored,
                kinds_ms=self.planner.last_predictions if plan.predicted_s else {},
            )
        job = LoadJob(
            load_keys,
            store=ctx.store,
            caches=self.caches,
            headers=self.headers,
            staging=LentSlots(area.array, slots),
            plan=plan,
            lanes=ctx.load_lanes,
            renew_after_s=ctx.config.lease_renew_after_s,
            prefetch_layers=prefetch,
            start_marker=self.caches.views.copies.compute_marker(),
        )  # the cache's earlier users first
        area.lend(slots, job)
        return job

    def _load_keys(self, specs: tuple[BlockSpec, ...]) -> list[LoadKey] | None:
        by_key: dict[ObjectKey, tuple[bytes, int, list[int]]] = {}
        storage_rank = self.context.storage_rank
        for spec in specs:
            for gen, block_hash, block_id in zip(
                spec.generations or [0] * len(spec), spec.block_hashes, spec.block_ids
            ):
                if gen >= len(self.namespaces):  # the scheduler found it under a key this worker lacks
                    log.error(
                        "layerkv: a pool hit under tenant key %d of the key file, which holds %d here: this "
                        "step's loads are recomputed (give every process the same tenant_key_file)",
                        gen + 1,
                        len(self.namespaces),
                    )
                    return None
                namespace = self.namespaces[gen]
                key = block_keys(namespace, (block_hash,), storage_rank)[0]
                by_key.setdefault(key, (namespace.block_id(block_hash), gen, []))[2].append(block_id)
        return [LoadKey(key, h, ids[0], tuple(ids[1:]), gen) for key, (h, gen, ids) in by_key.items()]

    def start_saves(self, step_seq: int, specs: tuple[BlockSpec, ...]) -> SaveJob | None:
        """Staged (object images in staging slots) unless register_kv_cache and the per-layer
        plan ask for direct writes. Keys beyond the free staging slots are not saved this step
        (counted): wait_for_save never waits for the store to free rows."""
        ctx = self.context
        by_key: dict[ObjectKey, SaveKey] = {}
        for spec in specs:
            keys = block_keys(self.namespace, spec.block_hashes, ctx.storage_rank)
            for key, block_hash, block_id in zip(keys, spec.block_hashes, spec.block_ids):
                by_key.setdefault(key, SaveKey(key, self.namespace.block_id(block_hash), block_id, spec.req_id))
        direct = self.planner.mode == PlanMode.LAYERS and direct_transfers(ctx.config, self.caches)
        area = self.caches.areas.headers if direct else self.caches.areas.saves
        assert area is not None
        slots = area.take(len(by_key))
        save_keys = list(by_key.values())[: slots.size]  # in block order: the saved part is a prefix
        if len(save_keys) < len(by_key):
            skipped = len(by_key) - len(save_keys)
            ctx.stats.save_skipped_staging += skipped
            log.info(
                "layerkv: %d of %d keys of this step not saved: %d of %d %s staging slots free",
                skipped,
                len(by_key),
                slots.size,
                area.num_slots,
                area.name,
            )
        if not save_keys:
            return None
        lanes = ctx.config.transfer_lanes or choose_lanes(len(save_keys), 4)
        job = SaveJob(
            save_keys,
            step_seq,
            store=ctx.store,
            caches=self.caches,
            header=self.headers[0],
            staging=LentSlots(area.array, slots),
            placement=Placement.from_config(ctx.config),
            commits=ctx.commits,
            lanes=ctx.save_lanes,
            num_lanes=lanes,
            staged=not direct,
        )
        area.lend(slots, job)
        return job


def direct_transfers(config: LayerKVConfig, caches: RegisteredCaches) -> bool:
    """Per-layer transfers straight into / out of the cache are possible: only a registered host
    cache (register_kv_cache; a device cache's layers could not be tagged on the host) and
    plaintext objects (encrypt_objects decrypts in private memory)."""
    return config.register_kv_cache and caches.on_host and not config.encrypt_objects


def planner_for(config: LayerKVConfig, caches: RegisteredCaches) -> Planner:
    """The worker's planner: the layout's part of every step's shape (the layout never changes)
    and the fixed knobs."""
    layout = caches.layout
    shape = StepShape(
        num_keys=0,
        num_layers=layout.num_layers,
        layer_nbytes=max(layout.layer_nbytes(li) for li in range(layout.num_layers)),
        header_nbytes=layout.header_nbytes,
        segments_per_layer=max(layout.template(li).num_segments for li in range(layout.num_layers)),
        staging_ok=True,
        direct_ok=direct_transfers(config, caches),
    )
    ends = tuple(g.end_layer for g in layer_groups(layout, config.read_layers_per_range))
    return Planner(
        PlanMode(config.transfer_plan),
        shape,
        lanes=config.transfer_lanes,
        prefetch_layers=config.prefetch_layers,
        group_ends=ends,
    )


def fold(stats: WorkerStats, job: LoadJob | SaveJob | CommitJob, samples: Samples) -> None:
    """Add a finished job's outcome to the worker's counters and its transfer's size and time
    to `samples` (compute thread)."""
    if isinstance(job, LoadJob):
        o = job.outcome
        samples.observe(LOAD_BYTES, o.loaded_bytes)
        if o.transfer_s:  # 0: not every layer read
            samples.observe(LOAD_TRANSFER_S, o.transfer_s)
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
        samples.observe(SAVE_BYTES, s.saved_bytes)
        if s.range_calls:
            samples.observe(SAVE_TRANSFER_S, s.write_s)
        stats.save_keys += s.started
        stats.saved_bytes += s.saved_bytes
        stats.save_range_calls += s.range_calls
        stats.save_skipped_existing += s.skipped_existing
        stats.save_copy_s += s.copy_s
        stats.save_incomplete_steps += s.incomplete
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

    def __init__(self, stats: WorkerStats, samples: Samples) -> None:
        self.stats = stats
        self.samples = samples  # each folded job's transfer size and time
        self.later: list[Job] = []  # jobs of ended steps still running: folded in when they finish
        self._folded: set[int] = set()  # ids of current-step jobs already folded

    def collect(self, current: list[Job]) -> None:
        """Fold every finished job's outcome into the counters, once."""
        still = []
        for job in self.later:  # jobs of ended steps: never folded yet
            if job.finished:
                fold(self.stats, job, self.samples)
            else:
                still.append(job)
        self.later = still
        for job in current:
            if job.finished and id(job) not in self._folded:
                fold(self.stats, job, self.samples)
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

    def wait_finished(self, current: list[Job], timeout_s: float, *, given_up_loads: bool = False) -> bool:
        """Wait until `current` and the jobs of ended steps have finished; True if they did within
        `timeout_s`. A load that gave up is waited for only with `given_up_loads`."""
        deadline = time.monotonic() + timeout_s
        jobs = [j for j in (*current, *self.later) if given_up_loads or not (isinstance(j, LoadJob) and j.cancelled)]
        return all(job.wait_finished(max(0.0, deadline - time.monotonic())) for job in jobs)

    def num_running(self, current: list[Job]) -> int:
        """Jobs of `current` and of ended steps not finished yet."""
        return sum(1 for j in (*current, *self.later) if not j.finished)

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
