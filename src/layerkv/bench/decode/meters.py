"""Suite `decode`'s meters and what they make of a run: per-method host timers installed on ONE
connector instance (an instance attribute shadows the class's method, so every caller — vLLM's
scheduler, its `ActiveKVConnector`, the per-layer `maybe_transfer_kv_layer` wrapper — goes
through it), per-thread call counters installed on one store object, and the table rows made
from the per-step samples. A timer is read and reset by the driver thread between steps; a
counter is bumped by any thread (one lock) and read by the driver.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerkv.bench.common import Row
from layerkv.bench.decode.engine import StepTimes
from layerkv.store.base import STORE_CALLS

# Hooks a KVConnectorBase_V1 subclass may implement, by the role that calls them; timed when the
# instance has them. Setup-time and one-off hooks (register_kv_caches, shutdown, ...) are left out.
SCHEDULER_HOOKS: tuple[str, ...] = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "may_load_async",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_kv_connector_stats",
    "get_loaded_kv_cache_group_ids",
    "get_finished_count",
)
WORKER_HOOKS: tuple[str, ...] = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "has_connector_metadata",
    "wait_for_layer_load",
    "save_kv_layer",
    "finish_forward",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
STORE_METHODS: tuple[str, ...] = tuple(STORE_CALLS)  # the KVStore protocol's calls (CheckedStore implements them)


@dataclass(slots=True)
class MethodTotals:
    """What a timer saw since its last `take()`: the outermost calls' ns summed (a hook that
    calls another timed hook of the same instance is counted once), and per method the calls
    and inclusive ns."""

    ns: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    method_ns: Counter[str] = field(default_factory=Counter)
    other_thread_calls: int = 0  # calls not on the driver thread (not timed)


class MethodTimer:
    """Times `names` on `obj` (those it has) with perf_counter_ns. Driver thread: the hooks are
    expected there (vLLM's engine-core thread and model-runner thread are both the driver here);
    a call from another thread runs untimed and is only counted."""

    def __init__(self, obj: Any, names: Iterable[str]) -> None:
        self._obj = obj
        self._owner = threading.get_ident()
        self._depth = 0
        self._totals = MethodTotals()
        self.names = [n for n in names if callable(getattr(obj, n, None))]
        for name in self.names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._owner:
                self._totals.other_thread_calls += 1
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - start
                self._depth -= 1
                totals = self._totals
                totals.calls[name] += 1
                totals.method_ns[name] += elapsed
                if self._depth == 0:
                    totals.ns += elapsed

        return timed

    def take(self) -> MethodTotals:
        totals, self._totals = self._totals, MethodTotals()
        return totals

    def remove(self) -> None:
        """Uninstall: the class's methods show through again."""
        for name in self.names:
            self._obj.__dict__.pop(name, None)


@dataclass(slots=True)
class ThreadCalls:
    """Store calls since the last `take()`: on the driver thread and on any other thread."""

    driver: Counter[str] = field(default_factory=Counter)
    other: Counter[str] = field(default_factory=Counter)

    def total(self) -> int:
        return sum(self.driver.values()) + sum(self.other.values())


class StoreCallCounter:
    """Counts calls of `names` on `store` (those it has; nested calls once), by thread: the
    driver thread is the scheduling thread in this harness (it also runs the worker's hooks);
    any other thread is one of the connector's own. Any thread; guarded by `_lock`."""

    def __init__(self, store: Any, names: Iterable[str]) -> None:
        self._store = store
        self._driver = threading.get_ident()
        self._lock = threading.Lock()
        self._calls = ThreadCalls()  # guarded by _lock
        self._depth = threading.local()
        self.names = [n for n in names if callable(getattr(store, n, None))]
        for name in self.names:
            setattr(store, name, self._wrap(name, getattr(store, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                with self._lock:
                    (self._calls.driver if threading.get_ident() == self._driver else self._calls.other)[name] += 1
            self._depth.n = depth + 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def take(self) -> ThreadCalls:
        with self._lock:
            calls, self._calls = self._calls, ThreadCalls()
        return calls

    def remove(self) -> None:
        for name in self.names:
            self._store.__dict__.pop(name, None)


# --------------------------------------------------------------------------- one engine's meters


@dataclass(slots=True)
class StepSample:
    """One step: vLLM's wall times and what the meters saw (None: no connector / store)."""

    times: StepTimes
    scheduler: MethodTotals | None
    worker: MethodTotals | None
    stores: ThreadCalls | None


@dataclass(slots=True)
class EngineMeters:
    """The timers on an engine's two connectors and the counters on its stores. Driver thread."""

    scheduler: MethodTimer | None
    worker: MethodTimer | None
    stores: list[StoreCallCounter]

    @classmethod
    def install(cls, scheduler_connector: Any, worker_connector: Any, stores: list[Any]) -> EngineMeters:
        return cls(
            MethodTimer(scheduler_connector, SCHEDULER_HOOKS) if scheduler_connector is not None else None,
            MethodTimer(worker_connector, WORKER_HOOKS) if worker_connector is not None else None,
            [StoreCallCounter(store, STORE_METHODS) for store in stores],
        )

    def take(self, times: StepTimes) -> StepSample:
        """What the meters saw since the last take, as one sample with `times`; resets them."""
        stores = ThreadCalls()
        for counter in self.stores:
            part = counter.take()
            stores.driver.update(part.driver)
            stores.other.update(part.other)
        return StepSample(
            times,
            self.scheduler.take() if self.scheduler else None,
            self.worker.take() if self.worker else None,
            stores if self.stores else None,
        )

    def remove(self) -> None:
        for meter in (self.scheduler, self.worker, *self.stores):
            if meter is not None:
                meter.remove()


# --------------------------------------------------------------------------- rows


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _per_call_us(totals: list[MethodTotals], name: str) -> tuple[float | None, int]:
    calls = sum(t.calls[name] for t in totals)
    ns = sum(t.method_ns[name] for t in totals)
    return (ns / calls / 1e3 if calls else None), calls


def summarize(contender: str, num_requests: int, kind: str, samples: list[StepSample]) -> Row:
    """One row: a contender at one batch size over the timed steps of one kind."""
    sched = [s.scheduler.ns / 1e3 for s in samples if s.scheduler is not None]
    worker = [s.worker.ns / 1e3 for s in samples if s.worker is not None]
    host = [(s.scheduler.ns if s.scheduler else 0) / 1e3 + (s.worker.ns if s.worker else 0) / 1e3 for s in samples]
    worker_totals = [s.worker for s in samples if s.worker is not None]
    wait_us, wait_calls = _per_call_us(worker_totals, "wait_for_layer_load")
    save_us, save_calls = _per_call_us(worker_totals, "save_kv_layer")
    stores = [s.stores for s in samples if s.stores is not None]
    has_connector = bool(sched or worker)
    return {
        "contender": contender,
        "requests": num_requests,
        "steps": kind,
        "num_steps": len(samples),
        "host_us_p50": _pct(host, 50) if has_connector else None,
        "host_us_p90": _pct(host, 90) if has_connector else None,
        "sched_us_p50": _pct(sched, 50),
        "sched_us_p90": _pct(sched, 90),
        "worker_us_p50": _pct(worker, 50),
        "worker_us_p90": _pct(worker, 90),
        "wait_load_us": wait_us,
        "save_layer_us": save_us,
        "wait_load_calls": wait_calls if worker_totals else None,
        "save_layer_calls": save_calls if worker_totals else None,
        "schedule_us_p50": _pct([s.times.schedule_ns / 1e3 for s in samples], 50),
        "pct_of_schedule": None,  # filled by the suite: needs the `none` run
        "update_us_p50": _pct([s.times.update_ns / 1e3 for s in samples], 50),
        "store_calls_driver": sum(sum(c.driver.values()) for c in stores) / len(samples)
        if stores and samples
        else None,
        "store_calls_total": sum(c.total() for c in stores) / len(samples) if stores and samples else None,
    }


def hook_rows(contender: str, samples: list[StepSample]) -> list[Row]:
    """Per hook / store method: calls and µs per step over `samples` (one kind of step)."""
    rows: list[Row] = []
    for role, totals in (("scheduler", [s.scheduler for s in samples]), ("worker", [s.worker for s in samples])):
        calls: Counter[str] = Counter()
        ns: Counter[str] = Counter()
        for t in totals:
            if t is not None:
                calls.update(t.calls)
                ns.update(t.method_ns)
        for method in sorted(calls, key=lambda m: -ns[m]):
            rows.append(
                {
                    "contender": contender,
                    "where": f"{role} connector",
                    "method": method,
                    "calls_per_step": calls[method] / len(samples),
                    "us_per_step": ns[method] / len(samples) / 1e3,
                    "us_per_call": ns[method] / calls[method] / 1e3,
                }
            )
    for thread in ("driver", "other"):
        store_calls: Counter[str] = Counter()
        for s in samples:
            if s.stores is not None:
                store_calls.update(getattr(s.stores, thread))
        for method, n in store_calls.most_common():
            rows.append(
                {
                    "contender": contender,
                    "where": f"store, {'scheduling' if thread == 'driver' else 'other'} thread",
                    "method": method,
                    "calls_per_step": n / len(samples),
                }
            )
    return rows


def warmup_row(contender: str, num_requests: int, num_steps: int, w: StepSample) -> Row:
    """A run's warm-up of `num_steps` steps summed in `w`: hook time and store calls (the
    arrival lookups included)."""
    stores = w.stores
    return {
        "contender": contender,
        "requests": num_requests,
        "warmup_steps": num_steps,
        "sched_hook_ms": w.scheduler.ns / 1e6 if w.scheduler else None,
        "worker_hook_ms": w.worker.ns / 1e6 if w.worker else None,
        "store_calls_driver": sum(stores.driver.values()) if stores else None,
        "exists_calls_driver": stores.driver["batch_is_exist"] if stores else None,
        "store_calls_total": stores.total() if stores else None,
    }
