"""Worker side of the connector (one per TP rank and pipeline stage): registers its staging areas
(its live KV cache only with register_kv_cache), turns each step's plan into a load job (receive
thread `layerkv-recv-<rank>`), a save job (its copies on the send thread `layerkv-send-<rank>`, its
store writes on the write thread `layerkv-write-<rank>`) and the commits of earlier steps (write
thread), and reports which blocks
failed to load and which step it ran. Hooks are called on the engine's compute thread; the jobs
own their sessions and publish outcomes the compute thread reads once they finished. Never raises
into the engine because of the store: a late layer is recomputed, a late save revoked.

Commit protocol (transfer/commit.py): a step's saves are written during the step and left open;
the scheduler side commits them in a later step's plan (`StepVerdict`) once every worker reported
the step, revoking what requests that attended to a failed block wrote. A role that never loads
(kv_producer) has nothing to revoke: it commits each step's objects right after their writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import layerkv.connector.worker_jobs as worker_jobs
from layerkv.config import LayerKVConfig
from layerkv.connector.failed_blocks import FailedBlocks
from layerkv.connector.handoff import SaveHandoff
from layerkv.connector.stats import LOAD_WAIT_S, Samples, WorkerStats
from layerkv.connector.worker_jobs import JobFactory, JobLedger, check_block_size
from layerkv.errors import ConfigError, TransferError
from layerkv.messages import Deployment
from layerkv.metadata import BlockSpec, StepPlan
from layerkv.objects.keys import storage_role, with_store_shards
from layerkv.objects.layout import CacheLayout
from layerkv.objects.tenant_key import tenant_keys
from layerkv.store.checked import CheckedStore
from layerkv.store.wheels import check_device_path
from layerkv.transfer.caches import RegisteredCaches
from layerkv.transfer.calls import Lanes
from layerkv.transfer.commit import Commits
from layerkv.transfer.load import LoadJob
from layerkv.transfer.memory import RegisteredMemory, memory_regions
from layerkv.transfer.planner import Planner
from layerkv.transfer.save import SaveJob
from layerkv.transfer.staging import StagingAreas
from layerkv.transfer.thread import TransferThread
from layerkv.transfer.views import CacheViews

log = logging.getLogger(__name__)
# Save jobs of earlier steps still writing (each holds its staging rows); with this many, a step's
# saves are skipped: a write that never returns must not make every later step hold more rows.
# 4 still dropped 1-3 saves of healthy steps in the engine tier (~20 processes on 2 cores).
MAX_SAVES_IN_FLIGHT = 8


class WorkerConnector:
    """The worker hooks (see hooks.WorkerHooks) over a CheckedStore.

    * Loads: one LoadJob per step; it starts, renews and ends its get sessions on the receive
      thread. wait_for_layer_load returns when the layer is readable or, after `load_timeout_s`,
      with every block of the job reported invalid.
    * Saves: one SaveJob per step (put start, layer writes, headers with checksums); its sessions
      then wait in `commits.pending` for the step's verdict. wait_for_save returns when every
      layer is written or, after `save_timeout_s`, with the job cancelled (it revokes).
    * Verdicts in a plan run first on the write thread (`commits`: transfer/commit.py); a step whose
      verdict never arrives is revoked after `commit_timeout_s`; shutdown revokes what is pending.
    * Only the staging areas are registered (register_kv_cache: false, the default): reads land
      in staging and are verified as they reach the cache, saves gather the cache into staging.
    """

    def __init__(
        self, config: LayerKVConfig, deployment: Deployment, store: CheckedStore, shard: int | None = None
    ) -> None:
        """`shard`: which of this rank's shards it stores (connector/shards.py builds one worker
        per shard when the split is finer than the TP size); None: the rank's only one."""
        if not isinstance(store, CheckedStore):
            raise TypeError(
                f"WorkerConnector needs a CheckedStore (store.factory.open_checked_store), got {type(store).__name__}"
            )
        deployment = with_store_shards(deployment, config.store_shards)
        self.config = config
        self.deployment = deployment
        self.store = store
        self.storage_role = storage_role(deployment)
        ranks = self.storage_role.storage_ranks
        if shard is None and len(ranks) > 1:
            raise ConfigError(
                f"this rank holds {len(ranks)} shards of each block (store_shards="
                f"{self.storage_role.num_storage_ranks}, tp_size={deployment.tp_size}): build its worker "
                "with layerkv.connector.shards.worker_connector"
            )
        if shard is not None and shard not in ranks:
            raise ConfigError(f"shard={shard} is not one of this rank's shards {list(ranks)}")
        self.storage_rank = ranks[0] if shard is None else shard
        self.tenant_keys = tenant_keys(config.tenant_key_file)  # read once; never shown
        self._epoch, self.namespaces = (
            "",
            worker_jobs.namespaces_for(config, deployment, self.tenant_keys, ""),
        )  # StepPlan.epoch
        self.namespace = self.namespaces[0]  # the current key's: it writes; every key's namespace reads
        self.layout: CacheLayout | None = None
        self._jobs: JobFactory | None = None  # once the KV caches are registered
        self._names_per_layer: list[int] = []  # registered cache names of each layer
        self._stats = WorkerStats()  # compute thread only
        self._plan: StepPlan | None = None  # compute thread only, from here on
        self._load: LoadJob | None = None
        self._save: SaveJob | None = None
        self.samples = Samples()  # per-step observations (connector/stats.py), compute thread; vLLM's histograms
        self._ledger = JobLedger(self._stats, self.samples)  # jobs whose outcomes are not counted yet
        self._failed, self._reported_steps = FailedBlocks(), list[int]()  # load failures for the engine
        self._handoff = SaveHandoff()  # this step's layers handed to its save job
        self._waited = False  # a layer of this step's load was waited for (per-layer hooks ran)
        self._areas: StagingAreas | None = None  # registered rows, one job at a time (once registered)
        self._closed = False  # compute thread: shutdown() ran
        rank = f"{deployment.pp_rank}-{deployment.tp_rank}" if deployment.pp_size > 1 else str(deployment.tp_rank)
        rank += f"s{shard}" if len(ranks) > 1 else ""
        self.planner: Planner | None = None  # once the KV caches are registered (compute thread)
        # one lane pool per transfer thread: a stuck write never holds up a read (or the reverse)
        self._load_lanes = Lanes(f"layerkv-rlane-{rank}", max_lanes=8)
        self._save_lanes = Lanes(f"layerkv-slane-{rank}", max_lanes=8)
        self._step_start_s = 0.0  # compute thread: when this step's forward began
        self._step_wait_s = 0.0  # compute thread: time this step waited for layers
        self._recv = TransferThread(f"layerkv-recv-{rank}")
        self._send = TransferThread(f"layerkv-send-{rank}")
        # staged saves' writes and the commits: never ahead of the copies a step needs
        self._write = TransferThread(f"layerkv-write-{rank}", on_idle=lambda: self.commits.expire())
        self.commits = Commits(store, self._write, config.commit_timeout_s)
        self._memory = RegisteredMemory(
            store, config.store_retry_interval_s, f"rank {deployment.tp_rank}", self._write.submit
        )

    # -- registration ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks!r} must be a positive int")
        self.layout = CacheLayout.from_caches(kv_caches, num_blocks, max_transfer_bytes=self.config.max_transfer_bytes)
        check_block_size(self.layout, self.deployment.block_size)
        check_device_path(self.layout.device_type, self.config.register_kv_cache)  # device KV: staging only
        headers = worker_jobs.headers_for(self.namespaces, self.layout, self.tenant_keys, self.config.encrypt_objects)
        self._names_per_layer = [len({e.layer_name for e in layer}) for layer in self.layout.layers]
        direct = self.config.register_kv_cache
        self._areas = StagingAreas.for_layout(self.layout, self.config.staging_nbytes, direct)
        caches = RegisteredCaches.over(CacheViews(self.layout, kv_caches), self._areas)
        self.planner = worker_jobs.planner_for(self.config, caches)
        self._jobs = JobFactory(
            self.config,
            self.store,
            self.namespaces,
            headers,
            self.storage_rank,
            caches,
            self.planner,
            self._load_lanes,
            self._save_lanes,
            self.commits,
            self._stats,
        )
        # the store can reach these and nothing else of the engine's (the live cache only when the
        # user opts in; a Mooncake client that mounts a global segment in this process exposes it too)
        registered = self._memory.register(self._areas.regions() + (memory_regions(kv_caches) if direct else []))
        log.info(
            "layerkv: rank %d shard %d: %d layers, object %d bytes, staging %d MiB%s %s, namespace %s",
            self.deployment.tp_rank,
            self.storage_rank,
            self.layout.num_layers,
            self.layout.object_nbytes,
            self._areas.nbytes() >> 20,
            " and the live KV cache (register_kv_cache)" if direct else "",
            "registered with the store" if registered else "not registered yet (retried)",
            self.namespace.name,
        )

    # -- per step -------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: Any) -> None:
        if meta is not None and not isinstance(meta, StepPlan):
            raise TypeError(f"layerkv worker got metadata of type {type(meta).__name__}, expected StepPlan")
        self._end_step()
        self._take_epoch(meta.epoch if meta is not None else self._epoch)
        self._plan = meta
        self._handoff.start(None, self._names_per_layer, lambda: None)
        self._waited = False
        self._failed.new_step()
        if meta is not None:
            self._reported_steps.append(meta.step_seq)

    def _take_epoch(self, epoch: str) -> None:
        """A cache reset's epoch (SchedulerConnector.reset_cache) names this step's jobs' objects on."""
        if epoch == self._epoch:
            return
        self._epoch, self.namespaces = (
            epoch,
            worker_jobs.namespaces_for(self.config, self.deployment, self.tenant_keys, epoch),
        )
        self.namespace = self.namespaces[0]
        self._jobs = self._jobs.renamed(self.namespaces, self.tenant_keys) if self._jobs is not None else None

    def start_load_kv(self) -> None:
        plan = self._plan
        if plan is None:
            return
        self._step_start_s, self._step_wait_s = time.perf_counter(), 0.0
        if self._closed:  # after shutdown: no transfers; loads are recomputed
            self._failed.add(plan.load_block_ids())
            return
        self._stats.steps += 1
        self._failed.add(plan.reinvalidate)  # the engine recomputes them (see StepPlan)
        if self.layout is None and (plan.loads or plan.saves):
            raise TransferError("layerkv: start_load_kv before register_kv_caches")
        self.commits.apply(plan.verdicts)
        if not (plan.loads or plan.saves):
            return
        if not self._memory.ready():
            # the store refused our memory (e.g. Mooncake's master is down): no transfers this
            # step; loads are reported failed so the engine recomputes, saves are skipped
            if plan.loads and self.deployment.role.loads:
                self._failed.add(plan.load_block_ids())
            return
        if plan.loads and self.deployment.role.loads:
            if self._ledger.stuck(LoadJob):  # an earlier load is still inside the store: recompute, don't queue
                self._failed.add(plan.load_block_ids())
                self._stats.load_skipped_stuck += 1
            else:
                self._load = self._start_loads(plan.loads, plan.num_tokens)
                if plan.loads_first and self._load is not None and self.layout is not None:
                    self._wait_layer(self._load, self.layout.num_layers - 1)  # a decode-shaped step: no layer will wait
        if plan.saves and self.deployment.role.saves and self.storage_role.writes:
            if (
                self._ledger.stuck(SaveJob)
                or self.store.is_down()
                or self._ledger.saves_in_flight() >= MAX_SAVES_IN_FLIGHT
            ):
                self._stats.save_skipped_steps += 1
            else:
                self._save = self._start_saves(plan.step_seq, plan.saves)
                if self._save is not None:
                    self.commits.saving(plan.step_seq)
                    copies = self._jobs.caches.views.copies if self._jobs is not None else None
                    self._handoff.start(
                        self._save, self._names_per_layer, copies.compute_marker if copies else lambda: None
                    )

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is None and not self._handoff.pending:  # nothing to wait for or hand over: free
            return
        if self.layout is None:
            return
        layer_idx = self.layout.layer_index(layer_name)
        self._handoff.passed(layer_idx)
        job = self._load
        if job is not None and not job.cancelled:
            self._waited = True
            self._wait_layer(job, layer_idx)

    def _wait_layer(self, job: LoadJob, layer_idx: int) -> None:
        start = time.perf_counter()
        if not job.wait_layer(layer_idx, self.config.load_timeout_s):
            self._stats.load_timeouts += 1
            log.warning(
                "layerkv: layer %d not loaded within %.1f s; this step's loaded blocks will be recomputed",
                layer_idx,
                self.config.load_timeout_s,
            )
        waited = time.perf_counter() - start
        self._stats.load_wait_s += waited
        self._step_wait_s += waited

    def save_kv_layer(self, layer_name: str) -> None:
        if self.layout is None or self._save is None:
            return
        self._handoff.saved(self.layout.layer_index(layer_name))

    def wait_for_save(self) -> None:
        """End of the forward: loads must be over (their failures go to the scheduler) and the
        save must no longer read the KV cache (staged: every layer copied; direct: written).
        Remote writes of staged saves and the plan's commits go on in the background. Bounded."""
        load, save = self._load, self._save
        plan = self._plan
        if load is None and save is None:  # nothing moved (a decode step)
            if plan is not None and plan.num_tokens == 0 and not (plan.loads or plan.saves):
                self.commits.finish_idle_step(self.config.save_timeout_s)  # the engine steps only to commit
            elif plan is not None and self.planner is not None and self._step_start_s:  # compute alone, sampled
                self.planner.observe_idle(
                    worker_jobs.step_times(plan, None, time.perf_counter() - self._step_start_s, 0.0, True)
                )
            return
        step_s = time.perf_counter() - self._step_start_s if self._step_start_s else 0.0
        # compute alone: reads beside it (layer and group plans) slow it on a CPU host, which
        # their kind's finish factor accounts for, not every kind's compute estimate
        compute_alone = not (load is not None and not load.cancelled and load.plan.reads_beside_compute)
        if load is not None and not load.cancelled and not load.wait_finished(self.config.load_timeout_s):
            load.give_up(f"still running after {self.config.load_timeout_s:.1f} s")
            self._stats.load_timeouts += 1
        if plan is not None and self.planner is not None and step_s:
            self.planner.observe(worker_jobs.step_times(plan, self._load, step_s, self._step_wait_s, compute_alone))
        if load is not None:
            self.samples.observe(LOAD_WAIT_S, self._step_wait_s)
        if load is not None and plan is not None and not (self._waited or plan.loads_first):
            # attention ran over these loads without waiting (a CUDA graph replay, connector/graphs.py):
            # recomputed, their saves revoked; asynchronous loads need no wait
            unwaited = plan.load_block_ids(skip_req_ids=plan.async_req_ids)
            self._stats.load_unwaited_steps += bool(unwaited)
            self._failed.add(unwaited)
        if save is not None:
            if self.layout is not None and self._handoff.finish(self.layout.num_layers):
                self._stats.save_after_forward_steps += 1  # no per-layer hook ran: copied from the cache now
            save.finalize()
            if not save.wait_for(lambda: save.released, self.config.save_timeout_s):
                save.cancel()  # it revokes its sessions when the stuck call returns
                self._stats.save_timeouts += 1
                log.warning(
                    "layerkv: saves not copied / written within %.1f s; revoking them", self.config.save_timeout_s
                )
            elif plan is not None and not self.deployment.role.loads:
                self.commits.commit_now(plan.step_seq)  # a prefill server's objects: readable once written
        if load is not None:
            self._failed.add_unreported(load.failed_block_ids())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads are synchronous; a save never holds the engine's blocks

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed, each reported once (vLLM's speculative decoding asks before
        the draft layers ran and wait_for_save; later failures are reported the next time)."""
        if self._load is not None:
            # settled first: a load settled by now has published every failure read below
            self._failed.load_settled = self._load.settled()
            self._failed.add_unreported(self._load.failed_block_ids())
        return self._failed.take()

    def flush(self, timeout_s: float | None = None, *, given_up_loads: bool = False) -> bool:
        """Wait until every transfer this worker started has finished (background writes and
        commits included); True if it did within `timeout_s` (default save_timeout_s). The
        reference engine calls it when `generate` returns, so its saves are readable then. A
        load that gave up (stuck in the store) is waited for only with `given_up_loads`: its
        blocks were recomputed, and what it still reads lands in its own staging rows (with
        register_kv_cache and direct reads: in the cache, docs/data-safety.md §5)."""
        deadline = time.monotonic() + (self.config.save_timeout_s if timeout_s is None else timeout_s)
        jobs = [j for j in self._all_jobs() if given_up_loads or not (isinstance(j, LoadJob) and j.cancelled)]
        return all(job.wait_finished(max(0.0, deadline - time.monotonic())) for job in jobs)

    def loads_settled(self) -> bool:
        """This step's load (if any) has finished and published its failures."""
        return self._load is None or self._load.settled()

    def report_steps(self) -> tuple[int, ...]:
        """The step numbers this worker ran since the last call (normally the current one). A
        step whose load is still running (vLLM's speculative decoding reports before its draft
        layers loaded) is held back until a later call, so its late failures count for it."""
        # a load that settled after the last error report may have failures that report missed
        settled = self._failed.pop_load_settled(self._load.settled if self._load is not None else None)
        held = self._load is not None and not settled and bool(self._reported_steps)
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
            self._stats.revoked_on_shutdown += self.commits.drain("shutdown")
            # a job still running after the threads' join revokes what it holds when it returns
            # (it is cancelled); wait for it within save_timeout_s, then drain once more
            self.flush(given_up_loads=True)
            self._stats.revoked_on_shutdown += self.commits.drain("shutdown")
            self._ledger.collect(self._current())
            self._memory.unregister()

    def stats(self) -> WorkerStats:
        self._ledger.collect(self._current())
        snapshot = self._stats.copy()
        snapshot.revoked_unsettled += self.commits.expired()
        return snapshot

    def threads_alive(self) -> list[str]:
        """Names of this worker's transfer threads still running (none after shutdown)."""
        return [t.name for t in (self._recv, self._send, self._write) if t.is_alive]

    def is_idle(self, timeout_s: float = 0.0) -> bool:
        """No put session waits for a verdict and no job is running (after a drained engine);
        waits up to `timeout_s` for running jobs to finish."""
        deadline = time.monotonic() + timeout_s
        for job in self._all_jobs():
            job.wait_finished(max(0.0, deadline - time.monotonic()))
        return self.open_sessions() == {"pending_puts": 0, "running_jobs": 0}

    def open_sessions(self) -> dict[str, int]:
        """Sessions this worker holds now: put sessions waiting for a verdict, jobs running."""
        return {
            "pending_puts": self.commits.pending.num_keys(),
            "running_jobs": sum(1 for j in self._all_jobs() if not j.finished),
        }

    def gauges(self) -> dict[str, int]:
        """open_sessions now, and the staging bytes lent to jobs that have not finished (compute thread)."""
        areas = self._areas.all() if self._areas is not None else ()
        return {**self.open_sessions(), "staging_bytes_in_use": sum(a.rows_in_use() * a.width for a in areas)}

    # -- internals ------------------------------------------------------------------------
    def _start_loads(self, specs: tuple[BlockSpec, ...], num_tokens: int) -> LoadJob | None:
        assert self._jobs is not None
        job = self._jobs.start_loads(specs, num_tokens)
        if job is not None:
            self._recv.submit(job)
        else:  # no staging: the step's loads are recomputed
            self._failed.add({b for spec in specs for b in spec.block_ids})
        return job

    def _start_saves(self, step_seq: int, specs: tuple[BlockSpec, ...]) -> SaveJob | None:
        assert self._jobs is not None
        job = self._jobs.start_saves(step_seq, specs)
        if job is not None:
            # staged: copies on the send thread, writes on the write thread; direct: all on the
            # write thread, after this step's verdicts (a revoke always precedes a re-save)
            (self._send if job.is_staged else self._write).submit(job)
        return job

    def _current(self) -> list[worker_jobs.Job]:
        return [j for j in (self._load, self._save, self.commits.job) if j is not None]

    def _all_jobs(self) -> list[worker_jobs.Job]:
        """This step's jobs and those of ended steps not folded in yet."""
        return [*self._current(), *self._ledger.later]

    def _end_step(self) -> None:
        """Forget this step's jobs (a job still running is collected when it finishes). A step
        abandoned before wait_for_save cancels its jobs: its loads are not used, its saves are
        revoked."""
        if self._load is not None and not self._load.finished:
            self._load.give_up("the step ended before its loads finished")
        elif self._load is not None:
            self._load.order_compute()  # a layer nobody waited for: its device copies still come first
        if self._save is not None and not self._save.released:
            self._save.cancel()
        self._ledger.end_step(self._current())
        self._load = self._save = None
        self.commits.end_step()
