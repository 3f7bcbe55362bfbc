"""What a worker tells the engine it failed to load (connector/failed_blocks.py): each block once
per step, a load's later failures added at the next report, planned recomputes always."""

from __future__ import annotations

from layerkv.connector.failed_blocks import FailedBlocks


def test_a_loads_failures_are_reported_once_per_step() -> None:
    failed = FailedBlocks()
    failed.add_unreported({1, 2})
    assert failed.take() == {1, 2}
    failed.add_unreported({1, 2, 3})  # the same load asked again after more of it failed
    assert failed.take() == {3} and failed.take() == set()
    failed.add({1})  # a recompute the plan names: reported even though named before
    assert failed.take() == {1}
    failed.new_step()
    failed.add_unreported({2})
    assert failed.take() == {2}


def test_the_loads_settledness_at_the_last_report_is_asked_once() -> None:
    failed = FailedBlocks()
    assert failed.pop_load_settled(None) is True  # no load
    assert failed.pop_load_settled(lambda: False) is False  # no report: asked now
    failed.load_settled = False  # not settled when the engine last asked for failures
    assert failed.pop_load_settled(lambda: True) is False
    assert failed.pop_load_settled(lambda: True) is True  # forgotten once asked


def test_a_step_is_held_back_while_its_load_may_still_fail() -> None:
    failed = FailedBlocks()
    failed.new_step(None)  # no plan: nothing for the scheduler to wait for
    assert failed.take_steps(None) == ()
    failed.new_step(1)
    failed.new_step(2)
    assert failed.take_steps(lambda: False) == (1,)  # 2's load still runs: held back
    assert failed.take_steps(lambda: True) == (2,)
    failed.new_step(3)
    failed.load_settled = False  # the failures were read before the load settled
    assert failed.take_steps(lambda: True) == ()  # so 3 waits for the next report
    assert failed.take_steps(lambda: True) == (3,)
    failed.new_step(4)
    assert failed.take_steps(None) == (4,)  # no load: reported at once
