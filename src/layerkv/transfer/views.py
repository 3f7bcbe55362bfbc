"""The registered KV caches as the transfer threads see them: `CacheViews`, one view per cache
segment, indexed by block id, built once at registration on the compute thread and read-only
afterwards. The jobs use them to tag a block's layer (host caches) and to fan a loaded block out
to other blocks; the staged paths copy through them (transfer/staged.py).

    segment s of layer l:  view[b] = the nbytes bytes of block b  (object bytes [offset, offset + nbytes))

Host caches get numpy views over their addresses; device caches get torch uint8 views on their
device, cut from the registered tensors' storages (no host reads of device memory). A segment
that lies in no registered tensor is a LayoutError at registration.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.seal import RowSealers, Sealer
from layerkv.transfer.device import DeviceCopies, copies_for


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
        device path (torch views and copies, no host tags). `copies`: how device copies
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
        return sealer.indexed_tags(contexts, layer_idx, [v.blocks for v in views], block_ids.tolist())

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
