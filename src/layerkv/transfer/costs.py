"""Running cost estimates for the planner (planner.py): the store's per-call and per-range
cost, its bandwidths, the local copy bandwidth and the compute time per layer and token, each a
least-squares fit of what transfers measured (`_Fit`), plus per plan kind the factors the model
leaves out. Fed only by `Planner.observe` (compute thread); `snapshot` is what plans read.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from layerkv.config import PlanMode


class PlanKind(NamedTuple):
    """A kind of load plan: its mode and how many concurrent calls each read uses."""

    mode: PlanMode
    lanes: int


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
    copy_bytes_per_s: float = 5.0e9  # staging scatter + tags (host memory)
    compute_per_layer_token_s: float = 2e-6  # compute of one layer for one token
    compute_per_layer_s: float = 50e-6  # compute of one layer whatever the tokens (a decode step's floor)
    weight: float = 0.2  # weight of each new sample (the fits forget old samples at 1 - weight)
    # per plan kind (mode, lanes): measured transfer time / modelled transfer time, what the model
    # leaves out (on a CPU-bound host per-layer reads compete with compute for the same cores)
    kind_factor: dict[PlanKind, float] = field(default_factory=dict)
    # per plan kind: measured step time / simulated finish (reads already corrected), what
    # neither the model nor the read factor sees: on a CPU host overlapping reads slow the compute
    finish_factor: dict[PlanKind, float] = field(default_factory=dict)
    finish_samples: dict[PlanKind, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _fits: dict[str, tuple[_Fit, tuple[float, ...]]] = field(default_factory=dict, repr=False, compare=False)

    def snapshot(self) -> Costs:
        """A copy with every fit solved for its samples so far (the planner reads only these)."""
        with self._lock:
            for name, (fit, prior) in self._fits.items():
                if fit.dirty:
                    for attr, unit in zip(_FIT_FIELDS[name], np.array(prior) * fit.solve()):
                        setattr(self, attr, 1 / float(unit) if attr.endswith("bytes_per_s") else float(unit))
            return dataclasses.replace(
                self,
                kind_factor=dict(self.kind_factor),
                finish_factor=dict(self.finish_factor),
                finish_samples=dict(self.finish_samples),
                _lock=threading.Lock(),
                _fits={},
            )

    def observe_ranges(self, seconds: float, num_calls: int, ranges_per_call: int, nbytes: int) -> None:
        """One (possibly concurrent) range read or write: `num_calls` calls of (at most)
        `ranges_per_call` ranges moving `nbytes` in all took `seconds`."""
        if seconds > 0 and ranges_per_call > 0:
            self._sample("ranges", (num_calls, ranges_per_call, num_calls * ranges_per_call, nbytes), seconds)

    def observe_whole(self, seconds: float, keys_per_call: int, nbytes: int) -> None:
        if seconds > 0 and keys_per_call > 0:
            self._sample("whole", (1, keys_per_call, nbytes), seconds)

    def observe_copy(self, seconds: float, nbytes: int) -> None:
        """A staging scatter (and its tags) of `nbytes`."""
        if seconds <= 0 or nbytes <= 0:
            return
        with self._lock:
            self.copy_bytes_per_s = _mix(self.copy_bytes_per_s, nbytes / seconds, self.weight)

    def observe_transfer(self, kind: PlanKind, modelled_s: float, seconds: float) -> None:
        """A load of plan kind `kind` read its last layer after `seconds`, where the cost model,
        refitted with that load's own calls, says `modelled_s` (`transfer_s`): the factor keeps
        only what the refitted model cannot explain (counting the fit's own error twice would
        condemn a kind for one slow first call)."""
        if seconds <= 0 or modelled_s <= 0:
            return
        with self._lock:
            ratio = min(4.0, max(0.25, seconds / modelled_s))  # one odd load moves it at most this far
            self.kind_factor[kind] = _mix(self.kind_factor.get(kind, 1.0), ratio, self.weight)

    def observe_finish(self, kind: PlanKind, simulated_s: float, seconds: float) -> None:
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

    def finish(self, kind: PlanKind) -> float:
        """`kind`'s finish factor; a kind not measured yet takes the mean of the measured kinds
        whose reads, like its own, run beside the compute (layer and group plans: what slows
        one such step slows the others; whole-object reads end before layer 0), else 1."""
        if kind in self.finish_factor:
            return self.finish_factor[kind]
        alike = [
            f for (mode, _), f in self.finish_factor.items() if (mode == PlanMode.WHOLE) == (kind[0] == PlanMode.WHOLE)
        ]
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


def _mix(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new
