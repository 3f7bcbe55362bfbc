"""objects/manifest.py: the manifest key never names a block, the body holds labels and settings
(never a tenant key), and ManifestWriter writes each namespace's manifest once ("put if
absent"), retries at most once per interval while the store is down, and never raises."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from layerkv.messages import Deployment
from layerkv.objects.keys import block_key, namespace_for, share_deployment, with_store_shards
from layerkv.objects.manifest import (
    MANIFEST_MAX_BYTES,
    ManifestInfo,
    ManifestWriter,
    is_manifest_key,
    manifest_body,
    manifest_key,
    parse_manifest,
)
from layerkv.store.base import Code, KVStore
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore

DEPLOYMENT = Deployment(
    model_id="org/Model-7B",
    kv_dtype="bfloat16",
    block_size=16,
    num_kv_heads=8,
    tp_size=2,
    kv_signature="L0:k[16,4,64]bf16",
)
CREATED_AT = 1_800_000_000.0
RPC_FAIL = int(Code.RPC_FAIL)


def info(deployment: Deployment = DEPLOYMENT, **kwargs: Any) -> ManifestInfo:
    return ManifestInfo.from_deployment(deployment, "team-a", **kwargs)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Switchable:
    """An embedded store whose batch calls answer RPC_FAIL while `down` (or batch_put_from
    `put_answer`), and whose other calls (register_buffer) raise `raises`."""

    def __init__(self, backend: EmbeddedStore) -> None:
        self.backend, self.name = backend, "switchable"
        self.down = False
        self.raises: Exception | None = None
        self.put_answer: int | None = None  # batch_put_from answers this per key instead
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> Callable[..., Any]:
        real = getattr(self.backend, method)

        def call(*args: Any) -> Any:
            self.calls.append(method)
            if self.raises is not None and not method.startswith("batch_"):
                raise self.raises  # register_buffer: CheckedStore raises StoreError
            if self.down and method.startswith("batch_"):
                return [RPC_FAIL] * len(args[0])
            if method == "batch_put_from" and self.put_answer is not None:
                return [self.put_answer] * len(args[0])
            return real(*args)

        return call


def read_object(store: KVStore, key: str) -> bytes:
    buffer = np.zeros(MANIFEST_MAX_BYTES, dtype=np.uint8)
    store.register_buffer(buffer.ctypes.data, buffer.nbytes)
    (nbytes,) = store.batch_get_into([key], [buffer.ctypes.data], [buffer.nbytes])
    store.unregister_buffer(buffer.ctypes.data)
    assert nbytes > 0, nbytes
    return buffer[:nbytes].tobytes()


def test_the_manifest_key_never_names_a_block() -> None:
    ns = namespace_for(DEPLOYMENT, "team-a")
    key = manifest_key(ns)
    assert key == f"{ns.name}@manifest" == manifest_key(ns.name) and is_manifest_key(key)
    blocks = [block_key(ns, bytes([b]) * n, rank) for b in (0, 0x6D, 0xFF) for n in (1, 8, 32) for rank in (0, 1, 7)]
    assert key not in blocks and not any(is_manifest_key(k) for k in blocks)
    with pytest.raises(ValueError):
        bytes.fromhex("manifest")  # no block id (hex) is ever spelt so


def test_the_body_holds_labels_and_settings() -> None:
    deployment = with_store_shards(DEPLOYMENT, 4)
    ns = namespace_for(deployment, "team-a")
    body = parse_manifest(manifest_body(ns, info(deployment), 0, CREATED_AT))
    assert body is not None
    assert body["namespace"] == ns.name and body["digest"] == ns.digest.hex()
    assert (body["model"], body["tenant"], body["pp_rank"]) == ("org/Model-7B", "team-a", 0)
    assert body["settings"] == {
        "block_size": 16,
        "kv_dtype": "bfloat16",
        "store_shards": 4,
        "tp_size": 2,
        "pp_size": 1,
        "keyed": False,
        "encrypted": False,
    }
    assert body["created_at"] == "2027-01-15T08:00:00+00:00"


def test_a_keyed_namespace_manifest_holds_no_key() -> None:
    names_key = os.urandom(32)
    ns = namespace_for(DEPLOYMENT, "team-a", names_key=names_key)
    raw = manifest_body(ns, info(keyed=True), 0, CREATED_AT)
    assert names_key not in raw and names_key.hex().encode() not in raw
    assert set(json.loads(raw)) == {
        "format",
        "namespace",
        "digest",
        "model",
        "tenant",
        "pp_rank",
        "settings",
        "created_at",
    }
    assert json.loads(raw)["settings"]["keyed"] is True


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"format": 2, "namespace": "a", "model": "m", "tenant": "t"}',
        b'{"format": 1, "namespace": "a", "model": 7, "tenant": "t"}',
    ],
)
def test_anything_but_a_manifest_parses_as_none(raw: bytes) -> None:
    assert parse_manifest(raw) is None


def test_the_writer_writes_once_and_is_cheap_after() -> None:
    root = EmbeddedStore(16 << 20, strict_buffers=True)
    backend = Switchable(root.client())
    store = CheckedStore(backend, max_batch_keys=64)
    two_stages = dataclasses.replace(DEPLOYMENT, pp_size=2)
    stages = [namespace_for(dataclasses.replace(two_stages, pp_rank=rank), "team-a") for rank in (0, 1)]
    writer = ManifestWriter(store, info(two_stages), wall_clock=lambda: CREATED_AT)
    writer.ensure(stages)
    assert (writer.stats.written, writer.stats.existed, writer.stats.failed_attempts) == (2, 0, 0)
    for stage, ns in enumerate(stages):
        assert read_object(root, manifest_key(ns)) == manifest_body(ns, writer.info, stage, CREATED_AT)
    calls = len(backend.calls)
    for _ in range(100):
        writer.ensure(stages)
    assert len(backend.calls) == calls  # no store call once written

    other = ManifestWriter(CheckedStore(root.client(), max_batch_keys=64), info(two_stages))  # another process
    other.ensure(stages)
    assert (other.stats.written, other.stats.existed) == (0, 2)


def test_a_down_store_is_retried_once_per_interval_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    backend = Switchable(EmbeddedStore(16 << 20, strict_buffers=True))
    store = CheckedStore(backend, max_batch_keys=64, retry_interval_s=5.0, clock=clock)
    ns = namespace_for(DEPLOYMENT, "team-a")
    writer = ManifestWriter(store, info(), retry_interval_s=30.0, clock=clock)
    backend.down = True
    with caplog.at_level(logging.WARNING, logger="layerkv"):
        writer.ensure([ns])
    assert writer.stats.failed_attempts == 1 and "namespace manifest not written (exists RPC_FAIL(-900))" in caplog.text
    calls = len(backend.calls)
    clock.now += 29.0
    writer.ensure([ns])
    assert len(backend.calls) == calls and writer.stats.failed_attempts == 1  # not before the interval
    backend.down, backend.raises = False, RuntimeError("boom")
    clock.now += 1.0
    writer.ensure([ns])  # register_buffer raises StoreError: still no exception here
    assert writer.stats.failed_attempts == 2 and "raised StoreError" in caplog.text
    backend.raises = None
    clock.now += 30.0
    writer.ensure([ns])
    assert (writer.stats.written, writer.stats.failed_attempts) == (1, 2)
    assert store.batch_is_exist([manifest_key(ns)]) == [1]


def test_a_failed_put_is_retried() -> None:
    clock = Clock()
    backend = Switchable(EmbeddedStore(16 << 20, strict_buffers=True))
    writer = ManifestWriter(CheckedStore(backend, max_batch_keys=64), info(), retry_interval_s=10.0, clock=clock)
    ns = namespace_for(DEPLOYMENT, "team-a")
    backend.put_answer = int(Code.NO_SPACE)
    writer.ensure([ns])
    assert writer.stats.failed_attempts == 1 and writer.stats.written == 0
    backend.put_answer = None
    clock.now += 10.0
    writer.ensure([ns])
    assert writer.stats.written == 1


def test_each_cp_share_gets_its_manifest_naming_stage_and_cp_rank() -> None:
    """Decode context parallelism: one namespace per (stage, CP rank), stage-major; each manifest
    names its stage and CP rank, the settings the CP size and interleave."""
    cp = Deployment(
        model_id="org/Model-7B", kv_dtype="bfloat16", block_size=16, num_kv_heads=1, tp_size=2, is_mla=True,
        pp_size=2, dcp_size=2, cp_interleave=4, kv_signature="mla",
    )  # fmt: skip
    shares = [namespace_for(share_deployment(cp, s, c), "team-a") for s in (0, 1) for c in (0, 1)]
    assert len({ns.name for ns in shares}) == 4
    root = EmbeddedStore(16 << 20, strict_buffers=True)
    writer = ManifestWriter(CheckedStore(root.client(), max_batch_keys=64), info(cp), wall_clock=lambda: CREATED_AT)
    writer.ensure(shares)
    bodies = [parse_manifest(read_object(root, manifest_key(ns))) for ns in shares]
    assert [(b["pp_rank"], b["cp_rank"]) for b in bodies if b] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(b["settings"]["dcp_size"], b["settings"]["cp_interleave"]) for b in bodies if b} == {(2, 4)}
    plain = parse_manifest(manifest_body(namespace_for(DEPLOYMENT, "team-a"), info(), 0, CREATED_AT))
    assert plain is not None and "cp_rank" not in plain and "dcp_size" not in plain["settings"]
