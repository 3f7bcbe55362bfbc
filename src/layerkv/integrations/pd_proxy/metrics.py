"""The proxy's Prometheus metrics, in a registry of its own (two proxies in one process never
share a sample). Updated from the proxy's event loop; read by `/metrics` (the same loop) and by
`PDProxy.prefills` from any thread (prometheus_client's values are thread-safe)."""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "layerkv_pd_proxy"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Outcome(str, enum.Enum):
    """How the proxy ended a request (the `outcome` label of requests_total)."""

    OK = "ok"  # the upstream's answer went through whole (its own status, 4xx included)
    BAD_REQUEST = "bad_request"  # 400: not JSON, a field of the wrong type, a malformed head
    TOO_LARGE = "too_large"  # 413: the body is over max_body_nbytes
    TIMEOUT = "timeout"  # 408: the body did not arrive within read_timeout_s
    NO_UPSTREAM = "no_upstream"  # 503: no decode server in rotation
    UPSTREAM_FAILED = "upstream_failed"  # 502: the decode server (and the one retry) failed before answering
    STREAM_BROKEN = "stream_broken"  # the decode server failed after the answer started: the stream was cut
    CLIENT_GONE = "client_gone"  # the client closed its connection before the answer ended
    INTERNAL_ERROR = "internal_error"  # 500: a bug in the proxy (logged with its traceback)


class ProxyMetrics:
    """One proxy's metrics. `server` labels are upstream base URLs; `role` is prefill or decode."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Client requests by how they ended", ["outcome"], registry=reg)
        self.prefills = Counter(
            f"{PREFIX}_prefills",
            "Prefill calls: ok, or failed (the decode server computed the prompt)",
            ["outcome"],
            registry=reg,
        )
        self.prefill_failures = Counter(
            f"{PREFIX}_prefill_failures",
            "Prefill failures by server (none: no server in rotation)",
            ["server"],
            registry=reg,
        )
        self.decode_retries = Counter(
            f"{PREFIX}_decode_retries", "Decode requests retried on another server", registry=reg
        )
        self.upstream_latency = Histogram(
            f"{PREFIX}_upstream_latency_seconds",
            "Seconds from sending a request to an upstream to the end of its answer",
            ["role", "server"],
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.upstream_failures = Counter(
            f"{PREFIX}_upstream_failures",
            "Upstream calls that failed (server taken out)",
            ["role", "server"],
            registry=reg,
        )
        self.out_of_rotation = Gauge(
            f"{PREFIX}_servers_out_of_rotation", "Servers out of rotation, per role", ["role"], registry=reg
        )
        self.connections = Gauge(f"{PREFIX}_open_connections", "Client connections open", registry=reg)
        self.refused = Counter(
            f"{PREFIX}_connections_refused", "Client connections closed at accept (max_connections)", registry=reg
        )
        for role in ("prefill", "decode"):
            self.out_of_rotation.labels(role).set(0)
        for outcome in ("ok", "failed"):
            self.prefills.labels(outcome)

    def count(self, outcome: Outcome) -> None:
        self.requests.labels(outcome.value).inc()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's value (0 if it has none), e.g. sample('layerkv_pd_proxy_prefills_total', {'outcome': 'ok'})."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
