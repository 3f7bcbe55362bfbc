"""Shared pieces of the bench suites: options, the per-suite result, a progress handle and
timing helpers. Driver thread only (the bench runs one measurement at a time).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What every suite gets: `quick` shrinks sweeps and repetitions; plots go to `out_dir`;
    `mooncake=False` skips the Mooncake backends (e.g. tests or no mooncake installed);
    `engine_python`: the Python that runs vLLM engines (suite `serving`)."""

    quick: bool
    out_dir: Path
    mooncake: bool = True
    tiny: bool = False  # tests: the smallest configuration that still exercises every path
    engine_python: str = ""
    tenant_keys: bool = (
        False  # suite serving: layerkv with no key, a tenant key and encrypt_objects instead of the peers
    )
    # suite load (load/plan.py): scenarios and contenders (empty: the defaults), a soak's duration,
    # the request rate / count instead of the plan's, LMCache's Python (empty: build .venv-lmcache)
    load_scenarios: tuple[str, ...] = ()
    load_contenders: tuple[str, ...] = ()
    soak_s: float = 0.0
    request_rate: float | None = None
    num_requests: int | None = None
    lmcache_python: str = ""
    # suite serving: the grid's prefix / suffix lengths and repeats instead of the mode's (empty / None)
    serving_prefixes: tuple[int, ...] = ()
    serving_suffixes: tuple[int, ...] = ()
    serving_repeats: int | None = None

    @property
    def reps(self) -> int:
        return 1 if self.tiny else (3 if self.quick else 5)


@dataclass(slots=True)
class SuiteResult:
    """One suite's output: table rows (flat dicts of str / int / float), headline numbers,
    notes (how it was measured), the PNG files it wrote (relative to out_dir) and further
    tables under a title each."""

    name: str
    rows: list[Row] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tables: dict[str, list[Row]] = field(default_factory=dict)


class Progress:
    """A tqdm bar over suites; suites call `case(label)` before each measurement."""

    def __init__(self, num_suites: int, enabled: bool) -> None:
        self._bar = tqdm(total=num_suites, desc="layerkv bench", unit="suite", disable=not enabled)

    def case(self, label: str) -> None:
        self._bar.set_postfix_str(label, refresh=True)

    def suite_done(self) -> None:
        self._bar.update()

    def close(self) -> None:
        self._bar.close()


def median_s(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    """Median wall time of `fn()` over `reps` runs (each after an untimed `setup()`)."""
    times = []
    for _ in range(max(1, reps)):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def kib(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < (1 << 20) else f"{nbytes >> 20} MiB"
