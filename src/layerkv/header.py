"""The object header: a small fixed-size record at offset 0 of every object that says which
deployment, layout and block the object belongs to, and carries one checksum per layer. Worker
side; a `Header` is immutable after construction and may be used from any thread (the send
thread encodes, the receive thread verifies).

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
       128     4  flags (u32): bit 0 = the checksum slots hold xxh3-64 checksums of the layers
       132     4  reserved (0)
       136  8 * L per-layer checksums (u64 each): xxh3-64 of layer l's bytes in object order
       ...        zero padding up to a multiple of 64 bytes (at most 4 KiB in all)

The producer writes the header last (after every layer, when the checksums are known); readers
read it with layer 0 and verify every later layer against its slot.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from layerkv.errors import HeaderError, LayoutError

SCHEMA_VERSION = 2
MAGIC = b"LAYERKV\0"
HEADER_ALIGN_NBYTES = 64
MAX_HEADER_NBYTES = 4096
DIGEST_NBYTES = 16
BLOCK_HASH_FIELD_NBYTES = 64
FLAG_CHECKSUMS = 1
_FIXED = struct.Struct("<8sIIIIQ16s16s64s")  # 128 bytes
_FLAGS_OFFSET = _FIXED.size
_CHECKSUMS_OFFSET = _FIXED.size + 8
_HASH_OFFSET = 64
_HASH_LEN_OFFSET = 20
MAX_LAYERS = (MAX_HEADER_NBYTES - _CHECKSUMS_OFFSET) // 8


def header_nbytes_for(num_layers: int) -> int:
    """Header size for a layout with `num_layers` layers: 136 + 8 * L rounded up to 64 bytes."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise LayoutError(
            f"num_layers={num_layers} must be 1 <= value <= {MAX_LAYERS}: the object header "
            f"(<= {MAX_HEADER_NBYTES} bytes) keeps an 8-byte checksum slot per layer"
        )
    raw = _CHECKSUMS_OFFSET + 8 * num_layers
    return -(-raw // HEADER_ALIGN_NBYTES) * HEADER_ALIGN_NBYTES


def block_hash_field(block_hash: bytes) -> bytes:
    """The 64-byte header field for `block_hash` (raw and zero padded, or a digest if longer)."""
    if len(block_hash) > BLOCK_HASH_FIELD_NBYTES:
        return hashlib.blake2b(block_hash, digest_size=BLOCK_HASH_FIELD_NBYTES).digest()
    return block_hash.ljust(BLOCK_HASH_FIELD_NBYTES, b"\0")


class Header:
    """Encoder / verifier of object headers for one (namespace, layout).

    `encode(block_hash, checksums)` returns `header_nbytes` bytes; `encode_into(staging, slots,
    hashes, checksums)` fills rows of a `[num_slots, >= header_nbytes]` uint8 staging array.
    `verify(buf, block_hash)` raises HeaderError naming the first field that does not match and
    returns the per-layer checksums (None when the producer wrote none).
    """

    __slots__ = ("namespace_digest", "layout_digest", "num_layers", "object_nbytes", "header_nbytes", "_template")

    def __init__(self, namespace_digest: bytes, layout_digest: bytes, num_layers: int, object_nbytes: int) -> None:
        if len(namespace_digest) != DIGEST_NBYTES or len(layout_digest) != DIGEST_NBYTES:
            raise HeaderError(f"namespace and layout digests must be {DIGEST_NBYTES} bytes, "
                              f"got {len(namespace_digest)} and {len(layout_digest)}")
        self.namespace_digest = bytes(namespace_digest)
        self.layout_digest = bytes(layout_digest)
        self.num_layers = num_layers
        self.header_nbytes = header_nbytes_for(num_layers)
        if object_nbytes <= self.header_nbytes:
            raise HeaderError(f"object_nbytes={object_nbytes} must exceed the header ({self.header_nbytes} bytes)")
        self.object_nbytes = object_nbytes
        template = bytearray(self.header_nbytes)
        _FIXED.pack_into(
            template, 0, MAGIC, SCHEMA_VERSION, self.header_nbytes, self.num_layers, 0,
            self.object_nbytes, self.namespace_digest, self.layout_digest, b"",
        )
        self._template = bytes(template)

    def encode(self, block_hash: bytes, layer_checksums: list[int] | np.ndarray | None = None) -> bytes:
        """The header of the object for `block_hash` (no checksums: flags 0, slots 0)."""
        staging = np.zeros((1, self.header_nbytes), dtype=np.uint8)
        sums = None if layer_checksums is None else np.asarray(layer_checksums, dtype=np.uint64).reshape(1, -1)
        self.encode_into(staging, np.zeros(1, dtype=np.int64), [block_hash], sums)
        return staging.tobytes()

    def encode_into(self, staging: np.ndarray, slots: np.ndarray, block_hashes: list[bytes],
                    checksums: np.ndarray | None = None) -> None:
        """Write the headers of `block_hashes` into rows `slots` of `staging` (uint8,
        [num_slots, >= header_nbytes]); `checksums`: uint64 [len(slots), num_layers] or None."""
        if len(slots) != len(block_hashes):
            raise HeaderError(f"{len(slots)} staging slots for {len(block_hashes)} block hashes")
        if staging.dtype != np.uint8 or staging.ndim != 2 or staging.shape[1] < self.header_nbytes:
            raise HeaderError(
                f"staging must be uint8 [num_slots, >= {self.header_nbytes}], got {staging.dtype} {staging.shape}"
            )
        if checksums is not None and checksums.shape != (len(slots), self.num_layers):
            raise HeaderError(f"checksums of shape {checksums.shape}; expected {(len(slots), self.num_layers)}")
        if len(slots) == 0:
            return
        rows = np.asarray(slots, dtype=np.int64)
        staging[rows, : self.header_nbytes] = np.frombuffer(self._template, dtype=np.uint8)[None, :]
        lens = np.array([len(h) for h in block_hashes], dtype="<u4")
        staging[rows, _HASH_LEN_OFFSET : _HASH_LEN_OFFSET + 4] = lens.view(np.uint8).reshape(-1, 4)
        fields = np.frombuffer(b"".join(block_hash_field(h) for h in block_hashes), dtype=np.uint8)
        staging[rows, _HASH_OFFSET : _HASH_OFFSET + BLOCK_HASH_FIELD_NBYTES] = fields.reshape(-1, BLOCK_HASH_FIELD_NBYTES)
        if checksums is not None:
            flags = np.array([FLAG_CHECKSUMS], dtype="<u4").view(np.uint8)
            staging[rows, _FLAGS_OFFSET : _FLAGS_OFFSET + 4] = flags[None, :]
            end = _CHECKSUMS_OFFSET + 8 * self.num_layers
            staging[rows, _CHECKSUMS_OFFSET:end] = checksums.astype("<u8").view(np.uint8).reshape(len(rows), -1)

    def verify(self, buf: bytes | bytearray | memoryview | np.ndarray, block_hash: bytes) -> tuple[int, ...] | None:
        """Check a header read from the pool against this deployment and `block_hash`; return
        its per-layer checksums (None if the producer wrote none). Raises
        HeaderError("header field '<name>' mismatch ...") on the first bad field."""
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
        (flags,) = struct.unpack_from("<I", raw, _FLAGS_OFFSET)
        if flags & ~FLAG_CHECKSUMS:
            raise HeaderError(f"header field 'flags' has unknown bits {flags:#x} for block {block_hash.hex()}")
        return self.layer_checksums(raw) if flags & FLAG_CHECKSUMS else None

    def verify_many(self, rows: np.ndarray, block_hashes: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`verify` over many headers at once: rows uint8 [n, >= header_nbytes]. Returns (ok
        [n] bool, has_checksums [n] bool, checksums uint64 [n, num_layers]); call `verify` on a
        row that is not ok for the message naming the field."""
        n = len(block_hashes)
        want = np.zeros((n, self.header_nbytes), dtype=np.uint8)
        self.encode_into(want, np.arange(n), block_hashes)
        got = rows[:n, : self.header_nbytes]
        ok = (got[:, :_FLAGS_OFFSET] == want[:, :_FLAGS_OFFSET]).all(axis=1)
        flags = got[:, _FLAGS_OFFSET : _FLAGS_OFFSET + 4].copy().view("<u4").reshape(n)
        ok &= (flags & ~np.uint32(FLAG_CHECKSUMS)) == 0
        end = _CHECKSUMS_OFFSET + 8 * self.num_layers
        checksums = got[:, _CHECKSUMS_OFFSET:end].copy().view("<u8").reshape(n, self.num_layers).astype(np.uint64)
        return ok, (flags & FLAG_CHECKSUMS) != 0, checksums

    def layer_checksums(self, buf: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, ...]:
        """The per-layer checksum slots of a header (0 when the producer wrote none)."""
        raw = buf.tobytes() if isinstance(buf, np.ndarray) else bytes(buf)
        return struct.unpack_from(f"<{self.num_layers}Q", raw, _CHECKSUMS_OFFSET)
