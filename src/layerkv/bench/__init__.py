"""`layerkv bench`: benchmark suites (one module per suite) and the runner that writes
results.json, results.md and PNG plots. Single-threaded drivers; the layerkv transfer threads
they exercise are started and joined inside each measurement. Benchmarks report, never assert.
"""

from __future__ import annotations

SUITES: tuple[str, ...] = ("datapath", "plans", "descriptors", "lookup", "objects", "overlap", "scale")
# Run only when named: `serving`, `pd` (prefill/decode) and `load` (`vllm serve` under vLLM's
# benchmark client) drive real vLLM engines under another venv's Python; `network` needs root
# (a namespace cluster of hosts); `decode` drives vLLM's own scheduler and worker hooks in this
# process (vllm installed here; its Mooncake contenders in a private network namespace).
OPT_IN_SUITES: tuple[str, ...] = ("serving", "network", "pd", "load", "decode")
