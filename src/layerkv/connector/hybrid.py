"""KV cache groups (hybrid models): one engine-neutral scheduler and worker connector per group,
composed so that an engine sees one connector. vLLM's hybrid KV cache manager gives each group of
layers its own block table (sliding-window layers one, full-attention layers another); each
group's blocks are one object per (block, storage rank) holding that group's layers, under the
group's own namespace (its index and spec are in its `Deployment.kv_signature`).

The hit is the longest prefix every group can provide (each group asked for the whole prefix: a
sliding-window group's objects of the blocks outside its window are asked for too, see
`GroupedScheduler.get_num_new_matched_tokens`). Blocks the engine did not allocate for a group
(vLLM's null block stands for a sliding-window block outside the window) are neither loaded nor
saved. A request whose load failed in any group taints its saves in every group: each group's
step carries the block ids of the request's other groups (`ScheduledRequest.other_block_ids`,
the engine adapter fills it), every group sees every failed block, and a step is reported to the
scheduler only once every group's worker ran it. With one group the calls are passed through, but
for the loads that run before a request's first step (`load_async`, and hits that keep full CUDA
graphs): connector/async_loads.py. Scheduler hooks on the scheduler thread, worker hooks on the
compute thread (as hooks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from layerkv.connector.async_loads import AsyncLoads, AsyncReceives
from layerkv.connector.hooks import SchedulerHooks, WorkerHooks
from layerkv.connector.prefill_wait import PREFIX_TOKENS, promised_tokens
from layerkv.connector.stats import SchedulerStats, WorkerStats
from layerkv.messages import ReqId, RequestView, SchedulerStep, WorkerReport
from layerkv.metadata import BlockSpec, StepPlan


@dataclass(frozen=True, slots=True)
class GroupedPlan:
    """One step's metadata: each group's plan, in group order."""

    plans: tuple[Any, ...]

    @property
    def loads(self) -> tuple[BlockSpec, ...]:
        return tuple(spec for plan in self.plans for spec in getattr(plan, "loads", ()))


def _without_blocks(plan: Any, skip: frozenset[int]) -> Any:
    """`plan` with the block ids in `skip` (blocks the engine did not allocate) left out."""
    if not skip or not isinstance(plan, StepPlan):
        return plan

    def keep(specs: tuple[BlockSpec, ...]) -> tuple[BlockSpec, ...]:
        if skip.isdisjoint(b for spec in specs for b in spec.block_ids):
            return specs
        out = []
        for spec in specs:
            gens = spec.generations or (0,) * len(spec)
            kept = [(h, b, g) for h, b, g in zip(spec.block_hashes, spec.block_ids, gens) if b not in skip]
            if kept:
                hashes, ids, generations = (tuple(column) for column in zip(*kept))
                out.append(BlockSpec(spec.req_id, hashes, ids, generations if any(generations) else ()))
        return tuple(out)

    return dataclasses.replace(plan, loads=keep(plan.loads), saves=keep(plan.saves))


class GroupedScheduler:
    """Scheduler hooks over one sub-scheduler per KV cache group; block ids come per group."""

    def __init__(
        self,
        subs: Sequence[SchedulerHooks],
        skip_block_ids: frozenset[int] = frozenset(),
        windows: Sequence[int] | None = None,
        load_async: bool = False,
        replayed: tuple[int, bool] = (0, False),
    ) -> None:
        if not subs:
            raise ValueError("GroupedScheduler needs at least one group")
        self.subs = tuple(subs)
        self._skip = skip_block_ids
        self._async = AsyncLoads(load_async, replayed)  # hits loaded before their request's first step
        # per group: 0 (every block of a hit) or a sliding window's blocks (SchedulerConnector.match_window)
        self._windows = tuple(windows) if windows is not None else (0,) * len(self.subs)
        self._check(self._windows)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The longest prefix for which every group is complete: each full group holds every
        block of it, each sliding-window group the blocks of the window that ends at it. Full
        groups first (their hits are prefixes: the shortest bounds all); then each window group
        lowers the hit to its longest complete window at or below it, until none does. A group
        not asked because the hit fell to 0 drops any stale match at allocation (0 external
        tokens)."""
        if self._async.refused(request.req_id):
            return 0, False
        hit = self._hit(request, num_computed_tokens)
        if hit is None:  # a full group waits for a prefill server's prefix: ask again
            return None, False
        return hit, self._async.decide(request, num_computed_tokens, hit)

    @property
    def load_async(self) -> bool:
        """Every hit loads before its request's first step (connector/async_loads.py)."""
        return self._async.load_async

    def may_load_async(self, request: RequestView) -> bool:
        """Would `get_num_new_matched_tokens` answer an asynchronous load for `request`? Asked as
        a request enters the engine's waiting queues (vLLM 0.34 keeps such requests in a queue of
        their own under --max-num-inflight-kv-loads), so it must be cheap: only with
        `load_async`, never for a request whose load failed, and then whether the first full
        group holds the request's first block (one exists query, `may_hit`). It may be wrong
        either way (the engine's own cache may cover that block, the pool may change before
        the lookup): the engine only queues the request differently."""
        if not self.load_async or self._async.refused(request.req_id):
            return False
        sub = next((s for s, window in zip(self.subs, self._windows) if not window), self.subs[0])
        return bool(getattr(sub, "may_hit", lambda _request: False)(request))

    def _hit(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """The hit in tokens; None while a full group asks to be asked again."""
        hit: int | None = None
        for sub, window in zip(self.subs, self._windows):
            if not window:
                tokens, _ = sub.get_num_new_matched_tokens(request, num_computed_tokens)
                if tokens is None:
                    return None
                hit = tokens if hit is None else min(hit, tokens)
                if hit == 0:
                    return 0
        windowed = [sub for sub, window in zip(self.subs, self._windows) if window]
        settled: set[int] = set()
        while windowed and len(settled) < len(windowed):
            for i, sub in enumerate(windowed):
                if i in settled:
                    continue
                tokens = sub.match_window(request, num_computed_tokens, hit)  # type: ignore[attr-defined]
                if hit is not None and tokens < hit:
                    settled = set()  # a lower hit: the others' windows end elsewhere now
                hit = tokens
                settled.add(i)
                if hit == 0:
                    return 0
        return hit or 0

    def needs_every_request(self) -> bool:
        """Must the step name every scheduled request (SchedulerStep)? When any group asks
        (SchedulerConnector.needs_every_request; a group that cannot say, always)."""
        return any([getattr(sub, "needs_every_request", lambda: True)() for sub in self.subs])

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[tuple[int, ...]], num_external_tokens: int
    ) -> None:
        self._check(block_ids)
        for sub, ids in zip(self.subs, block_ids):
            sub.update_state_after_alloc(request, tuple(ids), num_external_tokens)
        self._async.allocated(request, block_ids, num_external_tokens)

    def build_connector_meta(self, steps: Sequence[SchedulerStep]) -> Any:
        self._check(steps)
        steps, loading = self._async.with_loading(steps)
        plans = tuple(
            self._async.mark(_without_blocks(sub.build_connector_meta(step), self._skip), step, loading)
            for sub, step in zip(self.subs, steps)
        )
        return plans[0] if len(plans) == 1 else GroupedPlan(plans)

    def update_connector_output(self, report: WorkerReport) -> None:
        self._async.failed(report.failed_recving)
        for sub in self.subs:
            sub.update_connector_output(report)

    def request_finished(
        self, request: RequestView, block_ids: Sequence[tuple[int, ...]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._check(block_ids)
        self._async.forget(request.req_id)
        promised: list[int] = []
        for sub, ids in zip(self.subs, block_ids):
            _, params = sub.request_finished(request, tuple(ids))
            promised.append(promised_tokens(params))
        # the prefix every group commits (each rounds to its own block size)
        return (False, {PREFIX_TOKENS: min(promised)}) if promised and min(promised) > 0 else (False, None)

    def has_pending_work(self) -> bool:
        return any(sub.has_pending_work() for sub in self.subs)

    def take_events(self) -> list[tuple[int, Any]]:
        """(group index, PoolEvent) of every group since the last call."""
        return [(g, event) for g, sub in enumerate(self.subs) for event in getattr(sub, "take_events", list)()]

    def reset_cache(self) -> bool:
        """Every group's (SchedulerConnector.reset_cache); False when a group cannot reset."""
        return all([bool(getattr(sub, "reset_cache", lambda: False)()) for sub in self.subs])

    def stats(self) -> SchedulerStats | None:
        """Counters summed over the groups (a lookup asks each group: counted once per group)."""
        return _summed(self.subs, SchedulerStats)

    def shutdown(self) -> None:
        _each(getattr(sub, "shutdown", lambda: None) for sub in self.subs)

    def _check(self, per_group: Sequence[Any]) -> None:
        if len(per_group) != len(self.subs):
            raise ValueError(f"{len(per_group)} KV cache groups given, the connector has {len(self.subs)}")


class GroupedWorker:
    """Worker hooks over one sub-worker per KV cache group; layers routed by name."""

    def __init__(
        self, subs: Sequence[WorkerHooks], layer_names: Sequence[Sequence[str]], load_async: bool = False
    ) -> None:
        if not subs or len(subs) != len(layer_names):
            raise ValueError(f"{len(subs)} workers for {len(layer_names)} KV cache groups")
        self.subs = tuple(subs)
        self._group_of = {name: g for g, names in enumerate(layer_names) for name in names}
        self._unreported: list[list[int]] = [[] for _ in subs]  # steps each group ran, not yet reported
        self._receiving = AsyncReceives(self.subs, load_async)  # loads run before their request's first step

    @property
    def load_async(self) -> bool:
        """Every load runs before its request's first step (connector/async_loads.py)."""
        return self._receiving.load_async

    def _sub(self, layer_name: str) -> WorkerHooks:
        if len(self.subs) == 1:
            return self.subs[0]
        return self.subs[self._group_of[layer_name]]

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        if len(self.subs) == 1:
            self.subs[0].register_kv_caches(kv_caches, num_blocks)
            return
        unknown = sorted(set(kv_caches) - set(self._group_of))
        if unknown:
            raise ValueError(f"KV cache layers in no KV cache group: {', '.join(unknown)}")
        for g, sub in enumerate(self.subs):
            sub.register_kv_caches({n: t for n, t in kv_caches.items() if self._group_of[n] == g}, num_blocks)

    def bind_connector_metadata(self, meta: Any) -> None:
        if len(self.subs) == 1:
            plans: tuple[Any, ...] = (meta,)
        else:
            if meta is not None and not isinstance(meta, GroupedPlan):
                raise TypeError(
                    f"layerkv grouped worker got metadata of type {type(meta).__name__}, expected GroupedPlan"
                )
            plans = meta.plans if meta is not None else (None,) * len(self.subs)
            if len(plans) != len(self.subs):
                raise ValueError(f"a plan for {len(plans)} KV cache groups, the worker has {len(self.subs)}")
        for g, (sub, plan) in enumerate(zip(self.subs, plans)):
            sub.bind_connector_metadata(plan)
            self._receiving.bound(g, plan)

    def start_load_kv(self) -> None:
        for sub in self.subs:
            sub.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._sub(layer_name).wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        self._sub(layer_name).save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        for sub in self.subs:
            sub.wait_for_save()

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId] | None, set[ReqId] | None]:
        sending: set[ReqId] = set()
        recving: set[ReqId] = set()
        for sub in self.subs:
            done_sending, done_recving = sub.get_finished(finished_req_ids)
            sending |= done_sending or set()
            recving |= done_recving or set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.load_async:  # failures go to the requests (transfer_results), never as blocks
            self._receiving.collect_failures()
            return set()
        return set().union(*(sub.get_block_ids_with_load_errors() for sub in self.subs))

    def transfer_results(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        """(finished sending, finished receiving, failed receiving) for vLLM's
        get_transfer_results: every request whose load ran before its first step finishes
        receiving once every group's loads are over; with load_async, those with a failed block
        in any group failed (AsyncReceives.results)."""
        sending, recving = self.get_finished(finished_req_ids)
        done, failed = self._receiving.results(recving)
        return set(sending or ()), done, failed

    def report_steps(self) -> tuple[int, ...]:
        """Steps every group's worker ran (a group still loading holds its step back, and so the
        step's verdict waits for that group's failures too)."""
        if len(self.subs) == 1:
            return self.subs[0].report_steps()
        for pending, sub in zip(self._unreported, self.subs):
            pending.extend(sub.report_steps())
        ready = set(self._unreported[0]).intersection(*self._unreported[1:])
        for pending in self._unreported:
            pending[:] = [s for s in pending if s not in ready]
        return tuple(sorted(ready))

    def clear_connector_metadata(self) -> None:
        for sub in self.subs:
            sub.clear_connector_metadata()

    def shutdown(self) -> None:
        _each(sub.shutdown for sub in self.subs)

    def flush(self, timeout_s: float | None = None) -> bool:
        return all([sub.flush(timeout_s) for sub in self.subs])

    def is_idle(self, timeout_s: float = 0.0) -> bool:
        """Every group's worker is idle (WorkerConnector.is_idle); test doubles count as idle."""
        return all([getattr(sub, "is_idle", lambda t: True)(timeout_s) for sub in self.subs])

    def threads_alive(self) -> list[str]:
        return [name for sub in self.subs for name in getattr(sub, "threads_alive", list)()]

    def stats(self) -> WorkerStats | None:
        return _summed(self.subs, WorkerStats)


_Stats = TypeVar("_Stats", SchedulerStats, WorkerStats)


def _summed(subs: Sequence[Any], cls: type[_Stats]) -> _Stats | None:
    """The groups' `stats()` summed (the one group's own object with one group); None when no
    group has stats (test doubles)."""
    parts = [s() for s in (getattr(sub, "stats", None) for sub in subs) if s is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    total = cls()
    for part in parts:
        total.add(part)
    return total


def _each(calls: Iterable[Callable[[], Any]]) -> None:
    """Call every one (each group is shut down), then raise the first error."""
    errors = []
    for call in calls:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the others still run
            errors.append(exc)
    if errors:
        raise errors[0]
