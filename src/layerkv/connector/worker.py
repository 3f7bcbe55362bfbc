"""Worker side of the connector (one per TP rank and pipeline stage): registers its staging areas
(its live KV cache only with register_kv_cache), turns each step's plan (its state: worker_step.py)
into a load job, a save job and the commits of earlier steps on its transfer threads
(worker_threads.py), and reports which blocks failed to load and which steps it ran
(failed_blocks.py). Hooks are called on the engine's compute thread; the jobs own their sessions
and publish outcomes the compute thread reads once they finished. Never raises into the engine
because of the store: a late layer is recomputed, a late save revoked.

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
from layerkv.connector.stats import LOAD_WAIT_S, Samples, WorkerStats
from layerkv.connector.worker_jobs import JobContext, JobFactory, JobLedger, check_block_size
from layerkv.connector.worker_step import WorkerStep
from layerkv.connector.worker_threads import WorkerThreads
from layerkv.errors import ConfigError, TransferError
from layerkv.messages import Deployment
from layerkv.metadata import StepPlan
from layerkv.objects.keys import storage_role, with_store_shards
from layerkv.objects.layout import CacheLayout
from layerkv.objects.tenant_key import tenant_keys
from layerkv.store.checked import CheckedStore
from layerkv.store.wheels import check_device_path
from layerkv.transfer.caches import RegisteredCaches
from layerkv.transfer.commit import Commits
from layerkv.transfer.load import LoadJob
from layerkv.transfer.memory import RegisteredMemory, memory_regions
from layerkv.transfer.planner import Planner
from layerkv.transfer.save import SaveJob
from layerkv.transfer.staging import StagingAreas
from layerkv.transfer.views import CacheViews

log = logging.getLogger(__name__)
# Save jobs of earlier steps still writing (each holds its staging slots); with this many, a step's
# saves are skipped: a write that never returns must not make every later step hold more rows.
# 4 still dropped 1-3 saves of healthy steps in the engine tier (~20 processes on 2 cores).
MAX_SAVES_IN_FLIGHT = 8


class WorkerConnector:
    """The worker hooks (see hooks.WorkerHooks) over a CheckedStore.

    * Loads: one LoadJob per step; it starts, renews and ends its get sessions on the receive
      thread. wait_for_layer_load returns when the layer is readable or, after `load_timeout_s`,
      with every block of the job reported invalid.
    * Saves: one SaveJob per step (put start, layer writes, headers with tags); its sessions
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
        self._epoch = ""  # StepPlan.epoch
        self.namespaces = worker_jobs.namespaces_for(config, deployment, self.tenant_keys, self._epoch)
        self.namespace = self.namespaces[0]  # the current key's: it writes; every key's namespace reads
        self.layout: CacheLayout | None = None
        self._jobs: JobFactory | None = None  # once the KV caches are registered
        self._names_per_layer: list[int] = []  # registered cache names of each layer
        self._stats = WorkerStats()  # compute thread only, from here on
        self.samples = Samples()  # per-step observations (connector/stats.py), compute thread; vLLM's histograms
        self._ledger = JobLedger(self._stats, self.samples)  # jobs whose outcomes are not counted yet
        self._failed = FailedBlocks()  # load failures for the engine, steps run for the scheduler
        self._step = WorkerStep()  # the bound step's plan, jobs and clock: a fresh one at each bind
        self._areas: StagingAreas | None = None  # registered rows, one job at a time (once registered)
        self._closed = False  # compute thread: shutdown() ran
        self.planner: Planner | None = None  # once the KV caches are registered (compute thread)
        # the write thread, when idle, revokes the steps whose verdict is late
        self._threads = WorkerThreads.named(
            deployment, shard if len(ranks) > 1 else None, lambda: self.commits.expire()
        )
        self.commits = Commits(store, self._threads.write, config.commit_timeout_s)
        self._context = JobContext(
            config=config,
            store=store,
            storage_rank=self.storage_rank,
            load_lanes=self._threads.load_lanes,
            save_lanes=self._threads.save_lanes,
            commits=self.commits,
            stats=self._stats,
        )
        self._memory = RegisteredMemory(
            store, config.store_retry_interval_s, f"rank {deployment.tp_rank}", self._threads.write.submit
        )

    # -- registration ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks!r} must be a positive int")
        self.layout = CacheLayout.from_caches(kv_caches, num_blocks, max_transfer_bytes=self.config.max_transfer_bytes)
        check_block_size(self.layout, self.deployment.block_size)
        check_device_path(self.layout.device_type, self.config.register_kv_cache)  # device KV: staging only
        self._names_per_layer = [len({e.layer_name for e in layer}) for layer in self.layout.layers]
        direct = self.config.register_kv_cache
        self._areas = StagingAreas.for_layout(self.layout, self.config.staging_nbytes, direct)
        caches = RegisteredCaches.over(CacheViews(self.layout, kv_caches), self._areas)
        self._jobs = JobFactory.over(self._context, caches, self.namespaces, self.tenant_keys)
        self.planner = self._jobs.planner
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
        self._step = WorkerStep(meta)
        self._failed.new_step(meta.step_seq if meta is not None else None)

    def _take_epoch(self, epoch: str) -> None:
        """A cache reset's epoch (SchedulerConnector.reset_cache) names this step's jobs' objects on."""
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self.namespaces = worker_jobs.namespaces_for(self.config, self.deployment, self.tenant_keys, epoch)
        self.namespace = self.namespaces[0]
        self._jobs = self._jobs.renamed(self.namespaces, self.tenant_keys) if self._jobs is not None else None

    def start_load_kv(self) -> None:
        plan = self._step.plan
        if plan is None:
            return
        self._step.begin()
        if self._closed:  # after shutdown: no transfers; loads are recomputed
            self._fail_loads()
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
                self._fail_loads()
            return
        if plan.loads and self.deployment.role.loads:
            self._start_loads(plan)
        if plan.saves and self.deployment.role.saves and self.storage_role.writes:
            self._start_saves(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step.load is None and not step.handoff.pending:  # nothing to wait for or hand over: free
            return
        if self.layout is None:
            return
        layer_idx = self.layout.layer_index(layer_name)
        step.handoff.passed(layer_idx)
        job = step.load
        if job is not None and not job.cancelled:
            step.layer_waited = True
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
        self._step.wait_s += waited

    def save_kv_layer(self, layer_name: str) -> None:
        if self.layout is None or self._step.save is None:
            return
        self._step.handoff.saved(self.layout.layer_index(layer_name))

    def wait_for_save(self) -> None:
        """End of the forward: loads must be over (their failures go to the scheduler) and the
        save must no longer read the KV cache (staged: every layer copied; direct: written).
        Remote writes of staged saves and the plan's commits go on in the background. Bounded."""
        step = self._step
        load, save, plan = step.load, step.save, step.plan
        if load is None and save is None:  # nothing moved (a decode step)
            if plan is not None and plan.num_tokens == 0 and not (plan.loads or plan.saves):
                self.commits.finish_idle_step(self.config.save_timeout_s)  # the engine steps only to commit
            elif plan is not None and self.planner is not None and step.start_s:  # compute alone, sampled
                self.planner.observe_idle(step.times(step.elapsed_s(), compute_alone=True))
            return
        step_s = step.elapsed_s()
        # compute alone: reads beside it (layer and group plans) slow it on a CPU host, which
        # their kind's finish factor accounts for, not every kind's compute estimate
        compute_alone = not (load is not None and not load.cancelled and load.plan.reads_beside_compute)
        if load is not None and not load.cancelled and not load.wait_finished(self.config.load_timeout_s):
            load.give_up(f"still running after {self.config.load_timeout_s:.1f} s")
            self._stats.load_timeouts += 1
        if plan is not None and self.planner is not None and step_s:
            self.planner.observe(step.times(step_s, compute_alone))
        if load is not None:
            self.samples.observe(LOAD_WAIT_S, step.wait_s)
        unwaited = step.unwaited_block_ids()  # recomputed, their saves revoked
        self._stats.load_unwaited_steps += bool(unwaited)
        self._failed.add(unwaited)
        if save is not None:
            if self.layout is not None and step.handoff.finish(self.layout.num_layers):
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
        load = self._step.load
        if load is not None:
            # settled first: a load settled by now has published every failure read below
            self._failed.load_settled = load.settled()
            self._failed.add_unreported(load.failed_block_ids())
        return self._failed.take()

    def flush(self, timeout_s: float | None = None, *, given_up_loads: bool = False) -> bool:
        """Wait until every transfer this worker started has finished (background writes and
        commits included); True if it did within `timeout_s` (default save_timeout_s). The
        reference engine calls it when `generate` returns, so its saves are readable then. A
        load that gave up (stuck in the store) is waited for only with `given_up_loads`: its
        blocks were recomputed, and what it still reads lands in its own staging slots (with
        register_kv_cache and direct reads: in the cache, docs/data-safety.md §5)."""
        timeout_s = self.config.save_timeout_s if timeout_s is None else timeout_s
        return self._ledger.wait_finished(self._current(), timeout_s, given_up_loads=given_up_loads)

    def loads_settled(self) -> bool:
        """This step's load (if any) has finished and published its failures."""
        return self._step.load is None or self._step.load.settled()

    def report_steps(self) -> tuple[int, ...]:
        """The step numbers this worker ran since the last call (normally the current one). A
        step whose load is still running (vLLM's speculative decoding reports before its draft
        layers loaded) is held back until a later call, so its late failures count for it."""
        load = self._step.load
        return self._failed.take_steps(load.settled if load is not None else None)

    def clear_connector_metadata(self) -> None:
        self._end_step()
        self._step = WorkerStep()

    def shutdown(self) -> None:
        """Stop the transfer threads (running jobs close their sessions), revoke every put
        session still waiting for a verdict, unregister memory. Idempotent; hooks called
        afterwards do nothing."""
        self._closed = True
        try:
            self._end_step()
        finally:
            self._threads.close()
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
        return self._threads.alive()

    def is_idle(self, timeout_s: float = 0.0) -> bool:
        """No put session waits for a verdict and no job is running (after a drained engine);
        waits up to `timeout_s` for running jobs to finish."""
        self._ledger.wait_finished(self._current(), timeout_s, given_up_loads=True)
        return self.open_sessions() == {"pending_puts": 0, "running_jobs": 0}

    def open_sessions(self) -> dict[str, int]:
        """Sessions this worker holds now: put sessions waiting for a verdict, jobs running."""
        return {
            "pending_puts": self.commits.pending.num_keys(),
            "running_jobs": self._ledger.num_running(self._current()),
        }

    def gauges(self) -> dict[str, int]:
        """open_sessions now, and the staging bytes lent to jobs that have not finished (compute thread)."""
        areas = self._areas.all() if self._areas is not None else ()
        return {**self.open_sessions(), "staging_bytes_in_use": sum(a.slots_in_use() * a.width for a in areas)}

    # -- internals ------------------------------------------------------------------------
    def _fail_loads(self) -> None:
        """Every block this step's plan loads is reported failed: the engine recomputes it."""
        if self._step.plan is not None:
            self._failed.add(self._step.plan.load_block_ids())

    def _start_loads(self, plan: StepPlan) -> None:
        """This step's load job, on the receive thread; none (the loads recomputed) while an
        earlier load is still inside the store or no staging slot is free."""
        if self._ledger.stuck(LoadJob):  # recompute, don't queue behind it
            self._fail_loads()
            self._stats.load_skipped_stuck += 1
            return
        assert self._jobs is not None
        job = self._step.load = self._jobs.start_loads(plan.loads, plan.num_tokens)
        if job is None:
            self._fail_loads()
            return
        self._threads.recv.submit(job)
        if plan.loads_first and self.layout is not None:
            self._wait_layer(job, self.layout.num_layers - 1)  # a decode-shaped step: no layer will wait

    def _start_saves(self, plan: StepPlan) -> None:
        """This step's save job; skipped (counted) while an earlier save is stuck in the store,
        the store is down or MAX_SAVES_IN_FLIGHT saves of earlier steps still write."""
        if self._ledger.stuck(SaveJob) or self.store.is_down() or self._ledger.saves_in_flight() >= MAX_SAVES_IN_FLIGHT:
            self._stats.save_skipped_steps += 1
            self._stats.save_skipped_keys += sum(map(len, plan.saves))
            return
        assert self._jobs is not None
        job = self._step.save = self._jobs.start_saves(plan.step_seq, plan.saves)
        if job is None:
            return
        # staged: copies on the send thread, writes on the write thread; direct: all on the
        # write thread, after this step's verdicts (a revoke always precedes a re-save)
        (self._threads.send if job.is_staged else self._threads.write).submit(job)
        self.commits.saving(plan.step_seq)
        self._step.handoff.start(job, self._names_per_layer, self._jobs.caches.views.copies.compute_marker)

    def _current(self) -> list[worker_jobs.Job]:
        return [j for j in (*self._step.jobs(), self.commits.job) if j is not None]

    def _end_step(self) -> None:
        """Forget this step's jobs (WorkerStep.end: a step abandoned before wait_for_save cancels
        them); a job still running is collected when it finishes."""
        ended = self._step.end()
        self._ledger.end_step([j for j in (*ended, self.commits.job) if j is not None])
        self.commits.end_step()
