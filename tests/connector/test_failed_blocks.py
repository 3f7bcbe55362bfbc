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
