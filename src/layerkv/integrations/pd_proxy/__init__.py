"""`layerkv pd-proxy`: the prefill/decode proxy in front of N prefill servers (kv_producer) and
M decode servers (kv_consumer) on one layerkv pool (docs/vllm.md, "Prefill/decode
disaggregation"). asyncio on aiohttp (vLLM's own dependency): one event loop, no thread per
connection, every limit bounded.

    client ─▶ proxy ─▶ prefill server (least outstanding; max_tokens 1) ─▶ kv_transfer_params
                   └─▶ decode server (least outstanding; + those params) ─▶ answer, streamed back

    config.py   ProxyConfig: listen address, client limits, upstream timeouts, back-off
    bodies.py   the bounded body read, the request checks, prefill / decode bodies, JSON errors
    routing.py  server pools: least outstanding, out of rotation on failure, /health prober
    app.py      the request handler: prefill, decode with one retry, streaming, /metrics, /health
    server.py   aiohttp's server with a connection bound and JSON parser errors
    metrics.py  Prometheus metrics in a registry of the proxy's own
    proxy.py    PDProxy: start / serve_forever / close
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerkv.integrations.pd_proxy.config import ProxyConfig
    from layerkv.integrations.pd_proxy.proxy import PDProxy

__all__ = ["PDProxy", "ProxyConfig"]


def __getattr__(name: str) -> Any:
    """PDProxy and ProxyConfig on first use: `layerkv --help` reads config.py without aiohttp."""
    if name == "PDProxy":
        from layerkv.integrations.pd_proxy.proxy import PDProxy

        return PDProxy
    if name == "ProxyConfig":
        from layerkv.integrations.pd_proxy.config import ProxyConfig

        return ProxyConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
