"""One step of a worker (connector/worker.py), from its bind_connector_metadata to the next: the
step's plan, the load and save jobs started for it, the hand-off of its saved layers to the save
job (connector/handoff.py), whether a layer waited for its load (the per-layer hooks ran) and its
clock (when the forward began, how long it waited for layers). The worker starts a fresh one at
each bind. Compute thread only; the jobs it holds run on the transfer threads and are read here
through their own thread-safe state. Never raises: a step that ends early gives its jobs up.
"""

from __future__ import annotations

import time

from layerkv.connector.handoff import SaveHandoff
from layerkv.metadata import StepPlan
from layerkv.transfer.load import LoadJob
from layerkv.transfer.planner import StepTimes
from layerkv.transfer.save import SaveJob


class WorkerStep:
    __slots__ = ("plan", "load", "save", "handoff", "layer_waited", "start_s", "wait_s")

    def __init__(self, plan: StepPlan | None = None) -> None:
        self.plan = plan  # None: no metadata bound (the step transfers nothing)
        self.load: LoadJob | None = None  # started by start_load_kv
        self.save: SaveJob | None = None
        self.handoff = SaveHandoff()  # started with the save job; until then it hands nothing
        self.layer_waited = False  # wait_for_layer_load waited for a layer of this step's load
        self.start_s = 0.0  # perf_counter when the forward began (start_load_kv); 0: not begun
        self.wait_s = 0.0  # seconds this step waited for layers

    def begin(self) -> None:
        """start_load_kv: the forward begins now."""
        self.start_s, self.wait_s = time.perf_counter(), 0.0

    def elapsed_s(self) -> float:
        """Seconds since the forward began; 0.0 when it never began."""
        return time.perf_counter() - self.start_s if self.start_s else 0.0

    def jobs(self) -> list[LoadJob | SaveJob]:
        return [j for j in (self.load, self.save) if j is not None]

    def unwaited_block_ids(self) -> set[int]:
        """Blocks of this step's load that attention ran over without waiting for them (a CUDA
        graph replay ran no per-layer hook, connector/graphs.py): the engine must recompute them.
        None when a layer waited or the plan loaded first; asynchronous loads need no wait."""
        plan = self.plan
        if self.load is None or plan is None or self.layer_waited or plan.loads_first:
            return set()
        return plan.load_block_ids(skip_req_ids=plan.async_req_ids)

    def times(self, step_s: float, compute_alone: bool) -> StepTimes:
        """What this step measured, for the planner: its load's only once that load finished (its
        calls; its plan and transfer time when it read every layer, not cancelled)."""
        assert self.plan is not None
        load, num_tokens = self.load, self.plan.num_tokens
        if load is None or not load.finished:
            return StepTimes(num_tokens, step_s, self.wait_s, compute_alone)
        read_all = not load.cancelled
        return StepTimes(
            num_tokens,
            step_s,
            self.wait_s,
            compute_alone,
            load.plan if read_all else None,
            len(load.keys),
            load.outcome.transfer_s if read_all else 0.0,
            load.outcome.measured,
        )

    def end(self) -> list[LoadJob | SaveJob]:
        """The step is over (the next bind, clear_connector_metadata, shutdown): a load still
        running is given up (its blocks are not used), a save that still reads the cache is
        cancelled (it revokes). Returns the jobs, forgotten here: one still running is for the
        worker's ledger to collect when it finishes."""
        if self.load is not None and not self.load.finished:
            self.load.give_up("the step ended before its loads finished")
        elif self.load is not None:
            self.load.order_compute()  # a layer nobody waited for: its device copies still come first
        if self.save is not None and not self.save.released:
            self.save.cancel()
        jobs = self.jobs()
        self.load = self.save = None
        return jobs
