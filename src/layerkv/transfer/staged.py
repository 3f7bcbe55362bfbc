"""`StagedLayers`: transfers of the registered caches through staging. Per key, the contiguous
object span of layers l..l+k-1 (a `LayerGroup`, transfer/groups.py) is read as ONE range into a
registered host staging slot, then copied into the paged KV cache with one vectorised copy per
cache segment (fan-out blocks included) and verified where no peer can change the bytes any more
(`publish`: in the cache for host caches, in a private host copy for device caches); saves
gather a layer of every key from the cache into its object image the same way, tagged before it
reaches staging (`gather_sealed`).

    object:   | header | L0 | L1 | L2 | L3 | L4 | ...      groups (k=2): [0,1) [1,3) [3,5) ...
    staging:  row i = key i's span of one group  ->  cache[block] for every segment of the group

Host caches get numpy copies; device caches get torch copies on a side stream (transfer/device.py),
the only device-specific code of the data path. Called on a job's thread (load: the receive
thread, under its cache-writes lock; save: the send thread); built once at registration.
Verification failures are rows returned as bad, never exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from layerkv.objects.seal import TAG_NBYTES, RowSealers, Sealer
from layerkv.transfer.device import Marker, as_numpy
from layerkv.transfer.groups import LayerGroup
from layerkv.transfer.views import CacheViews

if TYPE_CHECKING:
    from layerkv.transfer.checks import ObjectChecks


class StagedLayers:
    """Layer groups of a layout plus views of every cache segment (numpy on the host, torch on a
    device)."""

    def __init__(self, views: CacheViews) -> None:
        layout = views.layout
        self.on_host = views.on_host
        self.layout = layout
        self._cache = views
        self.row_nbytes = layout.object_nbytes  # staging slot width: any group, or the whole object
        self._views = views.layers  # [layer][segment]

    def scatter(self, group: LayerGroup, staging: np.ndarray, slots: np.ndarray, block_ids: np.ndarray) -> None:
        """Host caches: cache[block_ids[j]] <- staging[slots[j]] for every segment of every
        layer of `group` (one fancy-indexed copy per segment; a slot may feed several blocks)."""
        if block_ids.size == 0:
            return
        n = int(slots.size)
        first = int(slots[0]) if n else 0
        in_order = n > 0 and int(slots[-1]) == first + n - 1 and bool(np.all(np.diff(slots) == 1))
        for layer_idx in range(group.first_layer, group.end_layer):
            for seg in self._views[layer_idx]:
                col = seg.object_offset - group.span_start
                src = (
                    staging[first : first + n, col : col + seg.nbytes]
                    if in_order
                    else staging[slots, col : col + seg.nbytes]
                )
                seg.blocks[block_ids] = src

    def scatter_device(
        self, group: LayerGroup, private: Any, local: np.ndarray, block_ids: np.ndarray, after: Marker
    ) -> Marker:
        """Device caches: cache[block_ids[j]] <- private[local[j]] for every segment of `group`,
        queued on the side stream once `after` is reached (transfer/device.py): one copy of the
        pinned rows to the device, then one indexed copy per segment there (device memory: those
        rows plus one segment of the targets at a time). Returns the marker of the copies'
        completion (None when they ran at once)."""
        if block_ids.size == 0:
            return None
        device, views, copies = self._cache.device, self._views, self._cache.copies

        def enqueue() -> None:
            rows = private.to(device, non_blocking=True)  # [rows, span] from pinned memory
            sources, ids = copies.index(local, device), copies.index(block_ids, device)
            for layer_idx in range(group.first_layer, group.end_layer):
                for seg in views[layer_idx]:  # one segment's worth of temporary at a time, fan-out included
                    col = seg.object_offset - group.span_start
                    seg.blocks[ids] = rows[sources, col : col + seg.nbytes]

        return self._cache.copies.run_after(after, enqueue)

    def publish(
        self,
        group: LayerGroup,
        staging: np.ndarray,
        rows: np.ndarray,
        slots: np.ndarray,
        block_ids: np.ndarray,
        fan_out: tuple[np.ndarray, np.ndarray],
        checks: ObjectChecks,
        after: Marker = None,
    ) -> tuple[int, np.ndarray, Marker]:
        """Copy `group` of the keys `rows` (block `block_ids[row]`, read into staging `slots`)
        into the cache, verified where no peer can change the bytes any more: host caches are
        copied first and their tags computed in the cache (staging stays writable by anyone who
        reaches the store's ports), device caches are tagged in a private host copy and copied
        from it. `fan_out` = (row, block) pairs that also want a key, copied only from a verified
        key. Device copies wait for `after` (the step's start) on the side stream. Returns
        (bytes copied, the rows that failed, the marker of the device copies: None for host
        caches and copies that ran at once). The caller holds its cache-writes lock."""
        extra_rows, extra_blocks = fan_out
        layers = range(group.first_layer, group.end_layer)
        layer_nbytes = sum(self.layout.layer_nbytes(li) for li in layers)
        if self.on_host and not checks.sealer(rows).encrypts:
            self.scatter(group, staging, slots, block_ids[rows])
            ok = self._verify_in_cache(group, rows, block_ids, checks)
            rows, bad = rows[ok], rows[~ok]
            fan = np.isin(extra_rows, rows)
            for li in layers:
                self._cache.copy_blocks(li, block_ids[extra_rows[fan]], extra_blocks[fan])
            return layer_nbytes * (int(rows.size) + int(fan.sum())), bad, None
        # device caches and encrypted objects: verified (decrypted) in a private copy, then copied
        host, private = self._private_copy(group, staging, slots)
        ok = self._verify_private(group, private, rows, checks)
        local = np.arange(rows.size, dtype=np.int64)[ok]
        rows, bad = rows[ok], rows[~ok]
        sources, targets = _with_fan_out(rows, local, block_ids, fan_out)
        if host is None:
            self.scatter(group, private, sources, targets)
            return layer_nbytes * int(targets.size), bad, None
        marker = self.scatter_device(group, host, sources, targets, after)
        return layer_nbytes * int(targets.size), bad, marker

    def _verify_in_cache(
        self, group: LayerGroup, rows: np.ndarray, block_ids: np.ndarray, checks: ObjectChecks
    ) -> np.ndarray:
        """Host caches, unencrypted: mask of `rows` whose layers of `group`, already copied into
        their blocks, match their headers' tags (computed in the cache: no peer can change them)."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        layers = range(group.first_layer, group.end_layer)
        sealer, contexts, ids = checks.sealer(rows), checks.contexts(rows), block_ids[rows].tolist()
        tags = np.empty((rows.size, len(layers), TAG_NBYTES), dtype=np.uint8)
        for j, li in enumerate(layers):
            tags[:, j] = sealer.indexed_tags(contexts, li, [v.blocks for v in self._views[li]], ids)
        return checks.layers(group.first_layer, rows, tags)

    def _private_copy(self, group: LayerGroup, staging: np.ndarray, slots: np.ndarray) -> tuple[Any, np.ndarray]:
        """(pinned tensor or None, its numpy view): `group`'s span of staging `slots`, copied
        where no peer can write it (row i = slots[i])."""
        if self.on_host:  # host caches, encrypted: fancy indexing makes an unregistered copy
            return None, staging[slots, : group.span_nbytes]
        host = self._cache.copies.pinned((len(slots), group.span_nbytes))
        private = as_numpy(host)  # pinned, so that the side stream copies it to the device asynchronously
        np.take(staging[:, : group.span_nbytes], slots, axis=0, out=private)
        return host, private

    def _verify_private(
        self, group: LayerGroup, private: np.ndarray, rows: np.ndarray, checks: ObjectChecks
    ) -> np.ndarray:
        """Mask of `rows` (row i of `private`) whose layers of `group` verify: decrypted in
        place (encrypted objects) or tagged there."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        sealer, contexts = checks.sealer(rows), checks.contexts(rows)
        if sealer.encrypts:
            return checks.judge(group.first_layer, rows, ~self.open(group, private, rows, contexts, checks))
        local = np.arange(rows.size, dtype=np.int64)
        return checks.layers(group.first_layer, rows, self.tags(group, private, local, contexts, sealer))

    def open(
        self, group: LayerGroup, private: np.ndarray, rows: np.ndarray, contexts: Sequence[bytes], checks: ObjectChecks
    ) -> np.ndarray:
        """Decrypt each layer of `group` in `private` (row i = key rows[i]'s span) in place,
        against the tags the headers carry; returns bool [rows, layers of group]: decrypted."""
        out = np.empty((rows.size, group.end_layer - group.first_layer), dtype=bool)
        for j, layer_idx in enumerate(range(group.first_layer, group.end_layer)):
            col = self.layout.layer_offset(layer_idx) - group.span_start
            width = self.layout.layer_nbytes(layer_idx)
            want = checks.expected(rows, layer_idx)
            out[:, j] = checks.sealer(rows).open_layers(
                contexts, layer_idx, [private[i, col : col + width] for i in range(rows.size)], want
            )
        return out

    def gather_sealed(
        self,
        layer_idx: int,
        staging: np.ndarray,
        slots: np.ndarray,
        block_ids: np.ndarray,
        contexts: Sequence[bytes],
        sealer: Sealer,
        after: Marker = None,
    ) -> np.ndarray:
        """`gather` plus the layer's tags (uint8 [len(slots), 16]), computed where no peer can
        change the bytes: in the cache (host caches) or in the private pinned copies (device
        caches), never in staging, which anyone who reaches the store's ports may write while we
        tag (a tag over bytes a peer slipped in would be valid). An encrypting sealer gathers
        into private memory, encrypts there and puts only ciphertext into staging. `after`: the
        compute marker of the layer (device caches)."""
        col, width = self.layout.layer_offset(layer_idx), self.layout.layer_nbytes(layer_idx)
        if not sealer.encrypts:
            segments, ids = self._private_layer(layer_idx, block_ids, after)
            tags = sealer.indexed_tags(
                contexts, layer_idx, segments, range(len(block_ids)) if ids is None else ids.tolist()
            )
            self._stage(layer_idx, staging, slots, segments, ids)
            return tags
        private = np.empty((len(slots), col + width), dtype=np.uint8)  # the layer at its object offset
        self.gather(layer_idx, private, np.arange(len(slots), dtype=np.int64), block_ids, after)
        spans = [private[i, col:] for i in range(len(slots))]
        tags = sealer.seal_layers(contexts, layer_idx, spans)
        staging[slots, col : col + width] = private[:, col:]
        return tags

    def gather(
        self, layer_idx: int, staging: np.ndarray, slots: np.ndarray, block_ids: np.ndarray, after: Marker = None
    ) -> None:
        """staging[slots[j]] <- cache[block_ids[j]] for every segment of `layer_idx`, at the
        layer's place in the object image (rows are whole objects: header first). Device
        caches: copied into pinned buffers on the side stream once `after` (the layer's
        compute marker) is reached; this thread waits for that copy alone."""
        segments, ids = self._private_layer(layer_idx, block_ids, after)
        self._stage(layer_idx, staging, slots, segments, ids)

    def _private_layer(
        self, layer_idx: int, block_ids: np.ndarray, after: Marker
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """The layer's segments (object order) as host arrays no peer can write, and the row of
        each block in them: the cache itself (host caches), or pinned copies of the blocks made
        on the side stream once `after` is reached (device caches, rows in order: None; this
        thread waits for them)."""
        views = self._views[layer_idx]
        if self.on_host:
            return [seg.blocks for seg in views], block_ids
        copies, device = self._cache.copies, self._cache.device
        hosts = [copies.pinned((len(block_ids), seg.nbytes)) for seg in views]

        def enqueue() -> None:
            ids = copies.index(block_ids, device)
            for seg, host in zip(views, hosts):
                host.copy_(seg.blocks[ids], non_blocking=True)

        copies.host_wait(copies.run_after(after, enqueue, save=True))
        return [as_numpy(host) for host in hosts], None

    def _stage(
        self, layer_idx: int, staging: np.ndarray, slots: np.ndarray, segments: list[np.ndarray], ids: np.ndarray | None
    ) -> None:
        for seg, src in zip(self._views[layer_idx], segments):
            staging[slots, seg.object_offset : seg.object_offset + seg.nbytes] = src if ids is None else src[ids]

    def tags(
        self,
        group: LayerGroup,
        staging: np.ndarray,
        slots: np.ndarray,
        contexts: Sequence[bytes],
        sealer: Sealer | RowSealers,
    ) -> np.ndarray:
        """Tags of each layer of `group` in staging slots `slots` (spans of the group): uint8
        [len(slots), layers in group, 16] (the same values CacheViews.tags gives for a block)."""
        out = np.empty((len(slots), group.end_layer - group.first_layer, TAG_NBYTES), dtype=np.uint8)
        for j, layer_idx in enumerate(range(group.first_layer, group.end_layer)):
            col = self.layout.layer_offset(layer_idx) - group.span_start
            width = self.layout.layer_nbytes(layer_idx)
            out[:, j] = sealer.indexed_tags(contexts, layer_idx, [staging[:, col : col + width]], slots.tolist())
        return out


def _with_fan_out(
    rows: np.ndarray, local: np.ndarray, block_ids: np.ndarray, fan_out: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(sources, targets): private row `local[j]` into block `block_ids[rows[j]]`, then into
    every fan-out block (row, block) whose row is among the verified `rows`."""
    extra_rows, extra_blocks = fan_out
    local_of_row = np.full(len(block_ids), -1, dtype=np.int64)
    local_of_row[rows] = local
    fan = local_of_row[extra_rows] >= 0 if extra_rows.size else np.zeros(0, dtype=bool)
    targets = np.concatenate([block_ids[rows], extra_blocks[fan]])
    sources = np.concatenate([local, local_of_row[extra_rows[fan]]])
    return sources, targets
