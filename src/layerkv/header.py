"""The object header: a small fixed-size record at offset 0 of every object that says which
deployment, layout and block the object belongs to. Worker side; a `Header` is immutable after
construction and may be used from any thread (send thread encodes, receive thread verifies).

    offset  size  field (little-endian)
         0     8  magic b"LAYERKV\\0"
         8     4  schema version (u32)
        12     4  header size in bytes (u32)
        16     4  number of layers (u32)
        20     4  length of the block hash in bytes (u32)
        24     8  object size in bytes (u64)
        32    16  namespace digest
        48    16  layout digest
        64    64  block hash (zero padded; hashes longer than 64 bytes: their blake2b-64 digest)
       128  4 * L per-layer checksums (u32 each, 0 = unused)
       ...        zero padding up to a multiple of 64 bytes (at most 4 KiB in all)
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

import numpy as np

from layerkv.errors import HeaderError, LayoutError

if TYPE_CHECKING:
    from layerkv.layout import CacheLayout

SCHEMA_VERSION = 1
MAGIC = b"LAYERKV\0"
HEADER_ALIGN_NBYTES = 64
MAX_HEADER_NBYTES = 4096
DIGEST_NBYTES = 16
BLOCK_HASH_FIELD_NBYTES = 64
_FIXED = struct.Struct("<8sIIIIQ16s16s64s")  # 128 bytes, checksums follow
_CHECKSUMS_OFFSET = _FIXED.size
_HASH_OFFSET = 64
_HASH_LEN_OFFSET = 20
MAX_LAYERS = (MAX_HEADER_NBYTES - _CHECKSUMS_OFFSET) // 4


def header_nbytes_for(num_layers: int) -> int:
    """Header size for a layout with `num_layers` layers: 128 + 4 * L rounded up to 64 bytes."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise LayoutError(
            f"num_layers={num_layers} must be 1 <= value <= {MAX_LAYERS}: the object header "
            f"(<= {MAX_HEADER_NBYTES} bytes) keeps a 4-byte checksum slot per layer"
        )
    raw = _CHECKSUMS_OFFSET + 4 * num_layers
    return -(-raw // HEADER_ALIGN_NBYTES) * HEADER_ALIGN_NBYTES


def block_hash_field(block_hash: bytes) -> bytes:
    """The 64-byte header field for `block_hash` (raw and zero padded, or a digest if longer)."""
    if len(block_hash) > BLOCK_HASH_FIELD_NBYTES:
        return hashlib.blake2b(block_hash, digest_size=BLOCK_HASH_FIELD_NBYTES).digest()
    return block_hash.ljust(BLOCK_HASH_FIELD_NBYTES, b"\0")


class Header:
    """Encoder / verifier of object headers for one (namespace, layout).

    `encode(block_hash)` returns `header_nbytes` bytes; `encode_into(staging, slots, hashes)`
    fills rows of a `[num_slots, header_nbytes]` uint8 staging array. `verify(buf, block_hash)`
    raises HeaderError naming the first field that does not match; it returns None on success.
    """

    __slots__ = ("namespace_digest", "layout_digest", "num_layers", "object_nbytes", "header_nbytes", "_template")

    def __init__(self, namespace_digest: bytes, layout: CacheLayout) -> None:
        if len(namespace_digest) != DIGEST_NBYTES:
            raise HeaderError(f"namespace digest must be {DIGEST_NBYTES} bytes, got {len(namespace_digest)}")
        self.namespace_digest = bytes(namespace_digest)
        self.layout_digest = bytes(layout.digest)
        self.num_layers = layout.num_layers
        self.object_nbytes = layout.object_nbytes
        self.header_nbytes = layout.header_nbytes
        assert self.header_nbytes == header_nbytes_for(self.num_layers)
        template = bytearray(self.header_nbytes)
        _FIXED.pack_into(
            template, 0, MAGIC, SCHEMA_VERSION, self.header_nbytes, self.num_layers, 0,
            self.object_nbytes, self.namespace_digest, self.layout_digest, b"",
        )
        self._template = bytes(template)

    def encode(self, block_hash: bytes, layer_checksums: list[int] | None = None) -> bytes:
        """The header of the object for `block_hash` (checksums default to 0 = unused)."""
        buf = bytearray(self._template)
        struct.pack_into("<I", buf, _HASH_LEN_OFFSET, len(block_hash))
        buf[_HASH_OFFSET : _HASH_OFFSET + BLOCK_HASH_FIELD_NBYTES] = block_hash_field(block_hash)
        if layer_checksums is not None:
            if len(layer_checksums) != self.num_layers:
                raise HeaderError(f"got {len(layer_checksums)} layer checksums for {self.num_layers} layers")
            struct.pack_into(f"<{self.num_layers}I", buf, _CHECKSUMS_OFFSET, *layer_checksums)
        return bytes(buf)

    def encode_into(self, staging: np.ndarray, slots: np.ndarray, block_hashes: list[bytes]) -> None:
        """Write the headers of `block_hashes` into rows `slots` of `staging`
        (uint8, shape [num_slots, header_nbytes] or wider rows). Vectorised over slots."""
        if len(slots) != len(block_hashes):
            raise HeaderError(f"{len(slots)} staging slots for {len(block_hashes)} block hashes")
        if staging.dtype != np.uint8 or staging.ndim != 2 or staging.shape[1] < self.header_nbytes:
            raise HeaderError(
                f"staging must be uint8 [num_slots, >= {self.header_nbytes}], got {staging.dtype} {staging.shape}"
            )
        if len(slots) == 0:
            return
        rows = np.asarray(slots, dtype=np.int64)
        n = self.header_nbytes
        staging[rows, :n] = np.frombuffer(self._template, dtype=np.uint8)[None, :]
        lens = np.array([len(h) for h in block_hashes], dtype="<u4")
        staging[rows, _HASH_LEN_OFFSET : _HASH_LEN_OFFSET + 4] = lens.view(np.uint8).reshape(-1, 4)
        fields = np.frombuffer(b"".join(block_hash_field(h) for h in block_hashes), dtype=np.uint8)
        staging[rows, _HASH_OFFSET : _HASH_OFFSET + BLOCK_HASH_FIELD_NBYTES] = fields.reshape(-1, BLOCK_HASH_FIELD_NBYTES)

    def verify(self, buf: bytes | bytearray | memoryview | np.ndarray, block_hash: bytes) -> None:
        """Check a header read from the pool against this deployment and `block_hash`.
        Raises HeaderError("header field '<name>' mismatch ...") on the first bad field."""
        raw = buf.tobytes() if isinstance(buf, np.ndarray) else bytes(buf)
        if len(raw) < self.header_nbytes:
            raise HeaderError(f"header of block {block_hash.hex()} is {len(raw)} bytes, expected {self.header_nbytes}")
        got = _FIXED.unpack_from(raw, 0)
        expected = (
            MAGIC, SCHEMA_VERSION, self.header_nbytes, self.num_layers, len(block_hash),
            self.object_nbytes, self.namespace_digest, self.layout_digest, block_hash_field(block_hash),
        )
        names = (
            "magic", "schema_version", "header_nbytes", "num_layers", "block_hash_nbytes",
            "object_nbytes", "namespace_digest", "layout_digest", "block_hash",
        )
        for name, value, want in zip(names, got, expected, strict=True):
            if value != want:
                shown = (value.hex(), want.hex()) if isinstance(value, bytes) and isinstance(want, bytes) else (value, want)
                raise HeaderError(
                    f"header field '{name}' mismatch for block {block_hash.hex()}: "
                    f"got {shown[0]}, expected {shown[1]}"
                )

    def layer_checksums(self, buf: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, ...]:
        """The per-layer checksum slots of a header (0 = unused)."""
        raw = buf.tobytes() if isinstance(buf, np.ndarray) else bytes(buf)
        return struct.unpack_from(f"<{self.num_layers}I", raw, _CHECKSUMS_OFFSET)
