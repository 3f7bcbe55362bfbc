"""The rows a step job moves: for each key its local block and its header staging slot, turned
into one layer's range lists (the header travels with layer 0). Built on the compute thread,
then read-only; the load or save thread uses it without locks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerkv.layout import CacheLayout
from layerkv.ranges import RangeLists


class KeyRows:
    def __init__(self, block_ids: Sequence[int], layout: CacheLayout, staging: np.ndarray) -> None:
        """`staging`: uint8 [>= len(block_ids), header_nbytes], registered with the store; row i
        holds key i's header."""
        self.layout = layout
        self.block_ids = np.array(block_ids, dtype=np.int64)  # [keys]
        self._slots = np.arange(len(self.block_ids), dtype=np.int64)  # [keys]
        self._header = layout.header_template(staging.ctypes.data, staging.shape[0], staging.strides[0])

    def ranges(self, layer_idx: int, rows: np.ndarray) -> RangeLists:
        """Range lists of `layer_idx` for the keys at `rows` (one inner list per row)."""
        return self.layout.step_ranges(layer_idx, self.block_ids[rows], self._header, self._slots[rows])
