"""The rows a step job moves: for each key its local block and its header staging slot, turned
into range lists: a layer's segments, the header slot alone, or the header slot followed by
layer 0 (what a load reads first). Built on the compute thread, then read-only; the load or save
thread uses it without locks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges


class KeyRows:
    def __init__(self, block_ids: Sequence[int] | np.ndarray, layout: CacheLayout, staging: np.ndarray,
                 slots: np.ndarray | None = None) -> None:
        """`staging`: uint8 [rows, >= header_nbytes], registered with the store; row
        `slots[i]` (default i) holds key i's header."""
        self.layout = layout
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
