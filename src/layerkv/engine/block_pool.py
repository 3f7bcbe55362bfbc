"""The reference engine's block pool: reference counts, the free queue (LRU eviction of free
cached blocks) and the local prefix cache (block hash -> block id). Scheduler side; used only
by the engine's scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from layerkv.messages import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        # free blocks, front = evicted first; freed blocks go to the back (LRU)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_of_hash: dict[BlockHash, int] = {}
        self._hash_of_block: dict[int, BlockHash] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of `hashes`, from block 0, that is in the prefix cache."""
        hit: list[int] = []
        for block_hash in hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        return self._block_of_hash.get(block_hash)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        return sum(1 for b in block_ids if self._ref_cnt[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on (cached) blocks; a free one leaves the free queue but stays cached."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks (evicting their cached hashes), or None if too few are free."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            b, _none = self._free.popitem(last=False)
            old_hash = self._hash_of_block.pop(b, None)
            if old_hash is not None:
                del self._block_of_hash[old_hash]
            self._ref_cnt[b] = 1
            block_ids.append(b)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; tail blocks first so they are evicted first."""
        for b in reversed(block_ids):
            assert self._ref_cnt[b] > 0, f"block {b} freed more often than taken"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Put a block whose KV is complete and valid into the prefix cache (idempotent).
        If another block already holds this hash, the first one stays the cached copy."""
        if block_id in self._hash_of_block or block_hash in self._block_of_hash:
            return
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
