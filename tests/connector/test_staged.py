"""Staged layer-group reads (read_layers_per_range > 1): the loaded bytes equal the direct
path's (fan-out included, layer counts not divisible by k), each group is one range per key,
a failed group read marks exactly its key's blocks and skips the key afterwards, and a header
that names another block is caught from the staging slot."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from layerkv.messages import KVRole
from layerkv.objects.header import Header
from layerkv.store.faults import GET_RANGES, GET_START
from layerkv.transfer.costs import Costs
from layerkv.transfer.groups import layer_groups
from tests.connector.rig import BLOCK_SIZE, Req, Rig, assert_get_sessions_well_formed, fill_value
from tests.tokens import block_tokens


def _pattern_block(rig: Rig, rank: int, layer_idx: int, block_hash: bytes) -> torch.Tensor:
    """What compute writes in the pattern tests: a different value in every element (K and V
    differ), so a shifted, swapped or misplaced byte range cannot go unnoticed."""
    shape = rig.caches[rank][rig.layer_name(layer_idx)][:, 0].shape  # [2, block_size, heads, head_dim]
    ramp = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    return fill_value(block_hash, layer_idx) + rank * 0.5 + ramp * 0.25


@pytest.fixture
def make_pattern_rig(make_rig, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(Rig, "expected_block", _pattern_block)
    return make_rig


@pytest.mark.parametrize(("num_layers", "k", "max_rows"), [(4, 2, 64), (5, 2, 4), (5, 3, 64), (7, 3, 4)])
def test_staged_bytes_equal_direct_path(make_pattern_rig, monkeypatch, num_layers: int, k: int, max_rows: int) -> None:
    """max_rows=4 (staging_nbytes holds 4 load rows): the 6 keys pass through 4 staging slots
    in two waves per group, each wave with its own get sessions."""
    producer = make_pattern_rig(num_layers=num_layers)
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    producer.run(Req("p", prefix + [1]))
    loaded = {}
    bound = 4 * max_rows * producer.workers[0].layout.object_nbytes  # a quarter for loads
    for name, layers_per_range in (("direct", 1), ("staged", k)):
        rig = make_pattern_rig(
            num_layers=num_layers, role=KVRole.CONSUMER, read_layers_per_range=layers_per_range, staging_nbytes=bound
        )
        a, b = (
            Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100)),
            Req("b", prefix + block_tokens(2, BLOCK_SIZE, base=200)),
        )
        (ext_a, sa), (ext_b, sb) = rig.admit(a), rig.admit(b)  # b's blocks are fan-out copies of a's
        assert ext_a == ext_b == 6 * BLOCK_SIZE
        rig.poison(a)
        rig.poison(b)
        assert rig.step([sa, sb]) == set()
        assert rig.wrong_blocks(a, range(6)) == [] and rig.wrong_blocks(b, range(6)) == []
        assert rig.workers[0].stats().load_failed_blocks == 0
        loaded[name] = [
            rig.block_values(0, li, req.block_ids[i]).clone()
            for li in range(num_layers)
            for req in (a, b)
            for i in range(6)
        ]
        assert_get_sessions_well_formed(rig.faults[0])
        if layers_per_range > 1:
            rows = rig.workers[0]._areas.loads.num_slots
            assert rows == max_rows if max_rows < 6 else rows >= 6  # the bound forces waves
            starts = [len(c.keys) for c in rig.faults[0].calls(GET_START)]
            groups = len(layer_groups(rig.workers[0].layout, k))
            # a window's sessions at a time: two waves per group, each opening its own sessions
            assert starts == ([4, 2] * groups if max_rows < 6 else [6])
    assert all(torch.equal(x, y) for x, y in zip(loaded["direct"], loaded["staged"], strict=True))


def test_each_group_is_one_range_per_key(make_rig) -> None:
    tokens = block_tokens(8, BLOCK_SIZE)
    counts = {}
    for k in (1, 3):
        rig = make_rig(num_layers=5, read_layers_per_range=k)
        if k == 1:
            rig.run(Req("a", tokens))
        b = Req(f"b{k}", tokens)
        _, s = rig.admit(b)
        rig.faults[0].clear_calls()
        assert rig.step([s]) == set()
        assert rig.wrong_blocks(b, range(8)) == []
        calls = rig.faults[0].calls(GET_RANGES)
        counts[k] = (
            [c.layer_idx for c in calls],
            sum(c.num_ranges for c in calls),
            rig.workers[0].stats().load_range_calls,
        )
    # direct: per key 1 header + K and V of 5 layers; staged: groups [0] [1..3] [4], one range each
    assert counts[1] == ([0, 1, 2, 3, 4], 8 * (1 + 2 * 5), 5)
    assert counts[3] == ([0, 1, 4], 8 * 3, 3)


def test_failed_group_read_marks_exactly_its_blocks(make_rig) -> None:
    rig = make_rig(num_layers=5, read_layers_per_range=2)
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    rig.run(Req("p", prefix + [1]))
    a, b = (
        Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100)),
        Req("b", prefix + block_tokens(2, BLOCK_SIZE, base=200)),
    )
    (_, sa), (_, sb) = rig.admit(a), rig.admit(b)
    keys = rig.keys(a, blocks=range(6))
    f = rig.faults[0]
    rule = f.fail(GET_RANGES, keys[4], layer_idx=1, times=1)  # group [1, 2]
    f.clear_calls()
    invalid = rig.step([sa, sb])
    assert f.fired(rule) == 1
    assert invalid == {a.block_ids[4], b.block_ids[4]}  # the shared key: both requests' blocks
    assert rig.workers[0].stats().load_failed_blocks == 2
    later = [k for c in f.calls(GET_RANGES) if c.layer_idx == 3 for k in c.keys]
    assert keys[4] not in later and sorted(later) == sorted(keys[:4] + keys[5:])
    assert rig.wrong_blocks(a, range(4)) == [] and rig.wrong_blocks(b, range(4)) == []
    rig.step([rig.chunk(a), rig.chunk(b)])  # recompute from the first invalid block
    assert rig.wrong_blocks(a, range(7)) == [] and rig.wrong_blocks(b, range(8)) == []
    assert_get_sessions_well_formed(f)


def test_header_of_another_block_is_detected(make_rig, backend, caplog) -> None:
    rig = make_rig(num_layers=4, read_layers_per_range=3)
    tokens = block_tokens(6, BLOCK_SIZE)
    req = Req("a", tokens)
    keys, hashes = rig.keys(req), req.hashes
    # plant key 2's object with block 3's header before the rig saves (its put then skips key 2)
    worker = rig.workers[0]
    layout = worker.layout
    header = Header(worker.namespace.digest, layout.digest, layout.num_layers, layout.object_nbytes)
    planted = np.zeros((1, layout.object_nbytes), dtype=np.uint8)
    header.encode_into(
        planted, np.arange(1), [worker.namespace.block_id(hashes[3])], [keys[2]], np.zeros((1, 16), np.uint8), None
    )
    client = backend.client()
    client.register_buffer(planted.ctypes.data, planted.nbytes)
    try:
        assert client.batch_put_from([keys[2]], [planted.ctypes.data], [planted.nbytes]) == [0]
    finally:
        client.unregister_buffer(planted.ctypes.data)
    rig.run(req)
    b = Req("b", tokens)
    _, s = rig.admit(b)
    with caplog.at_level(logging.WARNING, logger="layerkv.connector.worker"):
        invalid = rig.step([s])
    assert invalid == {b.block_ids[2]}
    assert "header field 'block_id' mismatch" in caplog.text
    later = {k for c in rig.faults[0].calls(GET_RANGES) if c.layer_idx == 1 for k in c.keys}
    assert keys[2] not in later and keys[3] in later
    rig.step([rig.chunk(b)])
    assert rig.wrong_blocks(b, range(6)) == []


def test_only_staging_is_registered_and_it_is_allocated_at_start_up(make_rig) -> None:
    """The store is handed the staging areas (allocated and registered once the KV caches are
    registered, pages mapped) and nothing else: the live cache is registered only with
    register_kv_cache. A run allocates and registers nothing more."""
    producer = make_rig()
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    producer.run(Req("p", prefix + [1]))
    rig = make_rig(role=KVRole.CONSUMER, transfer_plan="groups", read_layers_per_range=2)
    worker = rig.workers[0]
    areas = worker._areas
    assert areas is not None and areas.headers is None
    registered = sorted(worker._memory.regions())
    assert registered == sorted(a.ptr for a in areas.all())
    cache_ptrs = {t.untyped_storage().data_ptr() for t in rig.caches[0].values()}
    assert not cache_ptrs & set(registered)
    ext, invalid = rig.run(Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100)))
    assert ext == 6 * BLOCK_SIZE and invalid == set()
    assert sorted(worker._memory.regions()) == registered and worker._areas is areas
    direct = make_rig(role=KVRole.CONSUMER, transfer_plan="layers", register_kv_cache=True)
    direct_caches = {t.untyped_storage().data_ptr() for t in direct.caches[0].values()}
    assert direct_caches <= set(direct.workers[0]._memory.regions())


def test_auto_plans_feed_their_measurements_back(make_rig) -> None:
    """Every auto-planned load corrects its kind's predicted reads with its measured transfer
    time -- the wiring the pure planner tests cannot see."""
    producer = make_rig()
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    producer.run(Req("p", prefix + [1]))
    rig = make_rig(role=KVRole.CONSUMER, transfer_plan="auto")  # the default outside this rig
    worker = rig.workers[0]
    assert worker.planner.costs.kind_factor == {}
    for i in range(3):
        ext, invalid = rig.run(Req(f"a{i}", prefix + block_tokens(1, BLOCK_SIZE, base=100 + i)))
        assert ext == 6 * BLOCK_SIZE and invalid == set()
    assert worker.planner.costs.kind_factor and all(f > 0 for f in worker.planner.costs.kind_factor.values())
    stats = worker.stats()
    assert stats.load_plans_layers + stats.load_plans_groups + stats.load_plans_whole == 3


def test_compute_is_measured_without_reads_beside_it_and_steps_feed_their_kind(make_rig, monkeypatch) -> None:
    """The compute estimate comes only from steps whose compute ran without reads beside it
    (per-layer and group reads slow it on a CPU host: that is their kind's finish factor, not
    every kind's compute); once compute is measured, every auto-planned step corrects its
    kind's finish factor with its measured time to the last layer."""
    producer = make_rig()
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    producer.run(Req("p", prefix + [1]))
    layers = make_rig(role=KVRole.CONSUMER, transfer_plan="layers")
    computed: list[int] = []
    costs = layers.workers[0].planner.costs
    observe = Costs.observe_compute

    def spy(self: Costs, seconds: float, num_layers: int, num_tokens: int) -> None:
        if self is costs:
            computed.append(num_tokens)
        observe(self, seconds, num_layers, num_tokens)

    monkeypatch.setattr(Costs, "observe_compute", spy)
    ext, _ = layers.run(Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100)))  # loads 6 blocks layer by layer
    assert ext == 6 * BLOCK_SIZE
    assert [n for n in computed if n > 0] == []  # (the run's empty settle step computes 0 tokens)
    ext, _ = layers.run(Req("b", block_tokens(3, BLOCK_SIZE, base=300)))  # nothing in the pool: no load
    assert ext == 0 and [n for n in computed if n > 0] != []

    rig = make_rig(role=KVRole.CONSUMER, transfer_plan="auto")
    worker = rig.workers[0]
    worker.planner.costs.observe_compute(0.01, 2, 16)  # compute known (as after any step without reads)
    for i in range(3):
        ext, invalid = rig.run(Req(f"c{i}", prefix + block_tokens(1, BLOCK_SIZE, base=200 + i)))
        assert ext == 6 * BLOCK_SIZE and invalid == set()
    assert sum(worker.planner.costs.finish_samples.values()) == 3
    assert all(f > 0 for f in worker.planner.costs.finish_factor.values())


def test_device_caches_go_through_staging_and_every_layer_is_verified(make_pattern_rig, backend, monkeypatch) -> None:
    """Device caches take the torch copies (CacheViews(on_host=False), run here on CPU tensors):
    saves gather into staging images, loads scatter out of staging, and every layer is checked
    in staging first -- a byte flipped in the store fails exactly that key's block."""
    import functools

    import layerkv.connector.worker
    from layerkv.transfer.views import CacheViews

    monkeypatch.setattr(layerkv.connector.worker, "CacheViews", functools.partial(CacheViews, on_host=False))
    producer = make_pattern_rig(num_layers=4, transfer_plan="groups", read_layers_per_range=2)
    assert not producer.workers[0]._jobs.caches.views.on_host
    prefix = block_tokens(6, BLOCK_SIZE, extra=0)
    producer.run(Req("p", prefix + [1]))
    rig = make_pattern_rig(num_layers=4, role=KVRole.CONSUMER, transfer_plan="groups", read_layers_per_range=2)
    a = Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100))
    ext, s = rig.admit(a)
    assert ext == 6 * BLOCK_SIZE
    rig.poison(a)
    assert rig.step([s]) == set() and rig.wrong_blocks(a, range(6)) == []
    # flip 8 bytes of layer 3 of key 4 in the store
    key, layout = rig.keys(a)[4], rig.workers[0].layout
    client = backend.client()
    image = np.zeros((1, layout.object_nbytes), dtype=np.uint8)
    client.register_buffer(image.ctypes.data, image.nbytes)
    try:
        assert client.batch_get_into([key], [image.ctypes.data], [image.nbytes]) == [image.nbytes]
        image[0, layout.layer_offset(3) : layout.layer_offset(3) + 8] ^= 0xFF
        assert client.batch_remove([key]) == [0]
        assert client.batch_put_from([key], [image.ctypes.data], [image.nbytes]) == [0]
    finally:
        client.unregister_buffer(image.ctypes.data)
    again = make_pattern_rig(num_layers=4, role=KVRole.CONSUMER, transfer_plan="groups", read_layers_per_range=2)
    b = Req("b", prefix + block_tokens(1, BLOCK_SIZE, base=200))
    _, s = again.admit(b)
    again.poison(b)
    assert again.step([s]) == {b.block_ids[4]}
    assert again.workers[0].stats().checksum_failures == 1
    assert again.wrong_blocks(b, [0, 1, 2, 3, 5]) == []


def test_saves_beyond_the_free_staging_slots_are_skipped_not_waited_for(make_rig, backend) -> None:
    """A step with more new blocks than save rows saves its first blocks (a prefix of the
    request, one put session per row) and counts the rest; nothing waits for the store to free
    rows, and staging never grows."""
    from layerkv.store.faults import PUT_START

    row = make_rig(transfer_plan="groups", read_layers_per_range=2).workers[0].layout.object_nbytes
    rig = make_rig(transfer_plan="groups", read_layers_per_range=2, staging_nbytes=4 * row)  # 1 load row, 3 save rows
    worker = rig.workers[0]
    assert worker._areas is not None and worker._areas.saves.num_slots == 3
    req = Req("a", block_tokens(8, BLOCK_SIZE))
    ext, invalid = rig.run(req)
    assert ext == 0 and invalid == set()
    assert rig.faults[0].keys_sent(PUT_START) == rig.keys(req, blocks=range(3))
    assert worker.stats().save_skipped_staging == 5
    assert backend.exists(rig.keys(req)) == [1, 1, 1, 0, 0, 0, 0, 0]


class _RacingPeer:
    """A sealer whose tagging first lets a peer rewrite the layer's bytes in save staging (what
    anyone who reaches the store's ports can do at any moment): a tag computed over staging
    would then cover the peer's bytes."""

    def __init__(self, sealer, staging: np.ndarray, slots: np.ndarray, col: int, width: int) -> None:
        self._sealer, self._staging, self._slots, self._cols = sealer, staging, slots, slice(col, col + width)
        self.writes = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._sealer, name)

    def indexed_tags(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._staging[self._slots, self._cols] ^= 0x5A
        self.writes += 1
        return self._sealer.indexed_tags(*args, **kwargs)


@pytest.mark.parametrize("on_host", [True, False], ids=["host-caches", "device-path"])
def test_save_tags_cover_the_computed_bytes_not_what_a_peer_writes_into_staging(
    make_pattern_rig, monkeypatch, on_host: bool
) -> None:
    """A peer rewrites a layer in save staging while its tags are computed, then (second
    producer) once the layer is staged: the tags cover the cache's bytes (device path: the
    private pinned copy), so a consumer either loads exactly what compute wrote (the first write
    landed before ours and was overwritten) or refuses the block (the second) -- never the
    peer's bytes under a valid tag."""
    import functools

    import layerkv.connector.worker
    from layerkv.transfer.staged import StagedLayers
    from layerkv.transfer.views import CacheViews

    monkeypatch.setattr(layerkv.connector.worker, "CacheViews", functools.partial(CacheViews, on_host=on_host))
    real = StagedLayers.gather_sealed
    peers: list[_RacingPeer] = []
    after_tags = {"on": False}

    def racing(self, layer_idx, staging, slots, block_ids, contexts, sealer, after=None):
        col, width = self.layout.layer_offset(layer_idx), self.layout.layer_nbytes(layer_idx)
        peers.append(_RacingPeer(sealer, staging, slots, col, width))
        tags = real(self, layer_idx, staging, slots, block_ids, contexts, peers[-1], after)
        if after_tags["on"] and layer_idx == 2:
            staging[slots, col : col + width] ^= 0x3C  # after the tags: the write the check is for
        return tags

    monkeypatch.setattr(StagedLayers, "gather_sealed", racing)
    staged = {"num_layers": 4, "transfer_plan": "groups", "read_layers_per_range": 2}
    prefix = block_tokens(4, BLOCK_SIZE, extra=0)
    producer = make_pattern_rig(**staged)
    assert producer.workers[0]._jobs.caches.views.on_host == on_host
    producer.run(Req("p", prefix + [1]))
    assert peers and all(p.writes for p in peers)
    rig = make_pattern_rig(role=KVRole.CONSUMER, **staged)
    a = Req("a", prefix + block_tokens(1, BLOCK_SIZE, base=100))
    ext, s = rig.admit(a)
    assert ext == 4 * BLOCK_SIZE
    rig.poison(a)
    assert rig.step([s]) == set() and rig.wrong_blocks(a, range(4)) == []

    after_tags["on"] = True
    other = block_tokens(3, BLOCK_SIZE, extra=0, base=500)
    make_pattern_rig(**staged).run(Req("q", other + [1]))
    again = make_pattern_rig(role=KVRole.CONSUMER, **staged)
    b = Req("b", other + block_tokens(1, BLOCK_SIZE, base=200))
    ext, s = again.admit(b)
    assert ext == 3 * BLOCK_SIZE
    again.poison(b)
    assert again.step([s]) == set(b.block_ids[:3])
    assert again.workers[0].stats().checksum_failures == 3
