"""`layerkv demo`: the main job on the embedded store (or Mooncake)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="producer fills the pool, consumer loads layer by layer; outputs verified")
    p.add_argument("--store", choices=("embedded", "mooncake"), default="embedded",
                   help="embedded (in-process, default) or mooncake (starts a local master unless MOONCAKE_CONFIG_PATH is set)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the reference engine (default 1)")
    p.add_argument("--read-layers-per-range", type=int, default=None, metavar="K",
                   help="read K layers per range into staging and scatter locally (config read_layers_per_range)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    p.add_argument("--synthetic", action="store_true", help="datapath only: synthetic KV caches, no engine")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        from layerkv.datapath_demo import format_report, run_datapath_demo

        report = run_datapath_demo()
        print(format_report(report))
        return 0 if report.identical else 1

    from layerkv.config import LayerKVConfig
    from layerkv.demo import format_result, result_json, run_demo

    extra: dict[str, object] = {"backend": args.store}
    if args.read_layers_per_range is not None:
        extra["read_layers_per_range"] = args.read_layers_per_range
    config = LayerKVConfig.from_dict(extra)
    if args.store == "mooncake":
        import os

        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log: errors only on the demo's terminal
    if args.store == "mooncake" and not config.mooncake_config_path:
        from layerkv.store.mooncake_master import LocalDeployment

        with LocalDeployment() as deployment:  # a local master + segment holder on 127.0.0.1
            config = config.replace(mooncake_config_path=str(deployment.config_path))
            result = run_demo(config, tp_size=args.tp, progress=not args.json)
    else:
        result = run_demo(config, tp_size=args.tp, progress=not args.json)
    print(result_json(result) if args.json else format_result(result))
    return 0 if result.identical else 1
