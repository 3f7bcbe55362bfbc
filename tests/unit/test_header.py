from __future__ import annotations

import struct

import numpy as np
import pytest

from layerkv.errors import HeaderError, LayoutError
from layerkv.header import MAGIC, MAX_HEADER_NBYTES, MAX_LAYERS, SCHEMA_VERSION, Header, header_nbytes_for
from layerkv.layout import CacheLayout

NS = bytes(range(16))


def make_layout(num_layers: int = 3, num_blocks: int = 4) -> CacheLayout:
    caches = {f"layers.{i}": np.zeros((num_blocks, 2, 8, 4), np.float32) for i in range(num_layers)}
    return CacheLayout.from_caches(caches, num_blocks, max_transfer_bytes=1 << 20)


def header_of(namespace_digest: bytes, layout: CacheLayout) -> Header:
    return Header(namespace_digest, layout.digest, layout.num_layers, layout.object_nbytes)


@pytest.mark.parametrize(("num_layers", "nbytes"), [(1, 192), (7, 192), (8, 256), (16, 320), (80, 832), (MAX_LAYERS, 4096)])
def test_header_size_is_64_aligned_and_at_most_4_kib(num_layers: int, nbytes: int) -> None:
    assert header_nbytes_for(num_layers) == nbytes
    assert nbytes % 64 == 0 and nbytes <= MAX_HEADER_NBYTES


def test_too_many_layers_for_the_header() -> None:
    with pytest.raises(LayoutError, match=rf"num_layers={MAX_LAYERS + 1} must be 1 <= value <= {MAX_LAYERS}"):
        header_nbytes_for(MAX_LAYERS + 1)


def test_encode_layout_and_roundtrip() -> None:
    layout = make_layout()
    header = header_of(NS, layout)
    raw = header.encode(b"\x01\x02\x03")
    assert len(raw) == layout.header_nbytes
    magic, schema, hdr_nbytes, num_layers, hash_len, obj_nbytes = struct.unpack_from("<8sIIIIQ", raw)
    assert (magic, schema, hdr_nbytes, num_layers, hash_len, obj_nbytes) == (
        MAGIC, SCHEMA_VERSION, layout.header_nbytes, 3, 3, layout.object_nbytes,
    )
    assert raw[32:48] == NS and raw[48:64] == layout.digest and raw[64:67] == b"\x01\x02\x03"
    assert header.verify(raw, b"\x01\x02\x03") is None  # no checksums written: flags 0
    assert header.verify(np.frombuffer(raw, np.uint8), b"\x01\x02\x03") is None
    assert header.layer_checksums(raw) == (0, 0, 0)
    big = (1 << 64) - 1
    with_sums = header.encode(b"\x01", layer_checksums=[5, 6, big])
    assert struct.unpack_from("<I", with_sums, 128) == (1,)  # FLAG_CHECKSUMS
    assert header.verify(with_sums, b"\x01") == (5, 6, big)


def test_unknown_flags_are_rejected() -> None:
    header = header_of(NS, make_layout())
    raw = _corrupt(header.encode(b"\x01", layer_checksums=[1, 2, 3]), 128, struct.pack("<I", 3))
    with pytest.raises(HeaderError, match="header field 'flags' has unknown bits 0x3"):
        header.verify(raw, b"\x01")


def test_long_block_hashes_are_digested_but_still_checked() -> None:
    header = header_of(NS, make_layout())
    long_hash = bytes(range(100))
    raw = header.encode(long_hash)
    header.verify(raw, long_hash)
    with pytest.raises(HeaderError, match="header field 'block_hash' mismatch"):
        header.verify(raw, long_hash[:-1] + b"\xff")


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
        (20, struct.pack("<I", 5), "block_hash_nbytes"),
        (24, struct.pack("<Q", 1), "object_nbytes"),
        (40, b"\xee", "namespace_digest"),
        (50, b"\xee", "layout_digest"),
        (64, b"\xee", "block_hash"),
    ],
)
def test_verify_names_the_mismatching_field(offset: int, value: bytes, field: str) -> None:
    header = header_of(NS, make_layout())
    raw = _corrupt(header.encode(b"\xaa\xbb\xcc\xdd"), offset, value)
    with pytest.raises(HeaderError, match=rf"header field '{field}' mismatch for block aabbccdd"):
        header.verify(raw, b"\xaa\xbb\xcc\xdd")


def test_other_deployment_or_block_is_rejected() -> None:
    layout = make_layout()
    raw = header_of(NS, layout).encode(b"\x01")
    with pytest.raises(HeaderError, match="'namespace_digest' mismatch"):
        header_of(bytes(16), layout).verify(raw, b"\x01")
    with pytest.raises(HeaderError, match="'block_hash' mismatch for block 02"):
        header_of(NS, layout).verify(raw, b"\x02")
    with pytest.raises(HeaderError, match="'num_layers' mismatch"):
        header_of(NS, make_layout(num_layers=4)).verify(raw, b"\x01")
    with pytest.raises(HeaderError, match="header of block 01 is 10 bytes, expected 192"):
        header_of(NS, layout).verify(raw[:10], b"\x01")
    with pytest.raises(HeaderError, match="'magic' mismatch"):
        header_of(NS, layout).verify(bytes(layout.header_nbytes), b"\x01")


def test_encode_into_staging_slots_matches_encode() -> None:
    header = header_of(NS, make_layout())
    staging = np.full((6, header.header_nbytes + 64), 0x5A, np.uint8)  # wider rows than the header
    hashes = [b"\x01" * 32, b"\x02" * 8, bytes(range(70))]
    header.encode_into(staging, np.array([4, 0, 2]), hashes)
    for slot, h in zip([4, 0, 2], hashes):
        assert staging[slot, : header.header_nbytes].tobytes() == header.encode(h)
        header.verify(staging[slot], h)
        assert (staging[slot, header.header_nbytes :] == 0x5A).all()
    assert (staging[[1, 3, 5]] == 0x5A).all()


def test_encode_into_rejects_bad_staging() -> None:
    header = header_of(NS, make_layout())
    with pytest.raises(HeaderError, match=r"staging must be uint8 \[num_slots, >= 192\], got float32"):
        header.encode_into(np.zeros((2, 192), np.float32), np.array([0]), [b"\x01"])
    with pytest.raises(HeaderError, match="2 staging slots for 1 block hashes"):
        header.encode_into(np.zeros((2, 192), np.uint8), np.array([0, 1]), [b"\x01"])
    with pytest.raises(HeaderError, match="namespace and layout digests must be 16 bytes, got 3 and 16"):
        header_of(b"abc", make_layout())


def test_verify_many_agrees_with_verify_row_by_row() -> None:
    header = header_of(NS, make_layout())
    hashes = [b"\x01" * 8, b"\x02" * 3, bytes(range(70)), b"\x04"]
    rows = np.zeros((4, header.header_nbytes + 32), np.uint8)
    header.encode_into(rows, np.arange(4), hashes, np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], np.uint64))
    rows[3, : header.header_nbytes] = np.frombuffer(header.encode(b"\x04"), np.uint8)  # no checksums
    rows[1, 64] ^= 1  # another block's hash
    rows[2, 128] = 3  # unknown flag bits
    ok, has_sums, sums = header.verify_many(rows, hashes)
    assert ok.tolist() == [True, False, False, True] and has_sums.tolist() == [True, True, True, False]
    assert sums[0].tolist() == [1, 2, 3]
    for i, h in enumerate(hashes):
        if ok[i]:
            header.verify(rows[i], h)
        else:
            with pytest.raises(HeaderError):
                header.verify(rows[i], h)
