"""CacheLayout (objects/layout.py): the registered caches -> layers in object order, their
entries, offsets and signature; per-layer segment templates (merged where adjacent, split at
max_transfer_bytes), the header template, and the errors for caches it cannot describe.
The property over random cache structures is in test_layout_tiling.py, vLLM's physical byte
orders in test_layout_orders.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists, join_ranges
from tests.layouts import layer_group_template

MiB = 1 << 20


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
