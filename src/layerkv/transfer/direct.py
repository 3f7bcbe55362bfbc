"""The direct per-layer read path of a load (LAYERS plans: only with `register_kv_cache`, host
caches and objects that are not encrypted): layer l of every active key is read straight into
its cache blocks, one range list per key split over the job's lanes, with no staging slot but
the header's (layer 0 brings the header into the key's staging slot). Then, under the job's
cache-writes lock, each block's layer is tagged in the cache and compared with the tag its
header carried, and copied to the key's other blocks (fan-out) from a verified block only.

    receive:  read layer l (ranges -> cache blocks) ── tags in the cache ── fan-out copies

Called by `LoadJob` on the receive thread only. Failures are rows failed through the job's
`fail` (a short read, a tag mismatch), never exceptions. Device caches and encrypted objects
cannot be verified in the cache and never take this path (LayoutError). Unlike staging, a read
still inside the store after the job gave up may write blocks the engine has reused
(docs/data-safety.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from layerkv.errors import LayoutError
from layerkv.transfer.calls import JobReads, KeyRows
from layerkv.transfer.checks import ObjectChecks
from layerkv.transfer.views import CacheViews


class DirectLayers:
    def __init__(
        self,
        rows: KeyRows,
        views: CacheViews,
        reads: JobReads,
        checks: ObjectChecks,
        fan_out: tuple[np.ndarray, np.ndarray],  # (row, block) pairs beyond each key's first block
        fail: Callable[[np.ndarray, str], None],
    ) -> None:
        if not views.on_host or checks.encrypts:
            raise LayoutError(
                "per-layer reads straight into a device cache (or of encrypted objects) cannot be "
                "verified there; they go through staging"
            )
        self._rows, self._views, self._reads, self._checks = rows, views, reads, checks
        self._extra_rows, self._extra_blocks = fan_out
        self._fail = fail

    def read(self, layer_idx: int, active: np.ndarray) -> np.ndarray:
        """Read `layer_idx` of the keys `active` into their first blocks (layer 0: the header
        into its staging slot too); the rows read in full (the others failed)."""
        return self._reads.ranges(
            active, lambda rows: self._rows.step(layer_idx, rows), layer_idx, f"layer {layer_idx}"
        )

    def publish(self, layer_idx: int, rows: np.ndarray) -> None:
        """Verify `layer_idx` of `rows` in their blocks, then fan the verified ones out. The
        caller holds its cache-writes lock, has not given up and (layer 0) verified the headers."""
        good = rows[self._verify(layer_idx, rows)]
        fan = np.isin(self._extra_rows, good)
        self._views.copy_blocks(layer_idx, self._rows.block_ids[self._extra_rows[fan]], self._extra_blocks[fan])

    def _verify(self, layer_idx: int, rows: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose freshly read layer (in the cache) matches the header's tag."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        tags = self._views.tags(
            layer_idx, self._rows.block_ids[rows], self._checks.contexts(rows), self._checks.sealer(rows)
        )
        ok = self._checks.layers(layer_idx, rows, tags.reshape(rows.size, 1, -1))
        if not ok.all():
            self._fail(rows[~ok], "layer tag mismatch")
        return ok
