"""The prefill and decode server pools: which server a request goes to (least outstanding
requests, ties in turn), which servers are out of rotation after a failure and until when, and
the prober that returns them once their `GET /health` answers 200. The proxy's event loop only
(no lock: every method runs on it)."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

from layerkv.integrations.pd_proxy.config import ProxyConfig
from layerkv.integrations.pd_proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True, eq=False)
class Upstream:
    """One server. `outstanding`: requests sent and not yet answered in full; `failures`:
    failures in a row (0: in rotation); `probe_at_s`: loop time its back-off ends."""

    url: str
    role: Role
    outstanding: int = 0
    failures: int = 0
    probe_at_s: float = 0.0

    @property
    def in_rotation(self) -> bool:
        return self.failures == 0


class Pool:
    """The servers of one role. `pick` never returns a server out of rotation: with all of them
    out it returns None and the caller decides (prefill: skip it; decode: answer 503)."""

    def __init__(self, role: Role, urls: tuple[str, ...], config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.role = role
        self.upstreams = [Upstream(url, role) for url in urls]
        self._config, self._metrics = config, metrics
        self._turn = itertools.count()  # breaks ties between equally loaded servers in turn

    def pick(self, exclude: tuple[Upstream, ...] = ()) -> Upstream | None:
        candidates = [u for u in self.upstreams if u.in_rotation and u not in exclude]
        if not candidates:
            return None
        least = min(u.outstanding for u in candidates)
        tied = [u for u in candidates if u.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    @contextmanager
    def lease(self, upstream: Upstream) -> Iterator[Upstream]:
        """Count a request outstanding on `upstream` for the `with` block."""
        upstream.outstanding += 1
        try:
            yield upstream
        finally:
            upstream.outstanding -= 1

    def failed(self, upstream: Upstream, reason: str) -> None:
        """A call to `upstream` failed (transport error, timeout, 502/503/504, or its /health
        probe did): out of rotation for backoff_s * 2**(failures in a row - 1), capped."""
        first = upstream.in_rotation
        upstream.failures += 1
        backoff_s = min(self._config.backoff_s * 2 ** min(upstream.failures - 1, 30), self._config.max_backoff_s)
        upstream.probe_at_s = asyncio.get_running_loop().time() + backoff_s
        if first:
            log.warning(
                "pd-proxy: %s server %s out of rotation for %.1f s: %s",
                self.role.value,
                upstream.url,
                backoff_s,
                reason,
            )
        self._publish()

    def returned(self, upstream: Upstream) -> None:
        if not upstream.in_rotation:
            log.warning("pd-proxy: %s server %s back in rotation (/health answered 200)", self.role.value, upstream.url)
        upstream.failures = 0
        self._publish()

    def due_for_probe(self) -> list[Upstream]:
        now_s = asyncio.get_running_loop().time()
        return [u for u in self.upstreams if not u.in_rotation and u.probe_at_s <= now_s]

    def seconds_until_return(self) -> float:
        """The least time until a server out of rotation may be probed (0 if one is in rotation)."""
        if any(u.in_rotation for u in self.upstreams):
            return 0.0
        now_s = asyncio.get_running_loop().time()
        return max(0.0, min(u.probe_at_s for u in self.upstreams) - now_s) + self._config.probe_interval_s

    def _publish(self) -> None:
        self._metrics.out_of_rotation.labels(self.role.value).set(sum(not u.in_rotation for u in self.upstreams))


async def probe_forever(pools: tuple[Pool, ...], session: aiohttp.ClientSession, config: ProxyConfig) -> None:
    """Every probe_interval_s: a `GET /health` to each server whose back-off ended; 200 returns
    it to rotation, anything else (or no answer within connect_timeout_s) doubles its back-off.
    Runs until cancelled (PDProxy's shutdown)."""
    timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s)
    while True:
        await asyncio.sleep(config.probe_interval_s)  # a period, not a synchronisation
        due = [(pool, upstream) for pool in pools for upstream in pool.due_for_probe()]
        healthy = await asyncio.gather(*(_healthy(session, u.url, timeout) for _, u in due))
        for (pool, upstream), ok in zip(due, healthy):
            if ok:
                pool.returned(upstream)
            else:
                pool.failed(upstream, "its /health probe failed")


async def _healthy(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> bool:
    try:
        async with session.get(url + "/health", timeout=timeout) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
