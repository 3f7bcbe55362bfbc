"""The embedded store's host memory: one fixed numpy uint8 arena, a first-fit allocator with
coalescing, and the range copy between raw host pointers and the arena. Any side; not
thread-safe by itself: the embedded store calls it under its one lock.
"""

from __future__ import annotations

import bisect
import ctypes
import operator
from collections.abc import Sequence

import numpy as np

from layerkv.errors import ConfigError
from layerkv.store.base import Code

INVALID_PARAMS = int(Code.INVALID_PARAMS)

ALIGN_BYTES = 64  # every allocation starts on a cache line


def _round_up(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class Arena:
    """`capacity_bytes` of host memory handed out as `(offset, nbytes)` extents.

    Free extents are kept sorted by offset; `alloc` takes the first that fits, `free` merges
    with both neighbours, so a fully freed arena is one extent again.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes={capacity_bytes} must be > 0")
        self.capacity_bytes = capacity_bytes
        self.buffer = np.zeros(capacity_bytes, dtype=np.uint8)  # [capacity_bytes]
        self.base_ptr = int(self.buffer.ctypes.data)
        self._free_offsets: list[int] = [0]  # sorted
        self._free_sizes: list[int] = [capacity_bytes]  # parallel to _free_offsets
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every free extent, by offset (tests, stats)."""
        return list(zip(self._free_offsets, self._free_sizes))

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new extent of `nbytes` (rounded up to ALIGN_BYTES), None if no free
        extent is large enough."""
        need = _round_up(max(nbytes, 1))
        for i, size in enumerate(self._free_sizes):
            if size >= need:
                offset = self._free_offsets[i]
                if size == need:
                    del self._free_offsets[i]
                    del self._free_sizes[i]
                else:
                    self._free_offsets[i] = offset + need
                    self._free_sizes[i] = size - need
                self.used_bytes += need
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent `alloc` gave for `nbytes` at `offset`, merging neighbours."""
        size = _round_up(max(nbytes, 1))
        i = bisect.bisect_left(self._free_offsets, offset)
        assert i == len(self._free_offsets) or self._free_offsets[i] >= offset + size, "double free"
        assert i == 0 or self._free_offsets[i - 1] + self._free_sizes[i - 1] <= offset, "double free"
        self.used_bytes -= size
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes[i]  # merge with the next extent
            del self._free_offsets[i]
            del self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size  # merge into the previous extent
            return
        self._free_offsets.insert(i, offset)
        self._free_sizes.insert(i, size)

    def close(self) -> None:
        self.buffer = np.zeros(0, dtype=np.uint8)
        self.base_ptr = 0


def copy_ranges(dst_ptrs: Sequence[int], src_ptrs: Sequence[int], sizes: Sequence[int]) -> int:
    """memmove each range `src_ptrs[i] -> dst_ptrs[i]` of `sizes[i]` bytes; returns the bytes
    moved. Ranges that are adjacent on both sides (the common case for object offsets of a
    layer's blocks written from one contiguous cache) are merged into one memmove first.
    """
    n = len(sizes)
    if n == 0:
        return 0
    if n > 8:
        dst = np.asarray(dst_ptrs, dtype=np.int64)
        src = np.asarray(src_ptrs, dtype=np.int64)
        size = np.asarray(sizes, dtype=np.int64)
        # a new run starts where either side is not contiguous with the previous range
        breaks = np.flatnonzero((dst[1:] != dst[:-1] + size[:-1]) | (src[1:] != src[:-1] + size[:-1])) + 1
        if len(breaks) < n - 1:
            starts = np.concatenate(([0], breaks))
            run_sizes = np.add.reduceat(size, starts)
            dst_ptrs, src_ptrs, sizes = dst[starts].tolist(), src[starts].tolist(), run_sizes.tolist()
            total = int(run_sizes.sum())
            for d, s, k in zip(dst_ptrs, src_ptrs, sizes):
                ctypes.memmove(d, s, k)
            return total
    total = 0
    memmove = ctypes.memmove
    for d, s, k in zip(dst_ptrs, src_ptrs, sizes):
        memmove(d, s, k)
        total += k
    return total


class HostRegions:
    """Registered host memory regions `[ptr, ptr + nbytes)` of one client, sorted by start; a
    region registered again keeps its larger extent. Not thread-safe (the store's lock)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []  # parallel to _starts

    def add(self, ptr: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._starts, ptr)
        if i < len(self._starts) and self._starts[i] == ptr:
            self._ends[i] = max(self._ends[i], ptr + nbytes)
            return
        self._starts.insert(i, ptr)
        self._ends.insert(i, ptr + nbytes)

    def remove(self, ptr: int) -> None:
        i = bisect.bisect_left(self._starts, ptr)
        if i < len(self._starts) and self._starts[i] == ptr:
            del self._starts[i], self._ends[i]

    def holds(self, ptr: int, nbytes: int) -> bool:
        """[ptr, ptr + nbytes) lies inside one region."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._ends[i]


def is_index(value: object) -> bool:
    """An int-like value (numpy integers too), not a float."""
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_ranges(ptrs: Sequence[int], sizes: Sequence[int], offsets: Sequence[int], object_nbytes: int) -> int:
    """Total bytes of a key's ranges, or -600 (INVALID_PARAMS) if any range is malformed or
    outside the object."""
    if not len(ptrs) == len(sizes) == len(offsets):
        return INVALID_PARAMS
    total = 0
    for ptr, nbytes, offset in zip(ptrs, sizes, offsets):
        if nbytes < 0 or offset < 0 or offset + nbytes > object_nbytes or (nbytes and not ptr):
            return INVALID_PARAMS
        total += nbytes
    return total
