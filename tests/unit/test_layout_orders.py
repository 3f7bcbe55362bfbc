"""CacheLayout over vLLM's KV cache layouts (permutations of [L, B, H, N, C] in one buffer):
which register with one byte run per block, which are refused with the fix, how the byte order
inside a block enters the signature, and cross-layer layouts as one range per group of layers."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from tests.layouts import layer_group_template, layers_adjacent

MiB = 1 << 20


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
