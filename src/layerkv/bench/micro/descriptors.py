"""Suite `descriptors`: time to build one layer's range-call lists (ptrs / sizes / offsets per
key) with the layout's range templates (numpy over block ids) vs a straightforward per-block
Python loop over the layer's cache entries (the original design's approach), and a check that
both build identical lists. Driver thread only; no store involved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from layerkv.bench.common import BenchOptions, Progress, SuiteResult, ratio
from layerkv.bench.plots import line_plot
from layerkv.objects.layout import CacheLayout

NAME = "descriptors"
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class _Device:
    type: str = "cpu"


@dataclass(frozen=True, slots=True)
class FakeTensor:
    """Just what CacheLayout reads from a torch tensor (pointer, shape, strides); never
    dereferenced, so 8,192-block caches need no memory."""

    ptr: int
    shape: tuple[int, ...]
    itemsize: int = 2
    dtype: str = "bfloat16"
    device: _Device = _Device()

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return self.itemsize

    def stride(self) -> tuple[int, ...]:
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc *= size
        return tuple(reversed(strides))


SHAPES = {
    # [K|V, blocks, block_size, kv_heads, head_dim] bf16: 32 KiB per entry, 2 ranges per key
    "gqa kv[2,N,16,8,128]": lambda n: (2, n, 16, 8, 128),
    # MLA latent [blocks, block_size, 576] bf16: one 18 KiB range per key
    "mla [N,16,576]": lambda n: (n, 16, 576),
}


def build_layout(shape_name: str, num_blocks: int, num_layers: int = 2) -> CacheLayout:
    shape = SHAPES[shape_name](num_blocks)
    nbytes = int(np.prod(shape)) * 2
    caches = {
        f"model.layers.{i}.self_attn.attn": FakeTensor(0x10_0000_0000 + i * (nbytes + 4096), shape)
        for i in range(num_layers)
    }
    return CacheLayout.from_caches(caches, num_blocks, max_transfer_bytes=16 * MiB, kv_first=len(shape) == 5)


def loop_ranges(
    layout: CacheLayout, layer_idx: int, block_ids: list[int]
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The original design's per-block loop: for each block, for each cache entry of the layer,
    append address, size and object offset."""
    all_ptrs, all_sizes, all_offsets = [], [], []
    for block_id in block_ids:
        ptrs, sizes, offsets = [], [], []
        for entry in layout.layers[layer_idx]:
            ptrs.append(entry.base_ptr + block_id * entry.block_stride_nbytes)
            sizes.append(entry.block_nbytes)
            offsets.append(entry.object_offset)
        all_ptrs.append(ptrs)
        all_sizes.append(sizes)
        all_offsets.append(offsets)
    return all_ptrs, all_sizes, all_offsets


def _per_call_s(fn, min_total_s: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call: repeat until `min_total_s` has passed, best of 3 such batches."""
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_total_s:
                break
        best = min(best, elapsed / calls)
    return best


def measure(shape_name: str, num_blocks: int, min_total_s: float) -> dict:  # type: ignore[type-arg]
    layout = build_layout(shape_name, num_blocks)
    rng = np.random.default_rng(num_blocks)
    ids = rng.permutation(num_blocks).astype(np.int64)  # a step's blocks, scattered
    ids_list = ids.tolist()
    got = layout.template(1).ranges(ids)
    want = loop_ranges(layout, 1, ids_list)
    identical = (got.ptrs, got.sizes, got.offsets) == want
    t_template = _per_call_s(lambda: layout.template(1).ranges(ids), min_total_s)
    t_loop = _per_call_s(lambda: loop_ranges(layout, 1, ids_list), min_total_s)
    t_arrays = _per_call_s(lambda: layout.template(1).columns(ids), min_total_s)
    return {
        "shape": shape_name,
        "blocks": num_blocks,
        "ranges_per_layer": got.num_keys * got.num_segments,
        "template_us_per_layer": t_template * 1e6,
        "loop_us_per_layer": t_loop * 1e6,
        "arrays_only_us_per_layer": t_arrays * 1e6,
        "speedup": ratio(t_loop, t_template),
        "identical": bool(identical),
    }


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    blocks = (64, 512) if options.tiny else ((64, 512, 8192) if options.quick else (64, 256, 1024, 4096, 8192))
    min_total_s = 0.01 if options.tiny else (0.05 if options.quick else 0.2)
    for shape_name in SHAPES:
        for n in blocks:
            progress.case(f"{NAME} {shape_name} {n} blocks")
            result.rows.append(measure(shape_name, n, min_total_s))
    result.notes += [
        "template = CacheLayout.ranges(layer, block_ids): numpy broadcasting over the layer's segment table, then "
        ".tolist() (the range call takes Python lists); loop = per block, per cache entry: append ptr/size/offset.",
        "arrays_only = the template's numpy columns without .tolist(): what a range call taking arrays "
        "(buffer protocol) would cost; the gap to `template` is the Python list conversion.",
        "block ids are a random permutation (scattered blocks); `identical` compares the three lists exactly.",
    ]
    for shape_name in SHAPES:
        rows = [r for r in result.rows if r["shape"] == shape_name]
        result.summary[f"{shape_name}.speedup@{rows[-1]['blocks']}"] = rows[-1]["speedup"]
    result.summary["all_identical"] = float(all(r["identical"] for r in result.rows))
    series = {}
    for shape_name in SHAPES:
        rows = [r for r in result.rows if r["shape"] == shape_name]
        series[f"template {shape_name}"] = [r["template_us_per_layer"] for r in rows]
        series[f"loop {shape_name}"] = [r["loop_us_per_layer"] for r in rows]
    result.plots.append(
        line_plot(
            options.out_dir / "descriptors.png",
            list(blocks),
            series,
            title="one layer's range lists: template vs per-block loop",
            xlabel="blocks",
            ylabel="µs per layer",
            logx=True,
            logy=True,
        )
    )
    return result
