"""Suite `objects`: objects, keys, sessions and store calls per step with one object per
block x rank (layerkv, the reference engine's real save and load paths) vs one object per
block x layer x rank (a small per-layer key scheme below, through the same store). Everything
is counted from the FaultyStore call log under the CheckedStore, not computed. Driver thread.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, ratio
from layerkv.bench.plots import bar_plot
from layerkv.config import LayerKVConfig
from layerkv.objects.manifest import is_manifest_key
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import (
    ALL_METHODS,
    GET_INTO,
    GET_RANGES,
    GET_START,
    IS_EXIST,
    PUT_FROM,
    PUT_RANGES,
    PUT_START,
    FaultyStore,
)

NAME = "objects"
BLOCK_SIZE = 16
MAX_BATCH_KEYS = 64
RANGE_METHODS = frozenset({PUT_RANGES, GET_RANGES})
DATA_METHODS = frozenset({PUT_RANGES, GET_RANGES, PUT_FROM, GET_INTO})  # calls that move KV bytes


@dataclass(frozen=True, slots=True)
class Shape:
    num_layers: int
    num_blocks: int  # full blocks of the prompt (all saved, then all loaded)
    tp_size: int  # = storage ranks (num_kv_heads = tp_size, every rank writes)

    @property
    def label(self) -> str:
        return f"L{self.num_layers} B{self.num_blocks} R{self.tp_size}"


def count(faulty: FaultyStore) -> Row:
    """Objects, keys and calls of everything the FaultyStore saw since its log was cleared, less
    the namespace manifest (one small object per namespace and process, written on a thread of
    its own whenever it gets there: not a per-step cost)."""
    calls = [c for c in faulty.calls() if not (c.keys and all(is_manifest_key(k) for k in c.keys))]
    per_method = Counter(c.method for c in calls)
    keys = {m: sum(len(c.keys) for c in calls if c.method == m) for m in ALL_METHODS}
    return {
        "objects_created": keys[PUT_START] + keys[PUT_FROM],
        "exists_keys": keys[IS_EXIST],
        "sessions": keys[PUT_START] + keys[GET_START],
        "store_calls": len(calls),
        "metadata_calls": sum(n for m, n in per_method.items() if m not in RANGE_METHODS),
        "data_calls": sum(n for m, n in per_method.items() if m in DATA_METHODS),
        "keys_sent": sum(keys.values()),
    }


def _prompt(shape: Shape, vocab: int) -> list[int]:
    rng = np.random.default_rng(shape.num_blocks * 131 + shape.num_layers)
    return rng.integers(0, vocab, shape.num_blocks * BLOCK_SIZE + 1).tolist()  # +1: a full hit keeps the last token


def layerkv_counts(shape: Shape) -> tuple[Row, Row]:
    """(save, load) counts of the reference engine on layerkv: producer fills, consumer loads."""
    from layerkv.engine import EngineConfig, ModelConfig
    from layerkv.engine.pooled import pooled_engine

    model = ModelConfig(
        num_layers=shape.num_layers,
        hidden_size=32,
        num_heads=shape.tp_size * 2,
        num_kv_heads=shape.tp_size,
        head_dim=8,
        intermediate_size=32 * shape.tp_size,
        vocab_size=128,
    )
    tokens = shape.num_blocks * BLOCK_SIZE + 1
    engine_config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=shape.num_blocks + 8,
        max_num_batched_tokens=tokens,
        tp_size=shape.tp_size,
        model_id="bench/objects",
    )
    # the layerwise data path (one range call per layer), not the adaptive plan: this suite counts calls
    config = LayerKVConfig.from_dict({"max_transfer_blocks": MAX_BATCH_KEYS, "transfer_plan": "layers"}, env={})
    backend = EmbeddedStore(capacity_bytes=1 << 30)
    faulty = FaultyStore(backend)
    prompt = _prompt(shape, model.vocab_size)
    rows = []
    try:
        for phase in ("save", "load"):
            engine = pooled_engine(
                model, engine_config, config, store_factory=lambda: CheckedStore(faulty, max_batch_keys=MAX_BATCH_KEYS)
            )
            faulty.clear_calls()
            out = engine.generate([prompt], 1)[0]
            rows.append(count(faulty) | {"loaded_tokens": out.num_external_tokens})
            engine.shutdown()
    finally:
        backend.close()
    return rows[0], rows[1]


class PerLayerObjects:
    """The before-layerwise scheme: key `<ns>@<hash>@layer_<l>@<rank>`, one object per block x
    layer x rank. Save: exists query of every layer's keys, then per layer a gather of the
    layer's K/V into a staging slot and one batch_put_from; load: exists query, then per layer
    one batch_get_into and a scatter. The cheapest per-layer variant the store offers (one
    data call per layer; Mooncake does put start + end on the master inside batch_put_from)."""

    def __init__(self, store: CheckedStore, shape: Shape, entry_nbytes: int) -> None:
        self.store, self.shape = store, shape
        blocks = shape.num_blocks + 8
        rng = np.random.default_rng(7)
        # per rank, per layer: [K|V, blocks, entry bytes] like one layer of the paged cache
        self.src = [
            [rng.integers(0, 255, (2, blocks, entry_nbytes), dtype=np.uint8) for _ in range(shape.num_layers)]
            for _ in range(shape.tp_size)
        ]
        self.dst = [[np.zeros_like(a) for a in rank] for rank in self.src]
        self.staging = np.zeros((shape.num_blocks, 2 * entry_nbytes), dtype=np.uint8)  # [blocks, layer object bytes]
        store.register_buffer(self.staging.ctypes.data, self.staging.nbytes)
        self.block_ids = np.arange(shape.num_blocks) + 3  # not 0..B-1: catches an off-by-base error
        self.hashes = [hashlib.sha256(f"obj:{i}".encode()).hexdigest()[:32] for i in range(shape.num_blocks)]

    def keys(self, layer_idx: int, rank: int) -> list[str]:
        return [f"bench-perlayer@{h}@layer_{layer_idx}@{rank}" for h in self.hashes]

    def all_keys(self) -> list[str]:
        # scheduler order: per block, every layer and rank
        return [
            k
            for i in range(self.shape.num_blocks)
            for li in range(self.shape.num_layers)
            for r in range(self.shape.tp_size)
            for k in (self.keys(li, r)[i],)
        ]

    def save(self) -> None:
        self.store.batch_is_exist(self.all_keys())
        for rank in range(self.shape.tp_size):
            for layer_idx, cache in enumerate(self.src[rank]):
                self.staging[:] = np.concatenate([cache[0, self.block_ids], cache[1, self.block_ids]], axis=1)  # gather
                n = self.staging.shape[1]
                got = self.store.batch_put_from(
                    self.keys(layer_idx, rank), [row.ctypes.data for row in self.staging], [n] * len(self.block_ids)
                )
                if any(r != 0 for r in got):
                    raise RuntimeError(f"per-layer put of layer {layer_idx} rank {rank} returned {sorted(set(got))}")

    def load(self) -> bool:
        present = self.store.batch_is_exist(self.all_keys())
        if not all(p == 1 for p in present):
            raise RuntimeError("per-layer objects missing before the load")
        half = self.staging.shape[1] // 2
        for rank in range(self.shape.tp_size):
            for layer_idx, cache in enumerate(self.dst[rank]):
                n = self.staging.shape[1]
                got = self.store.batch_get_into(
                    self.keys(layer_idx, rank), [row.ctypes.data for row in self.staging], [n] * len(self.block_ids)
                )
                if any(r != n for r in got):
                    raise RuntimeError(f"per-layer get of layer {layer_idx} rank {rank} returned {sorted(set(got))}")
                cache[0, self.block_ids] = self.staging[:, :half]  # scatter
                cache[1, self.block_ids] = self.staging[:, half:]
        return all(
            np.array_equal(s[:, self.block_ids], d[:, self.block_ids])
            for rs, rd in zip(self.src, self.dst)
            for s, d in zip(rs, rd)
        )

    def close(self) -> None:
        self.store.unregister_buffer(self.staging.ctypes.data)


def per_layer_counts(shape: Shape, entry_nbytes: int = 1024) -> tuple[Row, Row]:
    backend = EmbeddedStore(capacity_bytes=1 << 30)
    faulty = FaultyStore(backend)
    scheme = PerLayerObjects(CheckedStore(faulty, max_batch_keys=MAX_BATCH_KEYS), shape, entry_nbytes)
    try:
        scheme.save()
        save = count(faulty)
        faulty.clear_calls()
        identical = scheme.load()
        load = count(faulty) | {"verified": identical}
    finally:
        scheme.close()
        backend.close()
    return save, load


def shapes(options: BenchOptions) -> list[Shape]:
    if options.tiny:
        return [Shape(2, 3, 2)]
    if options.quick:
        return [Shape(8, 32, 2), Shape(32, 64, 2)]
    return [Shape(8, 32, 1), Shape(8, 32, 2), Shape(32, 64, 2), Shape(32, 256, 4)]


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    for shape in shapes(options):
        progress.case(f"{NAME} {shape.label}")
        lk_save, lk_load = layerkv_counts(shape)
        pl_save, pl_load = per_layer_counts(shape)
        base = {"shape": shape.label, "layers": shape.num_layers, "blocks": shape.num_blocks, "ranks": shape.tp_size}
        for scheme, save, load in (
            ("block x rank (layerkv)", lk_save, lk_load),
            ("block x layer x rank", pl_save, pl_load),
        ):
            result.rows.append(base | {"scheme": scheme, "phase": "save"} | save)
            result.rows.append(base | {"scheme": scheme, "phase": "load"} | load)
        result.summary[f"{shape.label}.objects_ratio"] = ratio(pl_save["objects_created"], lk_save["objects_created"])
        result.summary[f"{shape.label}.metadata_calls_ratio(save+load)"] = ratio(
            pl_save["metadata_calls"] + pl_load["metadata_calls"], lk_save["metadata_calls"] + lk_load["metadata_calls"]
        )
        result.summary[f"{shape.label}.exists_keys_ratio(save+load)"] = ratio(
            pl_save["exists_keys"] + pl_load["exists_keys"], lk_save["exists_keys"] + lk_load["exists_keys"]
        )
    result.notes += [
        "layerkv rows: the reference engine (tp ranks = storage ranks) serving a prompt of B full blocks + 1 token, "
        "once as producer (save phase) and once fresh as consumer (load phase), through "
        "CheckedStore(FaultyStore(embedded)); "
        "counts are from the FaultyStore call log (after CheckedStore splits batches at 64 keys).",
        "per-layer rows: PerLayerObjects in this module (key ...@layer_<l>@<rank>, gather + batch_put_from per layer; "
        "batch_get_into + scatter per layer; exists over every block x layer x rank key), same store stack; bytes "
        "verified.",
        "metadata_calls = every store call except range calls (exists, session start/end/revoke, whole-object "
        "put/get); "
        "on Mooncake a whole-object put also makes put start + put end master RPCs internally.",
    ]
    labels = [f"{r['shape']} {r['phase']}" for r in result.rows if r["scheme"].startswith("block x rank")]
    groups = {
        s: [r["objects_created"] + r["exists_keys"] for r in result.rows if r["scheme"] == s]
        for s in ("block x rank (layerkv)", "block x layer x rank")
    }
    result.plots.append(
        bar_plot(
            options.out_dir / "objects.png",
            labels,
            groups,
            title="objects created + keys queried per step",
            ylabel="count",
            logy=True,
        )
    )
    return result
