"""Suite `plans`: layerkv's own worker data path (the WorkerConnector with each load / save plan,
tags and commits included) against whole-object reads and writes of the same bytes, side by
side per backend and entry size. Loads: every layer waited for with no compute in between (the
transfer alone); saves: every layer handed over at once, then the commit step, until the objects
are readable. What a tenant key costs: the default plan's save and load with one (BLAKE3-keyed
MACs instead of xxh3-128 tags). Driver thread only.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerkv.bench.backends import Backend, open_backends
from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, gbps, kib, median_s, ratio
from layerkv.bench.steps import drive_step
from layerkv.config import LayerKVConfig
from layerkv.connector.worker import WorkerConnector
from layerkv.messages import Deployment
from layerkv.metadata import BlockSpec, StepPlan, StepVerdict
from layerkv.objects.encryption import LayerCipher
from layerkv.objects.keys import block_keys
from layerkv.objects.seal import NONCE_NBYTES, Sealer, context
from layerkv.objects.tenant_key import write_key_file
from layerkv.store.checked import CheckedStore

NAME = "plans"
KiB = 1 << 10
BLOCK_SIZE = 16
MAX_BATCH_KEYS = 64
_runs = itertools.count()
LOAD_PLANS = ("layers", "groups", "whole", "auto")
SAVE_PLANS = ("layers", "auto")  # direct per-layer writes vs staged object images


@dataclass(frozen=True, slots=True)
class Case:
    entry_nbytes: int  # one K or V entry of one block of one layer
    num_keys: int
    num_layers: int


def cases(options: BenchOptions) -> list[Case]:
    if options.tiny:
        return [Case(4 * KiB, 4, 2)]
    if options.quick:
        return [Case(16 * KiB, 64, 8)]
    return [Case(16 * KiB, 64, 8), Case(64 * KiB, 64, 8)]


class _Worker:
    """One WorkerConnector (its own CheckedStore client wrapper) over paged caches of `case`."""

    def __init__(self, backend: Backend, case: Case, tag: str, **config: Any) -> None:
        self.case = case
        self.config = LayerKVConfig.from_dict(
            {"max_transfer_blocks": MAX_BATCH_KEYS, "read_layers_per_range": 4, **config}, env={}
        )
        width = case.entry_nbytes // BLOCK_SIZE
        self.deployment = Deployment(
            model_id=f"bench/plans-{tag}",
            kv_dtype="uint8",
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            kv_signature=f"plans:{case.num_layers}x{case.entry_nbytes}",
        )
        self.store = CheckedStore(backend.store, max_batch_keys=MAX_BATCH_KEYS, call_timeout_s=10.0)
        self.worker = WorkerConnector(self.config, self.deployment, self.store)
        rng = np.random.default_rng(case.entry_nbytes + case.num_layers)
        # per layer [K|V, blocks, block_size, width] uint8
        self.caches = {
            f"model.layers.{li}.attn": rng.integers(0, 255, (2, case.num_keys, BLOCK_SIZE, width), dtype=np.uint8)
            for li in range(case.num_layers)
        }
        self.worker.register_kv_caches(self.caches, case.num_keys)
        self.names = list(self.caches)
        self.seq = itertools.count()

    def save(self, hashes: tuple[bytes, ...]) -> None:
        """Save step, then the step carrying its commit verdict; until readable."""
        seq = next(self.seq)
        spec = BlockSpec("r", hashes, tuple(range(len(hashes))))
        drive_step(
            self.worker,
            StepPlan(step_seq=seq, num_tokens=len(hashes) * BLOCK_SIZE, saves=(spec,)),
            self.names,
            load=False,
            save=True,
        )
        drive_step(
            self.worker,
            StepPlan(step_seq=next(self.seq), verdicts=(StepVerdict(seq),)),
            self.names,
            load=False,
            save=False,
        )
        self.worker.flush()

    def load(self, hashes: tuple[bytes, ...]) -> None:
        spec = BlockSpec("r", hashes, tuple(range(len(hashes))))
        drive_step(
            self.worker,
            StepPlan(step_seq=next(self.seq), num_tokens=1, loads=(spec,)),
            self.names,
            load=True,
            save=False,
        )

    def keys(self, hashes: tuple[bytes, ...]) -> list[str]:
        return block_keys(self.worker.namespace, hashes, 0)

    def close(self) -> None:
        self.worker.shutdown()


def _hashes(tag: str, n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{tag}:{i}".encode()).digest()[:16] for i in range(n))


def _whole(backend: Backend, case: Case, nbytes: int, reps: int) -> tuple[float, float]:
    """(put_s, get_s) of whole-object batch_put_from / batch_get_into of `nbytes` per key."""
    store = CheckedStore(backend.store, max_batch_keys=MAX_BATCH_KEYS)
    rows = np.random.default_rng(1).integers(0, 255, (case.num_keys, nbytes), dtype=np.uint8)
    dst = np.zeros_like(rows)
    for a in (rows, dst):
        store.register_buffer(a.ctypes.data, a.nbytes)
    keys = [f"bench-plans-whole-{next(_runs)}-{i}" for i in range(case.num_keys)]
    ptrs, sizes = [r.ctypes.data for r in rows], [nbytes] * case.num_keys
    try:
        put_s = median_s(lambda: store.batch_put_from(keys, ptrs, sizes), reps, setup=lambda: store.batch_remove(keys))
        get_s = median_s(lambda: store.batch_get_into(keys, [r.ctypes.data for r in dst], sizes), reps)
        assert np.array_equal(rows, dst), "whole-object read returned other bytes"
        store.batch_remove(keys)
    finally:
        for a in (rows, dst):
            store.unregister_buffer(a.ctypes.data)
    return put_s, get_s


def _keyed_rows(
    backend: Backend,
    case: Case,
    tag: str,
    label: str,
    extra: dict[str, object],
    base: Row,
    payload: int,
    put_s: float,
    get_s: float,
    reps: int,
    progress: Progress,
) -> list[Row]:
    """The default plan's save and load with a tenant key (`extra`) on both sides."""
    keyed = _Worker(backend, case, tag, transfer_plan="auto", **extra)
    try:
        hashes = _hashes(f"{tag}:{label}", case.num_keys)
        s = median_s(lambda: keyed.save(hashes), reps, setup=lambda: keyed.store.batch_remove(keyed.keys(hashes)))
        rows: list[Row] = [
            {
                **base,
                "direction": "put",
                "path": f"layerkv save (auto), {label}",
                "ms": s * 1e3,
                "gbps": gbps(payload, s),
                "vs_whole": ratio(put_s, s),
            }
        ]
        keyed.save(hashes)
        rows.append(
            _load_row(backend, case, tag, "auto", extra, keyed, hashes, base, payload, get_s, reps, progress, label)
        )
        keyed.store.batch_remove(keyed.keys(hashes))
        return rows
    finally:
        keyed.close()


def _load_row(
    backend: Backend,
    case: Case,
    tag: str,
    plan: str,
    extra: dict[str, object],
    producer: _Worker,
    hashes: tuple[bytes, ...],
    base: Row,
    payload: int,
    get_s: float,
    reps: int,
    progress: Progress,
    key_label: str = "",
) -> Row:
    """One load plan's row: a fresh reader (same key as the producer) loading `hashes`."""
    label = f"layerkv load ({plan})" + (f", {key_label}" if key_label else "")
    progress.case(f"{NAME} {backend.name} load {plan}{', ' + key_label if key_label else ''}")
    reader = _Worker(backend, case, tag, transfer_plan=plan, **extra)
    try:
        reader.load(hashes)  # warm-up: staging registered, lanes started, estimates seeded
        for cache in reader.caches.values():
            cache[:] = 0
        s = median_s(lambda: reader.load(hashes), reps)
        same = all(np.array_equal(reader.caches[n], producer.caches[n]) for n in reader.names)
        stats = reader.worker.stats()
        return {
            **base,
            "direction": "get",
            "path": label,
            "ms": s * 1e3,
            "gbps": gbps(payload, s),
            "vs_whole": ratio(get_s, s),
            "verified": same and stats.load_failed_blocks == 0,
            "plans l/g/w": f"{stats.load_plans_layers}/{stats.load_plans_groups}/{stats.load_plans_whole}",
        }
    finally:
        reader.close()


def _measure(backend: Backend, case: Case, reps: int, progress: Progress) -> list[Row]:
    tag = f"{backend.name}-{next(_runs)}"
    producer = _Worker(backend, case, tag, transfer_plan="layers")
    assert producer.worker.layout is not None
    object_nbytes = producer.worker.layout.object_nbytes
    payload = case.num_keys * object_nbytes
    put_s, get_s = _whole(backend, case, object_nbytes, reps)
    base = {"backend": backend.name, "entry": kib(case.entry_nbytes), "keys": case.num_keys, "layers": case.num_layers}
    rows: list[Row] = [
        {**base, "direction": d, "path": "whole object", "ms": s * 1e3, "gbps": gbps(payload, s), "vs_whole": 1.0}
        for d, s in (("get", get_s), ("put", put_s))
    ]
    try:
        for plan in SAVE_PLANS:
            saver = producer if plan == "layers" else _Worker(backend, case, tag, transfer_plan=plan)
            try:
                rows.append(
                    {**base, **_save_row(backend, saver, f"{tag}:{plan}", plan, payload, put_s, reps, progress)}
                )
            finally:
                if saver is not producer:
                    saver.close()
        hashes = _hashes(f"{tag}:load", case.num_keys)
        producer.save(hashes)
        for plan in LOAD_PLANS:
            rows.append(_load_row(backend, case, tag, plan, {}, producer, hashes, base, payload, get_s, reps, progress))
        with tempfile.TemporaryDirectory(prefix="layerkv-bench-key-") as tmp:
            key_file = str(write_key_file(Path(tmp) / "tenant.key").path)
            variants: list[tuple[str, dict[str, object]]] = [
                ("tenant key", {"tenant_key_file": key_file}),
                ("encrypted", {"tenant_key_file": key_file, "encrypt_objects": True}),
            ]
            for label, extra in variants:
                rows += _keyed_rows(backend, case, tag, label, extra, base, payload, put_s, get_s, reps, progress)
        producer.store.batch_remove(producer.keys(hashes))
    finally:
        producer.close()
    return rows


def _save_row(
    backend: Backend, saver: _Worker, tag: str, plan: str, payload: int, put_s: float, reps: int, progress: Progress
) -> Row:
    """One save plan's row: `saver` saves fresh keys each repetition (after one warm-up save);
    every saved object must be readable; they are removed after."""
    progress.case(f"{NAME} {backend.name} save {plan}")
    num_keys = saver.case.num_keys
    run_hashes: list[tuple[bytes, ...]] = []

    def fresh() -> None:
        run_hashes.append(_hashes(f"{tag}:{len(run_hashes)}", num_keys))

    fresh()
    saver.save(run_hashes[-1])  # warm-up
    s = median_s(lambda: saver.save(run_hashes[-1]), reps, setup=fresh)
    assert saver.store.batch_is_exist(saver.keys(run_hashes[-1])) == [1] * num_keys, "saved objects not readable"
    for h in run_hashes:
        saver.store.batch_remove(saver.keys(h))
    return {
        "direction": "put",
        "path": f"layerkv save ({plan})",
        "ms": s * 1e3,
        "gbps": gbps(payload, s),
        "vs_whole": ratio(put_s, s),
    }


def tag_rows(options: BenchOptions) -> list[Row]:
    """GB/s of Sealer.layer_tags over 64 layers of one size (what a save or a load computes per
    layer of each key), unkeyed and keyed, on this thread."""
    out: list[Row] = []
    for nbytes in (16 * KiB,) if options.tiny else (4 * KiB, 64 * KiB, 1024 * KiB):
        rows = np.random.default_rng(nbytes).integers(0, 255, (64, nbytes), dtype=np.uint8)
        contexts = [context(f"bench@{i}@0", bytes(NONCE_NBYTES)) for i in range(64)]
        chunks = [[r] for r in rows]
        times: dict[str, float] = {}
        for name, sealer in (("unkeyed", Sealer(None)), ("keyed", Sealer(bytes(32)))):
            times[name] = median_s(functools.partial(sealer.layer_tags, contexts, 3, chunks), options.reps)
        cipher = Sealer(bytes(32), LayerCipher(bytes(32)))  # encrypts in place: a fresh copy per run
        times["encrypted"] = median_s(lambda: cipher.seal_layers(contexts, 3, list(rows.copy())), options.reps)
        out.append(
            {
                "layer_nbytes": nbytes,
                "unkeyed_gbps": gbps(rows.nbytes, times["unkeyed"]),
                "keyed_gbps": gbps(rows.nbytes, times["keyed"]),
                "encrypted_gbps": gbps(rows.nbytes, times["encrypted"]),
                "keyed_vs_unkeyed": ratio(times["keyed"], times["unkeyed"]),
                "encrypted_vs_unkeyed": ratio(times["encrypted"], times["unkeyed"]),
            }
        )
    return out


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    with open_backends(options.mooncake) as backends:
        for backend in backends:
            for case in cases(options):
                result.rows.extend(_measure(backend, case, options.reps, progress))
    for row in result.rows:
        if row["path"] == "layerkv load (auto)":
            result.summary[f"{row['backend']} {row['entry']} load auto vs whole"] = row["vs_whole"]
        if row["path"] == "layerkv save (auto)":
            result.summary[f"{row['backend']} {row['entry']} save auto vs whole"] = row["vs_whole"]
    result.tables[
        "Layer tags per core, one thread: xxh3-128 (no key), BLAKE3-keyed MAC (tenant key), "
        "AES-256-GCM (encrypt_objects; the copy it encrypts included)"
    ] = tag_rows(options)
    for row in result.tables[next(iter(result.tables))]:
        result.summary[f"tags {kib(row['layer_nbytes'])} keyed / unkeyed time"] = row["keyed_vs_unkeyed"]
    result.notes = [
        "layerkv save / load (auto), tenant key: the same with tenant_key_file (keyed names, keyed MACs per layer "
        "and header) on both sides; encrypted: also encrypt_objects (AES-256-GCM per layer, in private memory)",
        "whole object: batch_get_into / batch_put_from of contiguous objects, no session, no tag, no commit protocol",
        "layerkv load: one step of the WorkerConnector waiting for every layer with no compute (the transfer alone), "
        "bytes compared with the producer's caches afterwards; read_layers_per_range=4 for the groups plan",
        "layerkv save: the save step plus the step carrying its commit verdict, until every object is readable; "
        "layers = per-layer writes straight from the cache, auto = staged object images (one write per key)",
        "vs_whole = whole-object time / layerkv time (1.0 = as fast as whole objects)",
    ]
    return result
