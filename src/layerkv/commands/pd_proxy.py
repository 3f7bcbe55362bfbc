"""`layerkv pd-proxy --prefill URL --decode URL`: the prefill/decode proxy of
layerkv.integrations.pd_proxy in front of two vLLM servers with layerkv (docs/vllm.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pd-proxy",
        help="prefill/decode proxy in front of two vLLM servers",
        description="Send each completion first to the prefill server (max_tokens 1), then with its "
        "kv_transfer_params to the decode server, whose answer the client gets (docs/vllm.md).",
    )
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL (kv_producer)")
    parser.add_argument("--decode", required=True, help="the decode server's base URL (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on each upstream call")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerkv.integrations.pd_proxy import PDProxy

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    proxy = PDProxy(args.prefill, args.decode, args.host, args.port, args.timeout_s)
    print(
        f"layerkv pd-proxy: {proxy.url} -> prefill {proxy.prefill_url}, decode {proxy.decode_url}. Ctrl-C stops.",
        file=sys.stderr,
        flush=True,
    )
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
