"""vLLM scheduler output -> layerkv's neutral step messages, the metadata object that carries
the neutral plan to vLLM's workers, and the worker metadata that carries each worker's step
number back (vLLM aggregates it over every worker before the scheduler sees it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.connector.prefill_wait import PREFIX_TOKENS
from layerkv.integrations.vllm.pools import promise_read
from layerkv.messages import ReqId, RequestView, ScheduledRequest, SchedulerStep

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def request_view(request: Request, promise_key: str | None = None) -> RequestView:
    """`request.block_hashes` already chain the cache salt, LoRA id and multimodal hashes;
    `kv_transfer_params` is what the client sent (a prefill server's promise, from a proxy); with
    `promise_key` (this connector's pool's key) the promise meant for this pool is what the
    neutral side reads under PREFIX_TOKENS (integrations/vllm/pools.py)."""
    params = getattr(request, "kv_transfer_params", None)
    if promise_key is not None and isinstance(params, Mapping):
        promise = promise_read(params, promise_key)  # integrations/vllm/pools.py
        if promise is not None:
            params = {**params, PREFIX_TOKENS: promise}
    return RequestView(
        req_id=request.request_id,
        num_prompt_tokens=request.num_prompt_tokens,
        num_tokens=request.num_tokens,
        block_hashes=tuple(request.block_hashes),
        kv_transfer_params=params,
    )


def skips_external_kv(request: Request) -> bool:
    """vLLM reads no external KV for this request whatever the connector answers (0.34:
    `skip_reading_external_kv`, e.g. prompt logprobs or a bounded prefix hit; 0.32 / 0.33:
    `skip_reading_prefix_cache`, e.g. prompt logprobs)."""
    skip = getattr(request, "skip_reading_external_kv", None)
    if skip is None:
        skip = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skip)


class StepTranslator:
    """SchedulerOutput -> one SchedulerStep per KV cache group. vLLM sends only new block ids for
    running requests, so this keeps each live request's full block-id list per group (position
    i = token block i; vLLM's null block where a sliding-window group freed one) and a reference
    to its `Request` (whose block hashes grow as tokens arrive). Scheduler thread only.

    Preemption: a preempted request's blocks were freed, so its list is dropped. When it runs
    again vLLM sends its whole block table: in `scheduled_new_reqs` (vLLM 0.34, and 0.33 under
    model runner V2) or in `scheduled_cached_reqs` with its id in `resumed_req_ids` (0.32 / 0.33
    under model runner V1); either way the table replaces the list and the step marks it
    `resumed`. Preemptions are applied before the step's scheduled requests: a request preempted
    between two steps (vLLM's reset_prefix_cache(reset_running_requests=True)) is named in
    `preempted_req_ids` and may be scheduled again in the very same output."""

    def __init__(self, num_groups: int = 1, block_size: int = 0) -> None:
        self.num_groups = num_groups
        self.block_size = block_size  # 0: every scheduled request goes into the step
        self._requests: dict[ReqId, Request] = {}
        self._block_ids: dict[ReqId, list[list[int]]] = {}
        self._preempted: set[ReqId] = set()  # preempted and not scheduled since

    def track(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def request(self, req_id: ReqId) -> Request | None:
        """The live request `req_id` (None once forgotten)."""
        return self._requests.get(req_id)

    def forget(self, req_id: ReqId) -> None:
        self._requests.pop(req_id, None)
        self._block_ids.pop(req_id, None)
        self._preempted.discard(req_id)

    def translate(self, out: SchedulerOutput, everyone: bool = True) -> tuple[SchedulerStep, ...]:
        """One SchedulerStep per group. Without `everyone` (and with a block size) a running
        request goes into the step only when it completes a block in it (SchedulerStep): a
        decode step that completes none costs one pass over vLLM's lists, no object per
        request."""
        preempted = frozenset(out.preempted_req_ids or ())
        for req_id in preempted:
            self._block_ids.pop(req_id, None)
            self._preempted.add(req_id)
        scheduled: list[tuple[ScheduledRequest, ...]] = []
        for new in out.scheduled_new_reqs:  # new, or resumed whole (vLLM 0.34; 0.33 under model runner V2)
            resumed = new.req_id in self._preempted
            self._preempted.discard(new.req_id)
            self._block_ids[new.req_id] = self._groups(new.block_ids)
            scheduled.append(self._scheduled(new.req_id, new.num_computed_tokens, out, resumed=resumed))
        cached = out.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None) or ()  # vLLM 0.32 / 0.33 (model runner V1) only
        num_tokens = out.num_scheduled_tokens
        every = everyone or not self.block_size or bool(resumed_ids)
        if every:
            for i, req_id in enumerate(cached.req_ids):
                resumed = req_id in resumed_ids
                self._add_blocks(req_id, cached.new_block_ids[i], replace=resumed)
                scheduled.append(self._scheduled(req_id, cached.num_computed_tokens[i], out, resumed=resumed))
        else:
            for i, new_ids in enumerate(cached.new_block_ids):
                if new_ids:
                    self._add_blocks(cached.req_ids[i], new_ids, replace=False)
            for i in completing(cached.req_ids, cached.num_computed_tokens, num_tokens, self.block_size):
                scheduled.append(self._scheduled(cached.req_ids[i], cached.num_computed_tokens[i], out, resumed=False))
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        finished = frozenset(out.finished_req_ids)
        in_step = None if every else num_tokens.keys()
        total = None if every else out.total_num_scheduled_tokens
        return tuple(
            SchedulerStep(tuple(r[g] for r in scheduled), finished, preempted, in_step, total)
            for g in range(self.num_groups)
        )

    def _add_blocks(self, req_id: ReqId, new_ids: Any, replace: bool) -> None:
        if replace:  # resumed after a preemption: its old blocks were freed, these replace them
            self._preempted.discard(req_id)
            self._block_ids[req_id] = self._groups(new_ids)
        elif new_ids:
            for ids, more in zip(self._block_ids.setdefault(req_id, self._groups(None)), self._groups(new_ids)):
                ids.extend(more)

    def _groups(self, block_ids: Any) -> list[list[int]]:
        if not block_ids:
            return [[] for _ in range(self.num_groups)]
        if len(block_ids) != self.num_groups:
            raise ValueError(f"vLLM sent block ids for {len(block_ids)} KV cache groups, layerkv has {self.num_groups}")
        return [list(ids) for ids in block_ids]

    def _scheduled(
        self, req_id: ReqId, num_computed_tokens: int, out: SchedulerOutput, resumed: bool
    ) -> tuple[ScheduledRequest, ...]:
        request = self._requests.get(req_id)
        assert request is not None, f"request {req_id} scheduled but never seen by the connector"
        groups = self._block_ids[req_id]
        return tuple(
            ScheduledRequest(
                req_id=req_id,
                block_ids=tuple(ids),
                num_computed_tokens=num_computed_tokens,
                num_scheduled_tokens=out.num_scheduled_tokens[req_id],
                block_hashes=tuple(request.block_hashes),
                resumed=resumed,
                other_block_ids=tuple(b for h, other in enumerate(groups) if h != g for b in other),
                num_prompt_tokens=request.num_prompt_tokens,
            )
            for g, ids in enumerate(groups)
        )


def completing(
    req_ids: Sequence[ReqId], num_computed: Sequence[int], num_scheduled: Mapping[ReqId, int], block_size: int
) -> list[int]:
    """Indices of the requests whose computed tokens cross a multiple of `block_size` in this
    step (they complete a block). No request is scheduled more than the step's largest count,
    so only those that close enough to a boundary are looked up (in a decode step: exactly
    those that complete one); one pass over the computed counts."""
    if not req_ids or not num_scheduled:
        return []
    most = max(num_scheduled.values())
    low = block_size - most
    near = (
        [i for i, computed in enumerate(num_computed) if computed % block_size >= low]
        if low > 0
        else range(len(req_ids))
    )
    return [
        i for i in near if (num_computed[i] + num_scheduled[req_ids[i]]) // block_size != num_computed[i] // block_size
    ]


class LayerKVMetadata(KVConnectorMetadata):
    """Carries the neutral scheduler side's per-step metadata to the workers (pickled)."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload


class LayerKVWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the step numbers the workers ran. vLLM's output aggregator combines
    one per worker with `aggregate`, so a step appears once per worker that reported it."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = steps

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LayerKVWorkerMeta), type(other).__name__
        return LayerKVWorkerMeta(self.steps + other.steps)
