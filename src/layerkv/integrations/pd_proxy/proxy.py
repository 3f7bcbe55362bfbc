"""PDProxy: the proxy's lifecycle. `start()` runs its event loop in a daemon thread named
layerkv-pd-proxy and returns once it listens; `serve_forever()` runs it in the calling thread
(the CLI) until Ctrl-C or SIGTERM; `close()` stops it from any thread and joins the loop's
thread with a bound. Everything else (handlers, pools, the prober, the client session) lives on
that one event loop."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Sequence

import aiohttp
from aiohttp import web

from layerkv.integrations.pd_proxy.app import ProxyApp
from layerkv.integrations.pd_proxy.config import ProxyConfig, server_urls
from layerkv.integrations.pd_proxy.metrics import ProxyMetrics
from layerkv.integrations.pd_proxy.routing import Pool, Role, probe_forever
from layerkv.integrations.pd_proxy.server import ProxyServer

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 2.0  # what answers in flight get at close
LINGERING_TIME_S = 2.0  # a refused body is read and dropped this long before the close (the client reads the error)


class PDProxy:
    """`PDProxy(["http://p0:8100", ...], ["http://d0:8200", ...], ProxyConfig(...)).start()`.
    `url` and `port` hold where it listens once started; `metrics` its Prometheus metrics."""

    def __init__(
        self, prefill_urls: Sequence[str], decode_urls: Sequence[str], config: ProxyConfig | None = None
    ) -> None:
        self.prefill_urls = server_urls("prefill_urls", prefill_urls)
        self.decode_urls = server_urls("decode_urls", decode_urls)
        self.config = config or ProxyConfig()
        self.metrics = ProxyMetrics()
        self.port = self.config.port
        self._listening = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._on_listening: Callable[[PDProxy], None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def prefills(self) -> dict[str, int]:
        """Prefill calls so far: {"ok": n, "failed": m} (any thread)."""
        name = "layerkv_pd_proxy_prefills_total"
        return {outcome: int(self.metrics.sample(name, {"outcome": outcome})) for outcome in ("ok", "failed")}

    def start(self) -> PDProxy:
        """Listen from a thread of its own; returns once listening (raises what stopped it)."""
        self._thread = threading.Thread(target=self._run_thread, name="layerkv-pd-proxy", daemon=True)
        self._thread.start()
        if not self._listening.wait(START_TIMEOUT_S) or self._error is not None:
            self.close()
            raise RuntimeError(f"pd-proxy did not start on {self.config.host}:{self.config.port}") from self._error
        return self

    def serve_forever(self, on_listening: Callable[[PDProxy], None] | None = None) -> None:
        """Listen in this thread until Ctrl-C, SIGTERM or close(); `on_listening(self)` once it listens."""
        self._on_listening = on_listening
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self._main(handle_signals=True))

    def close(self) -> None:
        """Stop listening, give answers in flight SHUTDOWN_TIMEOUT_S, join the loop's thread."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("pd-proxy: its thread did not end within %.0f s", CLOSE_TIMEOUT_S)

    def _run_thread(self) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._main(handle_signals=False))
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._listening.set()

    async def _main(self, *, handle_signals: bool) -> None:
        config = self.config
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._stop.set)
        connector = aiohttp.TCPConnector(limit=config.max_upstream_connections)
        timeout = aiohttp.ClientTimeout(total=config.upstream_timeout_s, sock_connect=config.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            pools = (
                Pool(Role.PREFILL, self.prefill_urls, config, self.metrics),
                Pool(Role.DECODE, self.decode_urls, config, self.metrics),
            )
            app = ProxyApp(config, self.metrics, session, *pools)
            runner = web.ServerRunner(self._server(app), shutdown_timeout=SHUTDOWN_TIMEOUT_S)
            await runner.setup()
            prober = asyncio.create_task(probe_forever(pools, session, config), name="layerkv-pd-proxy-prober")
            try:
                site = web.TCPSite(runner, config.host, config.port, backlog=min(config.max_connections, 4096))
                await site.start()
                self.port = int(runner.addresses[0][1])
                self._listening.set()
                if self._on_listening is not None:
                    self._on_listening(self)
                await self._stop.wait()
            finally:
                prober.cancel()
                await runner.cleanup()

    def _server(self, app: ProxyApp) -> ProxyServer:
        return ProxyServer(
            app.handle,
            max_connections=self.config.max_connections,
            metrics=self.metrics,
            handler_cancellation=True,  # a client gone cancels its upstream call
            keepalive_timeout=self.config.idle_timeout_s,
            lingering_time=LINGERING_TIME_S,
            auto_decompress=False,  # a compressed body is not JSON: 400, never a decompression bomb
            access_log=None,
        )


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (vLLM depends on it), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]
