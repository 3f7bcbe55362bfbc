"""Suite `datapath`: the same bytes moved three ways, side by side per case and backend —
layerwise (put/get session + one range call per layer, header with layer 0), whole object
(batch_put_from / batch_get_into of contiguous rows) and a plain memcpy (the limit). Sweeps
range size, blocks per step and layers. Driver thread only; every store call goes through
CheckedStore (max 64 keys per backend call), as in layerkv.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from layerkv.bench.backends import Backend, open_backends
from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, gbps, kib, median_s, ratio
from layerkv.bench.plots import line_plot
from layerkv.objects.layout import CacheLayout
from layerkv.store.checked import CheckedStore
from layerkv.transfer.calls import KeyRows

NAME = "datapath"
KiB, MiB = 1 << 10, 1 << 20
MAX_BATCH_KEYS = 64  # layerkv's default max_transfer_blocks
_case_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Case:
    sweep: str  # which axis this case belongs to: range / blocks / layers
    range_nbytes: int  # bytes of one range (one K or V entry of one block of one layer)
    num_blocks: int  # keys per step
    num_layers: int


def cases(options: BenchOptions) -> list[Case]:
    if options.tiny:
        return [Case("range", 4 * KiB, 4, 2), Case("range", 64 * KiB, 4, 2)]
    ranges: tuple[int, ...]
    blocks: tuple[int, ...]
    layers: tuple[int, ...]
    if options.quick:
        ranges, rb, rl = (4 * KiB, 64 * KiB, 1 * MiB), 8, 4
        blocks, layers = (8, 64, 256), (4, 16, 48)
    else:
        ranges, rb, rl = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB), 8, 4
        blocks, layers = (4, 16, 64, 256, 1024), (2, 8, 32, 64)
    out = [Case("range", r, rb, rl) for r in ranges]
    out += [Case("blocks", 16 * KiB, b, 4) for b in blocks]
    out += [Case("layers", 16 * KiB, 16, n) for n in layers]
    return out


class _Buffers:
    """Source / destination paged caches (uint8 [2, blocks, range] per layer: K and V), header
    staging slots and contiguous object rows for the whole-object path, all registered."""

    def __init__(self, store: CheckedStore, case: Case) -> None:
        rng = np.random.default_rng(case.range_nbytes + case.num_blocks + case.num_layers)
        shape = (2, case.num_blocks, case.range_nbytes)  # [K|V, blocks, bytes of one entry]
        self.src = {
            f"model.layers.{i}.attn": rng.integers(0, 255, shape, dtype=np.uint8) for i in range(case.num_layers)
        }
        self.dst = {name: np.zeros_like(a) for name, a in self.src.items()}
        self.src_layout = CacheLayout.from_caches(self.src, case.num_blocks, max_transfer_bytes=16 * MiB, kv_first=True)
        self.dst_layout = CacheLayout.from_caches(self.dst, case.num_blocks, max_transfer_bytes=16 * MiB, kv_first=True)
        obj = self.src_layout.object_nbytes
        self.headers = rng.integers(0, 255, (case.num_blocks, self.src_layout.header_nbytes), dtype=np.uint8)
        self.read_headers = np.zeros_like(self.headers)
        self.rows_src = rng.integers(0, 255, (case.num_blocks, obj), dtype=np.uint8)  # [blocks, object bytes]
        self.rows_dst = np.zeros_like(self.rows_src)
        self._store = store
        self._arrays = [
            *self.src.values(),
            *self.dst.values(),
            self.headers,
            self.read_headers,
            self.rows_src,
            self.rows_dst,
        ]
        for a in self._arrays:
            store.register_buffer(a.ctypes.data, a.nbytes)

    def close(self) -> None:
        for a in self._arrays:
            self._store.unregister_buffer(a.ctypes.data)


def _check(results: list[int], expected: int, what: str) -> None:
    bad = sorted({r for r in results if r != expected})
    if bad:
        raise RuntimeError(f"datapath {what}: expected {expected} for every key, got {bad}")


def _layer_ranges(layout: CacheLayout, layer: int, ids: np.ndarray, headers: np.ndarray):
    """Block i's layer (and for layer 0 header row i first), as layerkv's jobs build them."""
    return KeyRows(ids, layout, headers).step(layer, np.arange(len(ids)))


def _layerwise_put(store: CheckedStore, buf: _Buffers, keys: list[str]) -> None:
    layout, ids = buf.src_layout, np.arange(len(keys))
    _check(store.batch_put_session_start(keys, [layout.object_nbytes] * len(keys)), 0, "put session start")
    for layer in range(layout.num_layers):
        r = _layer_ranges(layout, layer, ids, buf.headers)
        _check(
            store.batch_put_from_multi_buffer_ranges(keys, r.ptrs, r.sizes, r.offsets),
            sum(r.sizes[0]),
            f"layer {layer} put",
        )
    _check(store.batch_put_session_end(keys), 0, "put session end")


def _layerwise_get(store: CheckedStore, buf: _Buffers, keys: list[str]) -> None:
    layout, ids = buf.dst_layout, np.arange(len(keys))
    _check(store.batch_get_session_start(keys), 0, "get session start")
    for layer in range(layout.num_layers):
        r = _layer_ranges(layout, layer, ids, buf.read_headers)
        _check(
            store.batch_get_into_multi_buffer_ranges(keys, r.ptrs, r.sizes, r.offsets),
            sum(r.sizes[0]),
            f"layer {layer} get",
        )
    store.batch_get_session_end(keys)


def _whole_put(store: CheckedStore, buf: _Buffers, keys: list[str]) -> None:
    rows, obj = buf.rows_src, buf.rows_src.shape[1]
    _check(
        store.batch_put_from(keys, [rows[i].ctypes.data for i in range(len(keys))], [obj] * len(keys)), 0, "whole put"
    )


def _whole_get(store: CheckedStore, buf: _Buffers, keys: list[str]) -> None:
    rows, obj = buf.rows_dst, buf.rows_dst.shape[1]
    _check(
        store.batch_get_into(keys, [rows[i].ctypes.data for i in range(len(keys))], [obj] * len(keys)), obj, "whole get"
    )


def measure(backend: Backend, case: Case, reps: int) -> Row:
    """One case on one backend: median seconds of each path over `reps` rounds, interleaved."""
    store = CheckedStore(backend.store, max_batch_keys=MAX_BATCH_KEYS)
    buf = _Buffers(store, case)
    try:
        times: dict[str, list[float]] = {k: [] for k in ("lw_put", "lw_get", "wo_put", "wo_get", "memcpy")}
        for _ in range(reps):
            cid = next(_case_ids)
            lw_keys = [f"bench-dp-lw-{cid}-{b}" for b in range(case.num_blocks)]
            wo_keys = [f"bench-dp-wo-{cid}-{b}" for b in range(case.num_blocks)]
            times["lw_put"].append(median_s(lambda: _layerwise_put(store, buf, lw_keys), 1))
            times["lw_get"].append(median_s(lambda: _layerwise_get(store, buf, lw_keys), 1))
            times["wo_put"].append(median_s(lambda: _whole_put(store, buf, wo_keys), 1))
            times["wo_get"].append(median_s(lambda: _whole_get(store, buf, wo_keys), 1))
            times["memcpy"].append(median_s(lambda: np.copyto(buf.rows_dst, buf.rows_src), 1))
            store.batch_remove(lw_keys + wo_keys)
        verified = all(np.array_equal(buf.src[n], buf.dst[n]) for n in buf.src) and np.array_equal(
            buf.headers, buf.read_headers
        )
    finally:
        buf.close()
    t = {k: float(np.median(v)) for k, v in times.items()}
    nbytes = case.num_blocks * buf.src_layout.object_nbytes
    g = {k: gbps(nbytes, v) for k, v in t.items()}
    return {
        "backend": backend.name,
        "sweep": case.sweep,
        "range": kib(case.range_nbytes),
        "range_nbytes": case.range_nbytes,
        "blocks": case.num_blocks,
        "layers": case.num_layers,
        "step_nbytes": nbytes,
        "ranges_per_step": case.num_blocks * (1 + 2 * case.num_layers),
        "lw_put_gbps": g["lw_put"],
        "lw_get_gbps": g["lw_get"],
        "wo_put_gbps": g["wo_put"],
        "wo_get_gbps": g["wo_get"],
        "memcpy_gbps": g["memcpy"],
        "put_lw_over_wo": ratio(g["lw_put"], g["wo_put"]),
        "get_lw_over_wo": ratio(g["lw_get"], g["wo_get"]),
        "get_lw_over_memcpy": ratio(g["lw_get"], g["memcpy"]),
        "us_per_range_get": t["lw_get"] / (case.num_blocks * (1 + 2 * case.num_layers)) * 1e6,
        "verified": bool(verified),
    }


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    with open_backends(options.mooncake) as backends:
        for backend in backends:
            for case in cases(options):
                progress.case(
                    f"{NAME} {backend.name} {case.sweep} {kib(case.range_nbytes)} x{case.num_blocks} L{case.num_layers}"
                )
                result.rows.append(measure(backend, case, options.reps))
        result.notes.append("backends: " + "; ".join(f"{b.name}: {b.note}" for b in backends))
    result.notes += [
        "layerwise = put/get session start + one range call per layer (2 ranges per key per layer, K and V; "
        "header rides with layer 0) + session end; whole object = one batch_put_from / batch_get_into of "
        "contiguous object rows (no gather/scatter counted); memcpy = numpy copy of the same bytes.",
        "ratios are throughput ratios measured in the same run (> 1: layerwise faster).",
    ]
    _summarise(result)
    result.plots += _plots(result, options)
    return result


def _summarise(result: SuiteResult) -> None:
    for backend in sorted({r["backend"] for r in result.rows}):
        rows = [r for r in result.rows if r["backend"] == backend]
        for key in ("get_lw_over_wo", "put_lw_over_wo", "get_lw_over_memcpy"):
            result.summary[f"{backend}.{key}.min"] = min(r[key] for r in rows)
            result.summary[f"{backend}.{key}.max"] = max(r[key] for r in rows)
        result.summary[f"{backend}.us_per_range_get.median"] = float(np.median([r["us_per_range_get"] for r in rows]))


def _plots(result: SuiteResult, options: BenchOptions) -> list[str]:
    files = []
    for backend in sorted({r["backend"] for r in result.rows}):
        rows = sorted(
            (r for r in result.rows if r["backend"] == backend and r["sweep"] == "range"),
            key=lambda r: r["range_nbytes"],
        )
        if not rows:
            continue
        xs = [r["range_nbytes"] / KiB for r in rows]
        series = {
            label: [r[key] for r in rows]
            for label, key in (
                ("layerwise get", "lw_get_gbps"),
                ("whole-object get", "wo_get_gbps"),
                ("layerwise put", "lw_put_gbps"),
                ("whole-object put", "wo_put_gbps"),
                ("memcpy", "memcpy_gbps"),
            )
        }
        files.append(
            line_plot(
                options.out_dir / f"datapath_{backend}_gbps.png",
                xs,
                series,
                title=f"datapath on {backend}: GB/s vs range size",
                xlabel="range size (KiB)",
                ylabel="GB/s",
                logx=True,
                logy=True,
            )
        )
    rows = [r for r in result.rows if r["sweep"] == "range"]
    if rows:
        backends = sorted({r["backend"] for r in rows})
        xs = sorted({r["range_nbytes"] / KiB for r in rows})
        series = {
            f"{b} get": [
                next(r["get_lw_over_wo"] for r in rows if r["backend"] == b and r["range_nbytes"] / KiB == x)
                for x in xs
            ]
            for b in backends
        }
        files.append(
            line_plot(
                options.out_dir / "datapath_ratio.png",
                xs,
                series,
                title="layerwise / whole-object throughput (get)",
                xlabel="range size (KiB)",
                ylabel="ratio",
                logx=True,
            )
        )
    return files
