"""Counters of the connector, one object per side, exposed as plain dataclasses (engines and
`layerkv bench` read them; vLLM's stats hooks forward them), and `Samples`, the per-step
observations behind vLLM's histograms. Scheduler stats are touched only by the scheduler thread;
worker stats and samples only by the worker's compute thread.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    lookups: int = 0
    exists_calls: int = 0
    keys_queried: int = 0
    lookup_errors: int = 0
    hit_blocks: int = 0
    hit_blocks_older_key: int = 0  # hits under an older tenant key (a rotation: 0 once the pool turned over)
    load_blocks: int = 0
    save_blocks: int = 0
    save_skipped_existing: int = 0
    load_failures: int = 0
    tainted_requests: int = 0  # requests whose step's saves were revoked (a block they used failed)
    unreported_steps: int = 0  # steps some worker never reported: their saves revoked
    stale_blocks_reinvalidated: int = 0  # failed blocks a later request hit in the engine's prefix cache
    prefill_waits: int = 0  # requests that waited for a prefill server's prefix (connector/prefill_wait.py)
    prefill_wait_timeouts: int = 0  # ... and stopped waiting at prefill_wait_s without all of it
    prefill_wait_ms: int = 0  # their waits, summed
    cache_resets: int = 0  # reset_cache calls: each one a new namespace epoch (SchedulerConnector.reset_cache)
    save_skipped_reset: int = 0  # steps in which a request that ran across a reset completed blocks: none of them saved

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def add(self, other: SchedulerStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(slots=True)
class WorkerStats:
    steps: int = 0
    # loads
    load_keys: int = 0
    load_blocks: int = 0
    loaded_bytes: int = 0
    load_range_calls: int = 0
    load_failed_blocks: int = 0  # reported to the engine for recompute
    load_timeouts: int = 0  # waits for a layer that gave up (the blocks were recomputed)
    load_skipped_stuck: int = 0  # steps whose loads were recomputed at once: an earlier load was stuck
    load_skipped_staging: int = 0  # steps whose loads were recomputed: every staging slot held by earlier jobs
    header_failures: int = 0
    checksum_failures: int = 0
    removed_objects: int = 0  # objects that failed verification, removed from the pool
    fenced_keys: int = 0  # sessions not used after a store outage
    lease_renewals: int = 0
    load_wait_s: float = 0.0  # compute thread time spent waiting for layers
    load_copy_s: float = 0.0  # receive thread: verifying staged layers and copying them into the cache
    load_copied_bytes: int = 0  # ... bytes copied out of staging into the cache
    load_plans_layers: int = 0  # steps whose load plan read layer by layer straight into the cache
    load_plans_groups: int = 0  # ... groups of layers through staging
    load_plans_whole: int = 0  # ... whole objects through staging
    load_plans_explored: int = 0  # auto plans made to measure the mode least recently used
    # saves
    save_keys: int = 0  # put sessions started
    saved_bytes: int = 0
    save_range_calls: int = 0
    save_skipped_existing: int = 0
    save_failed_keys: int = 0  # put start failed, or revoked by the save job (write failure, incomplete step)
    save_timeouts: int = 0
    save_copy_s: float = 0.0  # send thread: copying the cache into staging images (and their tags)
    # steps whose saves were skipped: an earlier save stuck, the store down, or MAX_SAVES_IN_FLIGHT saves
    # of earlier steps still writing (overload: the engine never waits for the store); and their keys
    save_skipped_steps: int = 0
    save_skipped_keys: int = 0
    save_skipped_staging: int = 0  # keys not saved: no free staging slot (the staging area is full)
    save_incomplete_steps: int = 0  # saving steps handed fewer than all layers: nothing saved
    save_after_forward_steps: int = (
        0  # saving steps whose per-layer hooks never ran (a full CUDA graph): copied after the forward
    )
    load_unwaited_steps: int = 0  # steps that computed over a load without waiting for it: its blocks recomputed
    # commit protocol
    committed_keys: int = 0
    revoked_tainted: int = 0  # owned by a request that attended to a failed block (any rank / stage)
    revoked_unsettled: int = 0  # no verdict within commit_timeout_s
    revoked_on_shutdown: int = 0
    commit_failed: int = 0
    transfer_errors: int = 0  # a transfer thread raised (its step's transfers failed)

    def copy(self) -> WorkerStats:
        """A snapshot (vLLM reads one every step: one positional construction)."""
        return WorkerStats(*_worker_values(self))

    def count_plan(self, mode: str) -> None:  # a PlanMode other than auto
        name = f"load_plans_{mode}"
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def add(self, other: WorkerStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_worker_values = operator.attrgetter(*(f.name for f in dataclasses.fields(WorkerStats)))

# Per-step observations (Samples names): histograms in vLLM's Prometheus (integrations/vllm/metrics.py).
LOAD_WAIT_S = "load_wait_s"  # worker, per step with a load: compute thread time waiting for layers
LOAD_TRANSFER_S = "load_transfer_s"  # worker, per load job that read every layer: its start to its last layer read
SAVE_TRANSFER_S = "save_transfer_s"  # worker, per save job that wrote: time inside the store's write calls
LOAD_BYTES = "load_bytes"  # worker, per load job: bytes read from the pool
SAVE_BYTES = "save_bytes"  # worker, per save job: bytes written to the pool
LOOKUP_S = "lookup_s"  # scheduler, per pool lookup of a request (and KV cache group): its exists calls


class Samples:
    """Observations by name since the last `take`, each name's kept to the last MAX_PER_NAME (an
    engine that never takes them, like the reference engine, holds a bounded amount). Not
    locked: one thread observes and takes (the scheduler thread, or a worker's compute thread)."""

    MAX_PER_NAME = 4096

    def __init__(self) -> None:
        self._values: dict[str, deque[float]] = {}

    def observe(self, name: str, value: float) -> None:
        values = self._values.get(name)
        if values is None:
            values = self._values[name] = deque(maxlen=self.MAX_PER_NAME)
        values.append(float(value))

    def take(self) -> dict[str, list[float]]:
        """Every name's observations since the last call (names without any left out)."""
        taken, self._values = self._values, {}
        return {name: list(values) for name, values in taken.items() if values}
