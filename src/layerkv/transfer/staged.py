"""Staged layer-group reads (load side, host caches only): per key, the contiguous object span of
layers l..l+k-1 is read as ONE range into a registered host staging row, then scattered into the
paged KV cache with one vectorised numpy copy per cache segment (fan-out blocks included). Built
once per worker on the compute thread; read-only afterwards, used by the receive thread.

    object:   | header | L0 | L1 | L2 | L3 | L4 | ...      groups (k=2): [0,1) [1,3) [3,5) ...
    staging:  row i = key i's span of one group  ->  cache[block] for every segment of the group
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from layerkv.errors import LayoutError
from layerkv.layout import CacheLayout
from layerkv.ranges import RangeLists


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers [first_layer, end_layer) read together: object bytes [span_start, span_start +
    span_nbytes). The group of layer 0 starts at 0 (the header travels with it)."""

    first_layer: int
    end_layer: int
    span_start: int
    span_nbytes: int

    @property
    def label(self) -> str:
        last = self.end_layer - 1
        return f"layer {self.first_layer}" if last == self.first_layer else f"layers {self.first_layer}..{last}"


def layer_groups(layout: CacheLayout, layers_per_range: int) -> tuple[LayerGroup, ...]:
    """Layer 0 alone (compute can start early), then groups of `layers_per_range` layers; the
    last group holds what is left."""
    if layers_per_range < 1:
        raise LayoutError(f"layers_per_range={layers_per_range} must be >= 1")
    n = layout.num_layers
    bounds = [0, *range(1, n, layers_per_range), n] if n > 1 else [0, 1]
    groups = []
    for first, end in zip(bounds, bounds[1:]):
        start = 0 if first == 0 else layout.layer_offset(first)
        stop = layout.layer_offset(end - 1) + layout.layer_nbytes(end - 1)
        groups.append(LayerGroup(first, end, start, stop - start))
    return tuple(groups)


@dataclass(frozen=True, slots=True, eq=False)
class _SegmentView:
    """One segment of one layer: `blocks[b]` is block b's bytes in the cache, found at
    [object_offset, object_offset + nbytes) of the object."""

    blocks: np.ndarray  # uint8 [num_blocks, nbytes], a strided view over the cache memory
    object_offset: int
    nbytes: int


class StagedLayers:
    """Layer groups of a host-memory layout plus numpy views of every cache segment."""

    def __init__(self, layout: CacheLayout, layers_per_range: int) -> None:
        if layout.device_type != "cpu":
            raise LayoutError(f"staged layer-group reads need host caches; these live on {layout.device_type}")
        self.layout = layout
        self.groups = layer_groups(layout, layers_per_range)
        self.row_nbytes = max(g.span_nbytes for g in self.groups)  # staging row width
        self._views = tuple(_layer_views(layout, l) for l in range(layout.num_layers))  # [layer][segment]

    def ranges(self, group: LayerGroup, staging: np.ndarray, num_slots: int) -> RangeLists:
        """Range lists reading `group`'s span of key i into staging slot i (i < num_slots); the
        span is split into pieces of at most max_transfer_bytes."""
        if num_slots > staging.shape[0] or group.span_nbytes > staging.shape[1]:
            raise LayoutError(f"staging {list(staging.shape)} is too small for {num_slots} keys x {group.span_nbytes} bytes")
        piece = self.layout.max_transfer_bytes
        starts = np.arange(0, group.span_nbytes, piece, dtype=np.int64)  # [pieces]
        sizes_row = np.minimum(piece, group.span_nbytes - starts).tolist()
        offsets_row = (group.span_start + starts).tolist()
        slot_ptrs = staging.ctypes.data + np.arange(num_slots, dtype=np.int64) * staging.strides[0]
        ptrs = (slot_ptrs[:, None] + starts[None, :]).tolist()  # [num_slots, pieces]
        return RangeLists(ptrs, [sizes_row] * num_slots, [offsets_row] * num_slots, len(sizes_row))

    def scatter(self, group: LayerGroup, staging: np.ndarray, slots: np.ndarray, block_ids: np.ndarray) -> None:
        """cache[block_ids[j]] <- staging[slots[j]] for every segment of every layer of `group`
        (one fancy-indexed copy per segment; a slot may feed several blocks)."""
        if block_ids.size == 0:
            return
        n = int(slots.size)
        in_order = n > 0 and int(slots[0]) == 0 and int(slots[-1]) == n - 1 and bool(np.all(np.diff(slots) == 1))
        for layer_idx in range(group.first_layer, group.end_layer):
            for seg in self._views[layer_idx]:
                col = seg.object_offset - group.span_start
                src = staging[:n, col : col + seg.nbytes] if in_order else staging[slots, col : col + seg.nbytes]
                seg.blocks[block_ids] = src


def _layer_views(layout: CacheLayout, layer_idx: int) -> tuple[_SegmentView, ...]:
    template = layout.template(layer_idx)
    views = []
    for ptr, stride, nbytes, offset in zip(
        template.base_ptrs.tolist(), template.strides_nbytes.tolist(), template.nbytes.tolist(), template.object_offsets.tolist()
    ):
        extent = (layout.num_blocks - 1) * stride + nbytes  # never past the last block's bytes
        flat = np.frombuffer((ctypes.c_char * extent).from_address(ptr), dtype=np.uint8)
        blocks = np.lib.stride_tricks.as_strided(flat, shape=(layout.num_blocks, nbytes), strides=(stride, 1))
        views.append(_SegmentView(blocks, offset, nbytes))
    return tuple(views)
