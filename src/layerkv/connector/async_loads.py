"""Loads that run before a request's first step (asynchronous loads), for the grouped connector
(connector/hybrid.py): which hits load that way, the step that runs each such load, and which
requests finished (or failed) receiving.

`load_async` (what vLLM needs for a model with several KV cache groups): vLLM 0.32 to 0.34
cannot map a failed block back to a request when there are several groups (`invalid_block_ids`
stops the engine core), and recovers a failed load only for a request that waits for its load
(`failed_recving`: it recomputes the request from token 0). So with `load_async` the prefix is
loaded before the request's first step, whole: the hit is reported asynchronous, the load runs in
the next engine step (with the request added to that step's plans, 0 tokens scheduled) and ends
within it; the worker reports the request finished receiving, and failed if any block of any
group failed (never as invalid blocks); a request whose load failed is not offered the pool again.

The same mechanism, per request, keeps full CUDA graphs (connector/graphs.py, any number of
groups): a hit that leaves a decode step's worth to compute loads before the request's first step;
with one group its failed blocks are reported as usual (vLLM truncates the hit and recomputes from
there). Plans name these requests (`StepPlan.async_req_ids`) and mark `loads_first`.

`AsyncLoads` on the scheduler thread, `AsyncReceives` on the compute thread (the grouped hooks'
threads, hooks.py); no locks. Neither calls the store: a load's failures come from the workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from layerkv.connector.graphs import loads_before_scheduling, mark
from layerkv.connector.hooks import WorkerHooks
from layerkv.messages import ReqId, RequestView, ScheduledRequest, SchedulerStep

BlockIds = tuple[tuple[int, ...], ...]  # a request's block ids, per KV cache group


class AsyncLoads:
    """Scheduler side: the hits that load before their request's first step, from the lookup to
    the step that plans their load, and the requests whose such load failed."""

    def __init__(self, load_async: bool, replayed: tuple[int, bool]) -> None:
        self.load_async = load_async  # every hit loads before its request's first step
        # steps the engine may replay as one CUDA graph: (a decode step's tokens per request, any step) (graphs.py)
        self.decode_tokens, self._replays_any = replayed
        self._local: dict[ReqId, int] = {}  # asynchronous hits: the engine's own computed tokens before them
        self._loading: dict[ReqId, tuple[RequestView, BlockIds, int]] = {}  # allocated: the next step plans them
        self._failed: set[ReqId] = set()  # loads that failed: recomputed, not offered the pool again

    def refused(self, req_id: ReqId) -> bool:
        """The request's asynchronous load failed: the pool is not offered to it again."""
        return req_id in self._failed

    def decide(self, request: RequestView, num_computed_tokens: int, hit_tokens: int) -> bool:
        """Does the hit load before the request's first step? With `load_async` every hit; else
        a hit that leaves a decode step's worth to compute (connector/graphs.py): that step may
        run as one CUDA graph, without the per-layer waits."""
        load_async = hit_tokens > 0 and (
            self.load_async
            or loads_before_scheduling(request.num_tokens - num_computed_tokens - hit_tokens, self.decode_tokens)
        )
        if load_async:
            self._local[request.req_id] = num_computed_tokens
        return load_async

    def allocated(self, request: RequestView, block_ids: Sequence[tuple[int, ...]], num_external_tokens: int) -> None:
        """The engine allocated the request's blocks: an asynchronous hit's load is planned in the
        next step (none with 0 external tokens)."""
        local = self._local.pop(request.req_id, None)
        if local is not None and num_external_tokens > 0:
            self._loading[request.req_id] = (request, tuple(map(tuple, block_ids)), local + num_external_tokens)

    def with_loading(self, steps: Sequence[SchedulerStep]) -> tuple[Sequence[SchedulerStep], frozenset[ReqId]]:
        """Each group's step plus the requests whose asynchronous load this step runs (the engine
        does not schedule them until they finished receiving): 0 tokens scheduled, all loaded;
        and those requests (then forgotten here)."""
        loading, self._loading = self._loading, {}
        if not loading:
            return steps, frozenset()
        out = []
        for g, step in enumerate(steps):
            scheduled = {r.req_id for r in step.requests}
            extra = tuple(
                ScheduledRequest(
                    req_id,
                    ids[g],
                    computed,
                    0,
                    view.block_hashes,
                    other_block_ids=tuple(b for h, other in enumerate(ids) if h != g for b in other),
                )
                for req_id, (view, ids, computed) in loading.items()
                if req_id not in scheduled
            )
            out.append(dataclasses.replace(step, requests=step.requests + extra))
        return out, frozenset(loading)

    def mark(self, plan: Any, step: SchedulerStep, loading: frozenset[ReqId]) -> Any:
        """A group's plan with its asynchronous loads named and `loads_first` set (graphs.mark)."""
        return mark(plan, step, loading, self.decode_tokens, self._replays_any)

    def failed(self, req_ids: frozenset[ReqId]) -> None:
        """Requests the workers reported failed receiving (WorkerReport.failed_recving)."""
        self._failed |= req_ids

    def forget(self, req_id: ReqId) -> None:
        """The request ended (request_finished)."""
        self._loading.pop(req_id, None)
        self._local.pop(req_id, None)
        self._failed.discard(req_id)


class AsyncReceives:
    """Worker side: the requests whose load ran before their first step, per group their block
    ids, until reported finished receiving; with `load_async`, those with a failed block."""

    def __init__(self, subs: Sequence[WorkerHooks], load_async: bool) -> None:
        self._subs = subs  # one worker per KV cache group
        self.load_async = load_async  # every load runs before its request's first step
        self._receiving: dict[ReqId, list[set[int]]] = {}
        self._failed: set[ReqId] = set()  # load_async: requests with a failed block in some group

    def bound(self, group: int, plan: Any) -> None:
        """Group `group`'s worker was bound to `plan`: its asynchronous loads are followed."""
        asynchronous: frozenset[ReqId] = getattr(plan, "async_req_ids", frozenset())
        if asynchronous or self.load_async:  # loaded before the request's first step: reported finished receiving
            for spec in getattr(plan, "loads", ()):
                if self.load_async or spec.req_id in asynchronous:
                    blocks = self._receiving.setdefault(spec.req_id, [set() for _ in self._subs])
                    blocks[group].update(spec.block_ids)

    def collect_failures(self) -> None:
        """load_async: the requests whose blocks any group's worker reports failed (asked of it
        once: its failures go to the requests, never to the engine as blocks)."""
        for g, sub in enumerate(self._subs):
            invalid = sub.get_block_ids_with_load_errors()
            if invalid:
                self._failed |= {req for req, blocks in self._receiving.items() if blocks[g] & invalid}

    def results(self, recving: set[ReqId] | None) -> tuple[set[ReqId], set[ReqId]]:
        """(finished receiving, failed receiving): `recving` and, once every group's loads
        settled, every request followed here; with `load_async` those with a failed block in
        any group failed (a failed request is also finished: vLLM releases it and recomputes it
        from token 0). Without it the failures are blocks, reported as usual."""
        done = set(recving or ())
        if not self.load_async:
            if self._receiving and self._settled():
                done |= set(self._receiving)
                self._receiving.clear()
            return done, set()
        self.collect_failures()
        if not self._settled():
            return done, set()
        done |= set(self._receiving)
        failed = self._failed & done
        self._receiving.clear()
        self._failed -= failed
        return done, failed

    def _settled(self) -> bool:
        return all(getattr(sub, "loads_settled", lambda: True)() for sub in self._subs)
