"""Only staging is ever exposed (docs/data-safety.md §1). A real attacker -- a separate process
with a bare Mooncake TransferEngine and the master's metadata URL (tests/security/attacker.py) --
lists what a worker's Mooncake client publishes and tries to read and write the engine's live KV
cache: with the default config it finds only the staging areas and cannot address the cache;
with register_kv_cache it can (the opt-in's exposure, and the proof the probe can fail). Bytes it
writes into staging while a load is in flight are caught by the checksums: the blocks are
recomputed and the outputs equal local compute."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from layerkv.config import LayerKVConfig
from layerkv.connector.worker import WorkerConnector
from layerkv.messages import Deployment
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import GET_RANGES
from tests.e2e.harness import assert_identical, computed_chunks, local_oracle, random_tokens, serve, small_engine
from tests.mooncake_master import MasterProcess, connect_store
from tests.security.peer import Attacker

LAYERS, BLOCKS, BLOCK_SIZE = 3, 16, 16


@pytest.fixture
def attacker(mooncake_master: MasterProcess) -> Iterator[Attacker]:
    peer = Attacker(mooncake_master.metadata_url)
    try:
        yield peer
    finally:
        peer.close()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


@pytest.mark.parametrize("register_kv_cache", [False, True])
def test_a_peer_finds_only_staging_and_cannot_reach_the_live_cache(
    mooncake_master: MasterProcess, attacker: Attacker, register_kv_cache: bool
) -> None:
    store = connect_store(mooncake_master, 0)  # no global segment: the segment publishes only what is registered
    config = LayerKVConfig.from_dict({"backend": "mooncake", "register_kv_cache": register_kv_cache}, env={})
    deployment = Deployment(
        model_id="test/boundary",
        kv_dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        kv_signature=f"boundary:{LAYERS}x[2,{BLOCK_SIZE},2,8]f32",
    )
    worker = WorkerConnector(config, deployment, CheckedStore(store, max_batch_keys=64))
    shape = (2, BLOCKS, BLOCK_SIZE, 2, 8)
    caches = {f"model.layers.{li}.self_attn.attn": torch.full(shape, 7.0) for li in range(LAYERS)}
    cache_regions = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in caches.values()]
    try:
        before = attacker.ask(op="list", segment=store.segment_name)["buffers"]
        worker.register_kv_caches(caches, BLOCKS)
        published = [tuple(b) for b in attacker.ask(op="list", segment=store.segment_name)["buffers"]]
        new = sorted(set(published) - {tuple(b) for b in before})
        areas = worker._areas
        assert areas is not None
        staging = sorted((a.ptr, a.nbytes) for a in areas.all())
        target = cache_regions[1][0] + 4096  # a block of layer 1's live cache
        read = attacker.ask(op="read", segment=store.segment_name, addr=target, nbytes=64)
        wrote = attacker.ask(op="write", segment=store.segment_name, addr=target, nbytes=64, byte=0x5A)
        changed = not bool(torch.all(caches["model.layers.1.self_attn.attn"] == 7.0))
        if not register_kv_cache:
            assert new == staging  # what the store publishes of this worker: its staging, nothing else
            assert not any(_overlaps(b, c) for b in published for c in cache_regions)
            assert read["rc"] != 0 and wrote["rc"] != 0 and not changed
        else:  # the opt-in: the live cache is published and any peer can write into it
            assert set(cache_regions) <= set(new)
            assert read["rc"] == 0 and wrote["rc"] == 0 and changed
    finally:
        worker.shutdown()
        store.close()


PREFIX = random_tokens(22, seed=81)
PRODUCER_PROMPT = PREFIX + random_tokens(2, seed=82)
CONSUMER_PROMPT = PREFIX + random_tokens(18, seed=83)  # 5 blocks shared
MAX_TOKENS = 3
ENGINE = small_engine(max_num_batched_tokens=12)


@pytest.mark.parametrize("backend", ["mooncake"], indirect=True)
def test_bytes_a_peer_writes_into_staging_during_a_load_are_caught(
    make_oracle,
    backend,
    mooncake_master: MasterProcess,  # type: ignore[no-untyped-def]
    attacker: Attacker,
) -> None:
    oracle = make_oracle(engine_config=ENGINE)  # per-layer reads through staging (the harness pins the plan)
    producer = oracle.pooled()
    serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    segment = backend.client(0).segment_name
    before = attacker.ask(op="list", segment=segment)["buffers"]  # the pool's segment, the producer's staging
    consumer = oracle.pooled()
    scribbled: list[list[list[int]]] = []

    def scribble(keys, args) -> None:  # type: ignore[no-untyped-def]
        # layer 1 has landed in the consumer's staging: the peer overwrites every buffer that is new
        scribbled.append(attacker.ask(op="scribble", segment=segment, skip=before, byte=0x5A)["written"])

    rule = consumer.rank_faults(0).then(GET_RANGES, scribble, layer_idx=1, times=1)
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert consumer.rank_faults(0).fired(rule) == 1
    assert scribbled and scribbled[0] and all(rc == 0 for _, _, rc in scribbled[0])  # the writes landed
    stats = consumer.workers[0].stats()
    assert stats.checksum_failures >= 1 and stats.load_failed_blocks >= 1, stats
    engine = oracle.local()
    matched = serve(engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    assert computed_chunks(consumer.engine, got.req_id) == computed_chunks(engine, matched.req_id)  # all recomputed
    assert_identical([got], [matched])


class _TagHook:
    """The producer's sealer, with `hook` run as a layer's tags are computed."""

    def __init__(self, sealer, hook) -> None:  # type: ignore[no-untyped-def]
        self._sealer, self._hook = sealer, hook

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._sealer, name)

    def indexed_tags(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._hook()
        return self._sealer.indexed_tags(*args, **kwargs)


@pytest.mark.parametrize("backend", ["mooncake"], indirect=True)
@pytest.mark.parametrize("when", ["while-tagging", "after-tagging"])
def test_bytes_a_peer_writes_into_save_staging_are_never_served(
    make_oracle,
    backend,
    attacker: Attacker,  # type: ignore[no-untyped-def]
    monkeypatch,
    when: str,
) -> None:
    """The attacker overwrites layer 1 of every object in the producer's save staging, through
    the store's port, while that layer's tags are computed or right after: the tags cover the
    bytes compute wrote (never staging's), so a consumer either loads exactly those (the
    attacker's bytes were overwritten by ours) or refuses the blocks and recomputes them; its
    output equals local compute either way."""
    from layerkv.transfer.staged import StagedLayers

    oracle = make_oracle(engine_config=ENGINE)
    producer = oracle.pooled()
    segment = backend.client(0).segment_name
    written: list[int] = []
    real = StagedLayers.gather_sealed

    def attack(staging, slots, layer_idx: int, layout) -> None:  # type: ignore[no-untyped-def]
        col, width = layout.layer_offset(layer_idx), layout.layer_nbytes(layer_idx)
        for slot in slots.tolist():
            addr = staging.ctypes.data + slot * staging.strides[0] + col
            written.append(attacker.ask(op="write", segment=segment, addr=addr, nbytes=width, byte=0x5A)["rc"])

    def racing(self, layer_idx, staging, slots, block_ids, contexts, sealer, after=None):
        if layer_idx != 1:
            return real(self, layer_idx, staging, slots, block_ids, contexts, sealer, after)
        if when == "while-tagging":
            sealer = _TagHook(sealer, lambda: attack(staging, slots, layer_idx, self.layout))
        tags = real(self, layer_idx, staging, slots, block_ids, contexts, sealer, after)
        if when == "after-tagging":
            attack(staging, slots, layer_idx, self.layout)
        return tags

    with monkeypatch.context() as patch:
        patch.setattr(StagedLayers, "gather_sealed", racing)
        serve(producer.engine, [PRODUCER_PROMPT], MAX_TOKENS)
    assert written and all(rc == 0 for rc in written)  # the attacker's writes landed in save staging
    consumer = oracle.pooled()
    got = serve(consumer.engine, [CONSUMER_PROMPT], MAX_TOKENS)[0]
    stats = consumer.workers[0].stats()
    if when == "while-tagging":  # ours came after the attacker's: every block served from the pool
        want = local_oracle(oracle.local(), [PRODUCER_PROMPT], [CONSUMER_PROMPT], MAX_TOKENS)[0]
        assert got.num_external_tokens == 20 and stats.checksum_failures == 0, stats
    else:  # the attacker's bytes are what the store holds: refused, recomputed
        local = oracle.local()
        want = serve(local, [CONSUMER_PROMPT], MAX_TOKENS)[0]
        assert stats.checksum_failures >= 1 and stats.load_failed_blocks >= 1, stats
        assert computed_chunks(consumer.engine, got.req_id) == computed_chunks(local, want.req_id)  # all recomputed
    assert_identical([got], [want])
