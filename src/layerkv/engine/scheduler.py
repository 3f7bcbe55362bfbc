"""The reference engine's vLLM-v1-like scheduler: token budget per step, chunked prefill, local
prefix caching, greedy decode, preemption (newest running request first, recomputed later) and
vLLM's load-failure recovery; it calls the connector's scheduler hooks in vLLM's order.
Scheduler side; only the engine's scheduler thread (the caller of Engine.step) touches it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from layerkv.connector.hooks import SchedulerHooks
from layerkv.engine.block_pool import BlockPool
from layerkv.engine.request import Request, RequestStatus
from layerkv.errors import UnsupportedSetupError
from layerkv.messages import ReqId, ScheduledRequest, SchedulerStep, WorkerReport


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """What the runner computes for one request in one step."""

    req_id: ReqId
    token_ids: tuple[int, ...]  # the tokens computed in this step
    start_token: int  # position of token_ids[0] == num_computed_tokens before the step
    block_ids: tuple[int, ...]  # all of the request's blocks, in token order
    num_external_tokens: int  # loaded by the connector in this step
    resumed: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    connector_step: SchedulerStep
    connector_meta: Any


@dataclass(frozen=True, slots=True)
class StepResult:
    finished: tuple[Request, ...]
    discarded_req_ids: frozenset[ReqId]


class Scheduler:
    def __init__(
        self, hooks: SchedulerHooks, num_blocks: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.hooks = hooks
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size  # tokens per engine block (one block hash; block_size * dcp_size per rank)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[ReqId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in scheduling order: the last one is preempted first
        self._finished_since_last_step: set[ReqId] = set()
        self.num_asked_later = 0  # waiting requests the connector asked to ask again (last schedule)

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Requests to run, finished ids the workers have not been told yet, or connector work
        that needs more steps (as vLLM's Scheduler.has_requests)."""
        return bool(self.waiting or self.running or self._finished_since_last_step) or self.hooks.has_pending_work()

    # ---- schedule -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            chunks.append(self._chunk(request, num_new, 0, resumed=False))
            budget -= num_new
            idx += 1
        if not preempted:
            budget = self._schedule_waiting(budget, chunks)
        step = SchedulerStep(
            requests=tuple(
                ScheduledRequest(
                    req_id=c.req_id,
                    block_ids=c.block_ids,
                    num_computed_tokens=c.start_token,
                    num_scheduled_tokens=len(c.token_ids),
                    block_hashes=self.requests[c.req_id].block_hashes,
                    resumed=c.resumed,
                    num_prompt_tokens=len(self.requests[c.req_id].prompt_token_ids),
                )
                for c in chunks
            ),
            finished_req_ids=frozenset(self._finished_since_last_step),
            preempted_req_ids=frozenset(r.req_id for r in preempted),
        )
        self._finished_since_last_step.clear()
        meta = self.hooks.build_connector_meta(step)
        return StepPlan(chunks=tuple(chunks), connector_step=step, connector_meta=meta)

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Waiting requests in line while budget and seats last. One whose lookup answers
        "ask again" (None: a prefill server's prefix is not all in the pool yet) keeps its place
        and the next one is tried, as vLLM's scheduler does."""
        asked_later: list[Request] = []
        budget = self._schedule_line(budget, chunks, asked_later)
        self.waiting.extendleft(reversed(asked_later))
        self.num_asked_later = len(asked_later)
        return budget

    def _schedule_line(self, budget: int, chunks: list[ScheduledChunk], asked_later: list[Request]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            resumed = request.status is RequestStatus.PREEMPTED
            # a full hit keeps the last token to compute: the engine needs at least one
            max_hit_blocks = (request.num_tokens - 1) // self.block_size
            hit_block_ids = self.block_pool.cached_prefix(request.block_hashes[:max_hit_blocks])
            num_local = len(hit_block_ids) * self.block_size
            num_external, load_async = self.hooks.get_num_new_matched_tokens(request.view(), num_local)
            if num_external is None:
                asked_later.append(self.waiting.popleft())
                continue
            if load_async:
                raise UnsupportedSetupError(
                    "get_num_new_matched_tokens returned load_async=True; the reference engine loads synchronously"
                )
            if num_external < 0 or num_local + num_external >= request.num_tokens:
                raise ValueError(
                    f"get_num_new_matched_tokens({request.req_id}) returned {num_external} external tokens; "
                    f"with {num_local} local ones it must stay < num_tokens={request.num_tokens}"
                )
            num_computed = num_local + num_external
            num_new = min(request.num_tokens - num_computed, budget)
            if not self._allocate_with_hit(request, hit_block_ids, num_computed + num_new):
                break  # not enough free blocks: it stays first in line
            self.hooks.update_state_after_alloc(request.view(), tuple(request.block_ids), num_external)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            request.num_registered_blocks = len(hit_block_ids)
            request.num_external_tokens += num_external
            if request.num_local_cached_tokens < 0:
                request.num_local_cached_tokens = num_local
            chunks.append(self._chunk(request, num_new, num_external, resumed=resumed))
            budget -= num_new
        return budget

    def _chunk(self, request: Request, num_new: int, num_external: int, resumed: bool) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            req_id=request.req_id,
            token_ids=tuple(request.all_token_ids[start : start + num_new]),
            start_token=start,
            block_ids=tuple(request.block_ids),
            num_external_tokens=num_external,
            resumed=resumed,
        )

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Make sure a running request has blocks for `num_tokens` tokens."""
        missing = self._num_blocks_for(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True
        new_blocks = self.block_pool.allocate(missing)
        if new_blocks is None:
            return False
        request.block_ids.extend(new_blocks)
        return True

    def _allocate_with_hit(self, request: Request, hit_block_ids: list[int], num_tokens: int) -> bool:
        num_new_blocks = self._num_blocks_for(num_tokens) - len(hit_block_ids)
        # free cached hit blocks leave the free queue too, so they count against it
        if num_new_blocks + self.block_pool.num_free_among(hit_block_ids) > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(hit_block_ids)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        assert new_blocks is not None
        request.block_ids = [*hit_block_ids, *new_blocks]
        return True

    def _preempt(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    # ---- update -------------------------------------------------------------------------------

    def update_from_output(
        self,
        plan: StepPlan,
        last_logits: dict[ReqId, torch.Tensor],
        report: WorkerReport,
        draft_logits: dict[ReqId, torch.Tensor] | None = None,
    ) -> StepResult:
        """Apply a step's results: recover from load errors, sample, register computed blocks,
        finish requests. `last_logits[req_id]`: float32 [vocab] of the chunk's last token;
        `draft_logits`: the MTP layer's prediction there (recorded, not used for acceptance)."""
        self.hooks.update_connector_output(report)
        now = time.monotonic()
        finished: list[Request] = []
        discarded: set[ReqId] = set()
        for chunk in plan.chunks:
            request = self.requests[chunk.req_id]
            bad = [i for i, b in enumerate(chunk.block_ids) if b in report.invalid_block_ids]
            if bad:
                # vLLM: drop this step's output, recompute from the first invalid block
                rollback = min(chunk.start_token, bad[0] * self.block_size)
                request.num_computed_tokens = rollback
                request.num_registered_blocks = min(request.num_registered_blocks, bad[0])
                discarded.add(request.req_id)
                self._register_computed_blocks(request)
                continue
            request.num_computed_tokens = chunk.start_token + len(chunk.token_ids)
            self._register_computed_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the last token
            logits = last_logits[request.req_id]
            request.output_token_ids.append(int(torch.argmax(logits)))
            request.output_logits.append(logits)
            if draft_logits:
                request.draft_logits.append(draft_logits[request.req_id])
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            if len(request.output_token_ids) >= request.max_tokens:
                finished.append(request)
        for request in finished:
            self._finish(request, now)
        return StepResult(finished=tuple(finished), discarded_req_ids=frozenset(discarded))

    def _register_computed_blocks(self, request: Request) -> None:
        """Only blocks whose KV is computed (or loaded) and valid enter the prefix cache."""
        num_full = request.num_computed_tokens // self.block_size
        hashes = request.block_hashes
        for i in range(request.num_registered_blocks, num_full):
            self.block_pool.register(request.block_ids[i], hashes[i])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def _finish(self, request: Request, now: float) -> None:
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_time_s = now
        _, request.finished_kv_transfer_params = self.hooks.request_finished(request.view(), tuple(request.block_ids))
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        self._finished_since_last_step.add(request.req_id)
