"""The staging area: a fixed number of host slots (one object wide), allocated and registered with the store once at
start-up (transfer/memory.py), and the only memory of the engine's that the worker hands the
store (unless the user opts into `register_kv_cache`; a Mooncake client that mounts a global
segment in this process exposes that segment too). Slots are lent to one job at a time: a slot
whose last job has not finished is never lent again (a store call that outlived its job, or a
background write, may still read or write it), so a late read lands in slots nobody else holds.
Never grows: a job gets at most the slots that are free. Compute thread only (jobs are created
there); the slots stay registered until the worker shuts down.

    area:   slot 0 | slot 1 | ... | slot S-1   (S x width bytes, one registration)
    lease:  job A -> slots [0, 1, 2]   job B -> slots [3, 4]   free: [5 .. S-1]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerkv.errors import ConfigError
from layerkv.objects.layout import CacheLayout

HEADER_AREA_NBYTES = 64 << 20  # header slots of the direct plans (register_kv_cache), at most
WARM_NBYTES = 64 << 20  # slots of each area mapped at start-up (the rest on first use, as slots go lowest first)


@dataclass(slots=True)
class _Lease:
    slots: np.ndarray  # int64 slot indices
    job: Any = None  # has `.finished`; None: not lent yet (taken on this call)


@dataclass(slots=True)
class StagingArea:
    """`num_slots` slots of `width` bytes (`array`: uint8 [num_slots, width]), registered by the
    worker once (transfer/memory.py); `take` then `lend` for every job. Slots are taken lowest
    first, so the first WARM_NBYTES, mapped at start-up, serve most steps; the rest of the area
    is zero pages the kernel maps on first use (memory grows with what is used)."""

    name: str
    num_slots: int
    width: int
    array: np.ndarray = field(init=False, repr=False)
    _leases: list[_Lease] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.width < 1:
            raise ConfigError(
                f"staging area {self.name!r}: {self.num_slots} slots x {self.width} bytes must be >= 1 x 1"
            )
        self.array = np.zeros((self.num_slots, self.width), dtype=np.uint8)  # [slots, width]
        warm = min(self.num_slots, max(1, WARM_NBYTES // self.width))
        self.array[:warm].fill(0)  # these pages mapped now (written), not inside the first transfer into them

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def free_slots(self) -> np.ndarray:
        """Slots no unfinished job holds (int64, ascending)."""
        self._leases = [lease for lease in self._leases if lease.job is None or not lease.job.finished]
        busy = np.zeros(self.num_slots, dtype=bool)
        for lease in self._leases:
            busy[lease.slots] = True
        return np.flatnonzero(~busy).astype(np.int64)

    def take(self, num_slots: int) -> np.ndarray:
        """Up to `num_slots` free slots (possibly fewer, possibly none: the caller decides what a
        short lease means). Call `lend` with the job that uses them before the next `take`."""
        self._leases = [lease for lease in self._leases if lease.job is not None]  # taken, never lent: free
        slots = self.free_slots()[: max(0, num_slots)]
        if slots.size:
            self._leases.append(_Lease(slots))
        return slots

    def lend(self, slots: np.ndarray, job: Any) -> None:
        """`job` holds `slots` (from the last `take`) until it has finished."""
        for lease in reversed(self._leases):
            if lease.job is None and lease.slots is slots:
                lease.job = job
                return
        raise KeyError(f"staging area {self.name!r}: slots not taken from this area")

    def slots_in_use(self) -> int:
        """Slots unfinished jobs hold (leases never overlap: each is taken from free slots)."""
        if self._leases:
            self._leases = [lease for lease in self._leases if lease.job is None or not lease.job.finished]
        return sum(int(lease.slots.size) for lease in self._leases)


@dataclass(frozen=True, slots=True)
class StagingAreas:
    """A worker's staging: object slots for loads, object images for saves, and (only with
    register_kv_cache) header slots for the direct per-layer plans."""

    loads: StagingArea
    saves: StagingArea
    headers: StagingArea | None

    @classmethod
    def for_layout(cls, layout: CacheLayout, staging_nbytes: int, direct: bool) -> StagingAreas:
        """A quarter of `staging_nbytes` for loads (they stream through their slots a wave at a
        time) and the rest for saves (a step's new blocks must all fit: what does not is not
        saved), in object-sized slots, each side at most what the cache could use (loads: one
        slot per block; saves: two, for writes still in flight). ConfigError when the loads'
        quarter cannot hold one object."""
        row = layout.object_nbytes
        load_nbytes = staging_nbytes // 4
        if load_nbytes < row:
            raise ConfigError(
                f"staging_nbytes={staging_nbytes} must be >= {4 * row} for this layout (a quarter of it, the loads' "
                f"side, must hold one {row}-byte object); default is 512 MiB"
            )
        loads = StagingArea("loads", min(load_nbytes // row, layout.num_blocks), row)
        saves = StagingArea("saves", min((staging_nbytes - load_nbytes) // row, 2 * layout.num_blocks), row)
        headers = None
        if direct:
            width = layout.header_nbytes
            headers = StagingArea("headers", min(4 * layout.num_blocks, max(1024, HEADER_AREA_NBYTES // width)), width)
        return cls(loads, saves, headers)

    def all(self) -> tuple[StagingArea, ...]:
        return tuple(a for a in (self.loads, self.saves, self.headers) if a is not None)

    def regions(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of every area: what the worker registers with the store."""
        return [(a.ptr, a.nbytes) for a in self.all()]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.all())
