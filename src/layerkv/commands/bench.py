"""`layerkv bench [SUITE ...] [--quick] [--out DIR]`: run benchmark suites and write
results.json, results.md and PNG plots. Benchmarks report numbers; they assert nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from layerkv.bench import OPT_IN_SUITES, SUITES  # cheap: the package imports nothing heavy
from layerkv.commands import add_mooncake_log_flag

DEFAULT_ENGINE_PYTHON = ".venv-vllm-cpu/bin/python"  # what `make test-env` builds
LOAD_SCENARIOS = (
    "capacity",
    "eviction",
    "two-servers",
    "decode",
)  # layerkv.bench.load.plan's (not imported: cheap parser)
LOAD_CONTENDERS = (
    "none",
    "layerkv",
    "layerkv-consumer",
    "layerkv-prompts",
    "mooncake",
    "mooncake-save-decode",
    "lmcache",
)
_UNITS_S = {"s": 1, "m": 60, "h": 3600}


def duration_s(text: str) -> float:
    """'30m', '2h', '900s' or '900' (seconds) -> seconds."""
    unit = _UNITS_S.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 30m, 2h, 900s)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be > 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure data path, descriptor / lookup overhead, object counts, overlap, scale",
        description="Run benchmark suites (all by default) and write results.json, results.md and PNGs.",
    )
    _add_run_arguments(p)
    _add_serving_arguments(p)
    _add_load_arguments(p)
    add_mooncake_log_flag(p)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: smallest configuration
    p.set_defaults(func=run)


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Which suites, how big, where the results go, which Python runs vLLM: every suite's options."""
    p.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help=f"suites to run (default: all of {', '.join(SUITES)}); only when named: "
        "serving (real vLLM engines, see --engine-python), pd (prefill/decode, real vLLM engines), "
        "network (hosts as network namespaces: needs root), "
        "load (`vllm serve` servers under vLLM's benchmark client; see the load options), "
        "decode (a connector's host cost per decode step under vLLM's real scheduler and hooks), "
        "proxy (`layerkv pd-proxy`'s added latency per request, in front of fake vLLM servers)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sweeps, 3 repetitions (< 5 min on 2 cores; serving: 2 repetitions, ~5 min)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake backends (embedded store only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--engine-python",
        default=DEFAULT_ENGINE_PYTHON,
        help="suites serving, pd, network: the Python that runs vLLM (with vllm and mooncake installed; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--tenant-keys",
        action="store_true",
        help="suite serving: layerkv with no key, with a tenant key and with encrypt_objects side by side "
        "(instead of recompute, the local cache and MooncakeStoreConnector)",
    )


def _add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """Suite serving's TTFT grid: prefix and suffix lengths, repeats per cell."""
    serving = p.add_argument_group("suite serving")
    serving.add_argument(
        "--prefix",
        action="append",
        type=positive_int,
        default=[],
        metavar="TOKENS",
        help="prefix length(s) of the TTFT grid (repeat the flag; default: the mode's, 512 and 2048)",
    )
    serving.add_argument(
        "--suffix",
        action="append",
        type=positive_int,
        default=[],
        metavar="TOKENS",
        help="computed suffix length(s) of the TTFT grid (repeat the flag; default: the mode's)",
    )
    serving.add_argument(
        "--repeats", type=positive_int, default=None, help="repeats per cell (default: 1 with --quick, 3 otherwise)"
    )


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    """Suite load: scenarios, contenders, soak time, request rate and count, the LMCache Python."""
    load = p.add_argument_group("suite load")
    load.add_argument(
        "--scenario",
        action="append",
        default=[],
        choices=LOAD_SCENARIOS,
        help="scenario(s) to run (repeat the flag; default: capacity, eviction, two-servers; decode runs "
        "alone: distinct prompts, long answers, 16 in flight: TPOT / ITL of steps that move nothing)",
    )
    load.add_argument(
        "--contender",
        action="append",
        default=[],
        choices=LOAD_CONTENDERS,
        help="contender(s) (repeat the flag; default: none, layerkv, mooncake; lmcache builds "
        ".venv-lmcache unless --lmcache-python is given)",
    )
    load.add_argument(
        "--soak",
        type=duration_s,
        default=0.0,
        metavar="DURATION",
        help="hold the capacity scenario this long (e.g. 30m, 2h, 900s) and report RSS growth",
    )
    load.add_argument("--rate", type=float, default=None, help="requests per second (Poisson; default: the plan's)")
    load.add_argument("--requests", type=int, default=None, help="requests per run (default: the plan's)")
    load.add_argument("--lmcache-python", default="", help="a Python with vllm-cpu and lmcache 0.5.6 installed")


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
    options = BenchOptions(
        quick=args.quick,
        out_dir=args.out,
        mooncake=not args.no_mooncake,
        tiny=args.tiny,
        engine_python=args.engine_python,
        tenant_keys=args.tenant_keys,
        load_scenarios=tuple(args.scenario),
        load_contenders=tuple(args.contender),
        soak_s=args.soak,
        request_rate=args.rate,
        num_requests=args.requests,
        lmcache_python=args.lmcache_python,
        serving_prefixes=tuple(args.prefix),
        serving_suffixes=tuple(args.suffix),
        serving_repeats=args.repeats,
    )
    command = (
        "layerkv " + shlex.join(sys.argv[1:])
        if sys.argv and sys.argv[0].endswith("layerkv")
        else "layerkv bench "
        + shlex.join(
            [
                *args.suites,
                *(["--quick"] if args.quick else []),
                *(["--tenant-keys"] if args.tenant_keys else []),
                *[f"--prefix={n}" for n in args.prefix],
                *[f"--suffix={n}" for n in args.suffix],
                *([f"--repeats={args.repeats}"] if args.repeats else []),
                "--out",
                str(args.out),
            ]
        )
    )
    doc = run_bench(args.suites, options, progress=not args.no_progress, command=command)
    print(
        f"layerkv bench: {len(doc['suites'])} suite(s) in {doc['total_seconds']:.0f} s; "
        f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and plots"
    )
    return 0
