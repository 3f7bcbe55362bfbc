"""Counters of the connector, one object per side, exposed as plain dataclasses (engines and
`layerkv bench` read them; vLLM's stats hooks forward them). Scheduler stats are touched only
by the scheduler thread; worker stats are updated under the worker's stats lock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    lookups: int = 0
    exists_calls: int = 0
    keys_queried: int = 0
    lookup_errors: int = 0
    hit_blocks: int = 0
    load_blocks: int = 0
    save_blocks: int = 0
    save_skipped_existing: int = 0
    load_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class WorkerStats:
    steps: int = 0
    load_keys: int = 0
    load_blocks: int = 0
    loaded_bytes: int = 0
    load_range_calls: int = 0
    load_failed_blocks: int = 0
    save_keys: int = 0
    saved_bytes: int = 0
    save_range_calls: int = 0
    committed_keys: int = 0
    revoked_keys: int = 0
    save_failed_keys: int = 0
    save_skipped_existing: int = 0
    tainted_keys: int = 0
    transfer_errors: int = 0
    load_wait_s: float = 0.0  # compute thread time spent waiting for layers

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def add(self, other: WorkerStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
