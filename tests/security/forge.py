"""How an attacker without the tenant key forges an object: from a genuine object it read
(whose header gives the number of layers and the sizes) and another one's layer bytes, with
layerkv's own code (Header, Sealer), as anyone can. Layers are taken as equal-sized, as in every
model of these tests (the attacker knows the public model)."""

from __future__ import annotations

import secrets
import struct

import numpy as np

from layerkv.objects.header import Header
from layerkv.objects.seal import NONCE_NBYTES, Sealer, context


def layer_spans(genuine: bytes) -> list[tuple[int, int]]:
    """(offset, nbytes) of each layer, from the header's sizes."""
    header_nbytes, num_layers, _, object_nbytes = struct.unpack_from("<IIIQ", genuine, 12)
    per_layer = (object_nbytes - header_nbytes) // num_layers
    return [(header_nbytes + li * per_layer, per_layer) for li in range(num_layers)]


def forge(kind: str, genuine_x: bytes, genuine_y: bytes, key_x: str) -> bytes:
    """An object for key X: "recomputed" (Y's layers, fresh unkeyed tags, flags 0), "guessed key"
    (the same with a MAC under a key of its own), "swap" (Y whole), "layer swap" (X's header and
    layer 0, Y's other layers), "reserved" / "nonce" (X with that header field changed)."""
    x, y = bytearray(genuine_x), bytearray(genuine_y)
    spans = layer_spans(genuine_x)
    header_nbytes = spans[0][0]
    if kind == "swap":
        return bytes(y)
    if kind == "layer swap":
        start = spans[1][0]
        return bytes(x[:start] + y[start:])
    if kind == "reserved":
        x[133] = 1
        return bytes(x)
    if kind == "nonce":
        x[140] ^= 0xFF
        return bytes(x)
    assert kind in ("recomputed", "guessed key"), kind
    sealer = Sealer(None if kind == "recomputed" else secrets.token_bytes(32))
    forger = Header(bytes(x[32:48]), bytes(x[48:64]), len(spans), len(x), sealer)
    id_len = int.from_bytes(x[20:24], "little")
    nonce = secrets.token_bytes(NONCE_NBYTES)
    obj = np.frombuffer(bytes(y), dtype=np.uint8)
    ctx = [context(key_x, nonce)]
    tags = np.stack([sealer.layer_tags(ctx, li, [[obj[at : at + n]]])[0] for li, (at, n) in enumerate(spans)])
    return forger.encode(bytes(x[64 : 64 + id_len]), key_x, nonce, tags) + bytes(y[header_nbytes:])
