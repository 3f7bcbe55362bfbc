"""`layerkv demo`: the main job on the embedded store (or Mooncake)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from layerkv.commands import add_mooncake_log_flag
from layerkv.config import PlanMode

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig
    from layerkv.demos.demo import DemoResult


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="producer fills the pool, consumer loads layer by layer; outputs verified")
    p.add_argument(
        "--store",
        choices=("embedded", "mooncake"),
        default="embedded",
        help="embedded (in-process, default) or mooncake (starts a local master unless MOONCAKE_CONFIG_PATH is set)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the reference engine (default 1)")
    p.add_argument(
        "--transfer-plan",
        choices=tuple(m.value for m in PlanMode),
        default=None,
        help="how loads read (config transfer_plan; default auto: chosen per step from measured costs)",
    )
    p.add_argument(
        "--read-layers-per-range",
        type=int,
        default=None,
        metavar="K",
        help="with --transfer-plan groups: K layers per range into staging (config read_layers_per_range)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="where the engines run: cpu (default, float32) or cuda / cuda:N (bfloat16; docs/gpu.md)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    add_mooncake_log_flag(p)
    p.add_argument("--synthetic", action="store_true", help="datapath only: synthetic KV caches, no engine")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: a 3-layer model, 2 short prompts
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.device != "cpu":
        from layerkv.commands.doctor_device import unavailable

        why = unavailable(args.device)
        if why is not None:
            print(f"layerkv demo: {why}")
            return 2
    if args.synthetic:
        from layerkv.demos.datapath import format_report, run_datapath_demo

        report = run_datapath_demo()
        print(format_report(report))
        return 0 if report.identical else 1

    from layerkv.config import LayerKVConfig
    from layerkv.demos.demo import format_result, result_json

    extra: dict[str, object] = {"backend": args.store}
    if args.read_layers_per_range is not None:
        extra["read_layers_per_range"] = args.read_layers_per_range
        extra["transfer_plan"] = "groups"
    if args.transfer_plan is not None:
        extra["transfer_plan"] = args.transfer_plan
    config = LayerKVConfig.from_dict(extra)
    if args.store == "mooncake":
        from layerkv.store import native_log

        native_log.configure(args.mooncake_log)  # before the first Mooncake client (and for the child)
    if args.store == "mooncake" and not config.mooncake_config_path:
        from layerkv.store.local_master import LocalMaster

        with LocalMaster() as deployment:  # a local master + segment holder on 127.0.0.1
            config = config.replace(mooncake_config_path=str(deployment.config_path))
            result = _run_demo(config, args)
            deployment.check_alive()  # a pool that died mid-run is an error, not a quiet recompute
    else:
        result = _run_demo(config, args)
    print(result_json(result) if args.json else format_result(result))
    return 0 if result.identical else 1


def _run_demo(config: LayerKVConfig, args: argparse.Namespace) -> DemoResult:
    """run_demo at its default sizes, or (--tiny, for tests) a 3-layer model and 2 short prompts."""
    import dataclasses

    from layerkv.demos.demo import DEMO_MODEL, run_demo
    from layerkv.engine import ModelConfig

    dtype = "float32" if args.device == "cpu" else "bfloat16"
    if not args.tiny:
        return run_demo(
            config,
            tp_size=args.tp,
            progress=not args.json,
            model=dataclasses.replace(DEMO_MODEL, dtype=dtype),
            device=args.device,
        )
    model = ModelConfig(
        num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, dtype=dtype
    )
    return run_demo(
        config,
        tp_size=args.tp,
        progress=not args.json,
        model=model,
        num_docs=2,
        prefix_tokens=48,
        question_tokens=8,
        max_tokens=3,
        device=args.device,
    )
