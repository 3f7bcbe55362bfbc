"""`encrypt_objects`: every layer of an object encrypted with AES-256-GCM (the `cryptography`
library; nothing hand-written), so that nothing stored lets anyone without the tenant key read
the KV or test a guess of it. Any thread (each call builds its own cipher object).

    object key K_obj = BLAKE3-keyed(encryption subkey, "E" || context)   one per write of an object
    layer l:  ciphertext || tag = AES-256-GCM(K_obj, nonce = u32 l || 8 zero bytes,
                                              aad = "L" || context || u32 l, plaintext)

`context` (layerkv.objects.seal) is the object key and the write's random 16-byte nonce: a fresh key per
write, so GCM nonces never repeat under one key. The 16-byte GCM tag is the layer's tag in the
header; decrypting verifies it (a changed byte, layer, nonce or key fails). The ciphertext has
the plaintext's length: the object layout does not change.
"""

from __future__ import annotations

import functools
import struct

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_NBYTES = 16  # AES-GCM's tag: the layer's tag in the header (layerkv.objects.seal.TAG_NBYTES)
_LAYER = struct.Struct("<I")


@functools.lru_cache(maxsize=4096)
def _object_cipher(key: bytes, ctx: bytes) -> AESGCM:
    return AESGCM(blake3.blake3(b"E" + ctx, key=key).digest(32))


class LayerCipher:
    """Encrypts / decrypts layers under one tenant key's encryption subkey (never shown)."""

    __slots__ = ("_key",)

    def __init__(self, encryption_key: bytes) -> None:
        if len(encryption_key) != 32:
            raise ValueError("the encryption subkey must be 32 bytes")
        self._key = encryption_key

    def __repr__(self) -> str:
        return "LayerCipher()"

    def object_cipher(self, ctx: bytes) -> AESGCM:
        """The AES-256-GCM cipher of one write of one object (derived once per object, not per
        layer: the last few thousand are kept)."""
        return _object_cipher(self._key, ctx)

    @staticmethod
    def encrypt(cipher: AESGCM, ctx: bytes, layer_idx: int, plaintext: bytes | memoryview) -> tuple[bytes, bytes]:
        """(ciphertext of the plaintext's length, 16-byte tag)."""
        sealed = cipher.encrypt(
            _LAYER.pack(layer_idx) + bytes(8), bytes(plaintext), b"L" + ctx + _LAYER.pack(layer_idx)
        )
        return sealed[:-TAG_NBYTES], sealed[-TAG_NBYTES:]

    @staticmethod
    def decrypt(cipher: AESGCM, ctx: bytes, layer_idx: int, ciphertext: bytes | memoryview, tag: bytes) -> bytes | None:
        """The plaintext, or None when the tag does not verify (nothing of it is returned)."""
        try:
            return cipher.decrypt(
                _LAYER.pack(layer_idx) + bytes(8), bytes(ciphertext) + tag, b"L" + ctx + _LAYER.pack(layer_idx)
            )
        except InvalidTag:
            return None
