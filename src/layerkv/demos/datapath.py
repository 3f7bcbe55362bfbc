"""The datapath demo (`layerkv demo --synthetic`): a real layerwise save and load of synthetic
multi-layer KV caches through a store via the layout's range templates, bytes verified, one
table printed. Single-threaded; used before an engine is involved and by `layerkv doctor`-style
smoke checks.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np

from layerkv.config import LayerKVConfig
from layerkv.messages import Deployment
from layerkv.objects.header import Header
from layerkv.objects.keys import block_keys, namespace_for
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import RangeLists
from layerkv.objects.seal import NONCE_NBYTES, context
from layerkv.store.base import KVStore
from layerkv.store.factory import open_checked_store
from layerkv.transfer.calls import KeyRows
from layerkv.transfer.views import CacheViews


@dataclass(frozen=True, slots=True)
class LayerTiming:
    layer_idx: int
    ranges: int
    nbytes: int
    put_ms: float
    get_ms: float


@dataclass(frozen=True, slots=True)
class DatapathReport:
    num_blocks: int
    num_layers: int
    object_nbytes: int
    layers: tuple[LayerTiming, ...]
    identical: bool


def _caches(
    num_layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int, seed: int
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # [2, num_blocks, block_size, heads, head_dim]: K and V, two entries per layer
    return {
        f"model.layers.{li}.self_attn.attn": rng.standard_normal(
            (2, num_blocks, block_size, heads, head_dim), dtype=np.float32
        )
        for li in range(num_layers)
    }


def run_datapath_demo(
    store: KVStore | None = None,
    *,
    num_blocks: int = 32,
    num_layers: int = 8,
    block_size: int = 16,
    heads: int = 4,
    head_dim: int = 64,
    seed: int = 0,
) -> DatapathReport:
    """Save `num_blocks` blocks layer by layer from one cache, load them layer by layer into a
    zeroed second cache, and compare every byte."""
    config = LayerKVConfig.from_dict({}, env={})
    store = store if store is not None else open_checked_store(config)
    src = _caches(num_layers, num_blocks, block_size, heads, head_dim, seed)
    dst = {name: np.zeros_like(a) for name, a in src.items()}
    src_layout = CacheLayout.from_caches(src, num_blocks, max_transfer_bytes=config.max_transfer_bytes)
    dst_layout = CacheLayout.from_caches(dst, num_blocks, max_transfer_bytes=config.max_transfer_bytes)
    deployment = Deployment(model_id="demo/synthetic", kv_dtype="float32", block_size=block_size, num_kv_heads=heads)
    namespace = namespace_for(deployment, "demo", src_layout)
    header = Header(namespace.digest, src_layout.digest, src_layout.num_layers, src_layout.object_nbytes)
    hashes = [seed.to_bytes(4, "big") + i.to_bytes(4, "big") for i in range(num_blocks)]
    keys = block_keys(namespace, hashes, 0)
    for arrays in (src, dst):
        for a in arrays.values():
            store.register_buffer(a.ctypes.data, a.nbytes)
    staging = _sealed_headers(header, src_layout, src, hashes, keys)
    read_headers = np.zeros_like(staging)
    for h in (staging, read_headers):
        store.register_buffer(h.ctypes.data, h.nbytes)
    put_ms = _save_layers(store, src_layout, keys, staging)
    timings = _load_layers(store, dst_layout, keys, read_headers, put_ms)
    for row, block_hash in enumerate(hashes):
        header.verify(read_headers[row], block_hash, keys[row])
    identical = all(np.array_equal(src[name], dst[name]) for name in src)
    store.batch_remove(keys)
    for arrays in (src, dst):
        for a in arrays.values():
            store.unregister_buffer(a.ctypes.data)
    for h in (staging, read_headers):
        store.unregister_buffer(h.ctypes.data)
    return DatapathReport(num_blocks, num_layers, src_layout.object_nbytes, tuple(timings), identical)


def _sealed_headers(
    header: Header, layout: CacheLayout, caches: dict[str, np.ndarray], hashes: list[bytes], keys: list[str]
) -> np.ndarray:
    """The objects' headers, [blocks, header] bytes: fresh nonces and each layer's tag of each block."""
    num_blocks = len(keys)
    staging = np.zeros((num_blocks, layout.header_nbytes), dtype=np.uint8)  # [blocks, header]
    nonces = np.frombuffer(secrets.token_bytes(NONCE_NBYTES * num_blocks), dtype=np.uint8).reshape(num_blocks, -1)
    contexts = [context(k, n.tobytes()) for k, n in zip(keys, nonces)]
    views = CacheViews(layout, caches)
    blocks = np.arange(num_blocks)
    tags = np.stack([views.tags(li, blocks, contexts, header.sealer) for li in range(layout.num_layers)], axis=1)
    header.encode_into(staging, np.arange(num_blocks), hashes, keys, nonces, tags)
    return staging


def _save_layers(store: KVStore, layout: CacheLayout, keys: list[str], headers: np.ndarray) -> list[float]:
    """One put session writing every object layer by layer; each layer's put time (ms)."""
    ids = np.arange(len(keys))
    _check(store.batch_put_session_start(keys, [layout.object_nbytes] * len(keys)), 0, "put session start")
    put_ms = []
    for layer in range(layout.num_layers):
        ranges = _layer_ranges(layout, layer, ids, headers)
        start = time.perf_counter()
        _check(
            store.batch_put_from_multi_buffer_ranges(keys, ranges.ptrs, ranges.sizes, ranges.offsets),
            sum(ranges.sizes[0]),
            f"layer {layer} put",
        )
        put_ms.append((time.perf_counter() - start) * 1e3)
    _check(store.batch_put_session_end(keys), 0, "put session end")
    return put_ms


def _load_layers(
    store: KVStore, layout: CacheLayout, keys: list[str], headers: np.ndarray, put_ms: list[float]
) -> list[LayerTiming]:
    """One get session reading every object layer by layer into `layout`'s caches and `headers`; the
    timing row of each layer (its put time from `put_ms`)."""
    ids = np.arange(len(keys))
    _check(store.batch_get_session_start(keys), 0, "get session start")
    timings = []
    for layer in range(layout.num_layers):
        ranges = _layer_ranges(layout, layer, ids, headers)
        start = time.perf_counter()
        _check(
            store.batch_get_into_multi_buffer_ranges(keys, ranges.ptrs, ranges.sizes, ranges.offsets),
            sum(ranges.sizes[0]),
            f"layer {layer} get",
        )
        get_ms = (time.perf_counter() - start) * 1e3
        timings.append(
            LayerTiming(
                layer,
                ranges.num_keys * ranges.num_segments,
                ranges.num_keys * sum(ranges.sizes[0]),
                put_ms[layer],
                get_ms,
            )
        )
    store.batch_get_session_end(keys)
    return timings


def _layer_ranges(layout: CacheLayout, layer: int, ids: np.ndarray, headers: np.ndarray) -> RangeLists:
    return KeyRows(ids, layout, headers).step(layer, np.arange(len(ids)))


def _check(results: list[int], expected: int, what: str) -> None:
    bad = sorted({r for r in results if r != expected})
    if bad:
        raise RuntimeError(f"{what}: expected {expected} for every key, got {bad}")


def format_report(report: DatapathReport) -> str:
    lines = [
        f"objects: {report.num_blocks} (one per block, {report.object_nbytes} bytes each, all {report.num_layers} "
        "layers inside)",
        f"{'layer':>5} {'ranges':>7} {'bytes':>10} {'put ms':>8} {'get ms':>8}",
    ]
    for t in report.layers:
        lines.append(f"{t.layer_idx:>5} {t.ranges:>7} {t.nbytes:>10} {t.put_ms:>8.3f} {t.get_ms:>8.3f}")
    total = sum(t.nbytes for t in report.layers)
    lines.append(
        f"{'total':>5} {sum(t.ranges for t in report.layers):>7} {total:>10} "
        f"{sum(t.put_ms for t in report.layers):>8.3f} {sum(t.get_ms for t in report.layers):>8.3f}"
    )
    if report.identical:
        lines.append(f"verified: {report.num_blocks} blocks x {report.num_layers} layers identical")
    else:
        lines.append(
            f"MISMATCH: loaded bytes differ from the saved ones ({report.num_blocks} blocks x {report.num_layers} "
            "layers)"
        )
    return "\n".join(lines)
