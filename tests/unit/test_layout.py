from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerkv.errors import LayoutError
from layerkv.objects.header import Header
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges
from layerkv.transfer.calls import KeyRows
from tests.layouts import layer_group_template, layers_adjacent

MiB = 1 << 20


def address_of(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def block_bytes(view: torch.Tensor, block_id: int) -> bytes:
    return view[block_id].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------------
# Layer order, entries, offsets


def test_llama_style_layout_offsets_and_names() -> None:
    nb = 5
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, nb, 16, 2, 8, dtype=torch.float16) for i in (1, 0)}
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    block = 16 * 2 * 8 * 2
    assert layout.num_layers == 2 and layout.header_nbytes == 256
    assert layout.object_nbytes == 256 + 4 * block
    assert layout.layer_index("model.layers.0.self_attn.attn") == 0
    assert layout.layer_index("model.layers.1.self_attn.attn") == 1
    assert [layout.layer_offset(i) for i in range(2)] == [256, 256 + 2 * block]
    assert layout.layers[1][1].object_offset == 256 + 3 * block
    k0 = layout.layers[0][0]
    t = caches["model.layers.0.self_attn.attn"]
    assert (k0.base_ptr, k0.block_stride_nbytes, k0.block_nbytes) == (t.data_ptr(), block, block)
    assert layout.layers[0][1].base_ptr == t[1].data_ptr()
    assert [layout.template(li).num_segments for li in range(2)] == [2, 2]  # K and V blocks are not adjacent in memory
    assert layout.device_type == "cpu" and k0.dtype == "float16"
    with pytest.raises(LayoutError, match="layer name 'model.layers.9.attn' was not registered"):
        layout.layer_index("model.layers.9.attn")


def test_indexer_cache_joins_its_layer_and_mtp_goes_last() -> None:
    nb = 3
    caches = {
        "model.layers.0.mtp_block.attn": np.zeros((nb, 4, 4), np.float32),  # draft: after main layers
        "model.layers.1.self_attn.attn": np.zeros((nb, 2, 4, 4), np.float16),
        "model.layers.0.self_attn.attn": np.zeros((nb, 2, 4, 4), np.float16),
        "model.layers.0.self_attn.indexer.k_cache": np.zeros((nb, 4, 2), np.uint8),
    }
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    assert layout.num_layers == 3
    names = [[e.layer_name for e in layer] for layer in layout.layers]
    assert names == [
        ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"],  # one module: one layer
        ["model.layers.1.self_attn.attn"],
        ["model.layers.0.mtp_block.attn"],
    ]
    assert layout.layer_index("model.layers.0.self_attn.indexer.k_cache") == 0
    assert layout.layer_index("model.layers.0.mtp_block.attn") == 2
    assert layout.layer_names[:2] == ("model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache")
    assert layout.layer_nbytes(0) == 2 * 4 * 4 * 2 + 4 * 2


def test_caches_of_different_modules_with_one_layer_index_are_rejected() -> None:
    nb = 3
    caches = {
        "model.layers.0.mtp_block.attn": np.zeros((nb, 4, 4), np.float32),
        "draft.layers.0.attn": np.zeros((nb, 4, 4), np.float32),
    }  # both draft layer 0: which is it?
    with pytest.raises(
        LayoutError,
        match=r"cache names 'model.layers.0.mtp_block.attn' and 'draft.layers.0.attn' both "
        r"parse to layer index 0 but belong to different modules",
    ):
        CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    with pytest.raises(LayoutError, match="both parse to layer index 1"):
        CacheLayout.from_caches(
            {"encoder.layers.1.attn": np.zeros((nb, 8)), "decoder.layers.1.attn": np.zeros((nb, 8))},
            nb,
            max_transfer_bytes=MiB,
        )


def test_draft_layers_with_same_index_share_a_layer() -> None:
    nb = 3
    caches = {
        "model.layers.2.attn": np.zeros((nb, 8), np.float32),
        "mtp.layers.0.attn": np.zeros((nb, 8), np.float32),
        "mtp.layers.0.indexer": np.zeros((nb, 8), np.float32),
    }
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    assert layout.num_layers == 2
    assert [e.layer_name for e in layout.layers[1]] == ["mtp.layers.0.attn", "mtp.layers.0.indexer"]


def test_signature_ignores_addresses_but_not_shapes() -> None:
    def build(dtype: np.dtype, shape: tuple[int, ...]) -> CacheLayout:
        return CacheLayout.from_caches({"layers.0": np.zeros(shape, dtype)}, 4, max_transfer_bytes=MiB)

    a, b = build(np.float16, (4, 2, 8)), build(np.float16, (4, 2, 8))
    assert a.digest == b.digest and a.signature == b.signature and len(a.digest) == 16
    assert build(np.float16, (4, 8, 2)).digest != a.digest  # same bytes, different block shape
    assert build(np.int16, (4, 2, 8)).digest != a.digest  # same bytes, different dtype
    assert build(np.float16, (2, 4, 2, 4)).digest != a.digest  # K/V split: two entries


def test_kv_adjacent_tuple_merges_and_large_segments_split() -> None:
    nb = 4
    base = torch.zeros(nb, 2, 8, 16, dtype=torch.float32)  # [num_blocks, K/V, tokens, dim]: 512 B each
    layout = CacheLayout.from_caches({"layers.0": (base[:, 0], base[:, 1])}, nb, max_transfer_bytes=300)
    tpl = layout.template(0)
    # one merged 1024-byte segment split into 300 + 300 + 300 + 124
    assert tpl.num_segments == 4 and tpl.nbytes.tolist() == [300, 300, 300, 124]
    ranges = tpl.ranges(np.array([2, 0]))
    assert ranges.num_keys == 2 and ranges.num_segments == 4
    assert ranges.ptrs[0][0] == base[2].data_ptr() and ranges.ptrs[1][3] == base[0].data_ptr() + 900
    assert ranges.offsets[0] == [256, 556, 856, 1156]
    assert ranges.sizes[1] == [300, 300, 300, 124]


def test_whole_object_template_merges_layers_of_one_buffer() -> None:
    nb = 3
    big = torch.zeros(nb, 4, 2, 8, dtype=torch.float16)  # [num_blocks, layers, K/V, dim]
    caches = {f"layers.{i}": big[:, i] for i in range(4)}
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    assert [layout.template(li).num_segments for li in range(4)] == [1, 1, 1, 1]
    whole = layer_group_template(layout, 0, 4)
    assert whole.num_segments == 1 and whole.nbytes.tolist() == [4 * 2 * 8 * 2]


def test_header_template_and_join() -> None:
    layout = CacheLayout.from_caches({"layers.0": np.zeros((4, 64), np.float32)}, 4, max_transfer_bytes=4096)
    staging = np.zeros((8, 256), np.uint8)
    hdr = layout.header_template(staging.ctypes.data, num_slots=8, slot_stride_nbytes=256)
    out = join_ranges((hdr, np.array([5, 6])), (layout.template(0), np.array([3, 1])))
    assert out.num_segments == 2
    assert out.ptrs[0] == [staging.ctypes.data + 5 * 256, layout.layers[0][0].base_ptr + 3 * 256]
    assert out.sizes[1] == [256, 256] and out.offsets[1] == [0, 256]
    with pytest.raises(LayoutError, match="slot_stride_nbytes=100 must be >= header_nbytes=256"):
        layout.header_template(staging.ctypes.data, 8, 100)
    with pytest.raises(LayoutError, match=r"join_ranges needs one id per key in every part, got lengths \[1, 2\]"):
        join_ranges((hdr, np.array([0])), (layout.template(0), np.array([0, 1])))


def test_ranges_check_block_ids() -> None:
    layout = CacheLayout.from_caches({"layers.0": np.zeros((4, 64), np.float32)}, 4, max_transfer_bytes=4096)
    with pytest.raises(LayoutError, match=r"block ids must be in \[0, 4\), got min=0 max=4"):
        layout.template(0).ranges(np.array([0, 4]))
    with pytest.raises(LayoutError, match=r"block ids must be a 1-D integer array, got float64"):
        layout.template(0).ranges(np.array([0.0]))
    assert layout.template(0).ranges(np.array([], dtype=np.int64)) == RangeLists([], [], [], 1)


# --------------------------------------------------------------------------------------------
# Bad layouts: each error names the layer and the shape


@pytest.mark.parametrize(
    ("caches", "num_blocks", "message"),
    [
        ({}, 4, "no KV caches registered"),
        ({"layers.0": np.zeros((4, 8))}, 0, "num_blocks=0 must be >= 1"),
        ({"attn": np.zeros((4, 8))}, 4, "cannot parse a layer index from cache name 'attn'"),
        ({"layers.0": np.zeros((3, 8))}, 4, r"cache 'layers.0' has unsupported shape \[3, 8\] for num_blocks=4"),
        ({"layers.0": np.zeros((4,))}, 4, r"cache 'layers.0' has unsupported shape \[4\]"),
        ({"layers.0": np.zeros((2, 3, 8))}, 4, r"cache 'layers.0' has unsupported shape \[2, 3, 8\]"),
        (
            {"layers.0": np.zeros((2, 2, 8))},
            2,
            r"cache 'layers.0' shape \[2, 2, 8\] is ambiguous with num_blocks=2.*pass kv_first=True or kv_first=False",
        ),
        (
            {"layers.0": (np.zeros((4, 8)), np.zeros((3, 8)))},
            4,
            r"cache 'layers.0' element 1 has shape \[3, 8\]; tuple elements must be \[num_blocks=4, ...\]",
        ),
        ({"layers.0": ()}, 4, "cache 'layers.0' is an empty tuple"),
        ({"layers.0": [1, 2]}, 4, "cache 'layers.0' is a int; expected a torch tensor, numpy array"),
        ({"layers.0": np.zeros((4, 0))}, 4, r"cache 'layers.0' shape \[4, 0\] has zero bytes per block"),
        (
            {"layers.0": np.zeros((4, 8, 6))[:, :, :3]},
            4,
            r"cache 'layers.0' shape \[4, 8, 3\] strides\(bytes\) \[384, 48, 8\]: one block is not contiguous",
        ),
        (
            {"layers.0": np.zeros((8, 4)).T},
            4,
            r"cache 'layers.0' shape \[4, 8\] strides\(bytes\) \[8, 32\]: one block is not contiguous",
        ),
        (
            {"layers.0": np.lib.stride_tricks.as_strided(np.zeros(64), shape=(4, 8), strides=(16, 8))},
            4,
            r"cache 'layers.0' shape \[4, 8\]: block stride 16 bytes is smaller than one block \(64 bytes\)",
        ),
    ],
)
def test_bad_layouts_raise_layout_error(caches: dict, num_blocks: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        CacheLayout.from_caches(caches, num_blocks, max_transfer_bytes=MiB)


def test_ambiguous_shape_resolved_by_hint() -> None:
    t = np.zeros((2, 2, 8), np.float32)
    kv = CacheLayout.from_caches({"layers.0": t}, 2, max_transfer_bytes=MiB, kv_first=True)
    assert [e.block_nbytes for e in kv.layers[0]] == [32, 32]
    assert kv.layers[0][0].block_stride_nbytes == 32 and kv.layers[0][1].base_ptr == t.ctypes.data + 64
    blocks = CacheLayout.from_caches({"layers.0": t}, 2, max_transfer_bytes=MiB, kv_first=False)
    assert [e.block_nbytes for e in blocks.layers[0]] == [64]


def test_bad_max_transfer_bytes_and_mixed_devices() -> None:
    with pytest.raises(LayoutError, match="max_transfer_bytes=0 must be > 0; default is 16 MiB"):
        CacheLayout.from_caches({"layers.0": np.zeros((4, 8))}, 4, max_transfer_bytes=0)

    @dataclass
    class _Device:
        type: str

    class FakeDeviceTensor:  # a device tensor as layerkv sees one (no device memory is touched)
        shape = (4, 8)
        device = _Device("cuda")
        dtype = "torch.float16"

        def data_ptr(self) -> int:
            return 1 << 20

        def stride(self) -> tuple[int, ...]:
            return (8, 1)

        def element_size(self) -> int:
            return 2

    caches = {"layers.0": np.zeros((4, 8)), "layers.1": FakeDeviceTensor()}
    with pytest.raises(LayoutError, match=r"KV caches live on several device types \['cpu', 'cuda'\]"):
        CacheLayout.from_caches(caches, 4, max_transfer_bytes=MiB)
    device_only = CacheLayout.from_caches({"layers.1": FakeDeviceTensor()}, 4, max_transfer_bytes=MiB)
    assert device_only.device_type == "cuda" and device_only.layers[0][0].dtype == "float16"
    assert device_only.template(0).ranges(np.array([3])).ptrs == [[(1 << 20) + 3 * 16]]


# --------------------------------------------------------------------------------------------
# Property: ranges of all layers + header tile each object exactly, and move the right bytes

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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), data=st.data())
def test_ranges_tile_objects_and_move_the_tensors_bytes(spec: Spec, data: st.DataObject) -> None:
    caches, expected = build_caches(spec, seed=7)
    layout = CacheLayout.from_caches(caches, spec.num_blocks, max_transfer_bytes=spec.max_transfer_bytes)
    assert layout.num_layers == len(expected)
    assert [[e.block_nbytes for e in layer] for layer in layout.layers] == [
        [v[0].numel() * v.element_size() for v in layer] for layer in expected
    ]
    assert layout.object_nbytes == layout.header_nbytes + sum(
        v[0].numel() * v.element_size() for layer in expected for v in layer
    )
    block_ids = np.array(data.draw(st.lists(st.integers(0, spec.num_blocks - 1), min_size=1, max_size=4, unique=True)))
    num_keys = len(block_ids)
    staging = np.zeros((num_keys, layout.header_nbytes), np.uint8)
    header = Header(bytes(range(16)), layout.digest, layout.num_layers, layout.object_nbytes)
    keys = [f"k@{b}@0" for b in block_ids.tolist()]
    header.encode_into(
        staging,
        np.arange(num_keys),
        [bytes([b]) for b in block_ids.tolist()],
        keys,
        np.zeros((num_keys, 16), np.uint8),
        None,
    )
    hdr = layout.header_template(staging.ctypes.data, num_keys)
    slots = np.arange(num_keys)

    rows = KeyRows(block_ids, layout, staging)  # the per-job planner the transfer jobs use
    per_layer = [rows.step(i, slots) for i in range(layout.num_layers)]
    segments = [layout.template(i).num_segments for i in range(layout.num_layers)]
    assert [r.num_segments for r in per_layer[1:]] == segments[1:]
    assert per_layer[0].num_segments == 1 + segments[0]
    for r in per_layer[1:]:
        assert max(max(s) for s in r.sizes) <= spec.max_transfer_bytes
    joined = RangeLists(
        [sum((r.ptrs[k] for r in per_layer), []) for k in range(num_keys)],
        [sum((r.sizes[k] for r in per_layer), []) for k in range(num_keys)],
        [sum((r.offsets[k] for r in per_layer), []) for k in range(num_keys)],
        sum(r.num_segments for r in per_layer),
    )
    check_tiling(joined, layout.object_nbytes)
    whole = join_ranges((hdr, slots), (layer_group_template(layout, 0, layout.num_layers), block_ids))
    check_tiling(whole, layout.object_nbytes)
    if spec.shared_buffer and not any(spec.extras) and not spec.mtp and spec.max_transfer_bytes == MiB:
        assert layer_group_template(layout, 0, layout.num_layers).num_segments == 1

    # save: layer by layer into one object per key; the whole-object template gives the same bytes
    objects = [bytearray(layout.object_nbytes) for _ in range(num_keys)]
    for r in per_layer:
        move(r, objects, to_object=True)
    for k, b in enumerate(block_ids.tolist()):
        want = staging[k].tobytes() + b"".join(block_bytes(v, b) for layer in expected for v in layer)
        assert bytes(objects[k]) == want
        header.verify(objects[k][: layout.header_nbytes], bytes([b]), keys[k])
    again = [bytearray(layout.object_nbytes) for _ in range(num_keys)]
    move(whole, again, to_object=True)
    assert again == objects

    # load: into zeroed caches of the same structure (header goes to a fresh staging buffer)
    dst_caches, dst_expected = build_caches(spec, seed=None)
    dst = CacheLayout.from_caches(dst_caches, spec.num_blocks, max_transfer_bytes=spec.max_transfer_bytes)
    assert dst.digest == layout.digest
    dst_staging = np.zeros_like(staging)
    dst_rows = KeyRows(block_ids, dst, dst_staging)
    for i in range(dst.num_layers):
        move(dst_rows.step(i, slots), objects, to_object=False)
    assert (dst_staging == staging).all()
    for layer_src, layer_dst in zip(expected, dst_expected):
        for src, out in zip(layer_src, layer_dst):
            for b in range(spec.num_blocks):
                got = block_bytes(out, b)
                assert got == (block_bytes(src, b) if b in block_ids else bytes(len(got)))


def test_merge_needs_adjacency_in_memory_and_in_the_object() -> None:
    from layerkv.objects.ranges import Segment, merge_segments, split_segment

    a = Segment(1000, 64, 16, 200)
    assert merge_segments([a, Segment(1016, 64, 16, 216)]) == [Segment(1000, 64, 32, 200)]
    assert len(merge_segments([a, Segment(1016, 64, 16, 300)])) == 2  # gap in the object
    assert len(merge_segments([a, Segment(1020, 64, 16, 216)])) == 2  # gap in memory
    assert len(merge_segments([a, Segment(1016, 128, 16, 216)])) == 2  # other block stride
    assert split_segment(Segment(0, 64, 10, 5), 4) == [
        Segment(0, 64, 4, 5),
        Segment(4, 64, 4, 9),
        Segment(8, 64, 2, 13),
    ]


# --------------------------------------------------------------------------------------------
# Physical byte order inside a block (vLLM's KV cache layouts: permutations of [L, B, H, N, C])

_LAYOUT_ORDERS = {  # physical order of the logical dims (L, B, H, N, C), outermost first
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def permuted_caches(layout: str, num_layers: int = 3, nb: int = 4, heads: int = 2, tokens: int = 4, width: int = 8):
    """Per-layer logical [B, H, N, C] views of one buffer stored in `layout`'s physical order
    (what vLLM's allocator builds), filled with distinct values."""
    logical = (num_layers, nb, heads, tokens, width)
    order = _LAYOUT_ORDERS[layout]
    physical = torch.arange(math.prod(logical), dtype=torch.float32).view(*(logical[d] for d in order))
    view = physical.permute(*(order.index(d) for d in range(5)))  # back to logical [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(num_layers)}


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_every_layout_with_one_run_per_block_registers_and_ranges_move_its_bytes(name: str) -> None:
    caches = permuted_caches(name)
    layout = CacheLayout.from_caches(caches, 4, max_transfer_bytes=MiB)
    assert [layout.template(li).num_segments for li in range(3)] == [1, 1, 1]
    for layer_idx, cache in enumerate(caches.values()):
        (entry,) = layout.layers[layer_idx]
        assert entry.block_nbytes == 2 * 4 * 8 * 4
        for block_id in range(4):
            ((ptr,),), ((size,),) = (
                layout.template(layer_idx).ranges(np.array([block_id])).ptrs,
                layout.template(layer_idx).ranges(np.array([block_id])).sizes,
            )
            raw = (ctypes.c_char * size).from_address(ptr).raw
            physical = cache[block_id].permute(*((0, 1, 2) if "HN" in name else (1, 0, 2))).contiguous()
            assert raw == physical.numpy().tobytes()  # the run holds exactly this block's bytes


def test_byte_order_inside_a_block_is_part_of_the_signature() -> None:
    sigs = {
        name: CacheLayout.from_caches(permuted_caches(name), 4, max_transfer_bytes=MiB)
        for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
    }
    assert sigs["LBHNC"].signature == sigs["BLHNC"].signature  # same bytes per block: same objects
    assert sigs["LBNHC"].signature == sigs["BLNHC"].signature
    assert sigs["LBHNC"].digest != sigs["LBNHC"].digest  # [H, N, C] vs [N, H, C] bytes: never shared
    assert "@order=1,0,2" in sigs["LBNHC"].signature and "@order" not in sigs["LBHNC"].signature
    # one head: both orders are the same bytes, and the signature says so
    one_head = {
        n: CacheLayout.from_caches(permuted_caches(n, heads=1), 4, max_transfer_bytes=MiB) for n in ("LBHNC", "LBNHC")
    }
    assert one_head["LBHNC"].signature == one_head["LBNHC"].signature


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_layouts_that_scatter_a_block_are_refused_with_the_fix(name: str) -> None:
    with pytest.raises(LayoutError, match=r"one block is not contiguous in memory.*LBHNC, LBNHC, BLHNC or BLNHC"):
        CacheLayout.from_caches(permuted_caches(name), 4, max_transfer_bytes=MiB)
    # with a single head nothing is scattered: every layout is one run per block
    CacheLayout.from_caches(permuted_caches(name, heads=1), 4, max_transfer_bytes=MiB)


def test_cross_layer_layouts_make_a_group_of_layers_one_range_per_block() -> None:
    cross = CacheLayout.from_caches(permuted_caches("BLHNC"), 4, max_transfer_bytes=MiB)
    outer = CacheLayout.from_caches(permuted_caches("LBHNC"), 4, max_transfer_bytes=MiB)
    assert layers_adjacent(cross, 0, 3) and layers_adjacent(cross, 1, 2)
    assert not layers_adjacent(outer, 0, 2) and layers_adjacent(outer, 1, 1)
    group = layer_group_template(cross, 1, 2)
    assert group.num_segments == 1 and group.nbytes.tolist() == [2 * cross.layer_nbytes(1)]
    assert group.object_offsets.tolist() == [cross.layer_offset(1)]
    assert layer_group_template(outer, 1, 2).num_segments == 2
    assert layer_group_template(cross, 0, cross.num_layers).num_segments == 1
    with pytest.raises(LayoutError, match=r"layer group \[2, 4\) is not within the 3 layers"):
        layer_group_template(cross, 2, 2)
