"""Range templates: per-layer (or whole-object, or header-staging) segment tables built once at
registration, turned into the per-key ptr / size / offset lists of a range call by numpy
broadcasting over block ids. Worker side; templates are immutable and shared by the send and
receive threads without locks.

    ptrs[i, s]    = base_ptr[s] + block_ids[i] * stride_nbytes[s]     local address
    sizes[i, s]   = nbytes[s]
    offsets[i, s] = object_offset[s]                                  offset in the object
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from layerkv.errors import LayoutError


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes [object_offset, object_offset + nbytes) of every object live locally at
    base_ptr + block_id * stride_nbytes (contiguous)."""

    base_ptr: int
    stride_nbytes: int
    nbytes: int
    object_offset: int


@dataclass(frozen=True, slots=True)
class RangeLists:
    """Arguments of one batched range call: one inner list per key (block), all of equal length.
    The inner lists of `sizes` and `offsets` are one shared row (the same for every key): read
    them, never mutate them."""

    ptrs: list[list[int]]
    sizes: list[list[int]]
    offsets: list[list[int]]
    num_segments: int  # per key

    @property
    def num_keys(self) -> int:
        return len(self.ptrs)


@dataclass(frozen=True, slots=True, eq=False)
class SegmentTemplate:
    """Merged and split segments of one layer (or of all layers, or of the header slot).
    `num_rows` bounds the ids accepted by `columns` / `ranges` (num_blocks or staging slots)."""

    base_ptrs: np.ndarray  # int64 [num_segments]
    strides_nbytes: np.ndarray  # int64 [num_segments]
    nbytes: np.ndarray  # int64 [num_segments]
    object_offsets: np.ndarray  # int64 [num_segments]
    num_rows: int

    @classmethod
    def build(cls, segments: Sequence[Segment], num_rows: int, max_transfer_bytes: int) -> SegmentTemplate:
        """Merge neighbours adjacent both locally and in the object, then split pieces larger
        than `max_transfer_bytes`. `segments` must be in object order."""
        if max_transfer_bytes <= 0:
            raise LayoutError(f"max_transfer_bytes={max_transfer_bytes} must be > 0; default is 16 MiB")
        pieces = [piece for seg in merge_segments(segments) for piece in split_segment(seg, max_transfer_bytes)]
        cols = np.array(
            [(p.base_ptr, p.stride_nbytes, p.nbytes, p.object_offset) for p in pieces], dtype=np.int64
        ).reshape(-1, 4)
        return cls(cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy(), cols[:, 3].copy(), num_rows)

    @property
    def num_segments(self) -> int:
        return int(self.base_ptrs.shape[0])

    def columns(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 arrays [len(ids), num_segments]: local addresses, sizes, object offsets."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise LayoutError(f"block ids must be a 1-D integer array, got {ids.dtype} shape {ids.shape}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise LayoutError(
                f"block ids must be in [0, {self.num_rows}), got min={int(ids.min())} max={int(ids.max())}"
            )
        shape = (ids.shape[0], self.num_segments)
        ptrs = self.base_ptrs[None, :] + ids[:, None] * self.strides_nbytes[None, :]
        sizes = np.broadcast_to(self.nbytes[None, :], shape)
        offsets = np.broadcast_to(self.object_offsets[None, :], shape)
        return ptrs, sizes, offsets

    def ranges(self, ids: np.ndarray) -> RangeLists:
        """Per-key lists for a range call over `ids` (one inner list per id, same order)."""
        return join_ranges((self, ids))


def join_ranges(*parts: tuple[SegmentTemplate, np.ndarray]) -> RangeLists:
    """Concatenate several templates' segments per key, e.g. the header staging slots then
    layer 0: `join_ranges((header_tpl, slot_ids), (layer0_tpl, block_ids))`. All id arrays
    must have the same length (one row per key)."""
    lengths = {len(ids) for _, ids in parts}
    if len(lengths) != 1:
        raise LayoutError(f"join_ranges needs one id per key in every part, got lengths {sorted(lengths)}")
    cols = [tpl.columns(ids) for tpl, ids in parts]
    ptrs = np.concatenate([c[0] for c in cols], axis=1)
    num_keys = ptrs.shape[0]
    # sizes and offsets are the same for every key: one shared row (callers only read the lists)
    sizes_row = [int(n) for c in cols for n in c[1][0]] if num_keys else []
    offsets_row = [int(o) for c in cols for o in c[2][0]] if num_keys else []
    return RangeLists(ptrs.tolist(), [sizes_row] * num_keys, [offsets_row] * num_keys, int(ptrs.shape[1]))


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Merge each segment into its predecessor when both are adjacent in the object and in
    local memory with the same block stride."""
    merged: list[Segment] = []
    for seg in segments:
        if merged:
            prev = merged[-1]
            if (
                prev.stride_nbytes == seg.stride_nbytes
                and prev.base_ptr + prev.nbytes == seg.base_ptr
                and prev.object_offset + prev.nbytes == seg.object_offset
            ):
                merged[-1] = Segment(prev.base_ptr, prev.stride_nbytes, prev.nbytes + seg.nbytes, prev.object_offset)
                continue
        merged.append(seg)
    return merged


def split_segment(seg: Segment, max_transfer_bytes: int) -> list[Segment]:
    """Pieces of at most `max_transfer_bytes` covering `seg` in order."""
    return [
        Segment(
            seg.base_ptr + start,
            seg.stride_nbytes,
            min(max_transfer_bytes, seg.nbytes - start),
            seg.object_offset + start,
        )
        for start in range(0, seg.nbytes, max_transfer_bytes)
    ]
