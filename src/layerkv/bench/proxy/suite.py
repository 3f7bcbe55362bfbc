"""Suite `proxy` (opt-in: `layerkv bench proxy`): what `layerkv pd-proxy` adds to a request.
A fake prefill and a fake decode server (fake_vllm.py, one process, a fixed service time each)
and the proxy (`python -m layerkv.cli pd-proxy`, its own process); this process drives
`concurrency` clients (aiohttp, one event loop) through `num_requests` completions, three ways:

    decode          straight to the decode server (what a client without P/D waits)
    prefill+decode  the client itself makes the proxy's two calls: prefill, then decode with its params
    proxy           through the proxy (its two calls + its own cost)

added_* = proxy minus the other, per statistic (median of the latencies, their 99th percentile).
Non-streamed and streamed (max_tokens events) answers. Driver thread; the runs one after another.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.bench.vllm.engines import stop_group
from layerkv.integrations.pd_proxy.bodies import decode_body, prefill_body

NAME = "proxy"
SERVICE_MS = 5.0
MAX_TOKENS = 8
MODES = ("decode", "prefill+decode", "proxy")


@dataclass(frozen=True, slots=True)
class Load:
    num_requests: int
    concurrency: int
    warmup_requests: int

    @classmethod
    def of(cls, options: BenchOptions) -> Load:
        if options.tiny:
            return cls(40, 4, 8)
        return cls(500, 32, 100) if options.quick else cls(2000, 32, 200)


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    load = Load.of(options)
    result = SuiteResult(NAME)
    with tempfile.TemporaryDirectory(prefix="layerkv-bench-proxy-") as tmp, _Processes(Path(tmp)) as procs:
        for stream in (False, True):
            for mode in MODES:
                progress.case(f"{mode}{' stream' if stream else ''}")
                latencies_s, wall_s = asyncio.run(_drive(procs.urls, mode, stream, load))
                result.rows.append(_row(mode, stream, latencies_s, wall_s))
    _summarise(result)
    result.notes += [
        f"{load.num_requests} completions per row ({load.warmup_requests} more before, untimed), {load.concurrency} "
        f"clients at once; fake servers answer after {SERVICE_MS:g} ms (prefill: 1 token; decode: {MAX_TOKENS} "
        "tokens); clients, proxy and servers are three processes on this one machine, sharing its cores.",
        "added_median_ms / added_p99_ms: the proxy's median / 99th percentile minus the decode server's own "
        "(includes the prefill call the proxy makes); over_client_ms: minus the client's own prefill+decode calls "
        "(the proxy's own cost).",
    ]
    return result


class _Processes:
    """The fake servers' process and the proxy's; stopped at the end, whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._procs: list[subprocess.Popen[bytes]] = []
        self.urls: dict[str, str] = {}

    def __enter__(self) -> _Processes:
        try:
            fleet = self._spawn(
                [sys.executable, "-m", "layerkv.bench.proxy.fake_vllm", "--service-ms", str(SERVICE_MS)]
            )
            servers = json.loads(self._line(fleet))
            argv = [sys.executable, "-m", "layerkv.cli", "pd-proxy", "--port", "0", "--log-level", "WARNING"]
            argv += ["--prefill", servers["prefill"][0], "--decode", servers["decode"][0]]
            proxy_line = self._line(self._spawn(argv))
            self.urls = {
                "prefill": servers["prefill"][0],
                "decode": servers["decode"][0],
                "proxy": proxy_line.split("listening on ", 1)[1].split()[0],
            }
        except BaseException:
            self.__exit__()
            raise
        return self

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self._tmp / f"{len(self._procs)}.log").open("wb")
        proc = subprocess.Popen(  # each leads its own process group: stop_group ends it
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
        self._procs.append(proc)
        return proc

    @staticmethod
    def _line(proc: subprocess.Popen[bytes]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # both print one line once listening (or die: b"")
        if not line:
            raise RuntimeError(f"{proc.args!r} ended before listening (its log is in the bench's temporary folder)")
        return line

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self._procs):
            stop_group(proc, 15)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


async def _drive(urls: dict[str, str], mode: str, stream: bool, load: Load) -> tuple[list[float], float]:
    """Each request's latency (to the answer's end) and the timed part's wall time."""
    body = {"model": "fake", "prompt": "hello " * 64, "max_tokens": MAX_TOKENS, "stream": stream}
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        call = _Call(session, urls, mode, body)
        await _many(call, load.warmup_requests, load.concurrency, [])
        latencies_s: list[float] = []
        start_s = time.perf_counter()
        await _many(call, load.num_requests, load.concurrency, latencies_s)
        return latencies_s, time.perf_counter() - start_s


async def _many(call: _Call, num_requests: int, concurrency: int, latencies_s: list[float]) -> None:
    left = iter(range(num_requests))

    async def client() -> None:
        for _ in left:
            start_s = time.perf_counter()
            await call()
            latencies_s.append(time.perf_counter() - start_s)

    await asyncio.gather(*(client() for _ in range(concurrency)))


@dataclass(slots=True)
class _Call:
    session: aiohttp.ClientSession
    urls: dict[str, str]
    mode: str
    body: dict[str, Any]

    async def __call__(self) -> None:
        path = "/v1/completions"
        if self.mode == "prefill+decode":
            async with self.session.post(self.urls["prefill"] + path, json=prefill_body(self.body)) as answer:
                params = (await answer.json()).get("kv_transfer_params")
            await self._read(self.urls["decode"] + path, decode_body(self.body, params))
        else:
            await self._read(self.urls[self.mode] + path, self.body)

    async def _read(self, url: str, body: dict[str, Any]) -> None:
        async with self.session.post(url, json=body) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{url} answered {answer.status}: {await answer.text()}")
            await answer.read()


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _row(mode: str, stream: bool, latencies_s: list[float], wall_s: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "stream": stream,
        "requests": len(latencies_s),
        "median_ms": _percentile(latencies_s, 0.5) * 1000,
        "p99_ms": _percentile(latencies_s, 0.99) * 1000,
        "requests_per_s": len(latencies_s) / wall_s,
    }


def _summarise(result: SuiteResult) -> None:
    for stream in (False, True):
        rows = {r["mode"]: r for r in result.rows if r["stream"] is stream}
        kind = "stream" if stream else "json"
        for stat in ("median_ms", "p99_ms"):
            result.summary[f"{kind} added_{stat}"] = rows["proxy"][stat] - rows["decode"][stat]
            result.summary[f"{kind} over_client_{stat}"] = rows["proxy"][stat] - rows["prefill+decode"][stat]
        result.summary[f"{kind} proxy_requests_per_s"] = rows["proxy"]["requests_per_s"]
