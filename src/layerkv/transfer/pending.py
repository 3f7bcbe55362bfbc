"""Put sessions whose bytes are all written but whose commit is not decided yet, grouped by the
engine step that wrote them. A step's objects are committed only when the scheduler's verdict for
that step arrives (every rank and stage reported, no request that attended to a failed block
owns them); see settle.py. Worker side: the send thread adds, settles and expires; shutdown
drains it after the send thread stopped. Guarded by one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from layerkv.messages import ReqId
from layerkv.store.base import ObjectKey


@dataclass(frozen=True, slots=True)
class PendingPut:
    key: ObjectKey
    owner: ReqId  # the request whose block the object was written from


class PendingPuts:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._steps: dict[int, tuple[float, list[PendingPut]]] = {}  # guarded by _lock: seq -> (since, puts)

    def add(self, step_seq: int, puts: list[PendingPut]) -> None:
        if not puts:
            return
        with self._lock:
            since, held = self._steps.setdefault(step_seq, (self._clock(), []))
            held.extend(puts)

    def pop(self, step_seq: int) -> list[PendingPut]:
        """The step's puts (forgotten here: the caller ends or revokes them)."""
        with self._lock:
            entry = self._steps.pop(step_seq, None)
        return entry[1] if entry else []

    def pop_older_than(self, max_age_s: float) -> list[PendingPut]:
        """Puts of steps pending longer than `max_age_s` (their verdict never came)."""
        now = self._clock()
        with self._lock:
            old = [seq for seq, (since, _) in self._steps.items() if now - since > max_age_s]
            return [put for seq in old for put in self._steps.pop(seq)[1]]

    def pop_all(self) -> list[PendingPut]:
        with self._lock:
            steps, self._steps = self._steps, {}
        return [put for _, puts in steps.values() for put in puts]

    def num_keys(self) -> int:
        with self._lock:
            return sum(len(puts) for _, puts in self._steps.values())

    def step_seqs(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)
