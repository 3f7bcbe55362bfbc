"""`layerkv demo`: the main job on the embedded store (or Mooncake)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the demo: layerwise save and load, outputs verified")
    p.add_argument("--synthetic", action="store_true", help="datapath only: synthetic KV caches, no engine")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerkv.datapath_demo import format_report, run_datapath_demo

    report = run_datapath_demo()
    print(format_report(report))
    return 0 if report.identical else 1
