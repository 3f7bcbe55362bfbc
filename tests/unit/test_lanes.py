"""Lanes: a run's parts run at once (the caller runs the first, named lane threads the rest),
results in order, the first error re-raised after every part returned; two runs at once each
get lanes of their own. Real threads; every wait is bounded."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from layerkv.transfer.calls import Lanes, split_rows


def test_parts_run_at_once_on_named_lanes_and_results_keep_their_order() -> None:
    lanes = Lanes("layerkv-rlane-0", max_lanes=4)
    go = threading.Barrier(4, timeout=5.0)  # every part waits for the others: they must run at once

    def part(i: int):  # type: ignore[no-untyped-def]
        def run() -> tuple[int, str]:
            go.wait()
            return i, threading.current_thread().name

        return run

    try:
        got = lanes.run([part(i) for i in range(4)])
        assert [i for i, _ in got] == [0, 1, 2, 3]
        assert got[0][1] == threading.current_thread().name  # the caller runs the first part
        assert sorted(name for _, name in got[1:]) == ["layerkv-rlane-0-1", "layerkv-rlane-0-2", "layerkv-rlane-0-3"]
        assert lanes.run([lambda: 9]) == [9]  # one part: no lane thread
    finally:
        lanes.close()


def test_the_first_error_is_raised_after_every_part_returned() -> None:
    lanes = Lanes("layerkv-slane-0", max_lanes=3)
    done: list[int] = []

    def slow() -> int:
        time.sleep(0.1)
        done.append(1)
        return 1

    def fail() -> int:
        raise ValueError("lane 0")

    try:
        with pytest.raises(ValueError, match="lane 0"):
            lanes.run([fail, slow, slow])
        assert done == [1, 1]
        missing: dict[str, int] = {}
        with pytest.raises(KeyError):  # an error in a lane's part, the caller's part fine
            lanes.run([lambda: 0, lambda: missing["x"]])
    finally:
        lanes.close()
    with pytest.raises(RuntimeError, match="closed"):
        lanes.run([lambda: 0, lambda: 1])


def test_a_run_is_not_queued_behind_another_runs_stuck_part() -> None:
    """A stuck part of one run holds a lane; a second run on the same pool (another transfer
    thread) gets a lane of its own and returns at once."""
    lanes = Lanes("layerkv-slane-1", max_lanes=8)
    release = threading.Event()
    stuck_run = threading.Thread(target=lambda: lanes.run([lambda: None, lambda: release.wait(5.0)]), daemon=True)
    try:
        stuck_run.start()
        time.sleep(0.05)
        started = time.monotonic()
        assert lanes.run([lambda: 1, lambda: 2]) == [1, 2]
        assert time.monotonic() - started < 1.0
    finally:
        release.set()
        stuck_run.join(5.0)
        lanes.close()


def test_split_rows_contiguous_non_empty() -> None:
    parts = split_rows(np.arange(5), 3)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert [p.tolist() for p in split_rows(np.arange(2), 8)] == [[0], [1]]
