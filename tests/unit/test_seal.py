"""Layer tags and encryption (layerkv.objects.seal, layerkv.objects.encryption): tags bind the object key, the
write's nonce and the layer; AES-256-GCM layers decrypt only with the same key, context and
layer, and their ciphertext says nothing of the plaintext; no key shows in a repr."""

from __future__ import annotations

import numpy as np
import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError
from layerkv.objects.encryption import LayerCipher
from layerkv.objects.seal import RowSealers, Sealer, context

CTX = context("ns@00ff@0", bytes(range(16)))


@pytest.mark.parametrize("mac_key", [None, bytes(32)], ids=["unkeyed", "keyed"])
def test_tags_bind_key_nonce_and_layer(mac_key: bytes | None) -> None:
    sealer = Sealer(mac_key)
    data = np.arange(4096, dtype=np.uint8)
    tag = sealer.layer_tag(CTX, 3, [data])
    assert len(tag) == 16 and sealer.layer_tag(CTX, 3, [data[:1000], data[1000:]]) == tag  # chunks: same bytes
    assert sealer.layer_tag(CTX, 4, [data]) != tag
    assert sealer.layer_tag(context("ns@00ff@1", bytes(range(16))), 3, [data]) != tag
    assert sealer.layer_tag(context("ns@00ff@0", bytes(16)), 3, [data]) != tag
    changed = data.copy()
    changed[7] ^= 1
    assert sealer.layer_tag(CTX, 3, [changed]) != tag
    assert Sealer(bytes(range(32))).layer_tag(CTX, 3, [data]) != Sealer(bytes(32)).layer_tag(CTX, 3, [data])


def test_encrypted_layers_round_trip_and_refuse_any_change() -> None:
    sealer = Sealer(bytes(32), LayerCipher(bytes(range(32))))
    plain = np.random.default_rng(1).integers(0, 256, (3, 8192), dtype=np.uint8)
    rows = plain.copy()
    contexts = [context(f"k@{i}@0", bytes([i]) * 16) for i in range(3)]
    tags = sealer.seal_layers(contexts, 5, list(rows))
    assert tags.shape == (3, 16) and not np.array_equal(rows, plain)
    assert np.mean(rows == plain) < 0.01  # ciphertext: about 1 byte in 256 equal by chance
    tampered = rows.copy()
    tampered[1, 100] ^= 1
    ok = sealer.open_layers(contexts, 5, list(tampered), tags)
    assert ok.tolist() == [True, False, True]
    assert np.array_equal(tampered[[0, 2]], plain[[0, 2]]) and not np.array_equal(
        tampered[1], plain[1]
    )  # left as it was
    for ctx_list, layer, key in (
        (contexts[1:] + contexts[:1], 5, bytes(range(32))),
        (contexts, 6, bytes(range(32))),
        (contexts, 5, bytes(32)),
    ):
        other = Sealer(bytes(32), LayerCipher(key))
        assert not other.open_layers(ctx_list, layer, list(rows.copy()), tags).any()
    again = rows.copy()
    assert sealer.open_layers(contexts, 5, list(again), tags).all() and np.array_equal(again, plain)
    assert "LayerCipher()" in repr(sealer) or "encrypts=True" in repr(sealer)
    assert bytes(range(32)).hex()[:16] not in repr(sealer) + repr(LayerCipher(bytes(range(32))))


@pytest.mark.parametrize("encrypt", [False, True], ids=["keyed", "encrypted"])
def test_row_sealers_do_each_row_with_its_own_key(encrypt: bool) -> None:
    """After a key rotation one load holds objects of two keys: row i is done by sealers[picks[i]]."""
    sealers = [Sealer(bytes([k]) * 32, LayerCipher(bytes([k + 1]) * 32) if encrypt else None) for k in (1, 7)]
    picks = np.array([1, 0, 1])
    contexts = [context(f"ns@{i:02x}@0", bytes(16)) for i in range(3)]
    data = [np.full(256, i, dtype=np.uint8) for i in range(3)]
    mixed = RowSealers(sealers, picks)
    assert mixed.encrypts is encrypt and mixed.keyed
    if not encrypt:
        tags = mixed.layer_tags(contexts, 2, [[d] for d in data])
        for i, g in enumerate(picks.tolist()):
            assert tags[i].tobytes() == sealers[g].layer_tag(contexts[i], 2, [data[i]])
            assert tags[i].tobytes() != sealers[1 - g].layer_tag(contexts[i], 2, [data[i]])
        return
    spans = [d.copy() for d in data]
    tags = np.stack([sealers[g].seal_layers([contexts[i]], 2, [spans[i]])[0] for i, g in enumerate(picks.tolist())])
    assert mixed.open_layers(contexts, 2, spans, tags).all()
    assert all(np.array_equal(s, d) for s, d in zip(spans, data))
    swapped = [d.copy() for d in data]
    for i, g in enumerate(picks.tolist()):
        sealers[g].seal_layers([contexts[i]], 2, [swapped[i]])
    assert not RowSealers(sealers, 1 - picks).open_layers(contexts, 2, swapped, tags).any()  # the other key: refused


@pytest.mark.parametrize("mac_key", [None, bytes(range(32))], ids=["unkeyed", "keyed"])
def test_indexed_tags_are_the_layer_tags_of_those_entries(mac_key: bytes | None) -> None:
    """indexed_tags (entries of 2-D segments: a cache's blocks or staging slots) gives exactly the
    tags layer_tags gives for the same bytes, row by row; with row sealers each row its own key."""
    rng = np.random.default_rng(5)
    segments = [rng.integers(0, 256, (9, 300), dtype=np.uint8), rng.integers(0, 256, (9, 500), dtype=np.uint8)]
    rows = [7, 0, 3, 3]
    contexts = [context(f"ns@{i:02x}@0", bytes([i]) * 16) for i in range(4)]
    sealer = Sealer(mac_key)
    want = sealer.layer_tags(contexts, 5, [[seg[r] for seg in segments] for r in rows])
    assert np.array_equal(sealer.indexed_tags(contexts, 5, segments, rows), want)
    assert not np.array_equal(sealer.indexed_tags(contexts, 6, segments, rows), want)
    assert sealer.indexed_tags([], 5, segments, []).shape == (0, 16)
    if mac_key is not None:
        sealers, picks = [Sealer(bytes(32)), sealer], np.array([1, 0, 0, 1])
        mixed = RowSealers(sealers, picks).indexed_tags(contexts, 5, segments, rows)
        for i, g in enumerate(picks.tolist()):
            assert mixed[i].tobytes() == sealers[g].layer_tag(contexts[i], 5, [seg[rows[i]] for seg in segments])


def test_encryption_needs_a_key() -> None:
    with pytest.raises(ConfigError, match="encrypt_objects=true needs tenant_key_file"):
        LayerKVConfig.from_dict({"encrypt_objects": True}, env={})
    with pytest.raises(ValueError, match="needs the tenant key"):
        Sealer(None, LayerCipher(bytes(32)))


def test_lease_renewal_must_come_before_a_known_lease_expires() -> None:
    with pytest.raises(ConfigError, match=r"lease_renew_after_s=10.0 must be below embedded_lease_ttl_s=10.0"):
        LayerKVConfig.from_dict({"lease_renew_after_s": 10.0}, env={})
    LayerKVConfig.from_dict({"lease_renew_after_s": 10.0, "embedded_lease_ttl_s": 30.0}, env={})
    LayerKVConfig.from_dict(
        {"backend": "mooncake", "lease_renew_after_s": 10.0}, env={}
    )  # the master's TTL is not known here
