"""The object header: a small fixed-size record at offset 0 of every object that says which
deployment, layout and block the object belongs to, which write it is (a random nonce), and
carries one 16-byte tag per layer and, with a tenant key, a MAC over itself (layerkv.objects.seal).
Worker side; a `Header` is immutable after construction and may be used from any thread (the
send thread encodes, or the write thread for direct saves; the receive thread verifies).

    offset  size  field (little-endian)
         0     8  magic b"LAYERKV\\0"
         8     4  schema version (u32)
        12     4  header size in bytes (u32)
        16     4  number of layers (u32)
        20     4  length of the block id in bytes (u32)
        24     8  object size in bytes (u64)
        32    16  namespace digest
        48    16  layout digest
        64    64  block id (zero padded; ids longer than 64 bytes: their blake2b-64 digest); with
                  a tenant key the keyed id of the object key, else the engine's block hash
       128     4  flags (u32): bit 0 = keyed (BLAKE3-keyed tags and a header MAC), bit 1 =
                  encrypted (AES-256-GCM layers, their GCM tags as tags); a reader accepts
                  exactly the flags its own config writes, no bit turns a check off
       132     4  reserved (0)
       136    16  nonce: random per write of the object
       152    32  header MAC (keyed; zero without a key), over the header with this field zero
       184 16 * L per-layer tags (layerkv.objects.seal)
       ...        zero padding up to a multiple of 64 bytes (at most 4 KiB in all)

The producer writes the header last (after every layer, when the tags are known); readers
read it with layer 0, check every field (reserved and padding bytes too) and the MAC, then
verify every layer against its tag.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import numpy as np

from layerkv.errors import HeaderError, LayoutError
from layerkv.objects.seal import MAC_NBYTES, NONCE_NBYTES, TAG_NBYTES, Sealer, context

SCHEMA_VERSION = 3
MAGIC = b"LAYERKV\0"
HEADER_ALIGN_NBYTES = 64
MAX_HEADER_NBYTES = 4096
DIGEST_NBYTES = 16
BLOCK_HASH_FIELD_NBYTES = 64
FLAG_KEYED = 1
FLAG_ENCRYPTED = 2
_FIXED = struct.Struct("<8sIIIIQ16s16s64s")  # 128 bytes
_FLAGS_OFFSET = _FIXED.size
_NONCE_OFFSET = NONCE_OFFSET = _FIXED.size + 8  # public: what every write changes starts here
_MAC_OFFSET = _NONCE_OFFSET + NONCE_NBYTES
_TAGS_OFFSET = _MAC_OFFSET + MAC_NBYTES
_HASH_OFFSET = 64
_HASH_LEN_OFFSET = 20
MAX_LAYERS = (MAX_HEADER_NBYTES - _TAGS_OFFSET) // TAG_NBYTES


def header_nbytes_for(num_layers: int) -> int:
    """Header size for a layout with `num_layers` layers: 184 + 16 * L rounded up to 64 bytes."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise LayoutError(
            f"num_layers={num_layers} must be 1 <= value <= {MAX_LAYERS}: the object header "
            f"(<= {MAX_HEADER_NBYTES} bytes) keeps a {TAG_NBYTES}-byte tag per layer"
        )
    raw = _TAGS_OFFSET + TAG_NBYTES * num_layers
    return -(-raw // HEADER_ALIGN_NBYTES) * HEADER_ALIGN_NBYTES


def block_hash_field(block_hash: bytes) -> bytes:
    """The 64-byte header field for `block_hash` (raw and zero padded, or a digest if longer)."""
    if len(block_hash) > BLOCK_HASH_FIELD_NBYTES:
        return hashlib.blake2b(block_hash, digest_size=BLOCK_HASH_FIELD_NBYTES).digest()
    return block_hash.ljust(BLOCK_HASH_FIELD_NBYTES, b"\0")


class Header:
    """Encoder / verifier of object headers for one (namespace, layout, sealer).

    `encode_into(staging, slots, block_ids, object_keys, nonces, tags)` fills rows of a
    `[num_slots, >= header_nbytes]` uint8 staging array; `verify(buf, block_id, object_key)`
    raises HeaderError naming the first field that does not match and returns (nonce, tags);
    `verify_many` checks many rows at once.
    """

    __slots__ = (
        "namespace_digest",
        "layout_digest",
        "num_layers",
        "object_nbytes",
        "header_nbytes",
        "sealer",
        "_template",
        "_flags",
    )

    def __init__(
        self,
        namespace_digest: bytes,
        layout_digest: bytes,
        num_layers: int,
        object_nbytes: int,
        sealer: Sealer | None = None,
    ) -> None:
        if len(namespace_digest) != DIGEST_NBYTES or len(layout_digest) != DIGEST_NBYTES:
            raise HeaderError(
                f"namespace and layout digests must be {DIGEST_NBYTES} bytes, "
                f"got {len(namespace_digest)} and {len(layout_digest)}"
            )
        self.namespace_digest = bytes(namespace_digest)
        self.layout_digest = bytes(layout_digest)
        self.num_layers = num_layers
        self.header_nbytes = header_nbytes_for(num_layers)
        if object_nbytes <= self.header_nbytes:
            raise HeaderError(f"object_nbytes={object_nbytes} must exceed the header ({self.header_nbytes} bytes)")
        self.object_nbytes = object_nbytes
        self.sealer = sealer if sealer is not None else Sealer(None)
        self._flags = (FLAG_KEYED if self.sealer.keyed else 0) | (FLAG_ENCRYPTED if self.sealer.encrypts else 0)
        template = bytearray(self.header_nbytes)
        _FIXED.pack_into(
            template,
            0,
            MAGIC,
            SCHEMA_VERSION,
            self.header_nbytes,
            self.num_layers,
            0,
            self.object_nbytes,
            self.namespace_digest,
            self.layout_digest,
            b"",
        )
        struct.pack_into("<I", template, _FLAGS_OFFSET, self._flags)
        self._template = bytes(template)

    def _kind(self) -> str:
        return "encrypted" if self.sealer.encrypts else "keyed" if self.sealer.keyed else "unkeyed"

    @property
    def tags_end(self) -> int:
        return _TAGS_OFFSET + TAG_NBYTES * self.num_layers

    def encode(
        self, block_id: bytes, object_key: str, nonce: bytes = bytes(NONCE_NBYTES), tags: np.ndarray | None = None
    ) -> bytes:
        """One object's header (`tags`: uint8 [num_layers, 16]; None: zero tags)."""
        staging = np.zeros((1, self.header_nbytes), dtype=np.uint8)
        self.encode_into(
            staging,
            np.zeros(1, dtype=np.int64),
            [block_id],
            [object_key],
            np.frombuffer(nonce, dtype=np.uint8).reshape(1, NONCE_NBYTES),
            None if tags is None else np.asarray(tags, dtype=np.uint8).reshape(1, self.num_layers, TAG_NBYTES),
        )
        return staging.tobytes()

    def encode_into(
        self,
        staging: np.ndarray,
        slots: np.ndarray,
        block_ids: Sequence[bytes],
        object_keys: Sequence[str],
        nonces: np.ndarray,
        tags: np.ndarray | None,
    ) -> None:
        """Write the headers of `block_ids` into rows `slots` of `staging` (uint8,
        [num_slots, >= header_nbytes]): nonces uint8 [n, 16], tags uint8 [n, num_layers, 16]
        (None: zero tags, an object no reader accepts), then each header's MAC."""
        n = len(slots)
        if len(block_ids) != n or len(object_keys) != n:
            raise HeaderError(f"{n} staging slots for {len(block_ids)} block ids and {len(object_keys)} keys")
        if staging.dtype != np.uint8 or staging.ndim != 2 or staging.shape[1] < self.header_nbytes:
            raise HeaderError(
                f"staging must be uint8 [num_slots, >= {self.header_nbytes}], got {staging.dtype} {staging.shape}"
            )
        if nonces.shape != (n, NONCE_NBYTES):
            raise HeaderError(f"nonces of shape {nonces.shape}; expected {(n, NONCE_NBYTES)}")
        if tags is not None and tags.shape != (n, self.num_layers, TAG_NBYTES):
            raise HeaderError(f"tags of shape {tags.shape}; expected {(n, self.num_layers, TAG_NBYTES)}")
        if n == 0:
            return
        rows = np.asarray(slots, dtype=np.int64)
        self._fill(staging, rows, block_ids, nonces, tags)
        if self.sealer.keyed:
            for i, row in enumerate(rows.tolist()):
                ctx = context(object_keys[i], staging[row, _NONCE_OFFSET:_MAC_OFFSET].tobytes())
                mac = self.sealer.header_mac(ctx, staging[row, : self.header_nbytes].tobytes())
                staging[row, _MAC_OFFSET:_TAGS_OFFSET] = np.frombuffer(mac, dtype=np.uint8)

    def _fill(
        self,
        staging: np.ndarray,
        rows: np.ndarray,
        block_ids: Sequence[bytes],
        nonces: np.ndarray,
        tags: np.ndarray | None,
    ) -> None:
        """Every field but the MAC (zero)."""
        n = len(rows)
        staging[rows, : self.header_nbytes] = np.frombuffer(self._template, dtype=np.uint8)[None, :]
        lens = np.array([len(h) for h in block_ids], dtype="<u4")
        staging[rows, _HASH_LEN_OFFSET : _HASH_LEN_OFFSET + 4] = lens.view(np.uint8).reshape(-1, 4)
        fields = np.frombuffer(b"".join(block_hash_field(h) for h in block_ids), dtype=np.uint8)
        staging[rows, _HASH_OFFSET : _HASH_OFFSET + BLOCK_HASH_FIELD_NBYTES] = fields.reshape(
            -1, BLOCK_HASH_FIELD_NBYTES
        )
        staging[rows, _NONCE_OFFSET:_MAC_OFFSET] = nonces
        if tags is not None:
            staging[rows, _TAGS_OFFSET : self.tags_end] = tags.reshape(n, -1)

    def verify(
        self, buf: bytes | bytearray | memoryview | np.ndarray, block_id: bytes, object_key: str
    ) -> tuple[bytes, np.ndarray]:
        """Check a header read from the pool against this deployment, `block_id` and the key
        it was read from; return (nonce, tags uint8 [num_layers, 16]). Raises
        HeaderError("header field '<name>' mismatch ...") on the first bad field."""
        raw = buf.tobytes() if isinstance(buf, np.ndarray) else bytes(buf)
        if len(raw) < self.header_nbytes:
            raise HeaderError(f"header of key {object_key} is {len(raw)} bytes, expected {self.header_nbytes}")
        got = _FIXED.unpack_from(raw, 0)
        expected = (
            MAGIC,
            SCHEMA_VERSION,
            self.header_nbytes,
            self.num_layers,
            len(block_id),
            self.object_nbytes,
            self.namespace_digest,
            self.layout_digest,
            block_hash_field(block_id),
        )
        names = (
            "magic",
            "schema_version",
            "header_nbytes",
            "num_layers",
            "block_id_nbytes",
            "object_nbytes",
            "namespace_digest",
            "layout_digest",
            "block_id",
        )
        for name, value, want in zip(names, got, expected, strict=True):
            if value != want:
                shown = (
                    (value.hex(), want.hex()) if isinstance(value, bytes) and isinstance(want, bytes) else (value, want)
                )
                raise HeaderError(
                    f"header field '{name}' mismatch for key {object_key}: got {shown[0]}, expected {shown[1]}"
                )
        flags, reserved = struct.unpack_from("<II", raw, _FLAGS_OFFSET)
        if flags != self._flags:
            raise HeaderError(
                f"header field 'flags' mismatch for key {object_key}: got {flags:#x}, this reader "
                f"accepts only {self._flags:#x} ({self._kind()})"
            )
        if reserved:
            raise HeaderError(f"header field 'reserved' of key {object_key} is not zero")
        if any(raw[self.tags_end : self.header_nbytes]):
            raise HeaderError(f"header field 'padding' of key {object_key} is not zero")
        nonce = raw[_NONCE_OFFSET:_MAC_OFFSET]
        mac = raw[_MAC_OFFSET:_TAGS_OFFSET]
        unsigned = raw[:_MAC_OFFSET] + bytes(MAC_NBYTES) + raw[_TAGS_OFFSET : self.header_nbytes]
        if not hmac.compare_digest(mac, self.sealer.header_mac(context(object_key, nonce), unsigned)):
            raise HeaderError(f"header field 'mac' of key {object_key} does not verify")
        tags = np.frombuffer(raw, dtype=np.uint8, count=TAG_NBYTES * self.num_layers, offset=_TAGS_OFFSET)
        return nonce, tags.reshape(self.num_layers, TAG_NBYTES).copy()

    def verify_many(
        self, rows: np.ndarray, block_ids: Sequence[bytes], object_keys: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`verify` over many headers at once: rows uint8 [n, >= header_nbytes]. Returns (ok
        [n] bool, nonces uint8 [n, 16], tags uint8 [n, num_layers, 16]); call `verify` on a
        row that is not ok for the message naming the field."""
        n = len(block_ids)
        got = np.array(rows[:n, : self.header_nbytes], dtype=np.uint8)  # a private copy: checked, then used
        want = np.zeros((n, self.header_nbytes), dtype=np.uint8)
        if n == 0:
            return (
                np.ones(0, dtype=bool),
                np.zeros((0, NONCE_NBYTES), np.uint8),
                np.zeros((0, self.num_layers, TAG_NBYTES), np.uint8),
            )
        self._fill(want, np.arange(n), block_ids, got[:, _NONCE_OFFSET:_MAC_OFFSET], None)
        ok = (got[:, :_NONCE_OFFSET] == want[:, :_NONCE_OFFSET]).all(axis=1)
        ok &= ~got[:, self.tags_end :].any(axis=1)
        if self.sealer.keyed:
            unsigned = got.copy()
            unsigned[:, _MAC_OFFSET:_TAGS_OFFSET] = 0
            for i in np.flatnonzero(ok).tolist():
                ctx = context(object_keys[i], got[i, _NONCE_OFFSET:_MAC_OFFSET].tobytes())
                mac = self.sealer.header_mac(ctx, unsigned[i].tobytes())
                ok[i] = hmac.compare_digest(got[i, _MAC_OFFSET:_TAGS_OFFSET].tobytes(), mac)
        tags = got[:, _TAGS_OFFSET : self.tags_end].reshape(n, self.num_layers, TAG_NBYTES)
        return ok, got[:, _NONCE_OFFSET:_MAC_OFFSET].copy(), tags.copy()
