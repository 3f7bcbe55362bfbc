"""What the pool holds, as events for KV-aware routers (vLLM's KV cache events carry them):
a block is stored once its step's verdict commits its objects (never when planned: a revoked
save was never readable), removed when a load of it failed (the pool lost it, or it failed its
checks), and all are cleared at a cache reset (a new epoch: nothing before is served). Scheduler
side, the scheduler thread only; engine-neutral (integrations/vllm/events.py makes vLLM's)."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from layerkv.messages import BlockHash, ReqId
from layerkv.metadata import BlockSpec, StepVerdict

# Events not taken by then are dropped, oldest first (an engine that never takes them, or a
# router that fell behind: it resyncs from the next ones, as from any lost event).
MAX_EVENTS = 4096


class PoolEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # every block this engine announced (a cache reset)


@dataclass(frozen=True, slots=True)
class PoolEvent:
    kind: PoolEventKind
    req_id: ReqId  # who saved (stored) or loaded (removed) them; "" for CLEARED
    block_hashes: tuple[BlockHash, ...] = ()


class PoolEvents:
    """The events of the steps since the last `take`: fed the saves of each planned step, the
    verdicts as they are decided, the loads of each plan and the blocks that failed to load."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self._saving: dict[int, tuple[BlockSpec, ...]] = {}  # step seq -> its saves, until its verdict
        self._loading: dict[int, tuple[ReqId, BlockHash]] = {}  # block id -> what the latest plans load
        self._earlier_loading: dict[int, tuple[ReqId, BlockHash]] = {}  # the plan's before (async reports)
        self._queue: deque[PoolEvent] = deque(maxlen=max_events)

    def planned(self, step_seq: int, loads: Sequence[BlockSpec], saves: Sequence[BlockSpec]) -> None:
        if saves:
            self._saving[step_seq] = tuple(saves)
        self._earlier_loading = self._loading
        self._loading = {b: (spec.req_id, h) for spec in loads for h, b in zip(spec.block_hashes, spec.block_ids)}

    def decided(self, verdicts: Sequence[StepVerdict]) -> list[BlockSpec]:
        """Verdicts a plan carries now: the committed requests' blocks are stored (returned)."""
        stored = []
        for verdict in verdicts:
            for spec in self._saving.pop(verdict.step_seq, ()):
                if not verdict.revokes(spec.req_id):
                    self._queue.append(PoolEvent(PoolEventKind.STORED, spec.req_id, spec.block_hashes))
                    stored.append(spec)
        return stored

    def failed(self, invalid_block_ids: AbstractSet[int]) -> None:
        """Blocks whose load failed: the pool does not hold them (readably) any more."""
        by_req: dict[ReqId, list[BlockHash]] = {}
        for block_id in sorted(invalid_block_ids):
            found = self._loading.get(block_id) or self._earlier_loading.get(block_id)
            if found is not None:
                by_req.setdefault(found[0], []).append(found[1])
        for req_id, hashes in by_req.items():
            self._queue.append(PoolEvent(PoolEventKind.REMOVED, req_id, tuple(dict.fromkeys(hashes))))

    def cleared(self) -> None:
        """A cache reset: what waits for a verdict is of the old epoch (never announced)."""
        self._saving.clear()
        self._loading, self._earlier_loading = {}, {}
        self._queue.append(PoolEvent(PoolEventKind.CLEARED, ""))

    def take(self) -> list[PoolEvent]:
        taken = list(self._queue)
        self._queue.clear()
        return taken
