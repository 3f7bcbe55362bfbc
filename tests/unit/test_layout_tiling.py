"""Property of CacheLayout and the transfer jobs' ranges (transfer/calls.py KeyRows): over random
cache structures (K/V first or adjacent, tuples, padding, MLA, indexer and MTP caches, one
shared buffer), the header plus every layer's ranges tile each object exactly, saving moves the
caches' bytes into it and loading moves them back."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerkv.objects.header import Header
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges
from layerkv.transfer.calls import KeyRows
from tests.layouts import layer_group_template

MiB = 1 << 20


def address_of(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def block_bytes(view: torch.Tensor, block_id: int) -> bytes:
    return view[block_id].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


KINDS = ("kv_first", "kv_adjacent", "tuple_split", "tuple", "padded", "mla_tuple", "mixed_stride")


@dataclass
class Spec:
    num_blocks: int
    kinds: list[str]
    extras: list[bool]  # an indexer cache with the same layer index
    registration_order: list[int]
    mtp: bool
    shared_buffer: bool  # every main layer is a view of one [num_blocks, layers, rows, cols] tensor
    dtype: torch.dtype
    rows: int
    cols: int
    pad: int
    max_transfer_bytes: int


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    num_layers = draw(st.integers(1, 4))
    return Spec(
        num_blocks=draw(st.sampled_from([1, 3, 4, 5])),  # 2 is ambiguous for [2, 2, ...]: tested above
        kinds=draw(st.lists(st.sampled_from(KINDS), min_size=num_layers, max_size=num_layers)),
        extras=draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers)),
        registration_order=draw(st.permutations(range(num_layers))),
        mtp=draw(st.booleans()),
        shared_buffer=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.int8, torch.float16, torch.float32])),
        rows=draw(st.integers(1, 3)),
        cols=draw(st.integers(1, 5)),
        pad=draw(st.integers(0, 2)),
        max_transfer_bytes=draw(st.sampled_from([1, 3, 8, 40, MiB])),
    )


def _rand(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape, torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def build_caches(spec: Spec, seed: int | None) -> tuple[dict[str, object], list[list[torch.Tensor]]]:
    """Registered caches plus, per expected layer (object order), the entry views [num_blocks, ...].
    seed None: all zeros (a destination for loads)."""
    gen = torch.Generator().manual_seed(seed or 0)

    def make(*shape: int) -> torch.Tensor:
        t = _rand(gen, spec.dtype, *shape)
        return t if seed is not None else torch.zeros_like(t)

    nb, r, c, num_layers = spec.num_blocks, spec.rows, spec.cols, len(spec.kinds)
    big = make(nb, num_layers, r, c) if spec.shared_buffer else None
    values: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for i, kind in enumerate(spec.kinds):
        if big is not None:
            values[i] = (big[:, i], [big[:, i]])
        elif kind == "kv_first":
            t = make(2, nb, r, c)
            values[i] = (t, [t[0], t[1]])
        elif kind == "kv_adjacent":
            t = make(nb, 2, r, c)
            values[i] = (t, [t])
        elif kind == "tuple_split":
            t = make(nb, 2, r, c)
            values[i] = ((t[:, 0], t[:, 1]), [t[:, 0], t[:, 1]])
        elif kind == "tuple":
            k, v = make(nb, r, c), make(nb, r, c)
            values[i] = ((k, v), [k, v])
        elif kind == "padded":
            t = make(nb, r + spec.pad, c)[:, :r]
            values[i] = (t, [t])
        elif kind == "mixed_stride":
            # K in even slots, V starts right after K's block 0 but with another stride: no merge
            buf = make(4 * nb, r, c)
            k, v = buf[0 : 2 * nb : 2], buf[1::4][:nb]
            values[i] = ((k, v), [k, v])
        else:  # mla_tuple: latent + rope
            latent, rope = make(nb, r, c), make(nb, 1, c)
            values[i] = ((latent, rope), [latent, rope])
    caches: dict[str, object] = {}
    for i in spec.registration_order:
        caches[f"model.layers.{i}.self_attn.attn"] = values[i][0]
    expected = [list(values[i][1]) for i in range(num_layers)]
    for i, extra in enumerate(spec.extras):
        if extra:
            idx = make(nb, c, r + 1)
            caches[f"model.layers.{i}.self_attn.indexer.k_cache"] = idx
            expected[i].append(idx)
    if spec.mtp:
        m = make(2, nb, r, c)
        caches[f"model.layers.{num_layers}.mtp.attn"] = m
        expected.append([m[0], m[1]])
    return caches, expected


def check_tiling(ranges: RangeLists, object_nbytes: int) -> None:
    for sizes, offsets in zip(ranges.sizes, ranges.offsets):
        spans = sorted(zip(offsets, sizes))
        end = 0
        for offset, size in spans:
            assert size > 0 and offset == end, f"gap or overlap at {offset} (covered up to {end})"
            end = offset + size
        assert end == object_nbytes


def move(ranges: RangeLists, objects: list[bytearray], *, to_object: bool) -> None:
    for ptrs, sizes, offsets, obj in zip(ranges.ptrs, ranges.sizes, ranges.offsets, objects):
        base = address_of(obj)
        for ptr, size, offset in zip(ptrs, sizes, offsets):
            assert offset + size <= len(obj)
            if to_object:
                ctypes.memmove(base + offset, ptr, size)
            else:
                ctypes.memmove(ptr, base + offset, size)


def check_entries(layout: CacheLayout, expected: list[list[torch.Tensor]]) -> None:
    """One entry per expected view, one block of it each; an object is the header plus them all."""
    assert layout.num_layers == len(expected)
    assert [[e.block_nbytes for e in layer] for layer in layout.layers] == [
        [v[0].numel() * v.element_size() for v in layer] for layer in expected
    ]
    assert layout.object_nbytes == layout.header_nbytes + sum(
        v[0].numel() * v.element_size() for layer in expected for v in layer
    )


def encoded_headers(layout: CacheLayout, block_ids: np.ndarray) -> tuple[Header, list[str], np.ndarray]:
    """(header, keys, staging [num_keys, header_nbytes] uint8): each key's header encoded in its row."""
    num_keys = len(block_ids)
    staging = np.zeros((num_keys, layout.header_nbytes), np.uint8)
    header = Header(bytes(range(16)), layout.digest, layout.num_layers, layout.object_nbytes)
    keys = [f"k@{b}@0" for b in block_ids.tolist()]
    block_hashes = [bytes([b]) for b in block_ids.tolist()]
    header.encode_into(staging, np.arange(num_keys), block_hashes, keys, np.zeros((num_keys, 16), np.uint8), None)
    return header, keys, staging


def check_layer_ranges(layout: CacheLayout, per_layer: list[RangeLists], max_transfer_bytes: int) -> None:
    """Layer 0's ranges carry the header too, no segment is over max_transfer_bytes, and all the
    layers' ranges together tile each object."""
    segments = [layout.template(i).num_segments for i in range(layout.num_layers)]
    assert [r.num_segments for r in per_layer[1:]] == segments[1:]
    assert per_layer[0].num_segments == 1 + segments[0]
    for r in per_layer[1:]:
        assert max(max(s) for s in r.sizes) <= max_transfer_bytes
    num_keys = per_layer[0].num_keys
    joined = RangeLists(
        [sum((r.ptrs[k] for r in per_layer), []) for k in range(num_keys)],
        [sum((r.sizes[k] for r in per_layer), []) for k in range(num_keys)],
        [sum((r.offsets[k] for r in per_layer), []) for k in range(num_keys)],
        sum(r.num_segments for r in per_layer),
    )
    check_tiling(joined, layout.object_nbytes)


def check_load(
    spec: Spec,
    source: CacheLayout,
    expected: list[list[torch.Tensor]],
    block_ids: np.ndarray,
    staging: np.ndarray,
    objects: list[bytearray],
) -> None:
    """Load `objects` layer by layer into zeroed caches of the same structure (the headers into a
    fresh staging buffer): the loaded blocks hold the `expected` views' bytes, the others stay zero."""
    dst_caches, dst_expected = build_caches(spec, seed=None)
    dst = CacheLayout.from_caches(dst_caches, spec.num_blocks, max_transfer_bytes=spec.max_transfer_bytes)
    assert dst.digest == source.digest
    dst_staging = np.zeros_like(staging)
    dst_rows = KeyRows(block_ids, dst, dst_staging)
    slots = np.arange(len(block_ids))
    for i in range(dst.num_layers):
        move(dst_rows.step(i, slots), objects, to_object=False)
    assert (dst_staging == staging).all()
    for layer_src, layer_dst in zip(expected, dst_expected):
        for src, out in zip(layer_src, layer_dst):
            for b in range(spec.num_blocks):
                got = block_bytes(out, b)
                assert got == (block_bytes(src, b) if b in block_ids else bytes(len(got)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), data=st.data())
def test_ranges_tile_objects_and_move_the_tensors_bytes(spec: Spec, data: st.DataObject) -> None:
    caches, expected = build_caches(spec, seed=7)
    layout = CacheLayout.from_caches(caches, spec.num_blocks, max_transfer_bytes=spec.max_transfer_bytes)
    check_entries(layout, expected)
    block_ids = np.array(data.draw(st.lists(st.integers(0, spec.num_blocks - 1), min_size=1, max_size=4, unique=True)))
    header, keys, staging = encoded_headers(layout, block_ids)
    slots = np.arange(len(block_ids))
    rows = KeyRows(block_ids, layout, staging)  # the per-job planner the transfer jobs use
    per_layer = [rows.step(i, slots) for i in range(layout.num_layers)]
    check_layer_ranges(layout, per_layer, spec.max_transfer_bytes)
    hdr = layout.header_template(staging.ctypes.data, len(block_ids))
    whole = join_ranges((hdr, slots), (layer_group_template(layout, 0, layout.num_layers), block_ids))
    check_tiling(whole, layout.object_nbytes)
    if spec.shared_buffer and not any(spec.extras) and not spec.mtp and spec.max_transfer_bytes == MiB:
        assert layer_group_template(layout, 0, layout.num_layers).num_segments == 1

    # save: layer by layer into one object per key; the whole-object template gives the same bytes
    objects = [bytearray(layout.object_nbytes) for _ in block_ids]
    for r in per_layer:
        move(r, objects, to_object=True)
    for k, b in enumerate(block_ids.tolist()):
        want = staging[k].tobytes() + b"".join(block_bytes(v, b) for layer in expected for v in layer)
        assert bytes(objects[k]) == want
        header.verify(objects[k][: layout.header_nbytes], bytes([b]), keys[k])
    again = [bytearray(layout.object_nbytes) for _ in block_ids]
    move(whole, again, to_object=True)
    assert again == objects

    # load: into zeroed caches of the same structure
    check_load(spec, layout, expected, block_ids, staging, objects)
