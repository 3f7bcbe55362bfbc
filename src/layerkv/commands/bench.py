"""`layerkv bench [SUITE ...] [--quick] [--out DIR]`: run benchmark suites and write
results.json, results.md and PNG plots. Benchmarks report numbers; they assert nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

SUITE_NAMES = ("datapath", "descriptors", "lookup", "objects", "overlap", "scale")  # = layerkv.bench.SUITES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure data path, descriptor / lookup overhead, object counts, overlap, scale",
                       description="Run benchmark suites (all by default) and write results.json, results.md and PNGs.")
    p.add_argument("suites", nargs="*", metavar="SUITE",  
                   help=f"suites to run (default: all): {', '.join(SUITE_NAMES)}")
    p.add_argument("--quick", action="store_true", help="small sweeps, 3 repetitions (< 5 min on 2 cores)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake backends (embedded store only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: smallest configuration
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # keep Mooncake's info log out of the report
    from layerkv.bench.common import BenchOptions
    from layerkv.bench.runner import run_bench

    unknown = [s for s in args.suites if s not in SUITE_NAMES]
    if unknown:
        print(f"layerkv bench: unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITE_NAMES)}", file=sys.stderr)
        return 2
    options = BenchOptions(quick=args.quick, out_dir=args.out, mooncake=not args.no_mooncake, tiny=args.tiny)
    command = "layerkv " + shlex.join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("layerkv") else \
        "layerkv bench " + shlex.join([*args.suites, *(["--quick"] if args.quick else []), "--out", str(args.out)])
    doc = run_bench(args.suites, options, progress=not args.no_progress, command=command)
    print(f"layerkv bench: {len(doc['suites'])} suite(s) in {doc['total_seconds']:.0f} s; "
          f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and plots")
    return 0
