"""One worker step's state (connector/worker_step.py): which loaded blocks no layer waited for, and
what ending the step does to jobs still running. Plain objects stand in for the jobs."""

from __future__ import annotations

from typing import Any

from layerkv.connector.worker_step import WorkerStep
from layerkv.metadata import BlockSpec, StepPlan


class _Job:
    def __init__(self, finished: bool = False, released: bool = False) -> None:
        self.finished, self.released = finished, released
        self.calls: list[str] = []

    def give_up(self, reason: str) -> None:
        self.calls.append("give_up")

    def order_compute(self) -> None:
        self.calls.append("order_compute")

    def cancel(self) -> None:
        self.calls.append("cancel")


def _plan(**kwargs: Any) -> StepPlan:
    loads = (BlockSpec("a", (b"a1", b"a2"), (1, 2)), BlockSpec("b", (b"b1",), (7,)))
    return StepPlan(step_seq=3, loads=loads, **kwargs)


def _step(plan: StepPlan, load: Any) -> WorkerStep:
    step = WorkerStep(plan)
    step.load = load
    return step


def test_loads_no_layer_waited_for_are_named_unless_the_step_waited_or_loaded_first() -> None:
    assert _step(_plan(), _Job()).unwaited_block_ids() == {1, 2, 7}  # a graph replay: no hook ran
    assert _step(_plan(async_req_ids=frozenset({"b"})), _Job()).unwaited_block_ids() == {1, 2}
    assert _step(_plan(loads_first=True), _Job()).unwaited_block_ids() == set()
    assert _step(_plan(), None).unwaited_block_ids() == set()  # no load started
    waited = _step(_plan(), _Job())
    waited.layer_waited = True
    assert waited.unwaited_block_ids() == set()


def test_ending_a_step_gives_up_a_running_load_and_cancels_a_save_still_reading() -> None:
    step = _step(_plan(), _Job())
    step.save = _Job()
    load, save = step.load, step.save
    assert step.end() == [load, save]
    assert load.calls == ["give_up"] and save.calls == ["cancel"]  # type: ignore[union-attr]
    assert step.load is None and step.save is None and step.end() == []
    done = _step(_plan(), _Job(finished=True))
    done.save = _Job(released=True)
    load, save = done.load, done.save
    done.end()
    assert load.calls == ["order_compute"] and save.calls == []  # type: ignore[union-attr]
