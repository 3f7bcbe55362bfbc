"""`layerkv pool` end to end against a real `layerkv master` (a child with a 64 MiB segment):
objects of two namespaces and their manifests written by a Mooncake client (ManifestWriter),
one foreign key; the listing names each namespace's model, tenant label, digest, objects,
bytes and the master's capacity; --purge --yes removes one namespace only; --purge asks on a
terminal and refuses without one; an unknown namespace is an error naming the known ones."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import layerkv
from layerkv.messages import Deployment
from layerkv.objects.keys import Namespace, block_keys, namespace_for
from layerkv.objects.manifest import ManifestInfo, ManifestWriter, manifest_body, manifest_key
from layerkv.store.checked import CheckedStore
from layerkv.store.local_master import LocalMaster
from layerkv.store.mooncake import MooncakeStore
from tests.mooncake_master import require_mooncake

pytestmark = pytest.mark.mooncake

SRC = str(Path(layerkv.__file__).parents[1])
SEGMENT_BYTES = 64 << 20
CREATED_AT = 1_800_000_000.0
A = Deployment(model_id="org/model-a", kv_dtype="float16", block_size=16, num_kv_heads=4, kv_signature="a")
B = Deployment(model_id="org/model-b", kv_dtype="bfloat16", block_size=32, num_kv_heads=4, tp_size=2, kv_signature="b")
A_OBJECT_BYTES, B_OBJECT_BYTES, FOREIGN_BYTES = 4096, 10_000, 100


@dataclasses.dataclass
class Pool:
    master: LocalMaster
    store: CheckedStore  # a client without a segment, as an engine's
    a: Namespace
    b: Namespace
    a_bytes: int  # blocks + manifest
    b_bytes: int

    def pool(self, *argv: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PYTHONPATH=SRC, MC_TCP_BIND_ADDRESS="127.0.0.1")
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "layerkv.cli",
                "pool",
                "--master-info",
                str(self.master.info_path),
                "--config",
                str(self.master.config_path),
                *argv,
            ],
            check=False,
            stdin=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    def listing(self) -> dict[str, Any]:
        done = self.pool("--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]


def _write(store: CheckedStore, keys: list[str], nbytes: int) -> None:
    buffer = np.full(nbytes * len(keys), 7, dtype=np.uint8)  # [objects * bytes]
    store.register_buffer(buffer.ctypes.data, buffer.nbytes)
    got = store.batch_put_from(keys, [buffer.ctypes.data + i * nbytes for i in range(len(keys))], [nbytes] * len(keys))
    store.unregister_buffer(buffer.ctypes.data)
    assert got == [0] * len(keys)


def _manifest(store: CheckedStore, deployment: Deployment, tenant: str) -> tuple[Namespace, int]:
    ns = namespace_for(deployment, tenant)
    info = ManifestInfo.from_deployment(deployment, tenant)
    writer = ManifestWriter(store, info, wall_clock=lambda: CREATED_AT)
    writer.ensure([ns])
    assert (writer.stats.written, writer.stats.failed_attempts) == (1, 0)
    again = ManifestWriter(store, info)  # another process of the same deployment
    again.ensure([ns])
    assert (again.stats.written, again.stats.existed) == (0, 1)
    return ns, len(manifest_body(ns, info, 0, CREATED_AT))


@pytest.fixture
def pool() -> Iterator[Pool]:
    require_mooncake()
    master = LocalMaster(segment_size=f"{SEGMENT_BYTES >> 20}MB")
    store = None
    try:
        store = CheckedStore(MooncakeStore.from_mooncake_config(master.client_config), max_batch_keys=64)
        a, a_manifest = _manifest(store, A, "team-a")
        b, b_manifest = _manifest(store, B, "team-b")
        _write(store, block_keys(a, [bytes([i]) * 8 for i in range(4)], 0), A_OBJECT_BYTES)
        _write(store, [*block_keys(b, [b"\x01" * 8], 0), *block_keys(b, [b"\x01" * 8], 1)], B_OBJECT_BYTES)
        _write(store, ["foreign-object"], FOREIGN_BYTES)
        yield Pool(master, store, a, b, 4 * A_OBJECT_BYTES + a_manifest, 2 * B_OBJECT_BYTES + b_manifest)
    finally:
        if store is not None:
            store.close()
        master.stop()


def _rows(listing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["namespace"]: row for row in listing["namespaces"]}


def test_the_listing_names_each_namespace_and_the_capacity(pool: Pool) -> None:
    listing = pool.listing()
    rows = _rows(listing)
    assert set(rows) == {pool.a.name, pool.b.name, "(not layerkv)"}
    a, b, other = rows[pool.a.name], rows[pool.b.name], rows["(not layerkv)"]
    assert (a["model"], a["tenant"], a["digest"], a["num_objects"], a["nbytes"]) == (
        "org/model-a",
        "team-a",
        pool.a.digest.hex(),
        5,
        pool.a_bytes,
    )
    assert (b["model"], b["tenant"], b["digest"], b["num_objects"], b["nbytes"]) == (
        "org/model-b",
        "team-b",
        pool.b.digest.hex(),
        3,
        pool.b_bytes,
    )
    assert b["settings"]["block_size"] == 32 and b["settings"]["store_shards"] == 2 and b["settings"]["tp_size"] == 2
    assert (other["model"], other["num_objects"], other["nbytes"]) == (None, 1, FOREIGN_BYTES)
    assert listing["capacity_bytes"] == SEGMENT_BYTES and listing["num_keys"] == 9
    assert listing["used_bytes"] == pool.a_bytes + pool.b_bytes + FOREIGN_BYTES

    done = pool.pool()
    assert done.returncode == 0, done.stderr
    print(done.stdout)  # the operator's table (pytest -s shows it)
    text = done.stdout
    assert "of 64.0 MiB used" in text and "9 objects" in text
    line_a = next(line for line in text.splitlines() if line.startswith(pool.a.name))
    assert line_a.split() == [
        pool.a.name,
        "org/model-a",
        "team-a",
        "block",
        "16,",
        "float16,",
        "1",
        "shard,",
        "tp",
        "1",
        pool.a.digest.hex(),
        "5",
        f"{pool.a_bytes / 1024:.1f}",
        "KiB",
    ]
    line_b = next(line for line in text.splitlines() if line.startswith(pool.b.name))
    assert "org/model-b  team-b  block 32, bfloat16, 2 shards, tp 2" in line_b


def test_purge_with_yes_removes_that_namespace_only(pool: Pool) -> None:
    done = pool.pool("--purge", pool.b.name, "--yes")
    assert done.returncode == 0, done.stderr
    assert (
        f"removed 3 of 3 objects ({pool.b_bytes / 1024:.1f} KiB) of namespace {pool.b.name} "
        "(model org/model-b, tenant team-b)" in done.stdout
    )
    rows = _rows(pool.listing())
    assert set(rows) == {pool.a.name, "(not layerkv)"} and rows[pool.a.name]["num_objects"] == 5
    assert pool.store.batch_is_exist([manifest_key(pool.b), manifest_key(pool.a)]) == [0, 1]


def test_purge_asks_on_a_terminal_and_refuses_without_one(pool: Pool) -> None:
    refused = pool.pool("--purge", pool.a.name)  # stdin: /dev/null
    assert refused.returncode == 2
    assert (
        f"--purge {pool.a.name} asks before removing anything, and stdin is not a terminal: add --yes" in refused.stderr
    )
    parent, child = pty.openpty()
    try:
        os.write(parent, b"n\n")
        declined = pool.pool("--purge", pool.a.name, stdin=child)
    finally:
        os.close(parent)
        os.close(child)
    assert declined.returncode == 1, declined.stderr
    assert (
        f"remove 5 objects ({pool.a_bytes / 1024:.1f} KiB) of namespace {pool.a.name} (model org/model-a, "
        "tenant team-a)? Engines using it recompute. [y/N]" in declined.stdout
    )
    assert "nothing removed" in declined.stdout
    assert _rows(pool.listing())[pool.a.name]["num_objects"] == 5


def test_an_unknown_namespace_is_an_error_naming_the_known_ones(pool: Pool) -> None:
    for name in ("model-c-0123456789abcdef", "(not layerkv)"):
        done = pool.pool("--purge", name, "--yes")
        assert done.returncode == 2
        known = ", ".join(sorted([pool.a.name, pool.b.name]))
        assert f"layerkv pool: namespace {name!r} is not in the pool (its namespaces: {known})" in done.stderr
    assert pool.listing()["num_keys"] == 9


def test_a_cp_share_row_names_its_cp_rank_size_and_interleave() -> None:
    """A namespace of one decode-context-parallel share: the table shows which share it holds."""
    from layerkv.commands.pool import render

    cp = Deployment(
        model_id="org/mla", kv_dtype="bfloat16", block_size=16, num_kv_heads=1, is_mla=True, tp_size=2,
        dcp_size=2, dcp_rank=1, tp_rank=1, cp_interleave=8, kv_signature="mla",
    )  # fmt: skip
    ns = namespace_for(cp, "t")
    manifest = json.loads(manifest_body(ns, ManifestInfo.from_deployment(cp, "t"), 0, CREATED_AT, cp_rank=1))
    row = {"namespace": ns.name, "num_objects": 3, "nbytes": 3072, **manifest}
    listing = {"master": "m", "metrics_url": "u", "capacity_bytes": 1 << 20, "used_bytes": 3072, "num_keys": 3}
    text = render({**listing, "num_listed": 3, "namespaces": [row]})
    assert "block 16, bfloat16, 1 shard, tp 2, dcp 1/2 interleave 8" in text
