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
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

WHOLE = "whole"  # one whole-object read per key into staging, then scatter (no session)
GROUPS = "groups"  # layer groups, one range per key per group, through staging
LAYERS = "layers"  # one range call per layer straight into the cache (no staging; register_kv_cache only)


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
    mode: str  # WHOLE, GROUPS or LAYERS
    group_ends: tuple[int, ...]  # exclusive end layer of each group (WHOLE: (num_layers,))
    lanes: int  # concurrent range calls per group read
    predicted_s: float = 0.0  # simulated time until the last layer is computed
    explored: bool = False  # chosen to measure a mode whose estimates were the oldest (Exploration)

    @property
    def reads_beside_compute(self) -> bool:
        """Per-layer and group reads run beside the step's compute; whole-object reads end before it."""
        return self.mode != WHOLE

    @property
    def label(self) -> str:
        sizes = [e - b for b, e in zip((0, *self.group_ends), self.group_ends)]
        return f"{self.mode}:{'+'.join(map(str, sizes))}x{self.lanes}"


class _Fit:
    """seconds ~ m . components, where the components are what the defaults predict for each
    term (fixed, per range or per key, per byte) of one call: exponentially forgetting least
    squares on the *relative* error, pulled towards m = 1 (the defaults) by a small ridge (a
    fraction of each term's own weight in the data, so a term the defaults think small can still
    grow to what is measured; a term the data never exercise stays at its default). Relative
    error makes one stalled call nearly weightless (its error stays ~-1 whatever m is) and lets
    calls of different shapes (few large ranges, many small ones) separate the per-range cost
    from the bandwidth, which one scale factor per sample cannot."""

    def __init__(self, size: int, forget: float, ridge: float = 0.05) -> None:
        self.forget = forget
        self.ridge = ridge
        self.gram = np.zeros((size, size))
        self.rhs = np.zeros(size)
        self.dirty = False

    def update(self, components: np.ndarray, seconds: float) -> None:
        """One sample; cheap (the receive thread calls it once per range call): `solve` later."""
        row = components / seconds
        self.gram = self.forget * self.gram + np.outer(row, row)
        self.rhs = self.forget * self.rhs + row
        self.dirty = True

    def solve(self) -> np.ndarray:
        ridge = self.ridge * np.diag(self.gram) + 1e-9  # relative to each term's weight in the data
        m = np.linalg.solve(self.gram + np.diag(ridge), self.rhs + ridge)
        self.dirty = False
        return np.clip(m, 1 / 50, 50)


# the per-unit costs each fit of `Costs` scales, in the order of its terms (bandwidths kept as
# seconds per byte in the fit)
_FIT_FIELDS = {
    "ranges": ("call_s", "range_s", "range_cpu_s", "bytes_per_s"),
    "whole": ("whole_call_s", "whole_key_s", "whole_bytes_per_s"),
    "compute": ("compute_per_layer_s", "compute_per_layer_token_s"),
}


@dataclass(slots=True)
class Costs:
    """Running estimates of the store's per-call and per-range cost, its bandwidth, the local copy
    bandwidth and the compute time per layer per token. Starts from values measured on Mooncake
    over TCP loopback; every transfer refits them (`_Fit`), so plans follow what this machine
    and transport do."""

    call_s: float = 100e-6  # fixed cost of one range call (concurrent calls each pay it)
    range_s: float = 10e-6  # cost of each range within a call that concurrent calls overlap
    range_cpu_s: float = 30e-6  # cost of each range that concurrent calls do not overlap (measured here: most of it)
    bytes_per_s: float = 1.5e9  # range payload bandwidth
    whole_call_s: float = 150e-6  # fixed cost of one whole-object read call (includes the master lookup)
    whole_key_s: float = 20e-6  # per object of a whole-object read
    whole_bytes_per_s: float = 2.0e9
    copy_bytes_per_s: float = 5.0e9  # staging scatter + checksum (host memory)
    compute_per_layer_token_s: float = 2e-6  # compute of one layer for one token
    compute_per_layer_s: float = 50e-6  # compute of one layer whatever the tokens (a decode step's floor)
    weight: float = 0.2  # weight of each new sample (the fits forget old samples at 1 - weight)
    # per plan kind (mode, lanes): measured transfer time / modelled transfer time, what the model
    # leaves out (on a CPU-bound host per-layer reads compete with compute for the same cores)
    kind_factor: dict[tuple[str, int], float] = field(default_factory=dict)
    # per plan kind: measured step time / simulated finish (reads already corrected), what
    # neither the model nor the read factor sees: on a CPU host overlapping reads slow the compute
    finish_factor: dict[tuple[str, int], float] = field(default_factory=dict)
    finish_samples: dict[tuple[str, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _fits: dict[str, tuple[_Fit, tuple[float, ...]]] = field(default_factory=dict, repr=False, compare=False)

    def snapshot(self) -> Costs:
        """A copy with every fit solved for its samples so far (the planner reads only these)."""
        with self._lock:
            for name, (fit, prior) in self._fits.items():
                if fit.dirty:
                    for attr, unit in zip(_FIT_FIELDS[name], np.array(prior) * fit.solve()):
                        setattr(self, attr, 1 / float(unit) if attr.endswith("bytes_per_s") else float(unit))
            return Costs(self.call_s, self.range_s, self.range_cpu_s, self.bytes_per_s, self.whole_call_s, self.whole_key_s,
                         self.whole_bytes_per_s, self.copy_bytes_per_s, self.compute_per_layer_token_s,
                         self.compute_per_layer_s, self.weight, kind_factor=dict(self.kind_factor),
                         finish_factor=dict(self.finish_factor), finish_samples=dict(self.finish_samples))

    def observe_ranges(self, seconds: float, num_calls: int, ranges_per_call: int, nbytes: int) -> None:
        """One (possibly concurrent) range read or write: `num_calls` calls of (at most)
        `ranges_per_call` ranges moving `nbytes` in all took `seconds`."""
        if seconds > 0 and ranges_per_call > 0:
            self._sample("ranges", (num_calls, ranges_per_call, num_calls * ranges_per_call, nbytes), seconds)

    def observe_whole(self, seconds: float, keys_per_call: int, nbytes: int) -> None:
        if seconds > 0 and keys_per_call > 0:
            self._sample("whole", (1, keys_per_call, nbytes), seconds)

    def observe_copy(self, seconds: float, nbytes: int) -> None:
        """A staging scatter (and its checksums) of `nbytes`."""
        if seconds <= 0 or nbytes <= 0:
            return
        with self._lock:
            self.copy_bytes_per_s = _mix(self.copy_bytes_per_s, nbytes / seconds, self.weight)

    def observe_transfer(self, kind: tuple[str, int], modelled_s: float, seconds: float) -> None:
        """A load of plan kind `kind` read its last layer after `seconds`, where the cost model,
        refitted with that load's own calls, says `modelled_s` (`transfer_s`): the factor keeps
        only what the refitted model cannot explain (counting the fit's own error twice would
        condemn a kind for one slow first call)."""
        if seconds <= 0 or modelled_s <= 0:
            return
        with self._lock:
            ratio = min(4.0, max(0.25, seconds / modelled_s))  # one odd load moves it at most this far
            self.kind_factor[kind] = _mix(self.kind_factor.get(kind, 1.0), ratio, self.weight)

    def observe_finish(self, kind: tuple[str, int], simulated_s: float, seconds: float) -> None:
        """A step whose load was of kind `kind` computed its last layer after `seconds`, where
        the refitted model (reads corrected by their factor) says `simulated_s`. The factor is
        the mean of a kind's first steps (the prior 1 is no measurement), then forgets at
        `weight`; one odd step moves it at most 4x."""
        if seconds <= 0 or simulated_s <= 0:
            return
        with self._lock:
            ratio = min(4.0, max(0.25, seconds / simulated_s))
            n = self.finish_samples.get(kind, 0) + 1
            self.finish_samples[kind] = n
            self.finish_factor[kind] = _mix(self.finish_factor.get(kind, 1.0), ratio, max(self.weight, 1 / n))

    def finish(self, kind: tuple[str, int]) -> float:
        """`kind`'s finish factor; a kind not measured yet takes the mean of the measured kinds
        whose reads, like its own, run beside the compute (layer and group plans: what slows
        one such step slows the others; whole-object reads end before layer 0), else 1."""
        if kind in self.finish_factor:
            return self.finish_factor[kind]
        alike = [f for (mode, _), f in self.finish_factor.items() if (mode == WHOLE) == (kind[0] == WHOLE)]
        return sum(alike) / len(alike) if alike else 1.0

    def measured(self, name: str) -> bool:
        """Some sample of `name` ("ranges", "whole", "compute") has been seen."""
        with self._lock:
            return name in self._fits

    def observe_compute(self, seconds: float, num_layers: int, num_tokens: int) -> None:
        # fixed + per token: a 1-token decode step's time must not read as a per-token cost
        if seconds > 0 and num_layers > 0 and num_tokens > 0:
            self._sample("compute", (num_layers, num_layers * num_tokens), seconds)

    def _sample(self, name: str, counts: tuple[float, ...], seconds: float) -> None:
        """One (possibly concurrent) call of `counts` units of `name`'s terms (fixed, per range or
        key, ..., per byte) took `seconds`; the per-unit costs are refitted at the next snapshot."""
        with self._lock:
            if name not in self._fits:  # the estimates when the first sample comes are the prior
                self._fits[name] = (_Fit(len(counts), 1 - self.weight), self._units(name))
            fit, prior = self._fits[name]
            fit.update(np.array(prior) * np.array(counts, dtype=float), seconds)

    def _units(self, name: str) -> tuple[float, ...]:
        return tuple(1 / getattr(self, a) if a.endswith("bytes_per_s") else getattr(self, a) for a in _FIT_FIELDS[name])


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


def _simulate(plan: LoadPlan, shape: StepShape, costs: Costs, num_tokens: int, factor: float | None = None) -> tuple[float, float]:
    """(when the last layer is read, when it is computed)."""
    if factor is None:
        factor = costs.kind_factor.get((plan.mode, plan.lanes), 1.0)
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
            read = (lanes * costs.call_s + keys_per_lane * ranges * costs.range_s + N * ranges * costs.range_cpu_s
                    + payload / costs.bytes_per_s)
        copy = 0.0 if plan.mode == LAYERS else payload / costs.copy_bytes_per_s
        arrived += (read + copy) * factor
        for _ in range(k):
            done = max(done, arrived) + compute_s
        start_layer = end
    return arrived, done


def best_of_kinds(shape: StepShape, costs: Costs, num_tokens: int, max_lanes: int = 4,
                  lanes: int | None = None) -> dict[tuple[str, int], LoadPlan]:
    """Each kind's (mode, lanes) best candidate, with its predicted finish time (the simulation
    times the kind's finish factor; ties: fewer groups); with `lanes`, only plans on exactly
    that many lanes. In `plan_kinds` order."""
    best: dict[tuple[str, int], LoadPlan] = {}
    for plan in candidates(shape, max_lanes, lanes):
        kind = (plan.mode, plan.lanes)
        t = simulate(plan, shape, costs, num_tokens) * costs.finish(kind)
        old = best.get(kind)
        if old is None or (t, len(plan.group_ends)) < (old.predicted_s * (1 - 1e-9), len(old.group_ends)):
            best[kind] = LoadPlan(plan.mode, plan.group_ends, plan.lanes, t)
    return best


def fastest(plans: Iterable[LoadPlan]) -> LoadPlan:
    """The plan predicted to finish first (ties: fewer groups, then fewer lanes)."""
    return min(plans, key=lambda p: (p.predicted_s, len(p.group_ends), p.lanes))


def choose_plan(shape: StepShape, costs: Costs, num_tokens: int, max_lanes: int = 4,
                kind: tuple[str, int] | None = None, lanes: int | None = None) -> LoadPlan:
    """The candidate with the lowest predicted finish time; with `kind` (mode, lanes), the best
    candidate of that kind (if there is one); with `lanes`, only plans on that many lanes."""
    best = best_of_kinds(shape, costs, num_tokens, max_lanes, lanes)
    return best[kind] if kind in best else fastest(best.values())


def plan_kinds(shape: StepShape, max_lanes: int, lanes: int | None = None) -> tuple[tuple[str, int], ...]:
    """The (mode, lanes) pairs `candidates` offers, in a fixed order."""
    return tuple(dict.fromkeys((p.mode, p.lanes) for p in candidates(shape, max_lanes, lanes)))


class Exploration:
    """Which kind of plan (mode, lanes) an auto plan must be: at each turn, among the kinds
    predicted within `plausible` x the fastest, the one measured least recently, so that no kind
    is judged forever by a few samples (the first whole-object read of a process paid for its
    buffer; a model fitted only on many small ranges on 4 lanes cannot tell per-range cost from
    bandwidth, nor whether lanes overlap). Turns come every `every` plans while a plausible kind
    has fewer than `settle` samples, then every `settled_every` plans (a short run must not pay
    for exploring: 4-request demos and 24-request runs lost to the best fixed plan with a turn
    every 4th plan). Kinds predicted far slower are never forced (a forced whole-object read
    under a long suffix would give up all overlap). Call `kind_to_try` then `used` once per
    plan; compute thread only."""

    def __init__(self, every: int = 4, plausible: float = 1.5, settle: int = 2, settled_every: int = 16) -> None:
        self.every = every
        self.plausible = plausible
        self.settle = settle
        self.settled_every = settled_every
        self.plans = 0
        self.last_used: dict[tuple[str, int], int] = {}  # kind -> number of the plan that last was one
        self.uses: dict[tuple[str, int], int] = {}  # kind -> plans that were one
        self.last_turn = -1  # number of the plan of the last turn

    def kind_to_try(self, predicted_s: Mapping[tuple[str, int], float]) -> tuple[str, int] | None:
        """The kind the next plan must be, or None (the planner chooses freely); `predicted_s`:
        each kind's best predicted finish time, in a fixed order."""
        if self.every <= 0 or len(predicted_s) < 2:
            return None
        limit = self.plausible * min(predicted_s.values())
        kinds = [k for k, t in predicted_s.items() if t <= limit]
        settled = all(self.uses.get(k, 0) >= self.settle for k in kinds)
        period = self.settled_every if settled else self.every
        if self.last_turn >= 0 and self.plans - self.last_turn < period:
            return None
        self.last_turn = self.plans
        return min(kinds, key=lambda k: (self.last_used.get(k, -1), kinds.index(k)))

    def used(self, kind: tuple[str, int]) -> None:
        self.last_used[kind] = self.plans
        self.uses[kind] = self.uses.get(kind, 0) + 1
        self.plans += 1


def _mix(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


