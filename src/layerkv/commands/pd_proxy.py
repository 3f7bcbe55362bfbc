"""`layerkv pd-proxy --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]`: the
prefill/decode proxy of layerkv.integrations.pd_proxy in front of vLLM servers with layerkv
(docs/vllm.md). Prints `layerkv pd-proxy: listening on URL` on stdout once it listens; logs on stderr."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from typing import Any

_HELP = {
    "max_body_nbytes": "413 for a request body over this many bytes",
    "read_timeout_s": "408 for a request body not in within this many seconds of its head",
    "idle_timeout_s": "close a connection without a complete request head for this many seconds",
    "max_connections": "client connections open at once; more are closed at accept",
    "connect_timeout_s": "bound on connecting to an upstream (and on a /health probe)",
    "upstream_timeout_s": "bound on an upstream's whole answer",
    "max_upstream_connections": "connections to all upstreams at once",
    "backoff_s": "a failed server's first time out of rotation (doubles per failure in a row)",
    "max_backoff_s": "the longest time out of rotation",
    "probe_interval_s": "how often servers past their back-off are probed (GET /health)",
}


_NEEDS = ("aiohttp", "prometheus_client")  # the `proxy` extra


def add_parser(subparsers: Any) -> None:
    from layerkv.integrations.pd_proxy.config import ProxyConfig  # light: stdlib and layerkv.errors

    parser = subparsers.add_parser(
        "pd-proxy",
        help="prefill/decode proxy in front of vLLM prefill and decode servers",
        description="Send each completion first to a prefill server (max_tokens 1), then with its "
        "kv_transfer_params to a decode server, whose answer the client gets (docs/vllm.md).",
    )
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill server's base URL (repeat)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode server's base URL (repeat)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    for field in fields(ProxyConfig):
        if field.name in _HELP:
            kind = int if isinstance(field.default, int) else float
            flag = "--" + field.name.replace("_", "-")
            parser.add_argument(
                flag, type=kind, default=field.default, help=f"{_HELP[field.name]} (default %(default)s)"
            )
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerkv.errors import ConfigError

    try:
        from layerkv.integrations.pd_proxy import PDProxy, ProxyConfig
    except ModuleNotFoundError as exc:
        if exc.name not in _NEEDS:
            raise
        raise ConfigError(
            f"needs {' and '.join(_NEEDS)} ({exc.name} is not installed): vLLM's own dependencies bring both; "
            "on a host without vLLM: pip install 'layerkv[proxy]'"
        ) from None
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(message)s", stream=sys.stderr)
    config = ProxyConfig(host=args.host, port=args.port, **{name: getattr(args, name) for name in _HELP})
    proxy = PDProxy(args.prefill, args.decode, config)
    _raise_open_files_limit(config.max_connections + config.max_upstream_connections + 64)
    proxy.serve_forever(on_listening=_announce)
    return 0


def _announce(proxy: Any) -> None:
    print(
        f"layerkv pd-proxy: listening on {proxy.url} -> prefill {', '.join(proxy.prefill_urls)}; "
        f"decode {', '.join(proxy.decode_urls)}. Ctrl-C stops.",
        flush=True,
    )


def _raise_open_files_limit(num_files: int) -> None:
    """Each connection is a file: raise the soft limit toward `num_files` (up to the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = num_files if hard == resource.RLIM_INFINITY else min(num_files, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
