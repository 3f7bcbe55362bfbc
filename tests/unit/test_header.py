from __future__ import annotations

import struct

import numpy as np
import pytest

from layerkv.errors import HeaderError, LayoutError
from layerkv.objects.header import MAGIC, MAX_HEADER_NBYTES, MAX_LAYERS, SCHEMA_VERSION, Header, header_nbytes_for
from layerkv.objects.layout import CacheLayout
from layerkv.objects.seal import Sealer

NS = bytes(range(16))
KEY = "m-0011@aabbccdd@0"
NONCE = bytes(range(100, 116))
MAC_KEY = bytes(range(32))


def make_layout(num_layers: int = 3, num_blocks: int = 4) -> CacheLayout:
    caches = {f"layers.{i}": np.zeros((num_blocks, 2, 8, 4), np.float32) for i in range(num_layers)}
    return CacheLayout.from_caches(caches, num_blocks, max_transfer_bytes=1 << 20)


def header_of(namespace_digest: bytes, layout: CacheLayout, mac_key: bytes | None = None) -> Header:
    return Header(namespace_digest, layout.digest, layout.num_layers, layout.object_nbytes, Sealer(mac_key))


def tags_of(num_layers: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_layers, 16), dtype=np.uint8)


@pytest.mark.parametrize(
    ("num_layers", "nbytes"), [(1, 256), (4, 256), (5, 320), (8, 320), (80, 1472), (MAX_LAYERS, 4096)]
)
def test_header_size_is_64_aligned_and_at_most_4_kib(num_layers: int, nbytes: int) -> None:
    assert header_nbytes_for(num_layers) == nbytes
    assert nbytes % 64 == 0 and nbytes <= MAX_HEADER_NBYTES


def test_too_many_layers_for_the_header() -> None:
    with pytest.raises(LayoutError, match=rf"num_layers={MAX_LAYERS + 1} must be 1 <= value <= {MAX_LAYERS}"):
        header_nbytes_for(MAX_LAYERS + 1)


@pytest.mark.parametrize("mac_key", [None, MAC_KEY], ids=["unkeyed", "keyed"])
def test_encode_layout_and_roundtrip(mac_key: bytes | None) -> None:
    layout = make_layout()
    header = header_of(NS, layout, mac_key)
    tags = tags_of(3)
    raw = header.encode(b"\x01\x02\x03", KEY, NONCE, tags)
    assert len(raw) == layout.header_nbytes
    magic, schema, hdr_nbytes, num_layers, hash_len, obj_nbytes = struct.unpack_from("<8sIIIIQ", raw)
    assert (magic, schema, hdr_nbytes, num_layers, hash_len, obj_nbytes) == (
        MAGIC,
        SCHEMA_VERSION,
        layout.header_nbytes,
        3,
        3,
        layout.object_nbytes,
    )
    assert raw[32:48] == NS and raw[48:64] == layout.digest and raw[64:67] == b"\x01\x02\x03"
    assert struct.unpack_from("<II", raw, 128) == ((1 if mac_key else 0), 0)
    assert raw[136:152] == NONCE and raw[184 : 184 + 48] == tags.tobytes()
    assert (raw[152:184] != bytes(32)) == (mac_key is not None)  # the MAC, keyed only
    nonce, got = header.verify(raw, b"\x01\x02\x03", KEY)
    assert nonce == NONCE and np.array_equal(got, tags)
    nonce, got = header.verify(np.frombuffer(raw, np.uint8), b"\x01\x02\x03", KEY)
    assert np.array_equal(got, tags)


def test_a_reader_accepts_exactly_its_own_flags() -> None:
    """No header bit switches a check off: an unkeyed object is refused by a keyed reader and the
    other way round, whatever its flags say."""
    layout = make_layout()
    keyed, plain = header_of(NS, layout, MAC_KEY), header_of(NS, layout)
    with pytest.raises(HeaderError, match=r"header field 'flags' mismatch .* got 0x0, this reader accepts only 0x1"):
        keyed.verify(plain.encode(b"\x01", KEY, NONCE, tags_of(3)), b"\x01", KEY)
    with pytest.raises(HeaderError, match=r"'flags' mismatch .* got 0x1, this reader accepts only 0x0"):
        plain.verify(keyed.encode(b"\x01", KEY, NONCE, tags_of(3)), b"\x01", KEY)
    for flags in (2, 3, 0x80000000):
        raw = _corrupt(plain.encode(b"\x01", KEY, NONCE, tags_of(3)), 128, struct.pack("<I", flags))
        with pytest.raises(HeaderError, match="'flags' mismatch"):
            plain.verify(raw, b"\x01", KEY)


@pytest.mark.parametrize("mac_key", [None, MAC_KEY], ids=["unkeyed", "keyed"])
def test_reserved_and_padding_bytes_must_be_zero(mac_key: bytes | None) -> None:
    layout = make_layout()  # 3 layers: tags end at 232, header 256 bytes
    header = header_of(NS, layout, mac_key)
    raw = header.encode(b"\x01", KEY, NONCE, tags_of(3))
    with pytest.raises(HeaderError, match="'reserved' of key .* is not zero"):
        header.verify(_corrupt(raw, 132, b"\x01"), b"\x01", KEY)
    with pytest.raises(HeaderError, match="'padding' of key .* is not zero"):
        header.verify(_corrupt(raw, 250, b"\x01"), b"\x01", KEY)


def test_the_mac_binds_every_field_the_key_and_the_nonce() -> None:
    layout = make_layout()
    header = header_of(NS, layout, MAC_KEY)
    raw = header.encode(b"\x01", KEY, NONCE, tags_of(3))
    with pytest.raises(HeaderError, match="'mac' of key .* does not verify"):
        header.verify(_corrupt(raw, 190, b"\xff"), b"\x01", KEY)  # a layer tag changed
    with pytest.raises(HeaderError, match="'mac' .* does not verify"):
        header.verify(_corrupt(raw, 140, b"\xff"), b"\x01", KEY)  # the nonce changed
    with pytest.raises(HeaderError, match="'mac' .* does not verify"):
        header.verify(raw, b"\x01", KEY.replace("@0", "@1"))  # read under another key
    with pytest.raises(HeaderError, match="'mac' .* does not verify"):  # another tenant key
        header_of(NS, layout, bytes(32)).verify(raw, b"\x01", KEY)
    header.verify(raw, b"\x01", KEY)


def test_long_block_ids_are_digested_but_still_checked() -> None:
    header = header_of(NS, make_layout())
    long_id = bytes(range(100))
    raw = header.encode(long_id, KEY, NONCE)
    header.verify(raw, long_id, KEY)
    with pytest.raises(HeaderError, match="header field 'block_id' mismatch"):
        header.verify(raw, long_id[:-1] + b"\xff", KEY)


def _corrupt(raw: bytes, offset: int, value: bytes) -> bytes:
    buf = bytearray(raw)
    buf[offset : offset + len(value)] = value
    return bytes(buf)


@pytest.mark.parametrize(
    ("offset", "value", "field"),
    [
        (0, b"XAYERKV\0", "magic"),
        (8, struct.pack("<I", SCHEMA_VERSION + 1), "schema_version"),
        (12, struct.pack("<I", 64), "header_nbytes"),
        (16, struct.pack("<I", 4), "num_layers"),
        (20, struct.pack("<I", 5), "block_id_nbytes"),
        (24, struct.pack("<Q", 1), "object_nbytes"),
        (40, b"\xee", "namespace_digest"),
        (50, b"\xee", "layout_digest"),
        (64, b"\xee", "block_id"),
    ],
)
def test_verify_names_the_mismatching_field(offset: int, value: bytes, field: str) -> None:
    header = header_of(NS, make_layout())
    raw = _corrupt(header.encode(b"\xaa\xbb\xcc\xdd", KEY, NONCE), offset, value)
    with pytest.raises(HeaderError, match=rf"header field '{field}' mismatch for key {KEY}"):
        header.verify(raw, b"\xaa\xbb\xcc\xdd", KEY)


def test_other_deployment_or_block_is_rejected() -> None:
    layout = make_layout()
    raw = header_of(NS, layout).encode(b"\x01", KEY, NONCE)
    with pytest.raises(HeaderError, match="'namespace_digest' mismatch"):
        header_of(bytes(16), layout).verify(raw, b"\x01", KEY)
    with pytest.raises(HeaderError, match=f"'block_id' mismatch for key {KEY}"):
        header_of(NS, layout).verify(raw, b"\x02", KEY)
    with pytest.raises(HeaderError, match="'num_layers' mismatch"):
        header_of(NS, make_layout(num_layers=4)).verify(raw, b"\x01", KEY)
    with pytest.raises(HeaderError, match=f"header of key {KEY} is 10 bytes, expected 256"):
        header_of(NS, layout).verify(raw[:10], b"\x01", KEY)
    with pytest.raises(HeaderError, match="'magic' mismatch"):
        header_of(NS, layout).verify(bytes(layout.header_nbytes), b"\x01", KEY)


def test_encode_into_staging_slots_matches_encode() -> None:
    header = header_of(NS, make_layout(), MAC_KEY)
    staging = np.full((6, header.header_nbytes + 64), 0x5A, np.uint8)  # wider rows than the header
    ids = [b"\x01" * 32, b"\x02" * 8, bytes(range(70))]
    keys = [f"k@{i}@0" for i in range(3)]
    nonces = np.arange(48, dtype=np.uint8).reshape(3, 16)
    tags = np.stack([tags_of(3, i) for i in range(3)])
    header.encode_into(staging, np.array([4, 0, 2]), ids, keys, nonces, tags)
    for i, slot in enumerate([4, 0, 2]):
        assert staging[slot, : header.header_nbytes].tobytes() == header.encode(
            ids[i], keys[i], nonces[i].tobytes(), tags[i]
        )
        header.verify(staging[slot], ids[i], keys[i])
        assert (staging[slot, header.header_nbytes :] == 0x5A).all()
    assert (staging[[1, 3, 5]] == 0x5A).all()


def test_encode_into_rejects_bad_staging() -> None:
    header = header_of(NS, make_layout())
    one = np.zeros((1, 16), np.uint8)
    with pytest.raises(HeaderError, match=r"staging must be uint8 \[num_slots, >= 256\], got float32"):
        header.encode_into(np.zeros((2, 256), np.float32), np.array([0]), [b"\x01"], [KEY], one, None)
    with pytest.raises(HeaderError, match="2 staging slots for 1 block ids and 1 keys"):
        header.encode_into(np.zeros((2, 256), np.uint8), np.array([0, 1]), [b"\x01"], [KEY], one, None)
    with pytest.raises(HeaderError, match=r"tags of shape \(1, 2, 16\); expected \(1, 3, 16\)"):
        header.encode_into(
            np.zeros((2, 256), np.uint8), np.array([0]), [b"\x01"], [KEY], one, np.zeros((1, 2, 16), np.uint8)
        )
    with pytest.raises(HeaderError, match="namespace and layout digests must be 16 bytes, got 3 and 16"):
        header_of(b"abc", make_layout())


@pytest.mark.parametrize("mac_key", [None, MAC_KEY], ids=["unkeyed", "keyed"])
def test_verify_many_agrees_with_verify_row_by_row(mac_key: bytes | None) -> None:
    header = header_of(NS, make_layout(), mac_key)
    ids = [b"\x01" * 8, b"\x02" * 3, bytes(range(70)), b"\x04", b"\x05"]
    keys = [f"k@{i}@0" for i in range(5)]
    nonces = np.arange(80, dtype=np.uint8).reshape(5, 16)
    tags = np.stack([tags_of(3, i) for i in range(5)])
    rows = np.zeros((5, header.header_nbytes + 32), np.uint8)
    header.encode_into(rows, np.arange(5), ids, keys, nonces, tags)
    rows[1, 64] ^= 1  # another block's id
    rows[2, 128] = 3  # unknown flag bits
    rows[3, 133] = 1  # reserved
    ok, got_nonces, got_tags = header.verify_many(rows, ids, keys)
    assert ok.tolist() == [True, False, False, False, True]
    assert np.array_equal(got_nonces[0], nonces[0]) and np.array_equal(got_tags[4], tags[4])
    for i, h in enumerate(ids):
        if ok[i]:
            header.verify(rows[i], h, keys[i])
        else:
            with pytest.raises(HeaderError):
                header.verify(rows[i], h, keys[i])
    if mac_key is not None:
        rows[4, 200] ^= 1  # a tag changed: only the MAC catches it
        assert header.verify_many(rows, ids, keys)[0].tolist() == [True, False, False, False, False]
