"""Sub-commands of the `layerkv` CLI; each module: add_parser(subparsers) -> sets args.func.
Shared here: the --mooncake-log flag of every command that starts Mooncake clients."""

from __future__ import annotations

from typing import Any

MOONCAKE_LOG_LEVELS = ("quiet", "error", "warning", "info")  # = layerkv.store.native_log.LEVELS


def add_mooncake_log_flag(parser: Any) -> None:
    """--mooncake-log: Mooncake's native (glog) lines on this terminal. Cheap: no imports."""
    parser.add_argument(
        "--mooncake-log",
        choices=MOONCAKE_LOG_LEVELS,
        default=None,
        help="Mooncake's own log on stderr: quiet (default: hide its start-up chatter, show errors after), "
        "error, warning or info; also $LAYERKV_MOONCAKE_LOG",
    )
