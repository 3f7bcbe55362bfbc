"""Pool lookups for the scheduler side (connector/scheduler.py): which of a request's blocks the
pool can serve now. A block counts only if the object of every share's namespace (pipeline stage
x decode context parallel rank) and every storage rank is COMPLETE; older tenant keys (kept
after a rotation) are asked only for the blocks the newer ones miss; a request's run of hits is
asked one window at a time, stopping at the first window with a miss. Scheduler thread only; no
locks. Never raises because of the store (CheckedStore answers a code per key): an answer
outside {0, 1} is an error, counted, logged and taken as a miss, never a hit."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from layerkv.connector.stats import SchedulerStats
from layerkv.messages import BlockHash
from layerkv.objects.keys import Namespace, block_keys
from layerkv.store.checked import CheckedStore

log = logging.getLogger(__name__)


class PoolLookup:
    """Asks the store which blocks are readable: a block counts only if every storage rank's
    key is COMPLETE. Results outside {0, 1} are errors, never hits.

    `generations[g]`: the shares' namespaces (pipeline stage x CP rank) under tenant key g (0: the current key,
    higher: older keys kept after a rotation, asked only for what the newer ones miss)."""

    def __init__(
        self,
        store: CheckedStore,
        generations: Sequence[Sequence[Namespace]],
        num_storage_ranks: int,
        window_blocks: int,
        stats: SchedulerStats,
    ) -> None:
        self._store = store
        # every (share namespace, storage rank) pair must hold a block for a hit
        self._ranks = [[(ns, rank) for ns in stages for rank in range(num_storage_ranks)] for stages in generations]
        assert self._ranks, "at least the current key's namespaces"
        self._window_blocks = window_blocks
        self._stats = stats

    def present(self, hashes: Sequence[BlockHash], generation: int = 0) -> list[bool]:
        """Per block: are all storage ranks' keys under `generation` readable? One exists call
        (the store splits it)."""
        if not hashes:
            return []
        ranks = self._ranks[generation]
        keys_by_rank = [block_keys(ns, hashes, rank) for ns, rank in ranks]
        keys = [key for rank_keys in zip(*keys_by_rank) for key in rank_keys]  # block-major
        results = self._store.batch_is_exist(keys)
        self._stats.exists_calls += 1
        self._stats.keys_queried += len(keys)
        table = np.asarray(results, dtype=np.int64).reshape(len(hashes), len(ranks))  # [blocks, ranks]
        errors = ~np.isin(table, (0, 1)).all(axis=1)
        if errors.any():
            self._stats.lookup_errors += int(errors.sum())
            log.warning(
                "layerkv: exists query failed for %d of %d blocks (codes %s); treated as misses",
                int(errors.sum()),
                len(hashes),
                sorted(set(table[errors].ravel().tolist()) - {0, 1}),
            )
        return (table == 1).all(axis=1).tolist()

    def locate(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Per block: the first key generation under which it is present (-1: under none). The
        older keys are asked only for the blocks the newer ones miss."""
        found = [-1] * len(hashes)
        missing = list(range(len(hashes)))
        for generation in range(len(self._ranks)):
            if not missing:
                break
            present = self.present([hashes[i] for i in missing], generation)
            for i, flag in zip(missing, present):
                if flag:
                    found[i] = generation
            missing = [i for i in missing if found[i] < 0]
        return found

    def count_hit_blocks(self, hashes: Sequence[BlockHash], start_block: int, end_block: int) -> list[int]:
        """The run of present blocks from `start_block` (exclusive `end_block`), as each one's
        key generation, asking one window at a time and stopping at the first window with a
        miss. A window that hits entirely doubles the next one (a long full hit costs
        log-many queries, a low hit rate still costs one window)."""
        hit: list[int] = []
        window_start, window_blocks = start_block, self._window_blocks
        while window_start < end_block:
            window = hashes[window_start : min(window_start + window_blocks, end_block)]
            for generation in self.locate(window):
                if generation < 0:
                    return hit
                hit.append(generation)
            window_start += len(window)
            window_blocks *= 2
        return hit
