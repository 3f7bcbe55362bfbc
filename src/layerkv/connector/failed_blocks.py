"""The block ids a worker tells the engine it failed to load (vLLM's
get_block_ids_with_load_errors): collected over a step, each reported once per step (vLLM's
speculative decoding asks before the draft layers ran and again after wait_for_save; a load's
failures published in between are added then). Compute thread only."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class FailedBlocks:
    def __init__(self) -> None:
        self._pending: set[int] = set()  # to report at the next take()
        self._reported: set[int] = set()  # this step's, already reported
        # was the step's load settled at its last report (None: no report since): a load that
        # settled after it may have failures that report missed (WorkerConnector.report_steps)
        self.load_settled: bool | None = None

    def add(self, block_ids: Iterable[int]) -> None:
        """Blocks the engine must recompute (reported even if an earlier report named them)."""
        self._pending.update(block_ids)

    def add_unreported(self, block_ids: Iterable[int]) -> None:
        """A load's failures so far: only those this step has not reported yet."""
        self._pending.update(b for b in block_ids if b not in self._reported)

    def take(self) -> set[int]:
        taken, self._pending = self._pending, set()
        self._reported |= taken
        return taken

    def pop_load_settled(self, settled_now: Callable[[], bool] | None) -> bool:
        """Was the step's load settled at its last report (asked now if there was none; True
        without a load)? Forgotten once asked."""
        settled = self.load_settled
        self.load_settled = None
        if settled is None:
            return settled_now is None or settled_now()
        return settled

    def new_step(self) -> None:
        self._reported, self.load_settled = set(), None
