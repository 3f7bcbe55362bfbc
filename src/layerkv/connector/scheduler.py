"""Scheduler side of the connector: pool hit planning (the hit rule; the exists queries are
connector/lookup.py's), the per-step plan (blocks to load, new full blocks to save, planned
without a store call (connector/saved.py), and the commit verdicts of earlier steps, which
transfer/commit.py's `Verdicts` decides: a step's saves are committed only after every worker of
every rank and stage reported the step, and never those of a request whose block table held a
block that failed to load). Runs on the engine's scheduler thread only; no locks.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerkv.config import LayerKVConfig
from layerkv.connector.events import PoolEvent, PoolEvents
from layerkv.connector.lookup import PoolLookup
from layerkv.connector.prefill_wait import PREFIX_TOKENS, PrefillWaits, promised_tokens
from layerkv.connector.saved import SavedBlocks
from layerkv.connector.stats import LOOKUP_S, Samples, SchedulerStats
from layerkv.messages import BlockHash, Deployment, ReqId, RequestView, SchedulerStep, WorkerReport
from layerkv.metadata import BlockSpec, StepPlan
from layerkv.objects.keys import share_deployment, storage_role, tenant_namespace, tenant_namespaces, with_store_shards
from layerkv.objects.manifest import ManifestInfo, ManifestWriter
from layerkv.objects.tenant_key import tenant_keys
from layerkv.store.checked import CheckedStore
from layerkv.threads import NamedThreads, Task
from layerkv.transfer.commit import Verdicts

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingLoad:
    start_block: int
    num_blocks: int
    generations: tuple[int, ...]  # per block: the tenant key it is found under (PoolLookup.locate)


class SchedulerConnector:
    """The scheduler hooks (see hooks.SchedulerHooks) backed by a store."""

    def __init__(self, config: LayerKVConfig, deployment: Deployment, store: CheckedStore) -> None:
        deployment = with_store_shards(deployment, config.store_shards)
        self.config = config
        self.deployment = deployment
        self.store = store
        self._tenant_keys = tenant_keys(config.tenant_key_file)  # read once; never shown
        self._stats = SchedulerStats()
        self.samples = Samples()  # each lookup's seconds (vLLM's histograms); scheduler thread
        # each written namespace's manifest (layerkv pool), off the scheduler thread: a put has no time bound
        self._manifests = ManifestWriter(
            store,
            ManifestInfo.from_deployment(
                deployment, config.tenant, keyed=self._tenant_keys is not None, encrypted=config.encrypt_objects
            ),
        )
        self._manifest_thread = NamedThreads("layerkv-manifest", 1)
        self._manifest_task: Task[None] | None = None
        self._epoch = ""  # a new one at each reset_cache: the namespaces' and the plans'
        self._name_objects()
        self._block_size = deployment.scheduler_block_size  # tokens per block hash
        self._live: set[ReqId] = set()  # requests scheduled and not ended
        self._before_reset: set[ReqId] = set()  # live at a reset_cache: KV of the old weights, never saved
        self._matched: dict[ReqId, _PendingLoad] = {}  # from get_num_new_matched_tokens
        self._pending: dict[ReqId, BlockSpec] = {}  # from update_state_after_alloc
        self._ended: set[ReqId] = set()
        self._next_step_seq = 0
        # a step's verdict needs every TP rank's and pipeline stage's report (transfer/commit.py)
        self._verdicts = Verdicts(deployment.tp_size * deployment.pp_size, config.commit_timeout_s, self._stats)
        self._suspect: set[int] = set()  # block ids whose load failed and that nobody rewrote since
        self._waits = PrefillWaits(config.prefill_wait_s, self._stats)
        self._events = PoolEvents()  # what the pool holds, for routers (take_events)
        self._known = SavedBlocks()  # this engine's committed saves: planned again only once lost
        self._verdicts_in_flight = False  # verdicts went out in a step that computes (the workers do not wait for them)

    def _name_objects(self) -> None:
        """The namespaces of this epoch and the lookup over them."""
        config, deployment, keys = self.config, self.deployment, self._tenant_keys
        self.namespace = tenant_namespace(
            deployment, config.tenant, config.model_fingerprint, keys, config.encrypt_objects, self._epoch
        )
        # with pipeline parallelism each stage writes its own layers under its own namespace, with
        # decode context parallelism each CP rank its share of the tokens: one namespace per (stage,
        # CP rank), stage-major; after a key rotation each older key's too (read, never written)
        shares = [
            tenant_namespaces(
                share_deployment(deployment, s, c),
                config.tenant,
                config.model_fingerprint,
                keys,
                config.encrypt_objects,
                self._epoch,
            )
            for s in range(deployment.pp_size)
            for c in range(deployment.dcp_size)
        ]
        self._writing = tuple(generations[0] for generations in shares)  # each share's current-key namespace
        role = storage_role(deployment)
        self._lookup = PoolLookup(
            self.store, list(zip(*shares)), role.num_storage_ranks, config.exists_window_blocks, self._stats
        )

    def reset_cache(self) -> bool:
        """After new weights (vLLM's reset_prefix_cache(reset_connector=True)): no object written
        before is ever served. A fresh random epoch enters every namespace from the next plan on
        (the workers take it from StepPlan.epoch), so every earlier object is unreachable, this
        engine's and every other's; what was looked up is forgotten; requests running across the
        reset save nothing more (their KV attends to the old weights' KV). Called between steps
        on the scheduler thread. Objects written after the reset are this engine's alone until
        a restart: no other engine can know they share its new weights (docs/vllm.md)."""
        self._epoch = secrets.token_hex(8)
        self._name_objects()
        self._matched.clear()
        self._pending.clear()
        self._known.clear()  # the events forget the old namespace's saves waiting for verdicts
        self._before_reset |= self._live
        self._events.cleared()
        self._stats.cache_resets += 1
        log.info(
            "layerkv: cache reset: a new namespace %s; %d running requests save nothing more",
            self.namespace.name,
            len(self._live),
        )
        return True

    # -- hooks ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The pool's hit beyond `num_computed_tokens`; None ("ask again next step") while the
        prefix a prefill server promised in the request's kv_transfer_params is not all there
        yet, for up to prefill_wait_s (connector/prefill_wait.py)."""
        self._matched.pop(request.req_id, None)
        start_block, end_block = self._hit_range(request, num_computed_tokens)
        if start_block >= end_block:
            return 0, False
        promised = min(end_block, promised_tokens(request.kv_transfer_params) // self._block_size)
        waits = promised > start_block and self.config.prefill_wait_s > 0 and not self._waits.waited_out(request.req_id)
        if waits and self._waits.too_soon(request.req_id):
            return None, False
        self._stats.lookups += 1
        lookup_start_s = time.perf_counter()
        generations = self._lookup.count_hit_blocks(request.block_hashes, start_block, end_block)
        self.samples.observe(LOOKUP_S, time.perf_counter() - lookup_start_s)
        self._known.forget(request.block_hashes[start_block + len(generations) : end_block])  # computed: saved again
        if waits:
            if start_block + len(generations) < promised and self._waits.keep_waiting(request.req_id):
                return None, False
            self._waits.done(request.req_id)
        if not generations:
            return 0, False
        self._matched[request.req_id] = self._hit(start_block, generations)
        return len(generations) * self._block_size, False

    def may_hit(self, request: RequestView) -> bool:
        """A cheap hint before the lookup: is the request's first block in the pool (one exists
        query of that block)? False for a role that never loads, while the store is down, and for
        a prompt with no full block before its last token."""
        if self.store.is_down() or self._hit_range(request, 0)[1] < 1:
            return False
        return self._lookup.locate(request.block_hashes[:1])[0] >= 0

    def _hit_range(self, request: RequestView, num_computed_tokens: int) -> tuple[int, int]:
        """The hit rule: the blocks [start, end) a lookup may match: whole blocks after the
        computed tokens, keeping at least the last token for the engine to compute; (0, 0) for a
        role that never loads or computed tokens off a block boundary."""
        if not self.deployment.role.loads or num_computed_tokens % self._block_size:
            return 0, 0
        end = min((request.num_tokens - 1) // self._block_size, len(request.block_hashes))
        return num_computed_tokens // self._block_size, end

    def _hit(self, start_block: int, generations: Sequence[int]) -> _PendingLoad:
        self._stats.hit_blocks += len(generations)
        self._stats.hit_blocks_older_key += sum(1 for g in generations if g)
        return _PendingLoad(start_block, len(generations), tuple(generations) if any(generations) else ())

    def match_window(self, request: RequestView, num_computed_tokens: int, max_tokens: int | None = None) -> int:
        """A sliding-window group's hook in place of get_num_new_matched_tokens: the longest hit
        (tokens beyond `num_computed_tokens`, at most `max_tokens`) whose last
        `deployment.window_blocks` blocks are all in the pool; blocks before that window are
        never read by the group's layers (the engine gives them its null block). Asks one window
        per candidate end, moving the end to the last miss of the window before."""
        self._matched.pop(request.req_id, None)
        start_block, end_block = self._hit_range(request, num_computed_tokens)
        if max_tokens is not None:
            end_block = min(end_block, start_block + max_tokens // self._block_size)
        if end_block <= start_block:
            return 0
        window = max(1, self.deployment.window_blocks)
        self._stats.lookups += 1
        lookup_start_s = time.perf_counter()
        try:
            while end_block > start_block:
                first = max(start_block, end_block - window)
                found = self._lookup.locate(request.block_hashes[first:end_block])
                if min(found) >= 0:  # blocks before the window are the null block: not loaded
                    self._matched[request.req_id] = self._hit(start_block, [0] * (first - start_block) + found)
                    return (end_block - start_block) * self._block_size
                miss = first + max(i for i, g in enumerate(found) if g < 0)
                self._known.forget(request.block_hashes[miss:end_block])  # computed: saved again
                end_block = miss  # the hit ends before that miss
            return 0
        finally:
            self.samples.observe(LOOKUP_S, time.perf_counter() - lookup_start_s)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[int, ...], num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.req_id, None)
        if matched is None or num_external_tokens <= 0:
            return
        num_blocks = min(matched.num_blocks, num_external_tokens // self._block_size)
        first, last = matched.start_block, matched.start_block + num_blocks
        if last > len(block_ids):
            raise ValueError(
                f"request {request.req_id}: {len(block_ids)} blocks allocated, {last} needed for the pool hit"
            )
        self._pending[request.req_id] = BlockSpec(
            request.req_id,
            tuple(request.block_hashes[first:last]),
            tuple(block_ids[first:last]),
            matched.generations[:num_blocks],
        )

    def needs_every_request(self) -> bool:
        """Must the next step name every scheduled request (SchedulerStep.requests), not only
        those that are new or complete a block? Only while blocks whose load failed are
        suspect: any request attending to one is re-invalidated (_stale_blocks)."""
        return bool(self._suspect)

    def build_connector_meta(self, step: SchedulerStep) -> StepPlan:
        """This step's plan. With nothing to load or save and no verdict to carry, it costs no
        store call and nothing per running request (a decode step: SchedulerStep)."""
        loads = (
            tuple(self._pending.pop(req_id) for req_id in list(self._pending) if step.is_scheduled(req_id))
            if self._pending
            else ()
        )
        self._pending.clear()  # a hit whose request was not scheduled is planned again later
        saves = self._plan_saves(step) if self.deployment.role.saves and step.requests else ()
        if saves and (self._manifest_task is None or self._manifest_task.wait(0)):
            self._manifest_task = self._manifest_thread.submit(functools.partial(self._manifests.ensure, self._writing))
        ended = (
            frozenset(self._ended | step.finished_req_ids | step.preempted_req_ids)
            if self._ended or step.finished_req_ids or step.preempted_req_ids
            else frozenset()
        )
        self._ended.clear()
        self._live -= ended
        self._live.update(r.req_id for r in step.requests)  # a running request entered when it was new or resumed
        if self._before_reset and ended:
            self._before_reset -= {req_id for req_id in ended if not step.is_scheduled(req_id)}
        seq, self._next_step_seq = self._next_step_seq, self._next_step_seq + 1
        if saves:
            saving = {spec.req_id for spec in saves}
            self._verdicts.await_step(
                seq,
                {r.req_id: frozenset((*r.block_ids, *r.other_block_ids)) for r in step.requests if r.req_id in saving},
            )
        verdicts = self._verdicts.take()
        num_tokens = step.total_tokens()
        self._verdicts_in_flight = (self._verdicts_in_flight or bool(verdicts)) if num_tokens else False
        if verdicts:
            self._known.add(h for spec in self._events.decided(verdicts) for h in spec.block_hashes)
        self._events.planned(seq, loads, saves)
        self._stats.steps += 1
        if loads or saves:
            self._stats.load_blocks += sum(len(spec) for spec in loads)
            self._stats.save_blocks += sum(len(spec) for spec in saves)
        reinvalidate = self._stale_blocks(step, loads)
        return StepPlan(
            step_seq=seq,
            num_tokens=num_tokens,
            loads=loads,
            saves=saves,
            ended_req_ids=ended,
            verdicts=verdicts,
            reinvalidate=reinvalidate,
            epoch=self._epoch,
        )

    def _stale_blocks(self, step: SchedulerStep, loads: tuple[BlockSpec, ...]) -> frozenset[int]:
        """Suspect blocks a request of `step` attends to as already computed (an engine prefix-
        cache hit on a block whose load failed); blocks this step rewrites (loads or computes
        whole) stop being suspect."""
        if not self._suspect:
            return frozenset()
        bs = self._block_size
        written = {b for spec in loads for b in spec.block_ids}
        for r in step.requests:
            first = -(-r.num_computed_tokens // bs)  # blocks computed whole by this step
            last = (r.num_computed_tokens + r.num_scheduled_tokens) // bs
            written.update(r.block_ids[first:last])
        self._suspect -= written
        stale = {
            b
            for r in step.requests
            for b in r.block_ids[: r.num_computed_tokens // bs]
            if b in self._suspect and b not in written
        }
        self._stats.stale_blocks_reinvalidated += len(stale)
        return frozenset(stale)

    def update_connector_output(self, report: WorkerReport) -> None:
        """A step's combined worker output: its failed blocks, and the steps every worker has
        now reported are decided (Verdicts.report)."""
        self._stats.load_failures += len(report.invalid_block_ids)
        self._suspect |= report.invalid_block_ids
        self._events.failed(report.invalid_block_ids)
        self._verdicts.report(report.invalid_block_ids, report.reported_steps)

    def take_events(self) -> list[PoolEvent]:
        """Blocks stored, removed, or all cleared since the last call (connector/events.py)."""
        return self._events.take()

    def shutdown(self) -> None:
        """Stop the manifest thread (a write still inside the store is left to finish alone)."""
        self._manifest_thread.close(join_timeout_s=1.0)

    def stats(self) -> SchedulerStats:
        """Cumulative counters (the live object: read, do not keep for a snapshot)."""
        return self._stats

    def has_pending_work(self) -> bool:
        """True while a step's saves wait for their verdict or a decided verdict waits for the
        next step to carry it: the engine must keep stepping (with nothing scheduled) or the
        last step's objects are never committed. After verdicts went out in steps that compute
        tokens, one step with nothing scheduled: the workers wait for those commits in it (so
        they are in the pool, and in the stats, when the engine goes idle)."""
        return self._verdicts.pending() or self._verdicts_in_flight

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> tuple[bool, dict | None]:
        """Never holds the blocks (saves copy them out in the step). A role that saves names
        the prefix it commits, for a decode server (connector/prefill_wait.py): every full block
        of the prompt, unless the store is down (nothing is saved then)."""
        self._matched.pop(request.req_id, None)
        self._pending.pop(request.req_id, None)
        self._waits.forget(request.req_id)
        self._ended.add(request.req_id)
        prefix = request.num_prompt_tokens // self._block_size * self._block_size
        if not self.deployment.role.saves or prefix == 0 or self.store.is_down():
            return False, None
        return False, {PREFIX_TOKENS: prefix}

    # -- save planning --------------------------------------------------------------------
    def _plan_saves(self, step: SchedulerStep) -> tuple[BlockSpec, ...]:
        """New full blocks of this step, less those this engine knows it saved (SavedBlocks);
        never asks the store (a block someone else wrote is skipped by the worker's put start,
        off the engine's path). None while the store is down: nothing could be saved."""
        if self.store.is_down():
            return ()
        per_request: dict[ReqId, tuple[list[BlockHash], list[int]]] = {}
        seen: set[BlockHash] = set()
        known = self._known
        for request in step.requests:
            first = request.num_computed_tokens // self._block_size
            last = min(
                (request.num_computed_tokens + request.num_scheduled_tokens) // self._block_size,
                len(request.block_hashes),
                len(request.block_ids),
            )
            if not self.config.save_decode_blocks and request.num_prompt_tokens is not None:
                last = min(last, request.num_prompt_tokens // self._block_size)  # the prompt's blocks only
            if first >= last:
                continue
            if request.req_id in self._before_reset:
                self._stats.save_skipped_reset += 1
                continue
            for block in range(first, last):
                block_hash = request.block_hashes[block]
                if block_hash in seen:  # two requests computing the same block: save once
                    continue
                seen.add(block_hash)
                if block_hash in known:
                    self._stats.save_skipped_existing += 1
                    continue
                hashes, ids = per_request.setdefault(request.req_id, ([], []))
                hashes.append(block_hash)
                ids.append(request.block_ids[block])
        return tuple(BlockSpec(req_id, tuple(h), tuple(i)) for req_id, (h, i) in per_request.items())
