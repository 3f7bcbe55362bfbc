"""Layer tags of a 32-layer load, the two ways the worker has computed them (docs/performance-history.md,
overlap): `Sealer.layer_tags` over a Python list of each block's segment views (before
2026-12-03) against `Sealer.rows_tags` over rows of the cache's segments (now). Prints the time
per request of each, then the receive thread's verify-and-copy time and TTFT of the overlap
bench's 32-layer engine with each (alternating runs, per-range delay as its transfer ~ compute
row). A measurement, not a test: run it on a quiet machine.

    .venv/bin/python scripts/compare_tags.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from layerkv.bench.common import BenchOptions
from layerkv.bench.micro import overlap_rig
from layerkv.objects.seal import Sealer
from layerkv.transfer import views

BLOCKS, SEGMENT_NBYTES, LAYERS = 115, 4096, 32  # the overlap bench's 32-layer model: 1,840 tokens of 16


def _list_of_views(self, layer_idx, block_ids, contexts, sealer):  # type: ignore[no-untyped-def]
    segments = self.layers[layer_idx]
    return sealer.layer_tags(contexts, layer_idx, [[v.blocks[b] for v in segments] for b in block_ids.tolist()])


def tags_alone() -> None:
    rng = np.random.default_rng(1)
    segments = [
        np.lib.stride_tricks.as_strided(
            rng.integers(0, 256, 200 * SEGMENT_NBYTES * 3, dtype=np.uint8),
            shape=(200, SEGMENT_NBYTES),
            strides=(3 * SEGMENT_NBYTES, 1),
        )
        for _ in range(2)
    ]
    rows = list(range(3, 3 + BLOCKS))
    contexts = [bytes(range(48))] * BLOCKS
    for sealer in (Sealer(None), Sealer(bytes(range(32)))):
        ways = {
            "list of views": lambda: sealer.layer_tags(contexts, 5, [[s[r] for s in segments] for r in rows]),
            "rows_tags": lambda: sealer.indexed_tags(contexts, 5, segments, rows),
        }
        for name, fn in ways.items():
            best = min(_timed(fn) for _ in range(5))
            print(f"{sealer!r:40} {name:14} {best * 1e3:6.2f} ms per request ({BLOCKS} blocks x {LAYERS} layers)")


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for _ in range(LAYERS):
        fn()
    return time.perf_counter() - start


def in_the_engine(runs: int = 8, delay_s: float = 0.00356) -> None:
    rig = overlap_rig.Rig(BenchOptions(quick=False, out_dir=Path("/tmp")), deep=True)
    ways = {"list of views": _list_of_views, "rows_tags": views.CacheViews.tags}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    try:
        for i in range(runs):
            for name in list(ways) if i % 2 == 0 else list(ways)[::-1]:
                views.CacheViews.tags = ways[name]  # type: ignore[method-assign]
                ttft_s, _, _, _, copy_s, _ = rig.ttft_pooled(2, delay_s, False)
                got[name].append((ttft_s * 1e3, copy_s * 1e3))
    finally:
        views.CacheViews.tags = ways["rows_tags"]  # type: ignore[method-assign]
        rig.close()
    for name, rows in got.items():
        print(
            f"engine, {name:14}: TTFT median {statistics.median(r[0] for r in rows):6.1f} ms, "
            f"verify-and-copy median {statistics.median(r[1] for r in rows):5.1f} ms ({runs} runs)"
        )


if __name__ == "__main__":
    tags_alone()
    in_the_engine()
