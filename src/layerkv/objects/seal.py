"""What lets a reader trust an object's bytes: one 16-byte tag per layer and, with a tenant key,
a MAC over the header. Pure functions of (subkey, object key, write nonce, bytes); any thread.

    context   = object key (UTF-8) || 0x00 || the write's 16-byte nonce
    layer tag = H(the layer's bytes in object order || b"L" || context || u32 layer || u64 length)[:16]
    header    = H(b"H" || context || the header with its MAC field zeroed)[:32]   (keyed only)

(The layer's bytes go first: BLAKE3 hashes 1 KiB chunks in parallel only from an aligned start,
so a prefix would cost it 3-5x; the suffix's fixed fields keep the input unambiguous.)

H is BLAKE3 keyed with the tenant key's MAC subkey (`Sealer(mac_key)`), or, without a key,
xxh3-128 (`Sealer(None)`: a checksum against corruption, no protection against anyone who writes
the pool). Binding the object key and the nonce means a layer (or a whole header) copied from
another object, or from an earlier write of the same object, does not verify. With
`encrypt_objects` (`Sealer(mac_key, LayerCipher(...))`) each layer is AES-256-GCM ciphertext
and its tag is the GCM tag (layerkv.objects.encryption): decrypting verifies it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np
import xxhash

from layerkv.objects import encryption
from layerkv.objects.encryption import LayerCipher

if TYPE_CHECKING:
    from layerkv.objects.tenant_key import TenantKeys

TAG_NBYTES = 16
MAC_NBYTES = 32
NONCE_NBYTES = 16
_SUFFIX = struct.Struct("<IQ")  # layer index, the layer's length
assert encryption.TAG_NBYTES == TAG_NBYTES


def context(object_key: str, nonce: bytes) -> bytes:
    """What binds a tag to one write of one object."""
    return object_key.encode() + b"\0" + nonce


class Sealer:
    """Tags and header MACs under one subkey (None: unkeyed xxh3-128 tags, no header MAC).
    Never shows the key (`repr` says only whether it is keyed)."""

    __slots__ = ("_key", "_cipher")

    def __init__(self, mac_key: bytes | None, cipher: LayerCipher | None = None) -> None:
        if cipher is not None and mac_key is None:
            raise ValueError("encryption needs the tenant key's MAC subkey too")
        self._key = mac_key
        self._cipher = cipher

    @property
    def keyed(self) -> bool:
        return self._key is not None

    @property
    def encrypts(self) -> bool:
        return self._cipher is not None

    def __repr__(self) -> str:
        return f"Sealer(keyed={self.keyed}, encrypts={self.encrypts})"

    def seal_layers(self, contexts: Sequence[bytes], layer_idx: int, spans: Sequence[np.ndarray]) -> np.ndarray:
        """Tags of each object's layer `layer_idx` (`spans[i]`: its bytes, one contiguous
        writable uint8 array): uint8 [len(spans), 16]. An encrypting sealer replaces each span
        by its ciphertext (call it on private memory: the plaintext must never sit where a peer
        can read it)."""
        if self._cipher is None:
            return self.layer_tags(contexts, layer_idx, [[span] for span in spans])
        out = np.empty((len(spans), TAG_NBYTES), dtype=np.uint8)
        for i, (ctx, span) in enumerate(zip(contexts, spans, strict=True)):
            ciphertext, tag = self._cipher.encrypt(self._cipher.object_cipher(ctx), ctx, layer_idx, span.data)
            span[:] = np.frombuffer(ciphertext, dtype=np.uint8)
            out[i] = np.frombuffer(tag, dtype=np.uint8)
        return out

    def open_layers(
        self, contexts: Sequence[bytes], layer_idx: int, spans: Sequence[np.ndarray], tags: np.ndarray
    ) -> np.ndarray:
        """Encrypting sealers: decrypt each span in place where its tag (uint8 [n, 16]) verifies;
        returns the mask of those (a span that fails is left as it was)."""
        assert self._cipher is not None, "open_layers is for encrypted objects"
        ok = np.zeros(len(spans), dtype=bool)
        for i, (ctx, span) in enumerate(zip(contexts, spans, strict=True)):
            plain = self._cipher.decrypt(self._cipher.object_cipher(ctx), ctx, layer_idx, span.data, tags[i].tobytes())
            if plain is not None:
                span[:] = np.frombuffer(plain, dtype=np.uint8)
                ok[i] = True
        return ok

    def _hasher_type(self) -> Any:
        return blake3.blake3 if self._key is not None else xxhash.xxh3_128

    def _hasher(self) -> Any:
        return blake3.blake3(key=self._key) if self._key is not None else xxhash.xxh3_128()

    def layer_tag(self, ctx: bytes, layer_idx: int, chunks: Sequence[Any]) -> bytes:
        """The 16-byte tag of one layer whose bytes are `chunks` (buffers, in object order)."""
        h = self._hasher()
        nbytes = 0
        for chunk in chunks:
            h.update(chunk)
            nbytes += memoryview(chunk).nbytes
        return self._finish_tag(h, ctx, _SUFFIX.pack(layer_idx, nbytes))

    def layer_tags(self, contexts: Sequence[bytes], layer_idx: int, chunks: Sequence[Sequence[Any]]) -> np.ndarray:
        """Tags of many objects' layer `layer_idx` (`chunks[i]`: object i's layer bytes, in order): uint8
        [len(chunks), 16]."""
        out = bytearray()
        for ctx, object_chunks in zip(contexts, chunks, strict=True):
            out += self.layer_tag(ctx, layer_idx, object_chunks)
        return np.frombuffer(out, dtype=np.uint8).reshape(len(chunks), TAG_NBYTES)

    def indexed_tags(
        self, contexts: Sequence[bytes], layer_idx: int, segments: Sequence[np.ndarray], indices: Sequence[int]
    ) -> np.ndarray:
        """`layer_tags` where object i's layer is entry `indices[i]` (a block id of a cache, or a
        staging slot) of each of `segments` (2-D uint8 arrays, in object order): the same tags,
        without a Python list of views per object (a 32-layer load computes thousands of small tags
        per request)."""
        tail = _SUFFIX.pack(layer_idx, sum(int(seg.shape[1]) for seg in segments))
        new, key, keyed = self._hasher_type(), self._key, self._key is not None
        out = bytearray()
        for ctx, index in zip(contexts, indices, strict=True):
            h = new(key=key) if keyed else new()
            for seg in segments:
                h.update(seg[index])
            out += self._finish_tag(h, ctx, tail)
        return np.frombuffer(out, dtype=np.uint8).reshape(len(indices), TAG_NBYTES)

    def _finish_tag(self, h: Any, ctx: bytes, tail: bytes) -> bytes:
        """The one tag formula, after a layer's bytes: "L", the write's context, (layer, nbytes)."""
        h.update(b"L" + ctx + tail)
        return h.digest(TAG_NBYTES) if self._key is not None else h.digest()

    def header_mac(self, ctx: bytes, header: bytes) -> bytes:
        """The header's MAC (`header` with its MAC field zeroed); 32 zero bytes when unkeyed."""
        if self._key is None:
            return bytes(MAC_NBYTES)
        h = self._hasher()
        h.update(b"H" + ctx)
        h.update(header)
        return h.digest(MAC_NBYTES)


class RowSealers:
    """Several sealers, one chosen per row (after a key rotation a load's objects may be named
    and sealed under different keys): the per-row calls of Sealer, each row done by its own.
    `picks[i]` indexes `sealers` for row i of every call (the rows of the contexts given)."""

    __slots__ = ("_sealers", "_picks")

    def __init__(self, sealers: Sequence[Sealer], picks: np.ndarray) -> None:
        assert len({s.encrypts for s in sealers}) == 1, "every key of one engine encrypts, or none"
        self._sealers = tuple(sealers)
        self._picks = np.asarray(picks, dtype=np.int64)

    @property
    def keyed(self) -> bool:
        return self._sealers[0].keyed

    @property
    def encrypts(self) -> bool:
        return self._sealers[0].encrypts

    def __repr__(self) -> str:
        return f"RowSealers({len(self._sealers)} keys, keyed={self.keyed}, encrypts={self.encrypts})"

    def _split(self, n: int) -> list[tuple[Sealer, list[int]]]:
        assert self._picks.size == n, f"{self._picks.size} picks for {n} rows"
        return [(self._sealers[g], np.flatnonzero(self._picks == g).tolist()) for g in np.unique(self._picks).tolist()]

    def layer_tags(self, contexts: Sequence[bytes], layer_idx: int, rows: Sequence[Sequence[Any]]) -> np.ndarray:
        out = np.empty((len(rows), TAG_NBYTES), dtype=np.uint8)
        for sealer, idx in self._split(len(rows)):
            out[idx] = sealer.layer_tags([contexts[i] for i in idx], layer_idx, [rows[i] for i in idx])
        return out

    def indexed_tags(
        self, contexts: Sequence[bytes], layer_idx: int, segments: Sequence[np.ndarray], indices: Sequence[int]
    ) -> np.ndarray:
        out = np.empty((len(indices), TAG_NBYTES), dtype=np.uint8)
        for sealer, idx in self._split(len(indices)):
            out[idx] = sealer.indexed_tags([contexts[i] for i in idx], layer_idx, segments, [indices[i] for i in idx])
        return out

    def open_layers(
        self, contexts: Sequence[bytes], layer_idx: int, spans: Sequence[np.ndarray], tags: np.ndarray
    ) -> np.ndarray:
        ok = np.zeros(len(spans), dtype=bool)
        for sealer, idx in self._split(len(spans)):
            ok[idx] = sealer.open_layers([contexts[i] for i in idx], layer_idx, [spans[i] for i in idx], tags[idx])
        return ok


def sealers_for(keys: TenantKeys | None, encrypt: bool) -> tuple[Sealer, ...]:
    """One sealer per key of the key file, in its order (the first writes, all verify); one
    unkeyed sealer without a key."""
    if keys is None:
        return (Sealer(None),)
    return tuple(Sealer(k.mac_key, LayerCipher(k.encryption_key) if encrypt else None) for k in keys.all)
