from __future__ import annotations

from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from tests.connector.rig import BLOCK_SIZE, Req, Rig


def test_producer_then_consumer_roundtrip() -> None:
    root = EmbeddedStore(64 << 20)
    rig = Rig(lambda: CheckedStore(root.client(), max_batch_keys=64))
    tokens = list(range(10 * BLOCK_SIZE + 2))
    a = Req("a", tokens)
    ext, s = rig.admit(a)
    assert ext == 0
    assert rig.step([s]) == set()
    b = Req("b", tokens)
    ext, s = rig.admit(b)
    assert ext == 10 * BLOCK_SIZE
    # layers are loaded before compute; the rig's compute only touches scheduled blocks
    rig.caches[0]["model.layers.0.self_attn.attn"][:, b.block_ids[0]] = -1
    assert rig.step([s], layers=None) == set()
    hashes = b.view().block_hashes
    for layer in range(rig.num_layers):
        for i in range(10):
            assert bool((rig.block_values(0, layer, b.block_ids[i]) == rig.expected_block(0, layer, hashes[i])).all())
    rig.shutdown()
    assert rig.workers[0].tracker.is_empty()
