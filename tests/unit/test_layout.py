from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerkv.errors import LayoutError
from layerkv.header import Header
from layerkv.layout import CacheLayout
from layerkv.ranges import RangeLists, join_ranges

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
    assert layout.num_layers == 2 and layout.header_nbytes == 192
    assert layout.object_nbytes == 192 + 4 * block
    assert layout.layer_index("model.layers.0.self_attn.attn") == 0
    assert layout.layer_index("model.layers.1.self_attn.attn") == 1
    assert [layout.layer_offset(i) for i in range(2)] == [192, 192 + 2 * block]
    assert layout.entry_offset(1, 1) == 192 + 3 * block
    k0 = layout.layers[0][0]
    t = caches["model.layers.0.self_attn.attn"]
    assert (k0.base_ptr, k0.block_stride_nbytes, k0.block_nbytes) == (t.data_ptr(), block, block)
    assert layout.layers[0][1].base_ptr == t[1].data_ptr()
    assert layout.segments_per_layer() == (2, 2)  # K and V blocks are not adjacent in memory
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
        "draft.layers.0.attn": np.zeros((nb, 4, 4), np.float32),
    }
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    assert layout.num_layers == 3
    names = [[e.layer_name for e in layer] for layer in layout.layers]
    assert names == [
        ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"],
        ["model.layers.1.self_attn.attn"],
        ["model.layers.0.mtp_block.attn", "draft.layers.0.attn"],  # same draft index: registration order
    ]
    assert layout.layer_index("model.layers.0.self_attn.indexer.k_cache") == 0
    assert layout.layer_index("draft.layers.0.attn") == 2
    assert layout.layer_names[:2] == ("model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache")
    assert layout.layer_nbytes(0) == 2 * 4 * 4 * 2 + 4 * 2


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
    assert ranges.offsets[0] == [192, 492, 792, 1092]
    assert ranges.sizes[1] == [300, 300, 300, 124]


def test_whole_object_template_merges_layers_of_one_buffer() -> None:
    nb = 3
    big = torch.zeros(nb, 4, 2, 8, dtype=torch.float16)  # [num_blocks, layers, K/V, dim]
    caches = {f"layers.{i}": big[:, i] for i in range(4)}
    layout = CacheLayout.from_caches(caches, nb, max_transfer_bytes=MiB)
    assert layout.segments_per_layer() == (1, 1, 1, 1)
    assert layout.object_template().num_segments == 1
    assert layout.object_template().nbytes.tolist() == [4 * 2 * 8 * 2]


def test_header_template_and_join() -> None:
    layout = CacheLayout.from_caches({"layers.0": np.zeros((4, 64), np.float32)}, 4, max_transfer_bytes=4096)
    staging = np.zeros((8, 256), np.uint8)
    hdr = layout.header_template(staging.ctypes.data, num_slots=8, slot_stride_nbytes=256)
    out = layout.ranges_with_header(0, np.array([3, 1]), hdr, np.array([5, 6]))
    assert out.num_segments == 2
    assert out.ptrs[0] == [staging.ctypes.data + 5 * 256, layout.layers[0][0].base_ptr + 3 * 256]
    assert out.sizes[1] == [192, 256] and out.offsets[1] == [0, 192]
    with pytest.raises(LayoutError, match="slot_stride_nbytes=100 must be >= header_nbytes=192"):
        layout.header_template(staging.ctypes.data, 8, 100)
    with pytest.raises(LayoutError, match=r"join_ranges needs one id per key in every part, got lengths \[1, 2\]"):
        join_ranges((hdr, np.array([0])), (layout.template(0), np.array([0, 1])))


def test_ranges_check_block_ids() -> None:
    layout = CacheLayout.from_caches({"layers.0": np.zeros((4, 64), np.float32)}, 4, max_transfer_bytes=4096)
    with pytest.raises(LayoutError, match=r"block ids must be in \[0, 4\), got min=0 max=4"):
        layout.ranges(0, np.array([0, 4]))
    with pytest.raises(LayoutError, match=r"block ids must be a 1-D integer array, got float64"):
        layout.ranges(0, np.array([0.0]))
    assert layout.ranges(0, np.array([], dtype=np.int64)) == RangeLists([], [], [], 1)


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
    assert device_only.ranges(0, np.array([3])).ptrs == [[(1 << 20) + 3 * 16]]
