"""The one range builder of the transfer jobs: for each key of a job its local block and its
staging row, turned into the range lists a store call moves: a layer's segments in the cache,
the header slot alone, the header slot followed by layer 0 (what a per-layer load reads first),
or a group's span of the object through staging rows (group and whole-object reads, staged
writes). Built on the compute thread, then read-only; the transfer threads use it without locks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges
from layerkv.transfer.staged import LayerGroup


class KeyRows:
    def __init__(self, block_ids: Sequence[int] | np.ndarray, layout: CacheLayout, staging: np.ndarray,
                 slots: np.ndarray | None = None) -> None:
        """`staging`: uint8 [rows, >= header_nbytes], registered with the store; row
        `slots[i]` (default i) holds key i's header."""
        self.layout = layout
        self._staging = staging
        self.block_ids = np.array(block_ids, dtype=np.int64)  # [keys]
        self._slots = np.arange(len(self.block_ids), dtype=np.int64) if slots is None else slots[: len(self.block_ids)]
        self._header = layout.header_template(staging.ctypes.data, staging.shape[0], staging.strides[0])

    def layer(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """`layer_idx`'s ranges for the keys at `rows` (one inner list per row)."""
        return self.layout.template(layer_idx).ranges(self.block_ids[rows])

    def header(self, rows: np.ndarray) -> RangeLists:
        """The header slot of each key at `rows` <-> object bytes [0, header_nbytes)."""
        return self._header.ranges(self._slots[rows])

    def header_and_layer(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """Header slot ranges followed by `layer_idx`'s ranges, per key (a load's first read)."""
        return join_ranges((self._header, self._slots[rows]), (self.layout.template(layer_idx), self.block_ids[rows]))

    def step(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """What a layerwise transfer moves for `layer_idx`: layer 0 carries the header."""
        return self.header_and_layer(0, rows) if layer_idx == 0 else self.layer(layer_idx, rows)

    def span(self, group: LayerGroup, slots: np.ndarray) -> RangeLists:
        """`group`'s span of the object <-> staging row `slots[i]`, one inner list per slot; the
        span is split into pieces of at most max_transfer_bytes."""
        staging = self._staging
        if (slots.size and int(slots.max()) >= staging.shape[0]) or group.span_nbytes > staging.shape[1]:
            raise LayoutError(f"staging {list(staging.shape)} is too small for slots up to {int(slots.max())} x "
                              f"{group.span_nbytes} bytes")
        piece = self.layout.max_transfer_bytes
        starts = np.arange(0, group.span_nbytes, piece, dtype=np.int64)  # [pieces]
        sizes_row = np.minimum(piece, group.span_nbytes - starts).tolist()
        offsets_row = (group.span_start + starts).tolist()
        slot_ptrs = staging.ctypes.data + slots.astype(np.int64) * staging.strides[0]
        ptrs = (slot_ptrs[:, None] + starts[None, :]).tolist()  # [slots, pieces]
        return RangeLists(ptrs, [sizes_row] * len(slots), [offsets_row] * len(slots), len(sizes_row))
