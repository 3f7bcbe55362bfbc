"""Chained block hashes of the reference engine: hash_i = sha256(parent || token ids of block i
|| salt), only for full blocks, 32 raw bytes each. Pure functions; scheduler side.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT_HASH = bytes(32)  # parent of block 0


def hash_block(parent_hash: bytes, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)  # fixed 8 bytes per token id
    return hashlib.sha256(parent_hash + payload + salt).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: bytes = b""
) -> list[bytes]:
    """Append the hashes of blocks that became full in `token_ids` (all tokens so far) to `hashes`."""
    for block_idx in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        tokens = token_ids[block_idx * block_size : (block_idx + 1) * block_size]
        hashes.append(hash_block(parent, tokens, salt))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """Hashes of every full block of `token_ids`."""
    return tuple(extend_block_hashes([], token_ids, block_size, salt))
