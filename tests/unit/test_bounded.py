"""BoundedCaller: every call gets a thread of its own (up to the cap), so a stuck call never
holds a quick one in the queue past its bound, and a late answer reaches `on_late`."""

from __future__ import annotations

import threading
import time

from layerkv.store.bounded import _MAX_THREADS, BoundedCaller


def _fire_at_once(pool: BoundedCaller, n: int, fn) -> list[threading.Thread]:  # type: ignore[no-untyped-def]
    go = threading.Barrier(n)

    def call() -> None:
        go.wait()
        pool.call(fn)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_calls_submitted_at_once_each_get_their_own_thread() -> None:
    pool = BoundedCaller("t", timeout_s=10.0)
    stuck, release = threading.Semaphore(0), threading.Event()

    def hang() -> None:
        stuck.release()
        release.wait(10.0)

    try:
        n = _MAX_THREADS - 1
        for _ in range(5):  # rounds: submits racing thread start-up
            callers = _fire_at_once(pool, n, hang)
            # every stuck call is running (none queued behind another): all entered at once
            assert all(stuck.acquire(timeout=2.0) for _ in range(n))
            started = time.monotonic()
            assert pool.call(lambda: 7) == (True, 7)  # the last free thread answers at once
            assert time.monotonic() - started < 1.0
            release.set()
            for t in callers:
                t.join(5.0)
            release.clear()
    finally:
        release.set()
        pool.close()


def test_at_the_cap_a_call_waits_for_the_first_free_thread_and_a_late_answer_is_handed_on() -> None:
    pool = BoundedCaller("t", timeout_s=0.2)
    release = threading.Event()
    late: list[object] = []
    try:
        callers = _fire_at_once(pool, _MAX_THREADS, lambda: release.wait(10.0))
        time.sleep(0.1)
        # every thread is stuck: this call is not answered within its bound
        assert pool.call(lambda: 1, on_late=late.append) == (False, None)
        release.set()
        for t in callers:
            t.join(5.0)
        deadline = time.monotonic() + 5.0
        while not late and time.monotonic() < deadline:
            time.sleep(0.01)
        assert late == [1]  # it ran once a thread freed up, and its answer went to on_late
        assert pool.call(lambda: 2) == (True, 2)  # the pool is whole again
    finally:
        release.set()
        pool.close()
