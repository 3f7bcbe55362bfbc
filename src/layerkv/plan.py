"""The per-step metadata the scheduler side hands every worker: which blocks each request
loads from the pool and which new full blocks it saves. Plain frozen dataclasses, picklable;
built on the scheduler thread, read on the worker's compute and transfer threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerkv.messages import BlockHash, ReqId


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Blocks of one request: parallel tuples of pool block hashes and local block ids."""

    req_id: ReqId
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.block_ids), "hashes and block ids must pair up"

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step's transfer plan (the connector metadata)."""

    loads: tuple[BlockSpec, ...] = ()
    saves: tuple[BlockSpec, ...] = ()
    # Requests that left the engine (finished, aborted, preempted) since the last step: the
    # worker releases their sessions and forgets them.
    ended_req_ids: frozenset[ReqId] = field(default_factory=frozenset)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.ended_req_ids
