"""The per-step metadata the scheduler side hands every worker: which blocks each request
loads from the pool, which new full blocks it saves, and the verdicts on earlier steps' saves
(commit, or revoke what tainted requests wrote). Plain frozen dataclasses, picklable; built on
the scheduler thread, read on the worker's compute and transfer threads.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from layerkv.messages import BlockHash, ReqId


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Blocks of one request: parallel tuples of pool block hashes and local block ids."""

    req_id: ReqId
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    # loads: per block, the tenant key (index in the key file) the pool holds it under; () = all
    # the current key's (0), as every save is
    generations: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.block_ids), "hashes and block ids must pair up"
        assert not self.generations or len(self.generations) == len(self.block_ids), "one generation per block"

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """The decision on the put sessions an earlier step left open, taken once every worker of
    every rank and stage reported that step: commit them, except those owned by a tainted
    request (its load failed on some rank or stage, or its block table held a block whose load
    failed), which are revoked. `revoke_all`: the step's outcome cannot be known (a worker's
    report never came): revoke everything."""

    step_seq: int
    tainted_req_ids: frozenset[ReqId] = field(default_factory=frozenset)
    revoke_all: bool = False

    def revokes(self, req_id: ReqId) -> bool:
        return self.revoke_all or req_id in self.tainted_req_ids


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step's transfer plan (the connector metadata)."""

    step_seq: int = 0  # numbers the step; workers report it back (WorkerReport.reported_steps)
    num_tokens: int = 0  # tokens the engine computes in this step (the transfer planner's compute estimate)
    loads: tuple[BlockSpec, ...] = ()
    saves: tuple[BlockSpec, ...] = ()
    # Requests that left the engine (finished, aborted, preempted) since the last step.
    ended_req_ids: frozenset[ReqId] = field(default_factory=frozenset)
    # Verdicts on earlier steps' open put sessions, applied before this step's saves start.
    verdicts: tuple[StepVerdict, ...] = ()
    # Blocks whose load failed earlier and that a request of this step attends to without
    # rewriting them (vLLM keeps such a block in its prefix cache): every worker reports them
    # invalid again, so the engine recomputes them and this step's saves over them are revoked.
    reinvalidate: frozenset[int] = field(default_factory=frozenset)
    # The namespaces' epoch ("" until the first reset_cache): workers name this step's objects by it.
    epoch: str = ""
    # Loads no attention layer waits for (connector/graphs.py): `loads_first`, a request of this step
    # computes so few tokens over its hit that vLLM may replay the step as one CUDA graph (no per-layer
    # hook runs): start_load_kv returns once every layer landed; `async_req_ids`, requests loaded before
    # their first step (0 tokens scheduled in this one; connector/async_loads.py).
    loads_first: bool = False
    async_req_ids: frozenset[ReqId] = field(default_factory=frozenset)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.ended_req_ids or self.verdicts or self.reinvalidate)

    def load_block_ids(self, skip_req_ids: AbstractSet[ReqId] = frozenset()) -> set[int]:
        """The local blocks this plan loads (what the engine recomputes when they fail), less
        those of the requests in `skip_req_ids`."""
        return {b for spec in self.loads if spec.req_id not in skip_req_ids for b in spec.block_ids}
