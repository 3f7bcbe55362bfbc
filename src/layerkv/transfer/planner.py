"""Transfer plans: how one step's load reads its objects (layer by layer, in groups of layers
through host staging, or whole objects) and how many concurrent range calls it splits each read
into, chosen from measured costs by simulating the step. Pure functions of their inputs (the
tests pin the choices); `Costs` holds the running estimates the worker keeps. Any thread.

    model:  read(group of k layers) = call_s + ceil(N / lanes) * range_s + N * k * layer_nbytes / bytes_per_s
            compute(layer)         = compute_per_layer_s (this step's tokens)
            layer l may compute when its group has arrived and layer l-1 is done
    choose: the plan whose simulated finish time is lowest (ties: fewer calls)

With little compute (a short suffix) the cheapest plan is few large reads (whole objects, or
layer 0 then everything else); with enough compute, groups that stay ahead of it hide the
transfer (TTFT ~ max(transfer, compute) instead of their sum).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

WHOLE = "whole"  # one whole-object read per key into staging, then scatter (no session)
GROUPS = "groups"  # layer groups, one range per key per group, through staging
LAYERS = "layers"  # one range call per layer straight into the cache (no staging)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step moves: `num_keys` objects of `num_layers` layers."""

    num_keys: int
    num_layers: int
    layer_nbytes: int  # bytes of one layer of one object (the widest layer)
    header_nbytes: int
    segments_per_layer: int  # ranges per key per layer when reading straight into the cache
    staging_ok: bool  # host caches: staged group and whole-object reads are possible


@dataclass(frozen=True, slots=True)
class LoadPlan:
    mode: str  # WHOLE, GROUPS or LAYERS
    group_ends: tuple[int, ...]  # exclusive end layer of each group (WHOLE: (num_layers,))
    lanes: int  # concurrent range calls per group read
    predicted_s: float = 0.0  # simulated time until the last layer is computed

    @property
    def label(self) -> str:
        sizes = [e - b for b, e in zip((0, *self.group_ends), self.group_ends)]
        return f"{self.mode}:{'+'.join(map(str, sizes))}x{self.lanes}"


@dataclass(slots=True)
class Costs:
    """Running estimates (exponentially weighted) of the store's per-call and per-range cost,
    its bandwidth, the local copy bandwidth and the compute time per layer per token. Starts
    from values measured on Mooncake over TCP loopback; updated by every transfer."""

    call_s: float = 100e-6  # fixed cost of one range call
    range_s: float = 40e-6  # cost of each range within a call (serial in Mooncake's TCP transport)
    bytes_per_s: float = 1.5e9  # range payload bandwidth
    whole_call_s: float = 150e-6  # fixed cost of one whole-object read call (includes the master lookup)
    whole_key_s: float = 20e-6  # per object of a whole-object read
    whole_bytes_per_s: float = 2.0e9
    copy_bytes_per_s: float = 5.0e9  # staging scatter + checksum (host memory)
    compute_per_layer_token_s: float = 2e-6  # compute of one layer for one token
    weight: float = 0.2  # weight of each new sample
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> Costs:
        with self._lock:
            return Costs(self.call_s, self.range_s, self.bytes_per_s, self.whole_call_s, self.whole_key_s,
                         self.whole_bytes_per_s, self.copy_bytes_per_s, self.compute_per_layer_token_s, self.weight)

    def observe_ranges(self, seconds: float, num_calls: int, ranges_per_call: int, nbytes: int) -> None:
        """One (possibly concurrent) range read or write: `num_calls` calls of
        `ranges_per_call` ranges moving `nbytes` in all took `seconds`."""
        if seconds <= 0 or ranges_per_call <= 0:
            return
        with self._lock:
            predicted = self.call_s + ranges_per_call * self.range_s + nbytes / self.bytes_per_s
            scale = _clamp(seconds / predicted)  # one factor for latency and bandwidth alike
            self.range_s = _mix(self.range_s, self.range_s * scale, self.weight)
            self.call_s = _mix(self.call_s, self.call_s * scale, self.weight)
            self.bytes_per_s = _mix(self.bytes_per_s, self.bytes_per_s / scale, self.weight)

    def observe_whole(self, seconds: float, keys_per_call: int, nbytes: int) -> None:
        if seconds <= 0 or keys_per_call <= 0:
            return
        with self._lock:
            predicted = self.whole_call_s + keys_per_call * self.whole_key_s + nbytes / self.whole_bytes_per_s
            scale = _clamp(seconds / predicted)
            self.whole_key_s = _mix(self.whole_key_s, self.whole_key_s * scale, self.weight)
            self.whole_call_s = _mix(self.whole_call_s, self.whole_call_s * scale, self.weight)
            self.whole_bytes_per_s = _mix(self.whole_bytes_per_s, self.whole_bytes_per_s / scale, self.weight)

    def observe_compute(self, seconds: float, num_layers: int, num_tokens: int) -> None:
        if seconds <= 0 or num_layers <= 0 or num_tokens <= 0:
            return
        with self._lock:
            self.compute_per_layer_token_s = _mix(self.compute_per_layer_token_s, seconds / (num_layers * num_tokens), self.weight)


def choose_lanes(num_keys: int, max_lanes: int, min_keys_per_lane: int = 8) -> int:
    """Concurrent calls for `num_keys` keys: at most `max_lanes`, at least `min_keys_per_lane`
    keys each (a lane's fixed cost must pay off)."""
    return max(1, min(max_lanes, num_keys // min_keys_per_lane))


def candidates(shape: StepShape, max_lanes: int) -> list[LoadPlan]:
    """Plans worth simulating: per layer; layer 0 then groups of 1, 2, 4, ... layers (first
    group 1 or 2 layers); whole objects."""
    L = shape.num_layers
    lanes = choose_lanes(shape.num_keys, max_lanes)
    plans = [LoadPlan(LAYERS, tuple(range(1, L + 1)), lanes)]
    if not shape.staging_ok:
        return plans
    sizes = sorted({1 << i for i in range(max(1, math.ceil(math.log2(max(L, 1)))) + 1)} | {L})
    for first in (1, 2):
        if first > L:
            continue
        for size in sizes:
            ends = [first]
            while ends[-1] < L:
                ends.append(min(L, ends[-1] + size))
            plans.append(LoadPlan(GROUPS, tuple(ends), lanes))
    plans.append(LoadPlan(WHOLE, (L,), lanes))
    return list({p.group_ends + (p.mode,): p for p in plans}.values())


def simulate(plan: LoadPlan, shape: StepShape, costs: Costs, num_tokens: int) -> float:
    """Seconds from the start of the step until its last layer is computed under `plan`."""
    N, lanes = shape.num_keys, plan.lanes
    keys_per_lane = math.ceil(N / lanes)
    compute_s = costs.compute_per_layer_token_s * max(1, num_tokens)
    arrived, done, start_layer = 0.0, 0.0, 0
    for end in plan.group_ends:
        k = end - start_layer
        payload = N * k * shape.layer_nbytes + (N * shape.header_nbytes if start_layer == 0 else 0)
        if plan.mode == WHOLE:
            read = costs.whole_call_s + keys_per_lane * costs.whole_key_s + payload / costs.whole_bytes_per_s
        else:
            ranges = shape.segments_per_layer * k if plan.mode == LAYERS else 1
            read = costs.call_s + keys_per_lane * ranges * costs.range_s + payload / costs.bytes_per_s
        copy = 0.0 if plan.mode == LAYERS else payload / costs.copy_bytes_per_s
        arrived += read + copy
        for _ in range(k):
            done = max(done, arrived) + compute_s
        start_layer = end
    return done


def choose_plan(shape: StepShape, costs: Costs, num_tokens: int, max_lanes: int = 4) -> LoadPlan:
    """The candidate with the lowest simulated finish time (ties: fewer groups)."""
    best: LoadPlan | None = None
    for plan in candidates(shape, max_lanes):
        t = simulate(plan, shape, costs, num_tokens)
        scored = LoadPlan(plan.mode, plan.group_ends, plan.lanes, t)
        if best is None or (t, len(plan.group_ends)) < (best.predicted_s * (1 - 1e-9), len(best.group_ends)):
            best = scored
    assert best is not None
    return best


def _mix(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


def _clamp(scale: float) -> float:
    return min(4.0, max(0.25, scale))  # one odd sample moves the estimate at most 4x
