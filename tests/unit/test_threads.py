"""NamedThreads, the one named-thread pool: names, results and errors, the idle thread each
submitted task reserves (so below the cap no task waits behind a stuck one), the cap, close.
Real threads; every wait is bounded."""

from __future__ import annotations

import threading
import time

import pytest

from layerkv.threads import NamedThreads


def _until_idle(pool: NamedThreads, n: int) -> None:
    """Until `n` threads are idle again (a task's result is out just before its thread is free)."""
    deadline = time.monotonic() + 5.0
    while pool._free < n and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    assert pool._free == n  # noqa: SLF001


def test_tasks_return_or_raise() -> None:
    pool = NamedThreads("layerkv-t", 2)
    try:
        assert pool.submit(lambda: 3).result() == 3
        task = pool.submit(lambda: 1 // 0)
        assert task.wait(5.0)
        assert isinstance(task.error, ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            task.result()
        assert pool.submit(lambda: 4).result() == 4  # the thread survived the error
    finally:
        pool.close(join_timeout_s=5.0)


def test_threads_are_named_in_start_order() -> None:
    pool = NamedThreads("layerkv-t", 4, first=1)
    release, entered = threading.Event(), threading.Semaphore(0)

    def name() -> str:
        entered.release()
        release.wait(5.0)
        return threading.current_thread().name

    try:
        stuck = [pool.submit(name) for _ in range(3)]
        assert all(entered.acquire(timeout=2.0) for _ in stuck)  # each on a thread of its own
        release.set()
        assert sorted(t.result() for t in stuck) == ["layerkv-t-1", "layerkv-t-2", "layerkv-t-3"]
    finally:
        release.set()
        pool.close(join_timeout_s=5.0)


def test_back_to_back_submits_each_reserve_an_idle_thread() -> None:
    """Idle threads are reserved at submit time: with k threads idle, k tasks submitted one after
    another (before any thread woke up) start no new thread, and one more starts exactly one;
    none of them waits behind a stuck one."""
    pool = NamedThreads("layerkv-t", 8)
    release = threading.Event()
    try:
        warm = [pool.submit(lambda: release.wait(5.0)) for _ in range(3)]  # three threads ...
        release.set()
        assert all(t.wait(5.0) for t in warm)
        _until_idle(pool, 3)  # ... idle again
        release.clear()
        entered = threading.Semaphore(0)

        def hang() -> None:
            entered.release()
            release.wait(5.0)

        stuck = [pool.submit(hang) for _ in range(3)]  # every idle thread, reserved one by one
        assert pool.num_threads() == 3
        quick = pool.submit(lambda: 7)  # none idle any more: a thread of its own starts
        assert pool.num_threads() == 4
        assert quick.wait(2.0) and quick.result() == 7  # not queued behind a stuck task
        assert all(entered.acquire(timeout=2.0) for _ in stuck)  # every stuck task runs at once
    finally:
        release.set()
        pool.close(join_timeout_s=5.0)


def test_at_the_cap_tasks_wait_for_the_first_free_thread_then_the_pool_is_whole() -> None:
    pool = NamedThreads("layerkv-t", 2)
    release = threading.Event()
    try:
        stuck = [pool.submit(lambda: release.wait(5.0)) for _ in range(2)]
        queued = pool.submit(lambda: 5)
        assert pool.num_threads() == 2 and not queued.wait(0.2)  # at the cap: it waits
        release.set()
        assert all(t.wait(5.0) for t in stuck) and queued.result() == 5
        _until_idle(pool, 2)  # the accounting is exact again: two idle, no debt
        release.clear()
        again = [pool.submit(lambda: release.wait(5.0)) for _ in range(2)]
        third = pool.submit(lambda: 6)
        assert not third.wait(0.2)  # two reserved threads again, so the third waits
        release.set()
        assert third.result() == 6 and all(t.wait(5.0) for t in again)
    finally:
        release.set()
        pool.close(join_timeout_s=5.0)


def test_close_ends_the_threads_and_refuses_new_tasks() -> None:
    pool = NamedThreads("layerkv-closing", 3)
    tasks = [pool.submit(lambda: time.sleep(0.05)) for _ in range(3)]
    pool.close(join_timeout_s=5.0)
    assert all(t.wait(0) for t in tasks)  # queued before the close: they ran
    assert not any(t.name.startswith("layerkv-closing-") for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: None)
