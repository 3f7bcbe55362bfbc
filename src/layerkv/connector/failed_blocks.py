"""The block ids a worker tells the engine it failed to load (vLLM's
get_block_ids_with_load_errors): collected over a step, each reported once per step (vLLM's
speculative decoding asks before the draft layers ran and again after wait_for_save; a load's
failures published in between are added then). And the steps the worker ran, for the scheduler's
verdicts (WorkerConnector.report_steps): a step is held back while its load may still publish
failures, so that they count for it. Compute thread only."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class FailedBlocks:
    def __init__(self) -> None:
        self._pending: set[int] = set()  # to report at the next take()
        self._reported: set[int] = set()  # this step's, already reported
        # was the step's load settled at its last report (None: no report since): a load that
        # settled after it may have failures that report missed (take_steps)
        self.load_settled: bool | None = None
        self._steps: list[int] = []  # steps run and not reported yet (take_steps)

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

    def new_step(self, step_seq: int | None = None) -> None:
        """A step begins (bind_connector_metadata); `step_seq`: its number, None for no plan (a
        step the scheduler does not wait for)."""
        self._reported, self.load_settled = set(), None
        if step_seq is not None:
            self._steps.append(step_seq)

    def take_steps(self, load_settled_now: Callable[[], bool] | None) -> tuple[int, ...]:
        """The steps run since the last call (normally the current one). The current step is
        held back until a later call while its load (`load_settled_now`; None: no load) had not
        settled at the last report of failures (pop_load_settled)."""
        settled = self.pop_load_settled(load_settled_now)
        held = load_settled_now is not None and not settled and bool(self._steps)
        steps = self._steps[:-1] if held else self._steps
        self._steps = self._steps[-1:] if held else []
        return tuple(steps)
