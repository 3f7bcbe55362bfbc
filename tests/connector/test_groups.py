"""Hybrid models (connector/hybrid.py): one scheduler and one worker per KV cache group, composed into one
connector and driven in vLLM's order over real stores. The model: a full-attention group of 3
layers (model layers 0-2) and a sliding-window group of 2 layers (3-4) whose window is 2
blocks. As in vLLM, the groups share one block id space and id 0 is the null block (the
sliding-window group's blocks before its window): group A's blocks start at 1, group B's at 33.
"""

from __future__ import annotations

from typing import Any

from layerkv.connector.hybrid import GroupedPlan, GroupedScheduler, GroupedWorker
from layerkv.messages import ScheduledRequest, SchedulerStep, WorkerReport
from layerkv.store.base import Code
from layerkv.store.faults import GET_RANGES
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens

NULL = 0
WINDOW = 2  # blocks


class Hybrid:
    """Two rigs (the groups) behind one GroupedScheduler / GroupedWorker on rank 0."""

    def __init__(self, make_rig: Any, load_async: bool = False, **config: Any) -> None:
        self.full = make_rig(num_layers=3, **config)
        self.swa = make_rig(num_layers=2, first_layer=3, window_blocks=WINDOW, **config)
        self.full.next_block, self.swa.next_block = 1, 33
        self.rigs = (self.full, self.swa)
        self.scheduler = GroupedScheduler(
            [self.full.scheduler, self.swa.scheduler],
            skip_block_ids=frozenset({NULL}),
            windows=[0, WINDOW],
            load_async=load_async,
        )
        self.worker = GroupedWorker(
            [self.full.workers[0], self.swa.workers[0]],
            [[rig.layer_name(li) for li in range(rig.num_layers)] for rig in self.rigs],
            load_async=load_async,
        )
        self.load_async = load_async
        self.reqs: dict[str, tuple[Req, Req]] = {}

    def admit(self, req_id: str, tokens: list[int]) -> int:
        """Pool lookup and allocation as vLLM's hybrid manager does it: the sliding-window group
        gets the null block for the loaded blocks before its window."""
        full, swa = Req(req_id, tokens), Req(req_id, list(tokens))
        view = full.view()
        ext, load_async = self.scheduler.get_num_new_matched_tokens(view, 0)
        assert load_async is (self.load_async and ext > 0)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        for rig, req in zip(self.rigs, (full, swa)):
            req.block_ids = list(range(rig.next_block, rig.next_block + num_blocks))
            rig.next_block += num_blocks
            req.num_computed = ext
            rig.reqs[req_id] = req
        nulls = max(0, ext // BLOCK_SIZE - WINDOW)
        swa.block_ids[:nulls] = [NULL] * nulls
        self.scheduler.update_state_after_alloc(view, (tuple(full.block_ids), tuple(swa.block_ids)), ext)
        self.reqs[req_id] = (full, swa)
        return ext

    def step(self, *req_ids: str) -> set[int]:
        """One step computing the rest of each request's prompt in every layer, in model order."""
        per_group: list[list[ScheduledRequest]] = [[], []]
        for req_id in req_ids:
            pair = self.reqs[req_id]
            for g, req in enumerate(pair):
                other = tuple(b for r in pair if r is not req for b in r.block_ids)
                per_group[g].append(
                    ScheduledRequest(
                        req_id,
                        tuple(req.block_ids),
                        req.num_computed,
                        len(req.tokens) - req.num_computed,
                        req.hashes,
                        other_block_ids=other,
                    )
                )
        plan = self.scheduler.build_connector_meta([SchedulerStep(tuple(s)) for s in per_group])
        self.worker.bind_connector_metadata(plan)
        self.worker.start_load_kv()
        for g, rig in enumerate(self.rigs):
            for layer in range(rig.num_layers):
                self.worker.wait_for_layer_load(rig.layer_name(layer))
                rig._compute_layer(0, layer, per_group[g])
                self.worker.save_kv_layer(rig.layer_name(layer))
        self.worker.wait_for_save()
        invalid = self.worker.get_block_ids_with_load_errors()
        steps = self.worker.report_steps()
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(WorkerReport(invalid_block_ids=frozenset(invalid), reported_steps=steps))
        for pair in (self.reqs[r] for r in req_ids):
            for req in pair:
                req.num_computed = len(req.tokens)
        self.last_plan = plan
        return invalid

    def load_step(self, errors_first: bool = False) -> tuple[set[str], set[str], set[int]]:
        """An engine step in which the requests waiting for their (asynchronous) load are not
        scheduled and no layer runs (vLLM's no-forward step): (finished receiving, failed
        receiving, invalid blocks), passed to the scheduler as vLLM does."""
        plan = self.scheduler.build_connector_meta([SchedulerStep(()), SchedulerStep(())])
        self.worker.bind_connector_metadata(plan)
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        if errors_first:  # the other order of the two hooks: failures must still go to the request
            invalid = self.worker.get_block_ids_with_load_errors()
            _, finished, failed = self.worker.transfer_results(set())
        else:
            _, finished, failed = self.worker.transfer_results(set())
            invalid = self.worker.get_block_ids_with_load_errors()
        steps = self.worker.report_steps()
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(
            WorkerReport(
                finished_recving=frozenset(finished),
                invalid_block_ids=frozenset(invalid),
                reported_steps=steps,
                failed_recving=frozenset(failed),
            )
        )
        return finished, failed, invalid

    def settle(self) -> None:
        self.step()
        assert self.worker.flush(5.0)


def test_a_hit_needs_every_full_group_block_and_only_the_window_of_a_sliding_group(make_rig, backend) -> None:
    producer = Hybrid(make_rig)
    tokens = block_tokens(8, BLOCK_SIZE)
    assert producer.admit("p", tokens) == 0
    producer.step("p")
    producer.settle()
    full, swa = producer.reqs["p"]
    assert backend.exists(producer.full.keys(full)) == [1] * 8 and backend.exists(producer.swa.keys(swa)) == [1] * 8

    consumer = Hybrid(make_rig)
    assert backend.remove(consumer.swa.keys(swa, blocks=[0, 1, 2, 3])) == [0] * 4  # outside the window at 8
    assert consumer.admit("c", tokens) == 8 * BLOCK_SIZE
    assert consumer.step("c") == set()
    full_c, swa_c = consumer.reqs["c"]
    assert consumer.full.wrong_blocks(full_c, range(8)) == []
    assert consumer.swa.wrong_blocks(swa_c, range(6, 8)) == []  # the window, loaded
    assert swa_c.block_ids[:6] == [NULL] * 6
    assert all(
        bool((consumer.swa.block_values(0, li, NULL) == 0).all()) for li in range(2)
    )  # the null block: never written
    assert isinstance(consumer.last_plan, GroupedPlan)
    assert [len(p.loads[0]) for p in consumer.last_plan.plans] == [8, WINDOW]

    assert backend.remove(consumer.swa.keys(swa, blocks=[6])) == [0]
    assert consumer.scheduler.get_num_new_matched_tokens(Req("d", tokens).view(), 0) == (
        6 * BLOCK_SIZE,
        False,
    )  # window 4-5
    assert backend.remove(consumer.full.keys(full, blocks=[5])) == [0]
    # the full group ends the hit at 5, where the window (3-4) misses 3; so do 2, 1 and 0's windows
    assert consumer.scheduler.get_num_new_matched_tokens(Req("e", tokens).view(), 0) == (0, False)


def test_a_load_failure_in_one_group_revokes_the_request_s_saves_in_every_group(make_rig, backend) -> None:
    producer = Hybrid(make_rig)
    prefix = block_tokens(4, BLOCK_SIZE, extra=0)
    producer.admit("p", prefix + [9999])
    producer.step("p")
    producer.settle()

    consumer = Hybrid(make_rig)
    tokens = prefix + block_tokens(4, BLOCK_SIZE, base=5000)  # 4 loaded blocks, then 4 new full blocks in each group
    full_keys = consumer.full.keys(Req("x", tokens), blocks=[4, 5, 6, 7])
    swa_keys = consumer.swa.keys(Req("x", tokens), blocks=[4, 5, 6, 7])
    block1 = consumer.full.keys(Req("x", tokens), blocks=[1])[0]
    consumer.full.faults[0].fail(GET_RANGES, block1, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)
    assert consumer.admit("c", tokens) == 4 * BLOCK_SIZE
    full_c, _ = consumer.reqs["c"]

    assert consumer.step("c") == {full_c.block_ids[1]}  # a full-attention block failed to load
    consumer.settle()  # the verdict on that step: the request attended to a bad block in all layers

    assert backend.exists(full_keys) == [0] * 4
    assert backend.exists(swa_keys) == [0] * 4  # the sliding-window group's saves too
    assert consumer.swa.workers[0].stats().revoked_tainted == 4

    clean = Hybrid(make_rig)  # the same request without the fault commits both groups' blocks
    clean.admit("c", tokens)
    assert clean.step("c") == set()
    clean.settle()
    assert backend.exists(full_keys) == [1] * 4 and backend.exists(swa_keys) == [1] * 4


def test_a_step_is_reported_once_every_group_ran_it(make_rig, backend) -> None:
    """vLLM's speculative decoding asks for the step report before wait_for_save: a group whose
    load is still running holds its step back, and so must the composite (else the verdict
    could come before that group's failures)."""
    producer = Hybrid(make_rig)
    producer.admit("p", block_tokens(3, BLOCK_SIZE))
    producer.step("p")
    producer.settle()

    consumer = Hybrid(make_rig)
    consumer.full.faults[0].delay(GET_RANGES, 1.0, layer_idx=2, times=1)
    consumer.admit("c", block_tokens(3, BLOCK_SIZE))
    full, swa = consumer.reqs["c"]
    scheduled = [
        ScheduledRequest("c", tuple(r.block_ids), r.num_computed, len(r.tokens) - r.num_computed, r.hashes)
        for r in (full, swa)
    ]
    plan = consumer.scheduler.build_connector_meta([SchedulerStep((s,)) for s in scheduled])
    consumer.worker.bind_connector_metadata(plan)
    consumer.worker.start_load_kv()
    for rig in consumer.rigs:
        for layer in range(rig.num_layers - (rig is consumer.full)):  # all but the full group's last layer
            consumer.worker.wait_for_layer_load(rig.layer_name(layer))
    assert consumer.swa.workers[0].is_idle(5.0)  # the sliding-window group's load is over: it reports the step
    assert consumer.worker.report_steps() == ()  # the full group still loads: the step is held back
    consumer.worker.wait_for_save()
    assert consumer.worker.report_steps() == (plan.plans[0].step_seq,)
    consumer.worker.clear_connector_metadata()


def test_async_loads_report_a_failed_group_as_a_failed_request_never_as_blocks(make_rig, backend) -> None:
    """vLLM stops with several groups when blocks are reported invalid; with load_async the load
    runs in a step of its own and a failure in any group fails the request (vLLM recomputes it
    from token 0), which is then not offered the pool again."""
    producer = Hybrid(make_rig)
    tokens = block_tokens(6, BLOCK_SIZE)
    producer.admit("p", tokens)
    producer.step("p")
    producer.settle()

    consumer = Hybrid(make_rig, load_async=True)
    assert consumer.admit("ok", tokens) == 6 * BLOCK_SIZE
    assert consumer.load_step() == ({"ok"}, set(), set())
    full_ok, swa_ok = consumer.reqs["ok"]
    assert consumer.full.wrong_blocks(full_ok, range(6)) == [] and consumer.swa.wrong_blocks(swa_ok, range(4, 6)) == []
    assert consumer.step("ok") == set()  # then scheduled: computes the last token over the loaded blocks

    window_block = consumer.swa.keys(Req("x", tokens), blocks=[5])[0]
    consumer.swa.faults[0].fail(GET_RANGES, window_block, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)
    assert consumer.admit("bad", tokens) == 6 * BLOCK_SIZE
    assert consumer.load_step() == ({"bad"}, {"bad"}, set())  # failed in the sliding-window group only
    assert consumer.scheduler.get_num_new_matched_tokens(Req("bad", tokens).view(), 0) == (0, False)
    assert consumer.scheduler.get_num_new_matched_tokens(Req("other", tokens).view(), 0) == (6 * BLOCK_SIZE, True)

    consumer.full.faults[0].fail(
        GET_RANGES,
        consumer.full.keys(Req("x", tokens), blocks=[2])[0],
        code=int(Code.TRANSFER_FAIL),
        layer_idx=0,
        times=1,
    )
    assert consumer.admit("bad2", tokens) == 6 * BLOCK_SIZE
    assert consumer.load_step(errors_first=True) == ({"bad2"}, {"bad2"}, set())  # never as blocks, whatever the order
