"""The proxy's one validated config: where it listens, the limits a client meets, the upstream
timeouts and the back-off of a failed server. Frozen; built once by the CLI or the caller (any
thread) before the proxy starts, read by the proxy's event loop only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from urllib.parse import urlsplit

from layerkv.errors import ConfigError

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Limits and timeouts of `layerkv pd-proxy` (the CLI's flags carry the same names).

    A client: its request head within `idle_timeout_s` of connecting or of its previous answer
    (aiohttp's keep-alive timer, which runs until a head is complete; then the connection is
    closed), its body within `read_timeout_s` of the head (else 408), at most `max_body_nbytes`
    (else 413), at most `max_connections` connections open at once (more are closed at accept).
    An upstream: connected within `connect_timeout_s`, its whole answer within
    `upstream_timeout_s`; at most `max_upstream_connections` in flight over all servers. A failed
    server is out of rotation for `backoff_s`, doubled at each failure in a row up to
    `max_backoff_s`; then a `GET /health` every `probe_interval_s` decides its return."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (PDProxy.port holds it once listening)
    max_body_nbytes: int = 32 * MIB
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0
    max_connections: int = 1024
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    max_upstream_connections: int = 512
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535 (0: any free port); default {defaults['port']}")
        for name in ("max_body_nbytes", "max_connections", "max_upstream_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a whole number > 0; default {defaults[name]}")
        for name in [f.name for f in fields(self) if f.name.endswith("_s")]:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a number of seconds > 0; default {defaults[name]}")
        if self.max_backoff_s < self.backoff_s:
            raise ConfigError(
                f"max_backoff_s={self.max_backoff_s} must be >= backoff_s={self.backoff_s}; raise max_backoff_s"
            )


def server_urls(key: str, urls: Sequence[str]) -> tuple[str, ...]:
    """`urls` as base URLs without a trailing slash; ConfigError naming `key` if there are none,
    one is not http(s)://host:port, or one is given twice."""
    if isinstance(urls, str) or not urls:
        raise ConfigError(f"{key}={urls!r} must be a list of one or more base URLs, e.g. ['http://127.0.0.1:8100']")
    out = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ConfigError(f"{key}: {url!r} is not a server's base URL; give http://HOST:PORT (no path)")
        out.append(url.rstrip("/"))
    if len(set(out)) != len(out):
        raise ConfigError(f"{key}={list(urls)!r} names a server twice; give each server once")
    return tuple(out)
