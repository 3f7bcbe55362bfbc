"""Tenants who share one pool without trusting each other (docs/security.md). The attacker is a
separate process with a bare Mooncake store client (tests/security/pool_attacker.py) that knows
the master's addresses, layerkv's code, the public model, the block size and tenant A's tenant
string -- everything but A's key. Tenant A runs the reference engine on a real mooncake_master.

Each attack runs against A without a tenant key (the exposure without one: the attack works,
the proof that the test can fail), with one, and with encrypt_objects (the attack fails: A's
outputs stay bit-identical to local compute, the failures are counted)."""

from __future__ import annotations

import json
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from layerkv.engine import block_hashes
from layerkv.objects.keys import block_keys, tenant_namespace
from tests.e2e.harness import PooledRun, assert_identical, computed_chunks, random_tokens, serve, small_engine
from tests.mooncake_master import MasterProcess
from tests.security.forge import forge, layer_spans
from tests.security.peer import Attacker

pytestmark = pytest.mark.parametrize("backend", ["mooncake"], indirect=True)

PREFIX = random_tokens(24, seed=91)  # 6 blocks of 4
PRODUCER = PREFIX + random_tokens(2, seed=92)
CONSUMER = PREFIX + random_tokens(9, seed=93)
MAX_TOKENS = 3
ENGINE = small_engine(max_num_batched_tokens=16)
KEYED = pytest.mark.parametrize("keyed", [False, True, "encrypted"], ids=["no key", "tenant key", "encrypted"])


@pytest.fixture
def pool_attacker(mooncake_master: MasterProcess) -> Iterator[Attacker]:
    peer = Attacker(
        json.dumps(mooncake_master.config(global_segment_size=0)),
        mooncake_master.metrics_url,
        module="tests.security.pool_attacker",
    )
    try:
        yield peer
    finally:
        peer.close()


def _key_file(tmp_path: Path) -> str:
    path = tmp_path / "tenant-a.key"
    path.write_text(secrets.token_bytes(32).hex() + "\n")
    path.chmod(0o600)
    return str(path)


def _tenant_a(make_oracle, tmp_path: Path, keyed: bool | str):  # type: ignore[no-untyped-def]
    extra: dict[str, object] = {"tenant_key_file": _key_file(tmp_path)} if keyed else {}
    if keyed == "encrypted":
        extra["encrypt_objects"] = True
    return make_oracle(engine_config=ENGINE, tenant="tenant-a", **extra)


def _local(oracle, resume: int = len(PREFIX)) -> list:  # type: ignore[no-untyped-def]
    """Local compute with the schedule of a consumer that took its first `resume` tokens from
    the pool (the producer's chunks: [0, 16) [16, 26)) and computed the rest."""
    engine = oracle.local()
    if resume:
        serve(engine, [PRODUCER if resume == len(PREFIX) else PRODUCER[:resume]], MAX_TOKENS)
    return serve(engine, [CONSUMER], MAX_TOKENS)


def _assert_local_compute(oracle, consumer: PooledRun, got: list, resume: int) -> None:  # type: ignore[no-untyped-def]
    assert computed_chunks(consumer.engine, got[0].req_id)[0][0] == resume
    assert_identical(got, _local(oracle, resume))


def _same(got: list, want: list) -> bool:  # type: ignore[type-arg]
    try:
        assert_identical(got, want)
    except AssertionError:
        return False
    return True


def _unkeyed_keys(run: PooledRun, prompt: list[int]) -> list[str]:
    """A's keys as anyone computes them from public inputs (layerkv's own naming, no key)."""
    worker = run.workers[0]
    ns = tenant_namespace(worker.deployment, worker.config.tenant, worker.config.model_fingerprint, None)
    return block_keys(ns, block_hashes(prompt, run.engine.config.block_size), 0)


@KEYED
def test_probing_which_documents_a_served(
    make_oracle, tmp_path: Path, pool_attacker: Attacker, keyed: bool | str
) -> None:  # type: ignore[no-untyped-def]
    """The attacker computes the keys of six candidate documents and asks which exist."""
    oracle = _tenant_a(make_oracle, tmp_path, keyed)
    a = oracle.pooled()
    docs = [random_tokens(16, seed=700 + i) for i in range(6)]
    serve(a.engine, [docs[1], docs[4]], MAX_TOKENS)
    listed = set(pool_attacker.ask(op="list")["keys"])
    assert set(a.keys(docs[1])) <= listed  # the attacker sees A's keys listed either way
    # A's namespace is in the listing too: the attacker also tries it with the public block hashes
    namespace = a.workers[0].namespace.name
    assert any(k.startswith(namespace + "@") for k in listed)

    def probe(keys: list[str]) -> bool:
        return all(r == 1 for r in pool_attacker.ask(op="exists", keys=keys)["results"])

    computed = [probe(_unkeyed_keys(a, d)) for d in docs]
    with_listed = [
        probe([f"{namespace}@{h.hex()}@0" for h in block_hashes(d, a.engine.config.block_size)]) for d in docs
    ]
    if not keyed:  # the probe tells which documents A served
        assert computed == with_listed == [False, True, False, False, True, False]
    else:
        assert computed == with_listed == [False] * 6


FORGERIES = ["recomputed", "guessed key", "swap", "layer swap", "reserved", "nonce"]


@KEYED
@pytest.mark.parametrize("kind", FORGERIES)
def test_a_forged_object_is_never_served(
    make_oracle, tmp_path: Path, pool_attacker: Attacker, keyed: bool | str, kind: str
) -> None:  # type: ignore[no-untyped-def]
    """The attacker lists A's objects, reads two of them and overwrites one with a forgery."""
    if not keyed and kind != "recomputed":
        pytest.skip("without a key only the recomputed forgery is a clean attack (the others fail unkeyed checks too)")
    oracle = _tenant_a(make_oracle, tmp_path, keyed)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER], MAX_TOKENS)
    key_x, key_y = producer.keys(PRODUCER, blocks=[4, 5])  # block 4 starts the producer's second chunk
    listed = set(pool_attacker.ask(op="list")["keys"])
    assert {key_x, key_y} <= listed
    x, y = (bytes.fromhex(pool_attacker.ask(op="get", key=k)["data"]) for k in (key_x, key_y))
    layout = producer.workers[0].layout
    assert layout is not None and len(x) == len(y) == layout.object_nbytes
    assert layer_spans(x) == [(layout.layer_offset(li), layout.layer_nbytes(li)) for li in range(layout.num_layers)]
    forged = forge(kind, x, y, key_x)
    assert pool_attacker.ask(op="overwrite", key=key_x, data=forged.hex())["rc"] == 0
    assert pool_attacker.ask(op="get", key=key_x)["data"] == forged.hex(), "the forgery did not land"
    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER], MAX_TOKENS)
    stats = consumer.workers[0].stats()
    if not keyed:  # served silently: other outputs than local compute, and nothing noticed
        assert stats.header_failures == 0 and stats.checksum_failures == 0 and got[0].num_external_tokens == 24
        assert not _same(got, _local(oracle))
        return
    assert stats.header_failures + stats.checksum_failures >= 1 and stats.load_failed_blocks >= 1, stats
    _assert_local_compute(oracle, consumer, got, 16)
    # the forgery was removed; the consumer recomputed block 4 and wrote it again
    assert pool_attacker.ask(op="get", key=key_x)["data"] not in ("", forged.hex())


@KEYED
def test_squatting_on_a_s_future_keys(make_oracle, tmp_path: Path, pool_attacker: Attacker, keyed: bool | str) -> None:
    """Put sessions opened on the keys A will write make A's saves skip (every later request a
    miss); with a key the attacker cannot name them."""
    oracle = _tenant_a(make_oracle, tmp_path, keyed)
    a = oracle.pooled()
    squatted = _unkeyed_keys(a, PRODUCER)[:6]
    layout_nbytes = 4096
    assert pool_attacker.ask(op="squat", keys=squatted, nbytes=layout_nbytes)["results"] == [0] * 6
    try:
        serve(a.engine, [PRODUCER], MAX_TOKENS)
        consumer = oracle.pooled()
        got = serve(consumer.engine, [CONSUMER], MAX_TOKENS)
    finally:
        pool_attacker.ask(op="unsquat", keys=squatted)
    assert got[0].num_external_tokens == (24 if keyed else 0)
    _assert_local_compute(oracle, consumer, got, 24 if keyed else 0)


@KEYED
def test_a_wipe_is_a_miss_never_a_wrong_token(
    make_oracle, tmp_path: Path, pool_attacker: Attacker, keyed: bool | str
) -> None:  # type: ignore[no-untyped-def]
    """remove_by_regex on A's namespace (listed) removes A's objects: A recomputes (a denial of
    service a key cannot prevent; Mooncake tenants can, docs/security.md), outputs unchanged."""
    oracle = _tenant_a(make_oracle, tmp_path, keyed)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER], MAX_TOKENS)
    namespace = producer.workers[0].namespace.name
    assert pool_attacker.ask(op="wipe", regex=f"^{namespace}@.*")["removed"] >= 6
    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER], MAX_TOKENS)
    assert got[0].num_external_tokens == 0
    _assert_local_compute(oracle, consumer, got, 0)


@pytest.mark.parametrize("encrypted", [False, True], ids=["tenant key", "encrypted"])
def test_what_a_reader_of_the_pool_learns_of_the_kv(
    make_oracle, tmp_path: Path, pool_attacker: Attacker, encrypted: bool
) -> None:  # type: ignore[no-untyped-def]
    """The attacker reads A's objects. With a key alone their layers are A's KV in clear (what
    let an attacker recover A's prompt with the public weights); with encrypt_objects they are
    ciphertext: about one byte in 256 equal to the KV by chance, no layer's bytes anywhere, and
    A still serves from the pool, bit-identical to local compute."""
    key_file = _key_file(tmp_path)
    plain = make_oracle(engine_config=ENGINE, tenant="tenant-p", tenant_key_file=key_file)
    reference = plain.pooled()
    serve(reference.engine, [PRODUCER], MAX_TOKENS)  # the same KV, stored in clear
    oracle = make_oracle(engine_config=ENGINE, tenant="tenant-a", tenant_key_file=key_file, encrypt_objects=encrypted)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER], MAX_TOKENS)
    layout = producer.workers[0].layout
    assert layout is not None
    for key_kv, key_a in zip(reference.keys(PRODUCER), producer.keys(PRODUCER)):
        kv = bytes.fromhex(pool_attacker.ask(op="get", key=key_kv)["data"])
        read = bytes.fromhex(pool_attacker.ask(op="get", key=key_a)["data"])
        body_kv = np.frombuffer(kv, np.uint8)[layout.header_nbytes :]
        body = np.frombuffer(read, np.uint8)[layout.header_nbytes :]
        if not encrypted:
            assert np.array_equal(body, body_kv)  # A's KV, readable by anyone who reaches the pool
            continue
        assert np.mean(body == body_kv) < 0.02
        for li in range(layout.num_layers):
            at, n = layout.layer_offset(li), layout.layer_nbytes(li)
            assert kv[at : at + n] not in read and kv[at : at + 32] not in read
    assert struct.unpack_from("<I", read, 128)[0] == (3 if encrypted else 1)  # flags: keyed (+ encrypted)
    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER], MAX_TOKENS)
    assert got[0].num_external_tokens == 24
    _assert_local_compute(oracle, consumer, got, 24)


@KEYED
def test_a_segment_holder_rewrites_what_lands_in_its_segment(
    make_oracle, tmp_path: Path, mooncake_master: MasterProcess, keyed: bool | str
) -> None:  # type: ignore[no-untyped-def]
    """The attacker mounts a segment of the pool (A's objects are placed there); with a bare
    transfer engine it finds them in its own memory by the header's magic and rewrites one in
    place with a forgery (another of A's objects' layers, fresh unkeyed checksums)."""
    from layerkv.objects.header import MAGIC

    holder = Attacker(
        json.dumps(mooncake_master.config(global_segment_size=0)),
        mooncake_master.metrics_url,
        "64",
        module="tests.security.pool_attacker",
    )
    engine = Attacker(mooncake_master.metadata_url)
    try:
        segment = holder.ask(op="segment")["name"]
        extra: dict[str, object] = {"tenant_key_file": _key_file(tmp_path)} if keyed else {}
        if keyed == "encrypted":
            extra["encrypt_objects"] = True
        oracle = make_oracle(engine_config=ENGINE, tenant="tenant-a", preferred_segment=segment, **extra)
        producer = oracle.pooled()
        serve(producer.engine, [PRODUCER], MAX_TOKENS)
        layout = producer.workers[0].layout
        assert layout is not None
        found = engine.ask(op="find", segment=segment, magic=MAGIC.hex(), nbytes=layout.object_nbytes)["found"]
        by_id = {}
        for addr, data in found:
            obj = bytes.fromhex(data)
            by_id[obj[64 : 64 + int.from_bytes(obj[20:24], "little")].hex()] = (addr, obj)
        key_x, key_y = producer.keys(PRODUCER, blocks=[4, 5])
        # A's objects in the attacker's memory (a holder that stopped serving its segment: say why)
        assert {key_x.split("@")[1], key_y.split("@")[1]} <= set(by_id), holder.health()
        (addr_x, x), (_, y) = by_id[key_x.split("@")[1]], by_id[key_y.split("@")[1]]
        forged = forge("recomputed", x, y, key_x)
        assert engine.ask(op="put_bytes", segment=segment, addr=addr_x, data=forged.hex())["rc"] == 0
        consumer = oracle.pooled()
        got = serve(consumer.engine, [CONSUMER], MAX_TOKENS)
        stats = consumer.workers[0].stats()
        if not keyed:  # served silently
            assert stats.header_failures == 0 and stats.checksum_failures == 0 and got[0].num_external_tokens == 24
            assert not _same(got, _local(oracle))
            return
        assert stats.header_failures + stats.checksum_failures >= 1, stats
        _assert_local_compute(oracle, consumer, got, 16)
    finally:
        engine.close()
        holder.close()
