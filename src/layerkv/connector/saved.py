"""What this engine knows the pool holds, so that save planning never asks the store: the block
hashes of its own saves that were committed (their step's verdict came back without revoking
them), the most recent `capacity` of them. Scheduler thread only; no locks.

Planning a save of a block found here is skipped; everything else is planned and the worker's
put start answers "exists" off the engine's path (transfer/save.py) for a block someone else
wrote. The memory can be wrong only one way: the pool may have lost a block since (an eviction,
a verification that removed it). A lookup that misses blocks forgets them (`forget`), so a
request that recomputes a lost prefix saves it again.
"""

from __future__ import annotations

from collections.abc import Iterable

from layerkv.messages import BlockHash

# ~100 bytes per hash held: 32,768 of them is about 3 MiB, and covers every block of 32k
# requests' last blocks or 500 prompts of 1,000 tokens
CAPACITY = 1 << 15


class SavedBlocks:
    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self._capacity = capacity
        self._hashes: dict[BlockHash, None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def add(self, hashes: Iterable[BlockHash]) -> None:
        """Committed now: each becomes the newest (the oldest beyond `capacity` are dropped)."""
        table = self._hashes
        for block_hash in hashes:
            table.pop(block_hash, None)
            table[block_hash] = None
        while len(table) > self._capacity:
            del table[next(iter(table))]

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """A lookup found these missing (or could not tell): plan their saves again."""
        if self._hashes:
            for block_hash in hashes:
                self._hashes.pop(block_hash, None)

    def clear(self) -> None:
        self._hashes.clear()
