"""`layerkv` command line: one sub-command per module in layerkv.commands. Each module has
`add_parser(subparsers)` (cheap: no heavy imports) and sets `func` to its runner.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command modules, in the order `layerkv --help` lists them.
COMMANDS = ("demo", "master", "segment", "pool", "keygen", "doctor", "bench", "pd_proxy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerkv", description="Layerwise KV-cache pool for LLM inference engines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:  # a command module that fails to import is a broken install: let it raise
        importlib.import_module(f"layerkv.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from layerkv.errors import LayerKVError

    try:
        return int(args.func(args) or 0)
    except LayerKVError as exc:  # a setup problem the user can fix: the message, no traceback
        print(f"layerkv {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
