"""The registered KV caches as the transfer threads see them, built once at registration on the
compute thread and read-only afterwards:

* `CacheViews`: one view per cache segment, indexed by block id: what the jobs use to tag a
  block's layer and fan a loaded block out to other blocks.

      segment s of layer l:  view[b] = the nbytes bytes of block b  (object bytes [offset, offset + nbytes))

* `StagedLayers`: transfers through staging. Per key, the contiguous object span of layers
  l..l+k-1 (a `LayerGroup`) is read as ONE range into a registered host staging row, then copied
  into the paged KV cache with one vectorised copy per cache segment (fan-out blocks included)
  and verified where no peer can change the bytes any more (`publish`: in the cache for host
  caches, in a private host copy for device caches); saves gather a layer of every key from the
  cache into its object image the same way, tagged before it reaches staging (`gather_sealed`).

      object:   | header | L0 | L1 | L2 | L3 | L4 | ...      groups (k=2): [0,1) [1,3) [3,5) ...
      staging:  row i = key i's span of one group  ->  cache[block] for every segment of the group

Host caches get numpy views and copies; device caches get torch uint8 views on their device and
torch copies (no host reads of device memory), the only device-specific code of the data path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.seal import TAG_NBYTES, RowSealers, Sealer
from layerkv.transfer.device import DeviceCopies, Marker, as_numpy, copies_for

if TYPE_CHECKING:
    from layerkv.transfer.checks import ObjectChecks


@dataclass(frozen=True, slots=True, eq=False)
class SegmentView:
    """`blocks[b]` is block b's bytes of one segment; they sit at [object_offset,
    object_offset + nbytes) of every object."""

    blocks: Any  # numpy uint8 [num_blocks, nbytes] (host) or torch uint8 [num_blocks, nbytes] (device)
    object_offset: int
    nbytes: int


class CacheViews:
    """Per layer, the segment views of a registered layout (object order)."""

    def __init__(
        self,
        layout: CacheLayout,
        caches: Mapping[str, Any] | None = None,
        *,
        on_host: bool | None = None,
        copies: DeviceCopies | None = None,
    ) -> None:
        """`on_host` defaults to the caches' device; False on CPU torch caches exercises the
        device path (torch views and copies, no host checksums). `copies`: how device copies
        are ordered (default: the caches' device's, transfer/device.py)."""
        self.layout = layout
        self.on_host = layout.device_type == "cpu" if on_host is None else on_host
        self.device: Any = "cpu"
        if self.on_host:
            self.layers = tuple(_host_views(layout, li) for li in range(layout.num_layers))
        else:
            if caches is None:
                raise LayoutError(f"views of {layout.device_type} caches need the registered tensors")
            storages = _storages(caches)
            self.layers = tuple(_device_views(layout, li, storages) for li in range(layout.num_layers))
            self.device = storages[0][2].device
        self.copies: DeviceCopies = copies if copies is not None else copies_for(self.device)

    def tags(
        self, layer_idx: int, block_ids: np.ndarray, contexts: Sequence[bytes], sealer: Sealer | RowSealers
    ) -> np.ndarray:
        """Each block's tag of its layer bytes in object order (layerkv.objects.seal): uint8
        [len(block_ids), 16]. Host caches only (device caches are not read from the host)."""
        assert self.on_host, "tags of device caches are not computed on the host"
        views = self.layers[layer_idx]
        return sealer.rows_tags(contexts, layer_idx, [v.blocks for v in views], block_ids.tolist())

    def copy_blocks(self, layer_idx: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """cache[dst_ids[j]] <- cache[src_ids[j]] for every segment of the layer (host: numpy,
        device: one device copy per segment)."""
        if len(dst_ids) == 0:
            return
        for view in self.layers[layer_idx]:
            if self.on_host:
                view.blocks[dst_ids] = view.blocks[src_ids]
            else:
                import torch

                dev = view.blocks.device
                view.blocks[torch.as_tensor(dst_ids, device=dev)] = view.blocks[torch.as_tensor(src_ids, device=dev)]


def _host_views(layout: CacheLayout, layer_idx: int) -> tuple[SegmentView, ...]:
    template = layout.template(layer_idx)
    views = []
    for ptr, stride, nbytes, offset in zip(
        template.base_ptrs.tolist(),
        template.strides_nbytes.tolist(),
        template.nbytes.tolist(),
        template.object_offsets.tolist(),
    ):
        extent = (layout.num_blocks - 1) * stride + nbytes  # never past the last block's bytes
        flat = np.frombuffer((ctypes.c_char * extent).from_address(ptr), dtype=np.uint8)
        blocks = np.lib.stride_tricks.as_strided(flat, shape=(layout.num_blocks, nbytes), strides=(stride, 1))
        views.append(SegmentView(blocks, offset, nbytes))
    return tuple(views)


def _storages(caches: Mapping[str, Any]) -> list[tuple[int, int, Any]]:
    """(start ptr, nbytes, uint8 torch view of the whole storage) of every registered tensor."""
    import torch

    seen: dict[int, tuple[int, int, Any]] = {}
    for value in caches.values():
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen:
                flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                seen[ptr] = (ptr, storage.nbytes(), flat)
    return list(seen.values())


def _device_views(layout: CacheLayout, layer_idx: int, storages: list[tuple[int, int, Any]]) -> tuple[SegmentView, ...]:
    import torch

    template = layout.template(layer_idx)
    views = []
    for ptr, stride, nbytes, offset in zip(
        template.base_ptrs.tolist(),
        template.strides_nbytes.tolist(),
        template.nbytes.tolist(),
        template.object_offsets.tolist(),
    ):
        extent = (layout.num_blocks - 1) * stride + nbytes
        owner = next((s for s in storages if s[0] <= ptr and ptr + extent <= s[0] + s[1]), None)
        if owner is None:
            raise LayoutError(f"layer {layer_idx}: segment at {ptr:#x} (+{extent} bytes) lies in no registered tensor")
        blocks = torch.as_strided(owner[2], (layout.num_blocks, nbytes), (stride, 1), ptr - owner[0])
        views.append(SegmentView(blocks, offset, nbytes))
    return tuple(views)


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
    return groups_of(layout, tuple(bounds[1:]))


def groups_of(layout: CacheLayout, group_ends: tuple[int, ...]) -> tuple[LayerGroup, ...]:
    """The groups [0, e0), [e0, e1), ... (exclusive ends); the first one includes the header."""
    groups, first = [], 0
    for end in group_ends:
        start = 0 if first == 0 else layout.layer_offset(first)
        stop = layout.layer_offset(end - 1) + layout.layer_nbytes(end - 1)
        groups.append(LayerGroup(first, end, start, stop - start))
        first = end
    return tuple(groups)


class StagedLayers:
    """Layer groups of a layout plus views of every cache segment (numpy on the host, torch on a
    device)."""

    def __init__(self, views: CacheViews) -> None:
        layout = views.layout
        self.on_host = views.on_host
        self.layout = layout
        self._cache = views
        self.row_nbytes = layout.object_nbytes  # staging row width: any group, or the whole object
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
        sealer = checks.sealer(rows)
        bad = np.zeros(0, dtype=np.int64)
        if self.on_host and not sealer.encrypts:
            self.scatter(group, staging, slots, block_ids[rows])
            if rows.size:
                contexts = checks.contexts(rows)
                tags = np.empty((rows.size, len(layers), TAG_NBYTES), dtype=np.uint8)
                ids = block_ids[rows].tolist()
                for j, li in enumerate(layers):  # in the cache: no peer can change these bytes
                    tags[:, j] = sealer.rows_tags(contexts, li, [v.blocks for v in self._views[li]], ids)
                ok = checks.layers(group.first_layer, rows, tags)
                rows, bad = rows[ok], rows[~ok]
            fan = np.isin(extra_rows, rows)
            for li in layers:
                self._cache.copy_blocks(li, block_ids[extra_rows[fan]], extra_blocks[fan])
            return layer_nbytes * (int(rows.size) + int(fan.sum())), bad, None
        # device caches and encrypted objects: verified (decrypted) in a private copy, then copied
        host = self._cache.copies.pinned((len(slots), group.span_nbytes)) if not self.on_host else None
        if host is None:  # host caches, encrypted: fancy indexing makes an unregistered copy
            private = staging[slots, : group.span_nbytes]
        else:  # pinned, so that the side stream copies it to the device asynchronously
            private = as_numpy(host)
            np.take(staging[:, : group.span_nbytes], slots, axis=0, out=private)
        local = np.arange(rows.size, dtype=np.int64)
        if rows.size:
            contexts = checks.contexts(rows)
            if sealer.encrypts:
                ok = checks.judge(group.first_layer, rows, ~self.open(group, private, rows, contexts, checks))
            else:
                ok = checks.layers(group.first_layer, rows, self.tags(group, private, local, contexts, sealer))
            rows, local, bad = rows[ok], local[ok], rows[~ok]
        local_of_row = np.full(len(block_ids), -1, dtype=np.int64)
        local_of_row[rows] = local
        fan = local_of_row[extra_rows] >= 0 if extra_rows.size else np.zeros(0, dtype=bool)
        targets = np.concatenate([block_ids[rows], extra_blocks[fan]])
        sources = np.concatenate([local, local_of_row[extra_rows[fan]]])
        if host is None:
            self.scatter(group, private, sources, targets)
            return layer_nbytes * int(targets.size), bad, None
        marker = self.scatter_device(group, host, sources, targets, after)
        return layer_nbytes * int(targets.size), bad, marker

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
            tags = sealer.rows_tags(
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
        """Tags of each layer of `group` in staging rows `slots` (spans of the group): uint8
        [len(slots), layers in group, 16] (the same values CacheViews.tags gives for a block)."""
        out = np.empty((len(slots), group.end_layer - group.first_layer, TAG_NBYTES), dtype=np.uint8)
        for j, layer_idx in enumerate(range(group.first_layer, group.end_layer)):
            col = self.layout.layer_offset(layer_idx) - group.span_start
            width = self.layout.layer_nbytes(layer_idx)
            out[:, j] = sealer.rows_tags(contexts, layer_idx, [staging[:, col : col + width]], slots.tolist())
        return out
