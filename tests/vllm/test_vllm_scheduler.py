"""The facade's scheduler side under vLLM's real v1 Scheduler: Request / KVCacheBlocks /
SchedulerOutput translated into RequestView / block ids / SchedulerStep."""

from __future__ import annotations

import itertools

import pytest

from layerkv.bench.decode.engine import runner_output
from tests.tokens import prompt
from tests.vllm.vllm_harness import BLOCK_SIZE, make_engine, make_request, require_vllm

require_vllm()

from layerkv.integrations.vllm import LayerKVConnector, LayerKVMetadata  # noqa: E402
from layerkv.messages import KVRole  # noqa: E402

pytestmark = pytest.mark.vllm


def block_ids_in_vllm(engine, req_id):
    (ids,) = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    return tuple(ids)


def drive(engine, steps: int):
    """Schedule / update `steps` times; yield (scheduler_output, SchedulerStep) per step."""
    (core,) = engine.scheduler.connector.scheduler_side.subs
    for _ in range(steps):
        out = engine.scheduler.schedule()
        yield out, core.steps[-1]
        if not out.num_scheduled_tokens and not engine.scheduler.requests:
            return
        engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out))


def test_hit_translates_request_and_sets_sync_loads(doubles):
    engine = make_engine()
    assert isinstance(engine.scheduler.connector, LayerKVConnector)
    core = doubles.schedulers[0]
    assert core.deployment.block_size == BLOCK_SIZE and core.deployment.role is KVRole.BOTH
    request = make_request("a", prompt(1, 40))
    core.pool_hashes.update(request.block_hashes[:2])  # the pool holds blocks 0 and 1
    engine.scheduler.add_request(request)

    out = engine.scheduler.schedule()

    (name, (view, num_computed)), *_ = [c for c in core.calls if c[0] == "get_num_new_matched_tokens"]
    assert view.block_hashes == tuple(request.block_hashes) and len(view.block_hashes) == 2
    assert (view.req_id, view.num_prompt_tokens, view.num_tokens, num_computed) == ("a", 40, 40, 0)
    ((_, (alloc_view, alloc_ids, num_external)),) = [c for c in core.calls if c[0] == "update_state_after_alloc"]
    assert alloc_ids == block_ids_in_vllm(engine, "a") and len(alloc_ids) == 3
    assert num_external == 32
    assert out.has_sync_kv_loads is True
    assert out.num_scheduled_tokens == {"a": 8}
    assert isinstance(out.kv_connector_metadata, LayerKVMetadata)
    assert out.kv_connector_metadata.payload["step"] is core.steps[-1]
    (scheduled,) = core.steps[-1].requests
    assert (scheduled.req_id, scheduled.num_computed_tokens, scheduled.num_scheduled_tokens) == ("a", 32, 8)
    assert scheduled.block_ids == alloc_ids and scheduled.block_hashes == tuple(request.block_hashes)


def test_miss_schedules_without_sync_loads(doubles):
    engine = make_engine()
    engine.scheduler.add_request(make_request("a", prompt(2, 40)))
    out = engine.scheduler.schedule()
    assert out.has_sync_kv_loads is False
    assert out.num_scheduled_tokens == {"a": 40}
    ((_, (_, _, num_external)),) = [c for c in doubles.schedulers[0].calls if c[0] == "update_state_after_alloc"]
    assert num_external == 0


def test_chunked_prefill_appends_block_ids_and_finishes(doubles):
    engine = make_engine(max_num_batched_tokens=64)
    request = make_request("a", prompt(3, 100), max_tokens=14)
    engine.scheduler.add_request(request)
    seen, last_block_ids = [], ()
    for out, step in drive(engine, 20):
        for s in step.requests:
            assert s.block_ids == block_ids_in_vllm(engine, s.req_id)
            assert s.num_scheduled_tokens == out.num_scheduled_tokens[s.req_id]
            assert s.block_hashes == tuple(request.block_hashes)
            seen.append((s.num_computed_tokens, s.num_scheduled_tokens, len(s.block_ids)))
            last_block_ids = s.block_ids
        if step.finished_req_ids:
            assert step.finished_req_ids == {"a"} and not step.requests
            break
    # two prefill chunks (64 + 36 tokens), then one token per decode step; a new block at 113
    assert seen[:3] == [(0, 64, 4), (64, 36, 7), (100, 1, 7)]
    assert seen[-1] == (112, 1, 8)
    core = doubles.schedulers[0]
    ((_, (view, block_ids)),) = [c for c in core.calls if c[0] == "request_finished"]
    assert view.req_id == "a" and block_ids == last_block_ids  # 113 computed tokens: 8 blocks
    assert not engine.scheduler.connector._steps._block_ids  # nothing tracked after the finish


def resumed_per_vllm(out, req_id: str) -> bool | None:
    """vLLM 0.33's own word that `req_id` resumed (model runner V1: resumed_req_ids); None in 0.34,
    where a resumed request is re-sent whole in scheduled_new_reqs like a new one."""
    ids = getattr(out.scheduled_cached_reqs, "resumed_req_ids", None)
    return None if ids is None else req_id in ids


def test_preempted_request_resumes_with_replaced_block_ids(doubles):
    # 9 usable blocks: two 64-token prompts take 8, the first decode block preempts one.
    engine = make_engine(num_blocks=10, max_num_batched_tokens=128)
    engine.scheduler.add_request(make_request("a", prompt(4, 64), max_tokens=20))
    engine.scheduler.add_request(make_request("b", prompt(5, 64), max_tokens=20))
    preempted, resumed, waiting = set(), set(), set()
    for out, step in drive(engine, 80):
        preempted |= step.preempted_req_ids
        waiting |= step.preempted_req_ids
        for s in step.requests:
            assert s.block_ids == block_ids_in_vllm(engine, s.req_id)
            assert s.num_scheduled_tokens == out.num_scheduled_tokens[s.req_id]
            assert s.resumed == (s.req_id in waiting)  # scheduled again after its preemption
            assert resumed_per_vllm(out, s.req_id) in (None, s.resumed)
            if s.resumed:
                resumed.add(s.req_id)
                waiting.discard(s.req_id)
        if not engine.scheduler.requests:
            break
    assert preempted and resumed == preempted
    assert not engine.scheduler.requests
    assert not engine.scheduler.connector._steps._block_ids


def test_requests_preempted_between_steps_and_scheduled_again_keep_their_block_tables(doubles):
    """reset_prefix_cache(reset_running_requests=True) preempts every running request between two
    steps: the next output names them in preempted_req_ids AND schedules them again (0.34: in
    scheduled_new_reqs; 0.33: resumed cached requests). Their new block tables must survive
    the preemption, in that step and every later one."""
    engine = make_engine(num_blocks=32, max_num_batched_tokens=256)
    engine.scheduler.add_request(make_request("a", prompt(7, 40), max_tokens=30))
    engine.scheduler.add_request(make_request("b", prompt(8, 24), max_tokens=30))
    steps = drive(engine, 80)
    for out, step in itertools.islice(steps, 3):  # prefill and two decode steps
        assert not step.preempted_req_ids
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    out, step = next(steps)
    assert step.preempted_req_ids == {"a", "b"}
    assert {s.req_id for s in step.requests} == {"a", "b"} and all(s.resumed for s in step.requests)
    checked = 0
    for out, step in itertools.chain([(out, step)], steps):
        for s in step.requests:
            assert s.block_ids == block_ids_in_vllm(engine, s.req_id), f"step {checked}: {s.req_id}'s block table"
            checked += 1
        if not engine.scheduler.requests:
            break
    assert checked > 40 and not engine.scheduler.requests  # both decoded past new blocks to the end


def test_each_step_output_reaches_core_as_worker_report(doubles):
    from layerkv.messages import WorkerReport

    engine = make_engine()
    engine.scheduler.add_request(make_request("a", prompt(6, 20), max_tokens=3))
    steps = list(drive(engine, 10))
    reports = doubles.schedulers[0].reports
    assert len(reports) == len(steps) - 1  # the last schedule() found nothing left to update
    assert reports == [WorkerReport()] * len(reports)


def test_a_lookup_that_asks_again_leaves_the_request_waiting_and_schedules_the_others(doubles):
    """connector/prefill_wait.py: None from the lookup (a prefill server's prefix not in the
    pool yet). vLLM's real scheduler keeps the request waiting, schedules the one behind it, and
    asks again next step; the view carries the request's kv_transfer_params."""
    engine = make_engine()
    core = doubles.schedulers[0]
    promise = {"layerkv_prefix_tokens": 32}
    waiting = make_request("a", prompt(3, 40), kv_transfer_params=promise)
    core.pool_hashes.update(waiting.block_hashes[:4])
    core.ask_again.add("a")
    engine.scheduler.add_request(waiting)
    engine.scheduler.add_request(make_request("b", prompt(4, 40)))

    out = engine.scheduler.schedule()
    assert out.num_scheduled_tokens == {"b": 40}
    views = [c[1][0] for c in core.calls if c[0] == "get_num_new_matched_tokens" and c[1][0].req_id == "a"]
    assert views and views[0].kv_transfer_params == promise
    engine.scheduler.update_from_output(out, runner_output(engine.scheduler, out))

    core.ask_again.clear()  # the prefix is in the pool now
    out = engine.scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 8 and out.has_sync_kv_loads  # 32 tokens from the pool, 8 computed


@pytest.mark.parametrize("sent", ["own pool", "plain", "one other pool", "two other pools"])
def test_the_core_reads_the_promise_meant_for_its_pool(doubles, sent):
    """The facade hands the neutral core the promise (layerkv_prefix_tokens) that the client's
    kv_transfer_params name for this connector's pool (integrations/vllm/pools.py)."""
    from layerkv.config import LayerKVConfig
    from layerkv.connector.prefill_wait import pool_promise_key
    from layerkv.store.factory import pool_identity

    own, other, third = (pool_promise_key(pool_identity(LayerKVConfig(tenant=t))) for t in ("default", "x", "y"))
    params = {
        "own pool": {own: 32, other: 16},
        "plain": {"layerkv_prefix_tokens": 32, other: 16},
        "one other pool": {other: 32},
        "two other pools": {other: 32, third: 16},
    }[sent]
    engine = make_engine()
    engine.scheduler.add_request(make_request("a", prompt(9, 40), kv_transfer_params=params))
    engine.scheduler.schedule()
    core = doubles.schedulers[0]
    (view,) = [c[1][0] for c in core.calls if c[0] == "get_num_new_matched_tokens"]
    assert view.kv_transfer_params.get("layerkv_prefix_tokens") == (None if sent == "two other pools" else 32)
