"""Transfer plans: how one step's load reads its objects (layer by layer, in groups of layers
through host staging, or whole objects) and how many concurrent range calls it splits each read
into, chosen from measured costs by simulating the step. Pure functions of their inputs (the
tests pin the choices); `Costs` holds the running estimates the worker keeps. Any thread.

    model:  read(group of k layers) = lanes * call_s + ceil(N / lanes) * r * range_s + N * r * range_cpu_s
                                      + N * k * layer_nbytes / bytes_per_s        (+ staging copy)
            (N keys, r ranges per key: 1 for a staged group, K/V segments for a layer read)
            compute(layer)         = compute_per_layer_s + compute_per_layer_token_s * this step's tokens
            layer l may compute when its group has arrived and layer l-1 is done
            reads x the kind's (mode, lanes) measured / modelled transfer time
    choose: the plan whose predicted finish time is lowest (ties: fewer calls); every 4th plan
            while a plausible kind has < 2 samples, then every 16th, the plausible kind measured
            least recently (Exploration)

With little compute (a short suffix) the cheapest plan is few large reads (whole objects, or
layer 0 then everything else); with enough compute, groups that stay ahead of it hide the
transfer (TTFT ~ max(transfer, compute) instead of their sum).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from layerkv.config import PlanMode
from layerkv.transfer.costs import Costs, PlanKind

WHOLE, GROUPS, LAYERS = PlanMode.WHOLE, PlanMode.GROUPS, PlanMode.LAYERS


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step moves: `num_keys` objects of `num_layers` layers."""

    num_keys: int
    num_layers: int
    layer_nbytes: int  # bytes of one layer of one object (the widest layer)
    header_nbytes: int
    segments_per_layer: int  # ranges per key per layer when reading straight into the cache
    staging_ok: bool  # staged group and whole-object reads are possible
    direct_ok: bool = True  # the KV cache is registered: per-layer reads straight into it are possible


@dataclass(frozen=True, slots=True)
class LoadPlan:
    mode: PlanMode  # WHOLE, GROUPS or LAYERS
    group_ends: tuple[int, ...]  # exclusive end layer of each group (WHOLE: (num_layers,))
    lanes: int  # concurrent range calls per group read
    predicted_s: float = 0.0  # simulated time until the last layer is computed
    explored: bool = False  # chosen to measure a mode whose estimates were the oldest (Exploration)

    @property
    def kind(self) -> PlanKind:
        return PlanKind(self.mode, self.lanes)

    @property
    def reads_beside_compute(self) -> bool:
        """Per-layer and group reads run beside the step's compute; whole-object reads end before it."""
        return self.mode != WHOLE

    @property
    def label(self) -> str:
        sizes = [e - b for b, e in zip((0, *self.group_ends), self.group_ends)]
        return f"{self.mode}:{'+'.join(map(str, sizes))}x{self.lanes}"


def choose_lanes(num_keys: int, max_lanes: int, min_keys_per_lane: int = 8) -> int:
    """Concurrent calls for `num_keys` keys: at most `max_lanes`, at least `min_keys_per_lane`
    keys each (a lane's fixed cost must pay off)."""
    return max(1, min(max_lanes, num_keys // min_keys_per_lane))


def candidates(shape: StepShape, max_lanes: int, lanes: int | None = None) -> list[LoadPlan]:
    """Plans worth simulating: per layer straight into the cache (where it is registered);
    layer 0 then groups of 1, 2, 4, ... layers through staging (first group 1 or 2 layers);
    whole objects; each on one lane and on `choose_lanes` lanes (or on exactly `lanes`)."""
    L = shape.num_layers
    ends = [tuple(range(1, L + 1))]
    if shape.staging_ok:
        sizes = sorted({1 << i for i in range(max(1, math.ceil(math.log2(max(L, 1)))) + 1)} | {L})
        for first in (1, 2):
            if first > L:
                continue
            for size in sizes:
                group_ends = [first]
                while group_ends[-1] < L:
                    group_ends.append(min(L, group_ends[-1] + size))
                ends.append(tuple(group_ends))
    plans = []
    for n in (lanes,) if lanes else sorted({1, choose_lanes(shape.num_keys, max_lanes)}):
        if shape.direct_ok or not shape.staging_ok:
            plans.append(LoadPlan(LAYERS, ends[0], n))
        plans += [LoadPlan(GROUPS, e, n) for e in ends[1:]]
        if shape.staging_ok:
            plans.append(LoadPlan(WHOLE, (L,), n))
    return list({(p.mode, p.group_ends, p.lanes): p for p in plans}.values())


def simulate(plan: LoadPlan, shape: StepShape, costs: Costs, num_tokens: int) -> float:
    """Seconds from the start of the step until its last layer is computed under `plan` (its
    reads scaled by the kind's measured factor)."""
    return _simulate(plan, shape, costs, num_tokens)[1]


def transfer_s(plan: LoadPlan, shape: StepShape, costs: Costs) -> float:
    """Seconds until the last layer of `plan` is read, as the cost model alone says (no factor)."""
    return _simulate(plan, shape, costs, 1, factor=1.0)[0]


def _simulate(
    plan: LoadPlan, shape: StepShape, costs: Costs, num_tokens: int, factor: float | None = None
) -> tuple[float, float]:
    """(when the last layer is read, when it is computed)."""
    if factor is None:
        factor = costs.kind_factor.get(plan.kind, 1.0)
    N, lanes = shape.num_keys, plan.lanes
    keys_per_lane = math.ceil(N / lanes)
    compute_s = costs.compute_per_layer_s + costs.compute_per_layer_token_s * max(1, num_tokens)
    arrived, done, start_layer = 0.0, 0.0, 0
    for end in plan.group_ends:
        k = end - start_layer
        payload = N * k * shape.layer_nbytes + (N * shape.header_nbytes if start_layer == 0 else 0)
        if plan.mode == WHOLE:
            read = costs.whole_call_s + keys_per_lane * costs.whole_key_s + payload / costs.whole_bytes_per_s
        else:
            ranges = shape.segments_per_layer * k if plan.mode == LAYERS else 1
            read = (
                lanes * costs.call_s
                + keys_per_lane * ranges * costs.range_s
                + N * ranges * costs.range_cpu_s
                + payload / costs.bytes_per_s
            )
        copy = 0.0 if plan.mode == LAYERS else payload / costs.copy_bytes_per_s
        arrived += (read + copy) * factor
        for _ in range(k):
            done = max(done, arrived) + compute_s
        start_layer = end
    return arrived, done


def best_of_kinds(
    shape: StepShape, costs: Costs, num_tokens: int, max_lanes: int = 4, lanes: int | None = None
) -> dict[PlanKind, LoadPlan]:
    """Each kind's (mode, lanes) best candidate, with its predicted finish time (the simulation
    times the kind's finish factor; ties: fewer groups); with `lanes`, only plans on exactly
    that many lanes. In `plan_kinds` order."""
    best: dict[PlanKind, LoadPlan] = {}
    for plan in candidates(shape, max_lanes, lanes):
        kind = plan.kind
        t = simulate(plan, shape, costs, num_tokens) * costs.finish(kind)
        old = best.get(kind)
        if old is None or (t, len(plan.group_ends)) < (old.predicted_s * (1 - 1e-9), len(old.group_ends)):
            best[kind] = LoadPlan(plan.mode, plan.group_ends, plan.lanes, t)
    return best


def fastest(plans: Iterable[LoadPlan]) -> LoadPlan:
    """The plan predicted to finish first (ties: fewer groups, then fewer lanes)."""
    return min(plans, key=lambda p: (p.predicted_s, len(p.group_ends), p.lanes))


def choose_plan(
    shape: StepShape,
    costs: Costs,
    num_tokens: int,
    max_lanes: int = 4,
    kind: PlanKind | None = None,
    lanes: int | None = None,
) -> LoadPlan:
    """The candidate with the lowest predicted finish time; with `kind` (mode, lanes), the best
    candidate of that kind (if there is one); with `lanes`, only plans on that many lanes."""
    best = best_of_kinds(shape, costs, num_tokens, max_lanes, lanes)
    return best[kind] if kind in best else fastest(best.values())


def plan_kinds(shape: StepShape, max_lanes: int, lanes: int | None = None) -> tuple[PlanKind, ...]:
    """The (mode, lanes) pairs `candidates` offers, in a fixed order."""
    return tuple(dict.fromkeys(p.kind for p in candidates(shape, max_lanes, lanes)))


class Exploration:
    """Which kind of plan (mode, lanes) an auto plan must be: at each turn, among the kinds
    predicted within `plausible` x the fastest, the one measured least recently, so that no kind
    is judged forever by a few samples (the first whole-object read of a process paid for its
    buffer; a model fitted only on many small ranges on 4 lanes cannot tell per-range cost from
    bandwidth, nor whether lanes overlap). Turns come every `every` plans while a plausible kind
    has fewer than `min_samples` samples, then every `sampled_every` plans (a short run must not pay
    for exploring: 4-request demos and 24-request runs lost to the best fixed plan with a turn
    every 4th plan). Kinds predicted far slower are never forced (a forced whole-object read
    under a long suffix would give up all overlap). Call `kind_to_try` then `used` once per
    plan; compute thread only."""

    def __init__(self, every: int = 4, plausible: float = 1.5, min_samples: int = 2, sampled_every: int = 16) -> None:
        self.every = every
        self.plausible = plausible
        self.min_samples = min_samples
        self.sampled_every = sampled_every
        self.plans = 0
        self.last_used: dict[PlanKind, int] = {}  # kind -> number of the plan that last was one
        self.uses: dict[PlanKind, int] = {}  # kind -> plans that were one
        self.last_turn = -1  # number of the plan of the last turn

    def kind_to_try(self, predicted_s: Mapping[PlanKind, float]) -> PlanKind | None:
        """The kind the next plan must be, or None (the planner chooses freely); `predicted_s`:
        each kind's best predicted finish time, in a fixed order."""
        if self.every <= 0 or len(predicted_s) < 2:
            return None
        limit = self.plausible * min(predicted_s.values())
        kinds = [k for k, t in predicted_s.items() if t <= limit]
        sampled = all(self.uses.get(k, 0) >= self.min_samples for k in kinds)
        period = self.sampled_every if sampled else self.every
        if self.last_turn >= 0 and self.plans - self.last_turn < period:
            return None
        self.last_turn = self.plans
        return min(kinds, key=lambda k: (self.last_used.get(k, -1), kinds.index(k)))

    def used(self, kind: PlanKind) -> None:
        self.last_used[kind] = self.plans
        self.uses[kind] = self.uses.get(kind, 0) + 1
        self.plans += 1


@dataclass(slots=True)
class Measured:
    """The calls one load made, as the planner's fits take them: recorded by the job on the
    receive thread, handed to `Planner.observe` by the compute thread after the job finished."""

    ranges: list[tuple[float, int, int, int]] = field(default_factory=list)  # (s, calls, ranges per call, bytes)
    wholes: list[tuple[float, int, int]] = field(default_factory=list)  # (s, keys per call, bytes)
    copies: list[tuple[float, int]] = field(default_factory=list)  # (s, bytes) verified and copied out of staging


@dataclass(frozen=True, slots=True)
class StepTimes:
    """What one step measured, handed to `Planner.observe` once per step (compute thread)."""

    num_tokens: int  # tokens the step computed
    step_s: float  # from the step's start to its last layer computed
    wait_s: float = 0.0  # of it, waiting for layers to load
    compute_alone: bool = True  # no reads ran beside the compute (layer and group plans do)
    plan: LoadPlan | None = None  # the step's load plan, when its load read every layer it was asked for
    num_keys: int = 0  # objects that load read
    transfer_s: float = 0.0  # from the load's start to its last layer read (0: not every layer read)
    measured: Measured | None = None  # the calls of the step's load (a finished one)


COMPUTE_SAMPLE_FIRST, COMPUTE_SAMPLE_EVERY = 8, 32  # observe_idle's sampling


class Planner:
    """One worker's load planner: owns the running costs and the exploration turns, and is
    entered from two places only: `choose` a step's plan (the fixed knobs, or the fastest
    simulated plan with `mode` auto), and `observe` what a step measured. Compute thread."""

    def __init__(
        self,
        mode: PlanMode,
        shape: StepShape,
        *,
        lanes: int = 0,
        prefetch_layers: int | None = None,
        group_ends: tuple[int, ...] = (),
        exploration: Exploration | None = None,
    ) -> None:
        self.mode = PlanMode(mode)
        self.costs = Costs()
        self.exploration = exploration or Exploration()
        self.last_predictions: dict[str, float] = {}  # the last auto plan's best per kind (ms)
        self._idle_steps = 0  # steps that moved nothing, seen by observe_idle
        self._shape = shape  # the layout's part of every step's shape (num_keys 0)
        self._lanes = lanes  # 0: chosen per step
        self._prefetch = prefetch_layers
        self._group_ends = group_ends  # the fixed "groups" plan's

    def shape(self, num_keys: int) -> StepShape:
        return replace(self._shape, num_keys=num_keys)

    def choose(self, num_keys: int, num_tokens: int) -> tuple[LoadPlan, int | None]:
        """This step's load plan and read-ahead cap (None: none)."""
        L, lanes = self._shape.num_layers, self._lanes
        if self.mode == LAYERS:  # straight into the cache only where the cache is registered
            kind = LAYERS if self._shape.direct_ok else GROUPS
            return LoadPlan(kind, tuple(range(1, L + 1)), lanes or 1), self._prefetch
        if self.mode == GROUPS:
            return LoadPlan(GROUPS, self._group_ends, lanes or 1), self._prefetch
        if self.mode == WHOLE:
            return LoadPlan(WHOLE, (L,), lanes or choose_lanes(num_keys, 4)), None
        best = best_of_kinds(self.shape(num_keys), self.costs.snapshot(), num_tokens, lanes=lanes or None)
        self.last_predictions = {f"{m}x{n}": round(p.predicted_s * 1e3, 3) for (m, n), p in best.items()}
        trying = self.exploration.kind_to_try({kind: p.predicted_s for kind, p in best.items()})
        plan = fastest(best.values())
        explored = trying is not None and trying != plan.kind
        if trying is not None:
            plan = best[trying]
        self.exploration.used(plan.kind)
        return replace(plan, explored=explored), None

    def observe_idle(self, step: StepTimes) -> None:
        """A step that moved nothing (a decode step): its compute alone feeds the estimate for
        the first COMPUTE_SAMPLE_FIRST such steps, then one in COMPUTE_SAMPLE_EVERY (each refit
        costs tens of µs that an engine's decode steps need not pay every step)."""
        self._idle_steps += 1
        if self._idle_steps <= COMPUTE_SAMPLE_FIRST or self._idle_steps % COMPUTE_SAMPLE_EVERY == 0:
            self.observe(step)

    def observe(self, step: StepTimes) -> None:
        """Fold one step's measurements into the costs: its load's calls (the fits), its compute
        when no reads ran beside it (they slow it on a CPU host: their kind's finish factor, not
        every kind's compute), then for an auto plan its kind's corrections: the reads against
        the refitted model, and, once compute is measured, the step against the refitted
        simulation (before that the prior would condemn the kind for its own error)."""
        costs, measured = self.costs, step.measured
        if measured is not None:
            for call in measured.ranges:
                costs.observe_ranges(*call)
            for whole in measured.wholes:
                costs.observe_whole(*whole)
            for copy in measured.copies:
                costs.observe_copy(*copy)
        if step.compute_alone:
            costs.observe_compute(step.step_s - step.wait_s, self._shape.num_layers, step.num_tokens)
        plan = step.plan
        if plan is None or plan.predicted_s <= 0:
            return
        shape = self.shape(step.num_keys)
        if step.transfer_s > 0:
            costs.observe_transfer(plan.kind, transfer_s(plan, shape, costs.snapshot()), step.transfer_s)
        if step.step_s > 0 and step.num_tokens > 0 and costs.measured("compute"):
            costs.observe_finish(plan.kind, simulate(plan, shape, costs.snapshot(), step.num_tokens), step.step_s)
