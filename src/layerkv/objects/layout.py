"""Registered KV caches -> the object layout: layer order, cache entries, header and object
sizes, layout digest and the per-layer range templates. Worker side; built once when the engine
registers its caches, then read-only and shared by the send / receive threads without locks.

One object per (block, storage rank); entries of a layer in registration order:

    0        header_nbytes                                              object_nbytes
    | header | L0 e0 | L0 e1 | L1 e0 | L1 e1 | ... | L(n-1) e.. | MTP/draft layers ... |
             ^ layer_offset(0)       ^ layer_offset(1) = header + bytes of layer 0

An entry is usable when one block of it is one dense byte run, in whatever physical order its
dimensions have (vLLM's LBHNC and LBNHC keep [H, N, C] resp. [N, H, C] of a block together;
the cross-layer BLHNC / BLNHC also put the layers of a block side by side). That byte order
is part of the signature, so caches that order a block differently never share objects.
Layouts that scatter one block (vLLM's LHBNC, BHLNC: heads outside blocks) are refused.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerkv.errors import LayoutError
from layerkv.objects.header import header_nbytes_for
from layerkv.objects.ranges import Segment, SegmentTemplate

LayerName = str
_LAYERS_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_ANY_INDEX_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_DRAFT_RE = re.compile(r"mtp|draft", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cache of one layer: block b lives at base_ptr + b * block_stride_nbytes
    (block_nbytes contiguous bytes) and at object_offset in every object."""

    layer_name: LayerName
    layer_idx: int
    entry_idx: int  # position within the layer
    base_ptr: int
    block_stride_nbytes: int
    block_nbytes: int
    block_shape: tuple[int, ...]  # shape of one block of this entry
    dtype: str
    device_type: str
    object_offset: int
    # Logical dims of block_shape with size > 1, outermost in memory first: ascending for a
    # C-contiguous block; e.g. (1, 0, 2) for a [H, N, C] view stored as [N, H, C] (LBNHC).
    block_order: tuple[int, ...] = ()

    @property
    def is_c_order(self) -> bool:
        return list(self.block_order) == sorted(self.block_order)

    @property
    def segment(self) -> Segment:
        return Segment(self.base_ptr, self.block_stride_nbytes, self.block_nbytes, self.object_offset)


@dataclass(frozen=True, slots=True)
class _ArrayInfo:
    """What layerkv needs from a torch tensor or numpy array (strides in bytes)."""

    ptr: int
    shape: tuple[int, ...]
    strides_nbytes: tuple[int, ...]
    itemsize: int
    dtype: str
    device_type: str


@dataclass(frozen=True, slots=True)
class _RawEntry:
    layer_name: LayerName
    base_ptr: int
    block_stride_nbytes: int
    block_nbytes: int
    block_shape: tuple[int, ...]
    dtype: str
    device_type: str
    block_order: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class CacheLayout:
    """Build with `CacheLayout.from_caches(caches, num_blocks, max_transfer_bytes=...)`."""

    layers: tuple[tuple[CacheEntry, ...], ...]  # [layer_idx][entry_idx]
    num_blocks: int
    header_nbytes: int
    object_nbytes: int
    max_transfer_bytes: int
    device_type: str
    signature: str  # stable text: layers, entries, per-block shape, byte order, dtype, bytes
    digest: bytes  # 16 bytes of sha256(signature)
    _layer_idx_by_name: Mapping[LayerName, int] = field(repr=False)
    _templates: tuple[SegmentTemplate, ...] = field(repr=False)

    @classmethod
    def from_caches(
        cls, caches: Mapping[LayerName, Any], num_blocks: int, *, max_transfer_bytes: int, kv_first: bool | None = None
    ) -> CacheLayout:
        """Describe `caches` (layer name -> tensor / array, or a tuple of them; torch or numpy).
        `kv_first` resolves a single tensor whose shape fits both `[2, num_blocks, ...]` (True)
        and `[num_blocks, ...]` (False); left None, such a shape raises LayoutError."""
        if num_blocks < 1:
            raise LayoutError(f"num_blocks={num_blocks} must be >= 1")
        if max_transfer_bytes <= 0:
            raise LayoutError(f"max_transfer_bytes={max_transfer_bytes} must be > 0; default is 16 MiB")
        if not caches:
            raise LayoutError("no KV caches registered: caches is empty")
        grouped: dict[tuple[bool, int], list[_RawEntry]] = {}
        owners: dict[tuple[bool, int], tuple[str, LayerName]] = {}  # layer -> (module prefix, first name)
        for name, value in caches.items():
            key = _layer_sort_key(name)
            prefix = _layer_prefix(name)
            first = owners.setdefault(key, (prefix, name))
            if first[0] != prefix:  # several caches of one layer share its module path; others are a clash
                raise LayoutError(
                    f"cache names {first[1]!r} and {name!r} both parse to layer index {key[1]} but belong to "
                    f"different modules ({first[0]!r}, {prefix!r}); layerkv keys layers by index: rename the caches"
                )
            grouped.setdefault(key, []).extend(_entries_of(name, value, num_blocks, kv_first))
        device_types = sorted({e.device_type for group in grouped.values() for e in group})
        if len(device_types) != 1:
            raise LayoutError(f"KV caches live on several device types {device_types}; layerkv needs one")
        header_nbytes = header_nbytes_for(len(grouped))
        layers, offset = _place(grouped, header_nbytes)
        signature = _signature(layers)
        templates = tuple(
            SegmentTemplate.build([e.segment for e in layer], num_blocks, max_transfer_bytes) for layer in layers
        )
        return cls(
            layers=layers,
            num_blocks=num_blocks,
            header_nbytes=header_nbytes,
            object_nbytes=offset,
            max_transfer_bytes=max_transfer_bytes,
            device_type=device_types[0],
            signature=signature,
            digest=hashlib.sha256(signature.encode()).digest()[:16],
            _layer_idx_by_name={e.layer_name: e.layer_idx for layer in layers for e in layer},
            _templates=templates,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> tuple[LayerName, ...]:
        """Registered names in object order (a layer with several entries repeats no name
        unless the engine registered it twice)."""
        return tuple(dict.fromkeys(e.layer_name for layer in self.layers for e in layer))

    def layer_index(self, name: LayerName) -> int:
        """Layer index of a registered cache name (engines call hooks by name)."""
        try:
            return self._layer_idx_by_name[name]
        except KeyError:
            raise LayoutError(f"layer name {name!r} was not registered with the KV caches") from None

    def layer_offset(self, layer_idx: int) -> int:
        return self.layers[layer_idx][0].object_offset

    def layer_nbytes(self, layer_idx: int) -> int:
        return sum(e.block_nbytes for e in self.layers[layer_idx])

    def template(self, layer_idx: int) -> SegmentTemplate:
        """Segments of one layer (object offsets are absolute, header included)."""
        return self._templates[layer_idx]

    def header_template(
        self, staging_ptr: int, num_slots: int, slot_stride_nbytes: int | None = None
    ) -> SegmentTemplate:
        """The header segment: slot s of a host staging buffer at staging_ptr + s * stride
        <-> object bytes [0, header_nbytes). Never split (header <= 4 KiB <= max transfer)."""
        stride = self.header_nbytes if slot_stride_nbytes is None else slot_stride_nbytes
        if stride < self.header_nbytes:
            raise LayoutError(f"slot_stride_nbytes={stride} must be >= header_nbytes={self.header_nbytes}")
        return SegmentTemplate.build(
            [Segment(staging_ptr, stride, self.header_nbytes, 0)],
            num_slots,
            max(self.max_transfer_bytes, self.header_nbytes),
        )


def _layer_sort_key(name: LayerName) -> tuple[bool, int]:
    """(is_draft, index parsed from the name): main layers first, then MTP / draft layers."""
    match = _LAYERS_RE.search(name) or _ANY_INDEX_RE.search(name)
    if match is None:
        raise LayoutError(
            f"cannot parse a layer index from cache name {name!r}: expected 'layers.<N>' or '.<N>.' in the name"
        )
    return (_DRAFT_RE.search(name) is not None, int(match.group(1)))


def _layer_prefix(name: LayerName) -> str:
    """The name up to the parsed layer index ('model.layers.3' of 'model.layers.3.self_attn.attn')."""
    match = _LAYERS_RE.search(name) or _ANY_INDEX_RE.search(name)
    assert match is not None  # _layer_sort_key raised otherwise
    return name[: match.end(1)]


def _place(
    grouped: dict[tuple[bool, int], list[_RawEntry]], header_nbytes: int
) -> tuple[tuple[tuple[CacheEntry, ...], ...], int]:
    """Assign layer indices and object offsets; returns the layers and the object size."""
    layers: list[tuple[CacheEntry, ...]] = []
    offset = header_nbytes
    for layer_idx, key in enumerate(sorted(grouped)):
        entries = []
        for entry_idx, raw in enumerate(grouped[key]):
            entries.append(
                CacheEntry(
                    raw.layer_name,
                    layer_idx,
                    entry_idx,
                    raw.base_ptr,
                    raw.block_stride_nbytes,
                    raw.block_nbytes,
                    raw.block_shape,
                    raw.dtype,
                    raw.device_type,
                    offset,
                    raw.block_order,
                )
            )
            offset += raw.block_nbytes
        layers.append(tuple(entries))
    return tuple(layers), offset


def _signature(layers: Sequence[Sequence[CacheEntry]]) -> str:
    """Stable text of what makes objects (in)compatible: per layer, per entry the per-block
    shape, dtype and bytes, and the byte order inside a block when it is not C order
    (`@order=1,0,2`: a [H, N, C] block stored as [N, H, C]). Names and addresses are
    deliberately left out, and so is where the layers of a block sit (their object bytes
    are the same)."""
    parts = [f"layerkv-layout-v1;layers={len(layers)}"]
    for layer in layers:
        parts.append("|".join(_entry_signature(e) for e in layer))
    return ";".join(parts)


def _entry_signature(entry: CacheEntry) -> str:
    text = f"{'x'.join(map(str, entry.block_shape))}:{entry.dtype}:{entry.block_nbytes}"
    return text if entry.is_c_order else f"{text}@order={','.join(map(str, entry.block_order))}"


def _info(name: LayerName, value: Any) -> _ArrayInfo:
    if isinstance(value, np.ndarray):
        return _ArrayInfo(
            int(value.__array_interface__["data"][0]),
            tuple(value.shape),
            tuple(value.strides),
            int(value.itemsize),
            str(value.dtype),
            "cpu",
        )
    if all(hasattr(value, a) for a in ("data_ptr", "stride", "element_size", "shape", "device")):
        itemsize = int(value.element_size())
        return _ArrayInfo(
            int(value.data_ptr()),
            tuple(int(s) for s in value.shape),
            tuple(int(s) * itemsize for s in value.stride()),
            itemsize,
            str(value.dtype).removeprefix("torch."),
            str(value.device.type),
        )
    raise LayoutError(
        f"cache {name!r} is a {type(value).__name__}; expected a torch tensor, numpy array or a tuple of them"
    )


def _entries_of(name: LayerName, value: Any, num_blocks: int, kv_first: bool | None) -> list[_RawEntry]:
    """Entries of one registered cache value, in object order. Never guesses: an unsupported
    or ambiguous shape raises LayoutError naming the layer and the shape."""
    if isinstance(value, (tuple, list)):
        if not value:
            raise LayoutError(f"cache {name!r} is an empty {type(value).__name__}")
        infos = [_info(name, v) for v in value]
        for i, info in enumerate(infos):
            if len(info.shape) < 2 or info.shape[0] != num_blocks:
                raise LayoutError(
                    f"cache {name!r} element {i} has shape {list(info.shape)}; tuple elements must be "
                    f"[num_blocks={num_blocks}, ...] with at least 2 dims"
                )
        return [
            _block_entry(
                name, info, info.ptr, info.strides_nbytes[0], info.shape[1:], info.strides_nbytes[1:], num_blocks
            )
            for info in infos
        ]
    info = _info(name, value)
    shape, strides = info.shape, info.strides_nbytes
    fits_kv_first = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    fits_blocks_first = len(shape) >= 2 and shape[0] == num_blocks
    if fits_kv_first and fits_blocks_first:
        if kv_first is None:
            raise LayoutError(
                f"cache {name!r} shape {list(shape)} is ambiguous with num_blocks={num_blocks}: it fits both "
                f"[2, num_blocks, ...] and [num_blocks, ...]; pass kv_first=True or kv_first=False"
            )
        fits_kv_first, fits_blocks_first = kv_first, not kv_first
    if fits_kv_first:
        return [
            _block_entry(name, info, info.ptr + kv * strides[0], strides[1], shape[2:], strides[2:], num_blocks)
            for kv in range(2)
        ]
    if fits_blocks_first:
        return [_block_entry(name, info, info.ptr, strides[0], shape[1:], strides[1:], num_blocks)]
    raise LayoutError(
        f"cache {name!r} has unsupported shape {list(shape)} for num_blocks={num_blocks}: expected "
        f"[2, num_blocks, ...], [num_blocks, ...] or a tuple of [num_blocks, ...] tensors"
    )


def _block_entry(
    name: LayerName,
    info: _ArrayInfo,
    base_ptr: int,
    block_stride_nbytes: int,
    block_shape: tuple[int, ...],
    block_strides: tuple[int, ...],
    num_blocks: int,
) -> _RawEntry:
    """One entry whose block b is the dense sub-array at base_ptr + b * stride, its dims in
    any physical order (recorded in `block_order`)."""
    block_nbytes = math.prod(block_shape) * info.itemsize
    if block_nbytes == 0:
        raise LayoutError(f"cache {name!r} shape {list(info.shape)} has zero bytes per block")
    order = _dense_order(block_shape, block_strides, info.itemsize)
    if order is None:
        raise LayoutError(
            f"cache {name!r} shape {list(info.shape)} strides(bytes) {list(info.strides_nbytes)}: "
            f"one block is not contiguous in memory (its bytes are not one run in any dimension order); "
            f"layerkv needs each block of a layer in one byte run: with vLLM use a layout such as LBHNC, "
            f"LBNHC, BLHNC or BLNHC, not LHBNC or BHLNC"
        )
    if num_blocks == 1:
        block_stride_nbytes = block_nbytes
    elif block_stride_nbytes < block_nbytes:
        raise LayoutError(
            f"cache {name!r} shape {list(info.shape)}: block stride {block_stride_nbytes} bytes is smaller "
            f"than one block ({block_nbytes} bytes); blocks would overlap"
        )
    return _RawEntry(
        name, base_ptr, block_stride_nbytes, block_nbytes, tuple(block_shape), info.dtype, info.device_type, order
    )


def _dense_order(shape: Sequence[int], strides_nbytes: Sequence[int], itemsize: int) -> tuple[int, ...] | None:
    """The dims of size > 1, outermost in memory first, if they tile one dense byte run
    (innermost stride = itemsize, each next stride = the previous run); None otherwise.
    Size-1 dims carry no bytes of their own, so their strides do not matter."""
    dims = sorted((i for i, size in enumerate(shape) if size != 1), key=lambda i: (-strides_nbytes[i], i))
    expected = itemsize
    for i in reversed(dims):
        if strides_nbytes[i] != expected:
            return None
        expected *= shape[i]
    return tuple(dims)
