"""Producer then consumer: a prompt saved by one request is loaded byte for byte by the next."""

from __future__ import annotations

from tests.connector.rig import BLOCK_SIZE, Req


def test_producer_then_consumer_roundtrip(make_rig) -> None:
    rig = make_rig()
    tokens = list(range(10 * BLOCK_SIZE + 2))
    assert rig.run(Req("a", tokens)) == (0, set())
    b = Req("b", tokens)
    ext, s = rig.admit(b)
    assert ext == 10 * BLOCK_SIZE
    assert rig.step([s]) == set()
    assert rig.wrong_blocks(b, range(10)) == []
    stats = rig.workers[0].stats()
    assert stats.committed_keys == 10 and stats.load_blocks == 10 and stats.load_failed_blocks == 0
    assert stats.loaded_bytes > 0 and stats.saved_bytes > 0
    assert rig.scheduler.stats().hit_blocks == 10
