"""A bound on the wall time of one store call: the call runs on a pool of named daemon threads
(layerkv/threads.py: `layerkv-<name>-0`, ..., grown on demand up to 8, an idle thread reserved
per call so a stuck call never holds a quick one in the queue) and the caller waits at most
`timeout_s`. A call that answers late is not lost: its result goes to an `on_late` callback on
the pool thread (used to undo what a late put / get start did). Any thread may call; the pool
is the only shared state (thread-safe).

Why: a hung Mooncake master (stopped, no TCP reset) answers each call after ~30 s (-901), far
past any TTFT budget; the bound turns it into an outage answer at once.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from layerkv.threads import NamedThreads

log = logging.getLogger(__name__)
_MAX_THREADS = 8  # calls stuck at once before new ones queue (each is bounded by the store's own timeout)


class BoundedCaller:
    def __init__(self, name: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._threads = NamedThreads(f"layerkv-{name}", _MAX_THREADS)

    def call(
        self, fn: Callable[..., Any], *args: Any, on_late: Callable[[Any], None] | None = None
    ) -> tuple[bool, Any]:
        """(True, result) if `fn(*args)` returned within the bound (re-raises what fn raised),
        else (False, None); then `on_late(result)` runs on the pool thread when fn returns.
        Raises RuntimeError once closed."""
        answer = _Answer(on_late)
        task = self._threads.submit(functools.partial(answer.run, fn, args))
        if not task.wait(self.timeout_s) and answer.abandon():
            return False, None
        return True, task.result()  # answered in time, or just now (then result() waits the last instant)

    def close(self) -> None:
        """No more calls; threads end once the calls queued before they ran (not waited for: a
        stuck call may take the store's own timeout)."""
        self._threads.close()


class _Answer:
    """Who is late: the caller stopping to wait and fn returning meet under one lock; a result
    that arrives after the caller stopped goes to `on_late`."""

    def __init__(self, on_late: Callable[[Any], None] | None) -> None:
        self.on_late = on_late
        self.lock = threading.Lock()
        self.finished = False  # guarded by lock: fn returned or raised
        self.abandoned = False  # guarded by lock: the caller stopped waiting

    def abandon(self) -> bool:
        """The caller's bound passed: True if fn had not finished (its result now goes to on_late)."""
        with self.lock:
            self.abandoned = not self.finished
            return self.abandoned

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """On the pool thread: fn(*args), then on_late(result) if the caller stopped waiting."""
        try:
            result = fn(*args)
        except BaseException:
            self._finish()
            raise  # handed to the caller by the task
        if self._finish() and self.on_late is not None:
            try:
                self.on_late(result)
            except Exception:  # noqa: BLE001 - a cleanup must never kill the pool thread
                log.exception("layerkv: cleanup after a late store answer failed")
        return result

    def _finish(self) -> bool:
        """Marks fn finished; True if the caller had stopped waiting."""
        with self.lock:
            self.finished = True
            return self.abandoned
