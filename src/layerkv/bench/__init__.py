"""`layerkv bench`: benchmark suites and the runner that writes results.json, results.md and PNG
plots. Single-threaded drivers; the layerkv transfer threads they exercise are started and joined
inside each measurement. Benchmarks report, never assert. Imports nothing heavy (the CLI parser
reads the suite names from here).

    runner.py common.py plots.py   the runner, options / results / progress, the PNG plots
    backends.py steps.py           the stores a suite runs against; one connector step, no compute
    micro/     the default suites: layerkv's own data path and the reference engine, in this process
    serving/   suites serving and pd: time to first token in real vLLM engines on one pool
    load/      suite load: `vllm serve` servers under vLLM's benchmark client
    decode/    suite decode: a connector's host cost per decode step under vLLM's real scheduler
    network/   suite network: the reference engine and vLLM engines across namespace hosts
    vllm/      real vLLM engines as child processes (offline engine host, `vllm serve`), the model
    cluster/   network-namespace hosts and a Mooncake pool over them (also the cluster test tier's)
    proxy/     suite proxy: `layerkv pd-proxy`'s cost per request, fake vLLM servers (also its tests')
"""

from __future__ import annotations

SUITES: tuple[str, ...] = ("datapath", "plans", "descriptors", "lookup", "objects", "overlap", "scale")
# Run only when named: `serving`, `pd` (prefill/decode) and `load` (`vllm serve` under vLLM's
# benchmark client) drive real vLLM engines under another venv's Python; `network` needs root
# (a namespace cluster of hosts); `decode` drives vLLM's own scheduler and worker hooks in this
# process (vllm installed here; its Mooncake contenders in a private network namespace); `proxy`
# measures `layerkv pd-proxy` in front of fake servers (aiohttp).
OPT_IN_SUITES: tuple[str, ...] = ("serving", "network", "pd", "load", "decode", "proxy")

# The module whose `run(options, progress) -> SuiteResult` runs each suite (imported lazily).
SUITE_MODULES: dict[str, str] = {
    **{name: f"layerkv.bench.micro.{name}" for name in SUITES},
    "serving": "layerkv.bench.serving.suite",
    "pd": "layerkv.bench.serving.pd",
    "load": "layerkv.bench.load.suite",
    "decode": "layerkv.bench.decode.suite",
    "network": "layerkv.bench.network.suite",
    "proxy": "layerkv.bench.proxy.suite",
}
