"""Full CUDA graphs kept: the rules that let vLLM replay decode steps as one graph on a server
that loads. vLLM (FULL_AND_PIECEWISE, its default) replays a step as one full graph when it is a
uniform decode batch: every request computes the same `decode_tokens` (1, or 1 + its speculative
tokens), a prompt's single token over an existing context included. A replay runs no Python
between layers: no per-layer hook (wait_for_layer_load, save_kv_layer) is called. So:

* a pool hit that leaves a request `decode_tokens` tokens or fewer to compute is loaded before
  the request's first step, asynchronously (`loads_before_scheduling`; connector/async_loads.py runs
  it: 0 tokens scheduled in the step that loads it, finished receiving once every layer landed);
* a step in which a request still computes that few tokens over a load (vLLM's token budget cut
  its chunk to one token) loads before the forward (`StepPlan.loads_first`: start_load_kv
  returns once every layer landed; `mark`);
* the worker detects a step whose hooks never ran (connector/worker.py): its saves are copied
  from the cache after the forward, and a load no layer waited for is reported failed (the
  engine recomputes it), never attended to.

A step that computes more tokens per request is never replayed whole (vLLM runs it piecewise:
attention, and the hooks around it, run eagerly): its loads go layer by layer as before.
Scheduler thread only (pure functions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set as AbstractSet
from typing import Any

from layerkv.messages import ReqId, SchedulerStep
from layerkv.metadata import StepPlan


def loads_before_scheduling(num_tokens_left: int, decode_tokens: int) -> bool:
    """Should a hit that leaves `num_tokens_left` tokens to compute be loaded before the
    request's first step (asynchronously)? Yes when that first step could be a decode step."""
    return 0 < num_tokens_left <= decode_tokens


def mark(
    plan: Any, step: SchedulerStep, loading: AbstractSet[ReqId], decode_tokens: int, every_step: bool = False
) -> Any:
    """`plan` with its asynchronous loads named (the requests of `loading`, 0 tokens in `step`)
    and `loads_first` set when a request it loads for computes `decode_tokens` or fewer tokens in
    `step`, or for any load with `every_step` (vLLM's FULL mode replays mixed batches too).
    Plans without loads (and other engines' metadata) are returned as they are."""
    if not isinstance(plan, StepPlan) or not plan.loads:
        return plan
    async_ids = frozenset(spec.req_id for spec in plan.loads if spec.req_id in loading)
    sync_ids = {spec.req_id for spec in plan.loads} - async_ids
    first = (
        bool(sync_ids)
        and every_step
        or any(0 < r.num_scheduled_tokens <= decode_tokens for r in step.requests if r.req_id in sync_ids)
    )
    if not (async_ids or first):
        return plan
    return dataclasses.replace(plan, async_req_ids=async_ids, loads_first=first)
