"""`layerkv segment`: a storage holder on this host for a pool whose master runs elsewhere (`layerkv
master --host`). One Mooncake client mounts a global segment of `--size` bytes into the master's
pool, published at `--host` (this host's address, the one the engines' hosts can reach), and
holds it until SIGINT / SIGTERM; objects the master places there live in this process's memory.
Prints one line once mounted. Exit 1 when the master is unreachable or goes away for good (after
`--give-up-s` without an answer); exit 2 for bad input. Main thread only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from layerkv.commands import add_mooncake_log_flag
from layerkv.commands.master import host_address
from layerkv.errors import ConfigError, StoreError

WATCH_INTERVAL_S = 2.0  # how often the holder checks that its master still answers


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "segment",
        help="hold storage for a pool whose master runs on another host",
        description="Mount a global segment of --size bytes into the pool of the master named by --config (the "
        "client config `layerkv master --host` printed), published at --host; hold it until Ctrl-C.",
    )
    parser.add_argument("--config", type=Path, required=True, help="the Mooncake client config of the pool (JSON)")
    parser.add_argument(
        "--host",
        type=host_address,
        required=True,
        help="this host's IPv4 address, reachable from the engines' hosts (local_hostname)",
    )
    parser.add_argument("--size", default="1GB", help="the segment this process holds (e.g. 512MB, 4GB)")
    parser.add_argument(
        "--give-up-s",
        type=float,
        default=120.0,
        help="exit 1 once the master has not answered for this long (default 120)",
    )
    add_mooncake_log_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.host)  # before mooncake is imported
    from layerkv.store import native_log
    from layerkv.store.mooncake import MooncakeStore
    from layerkv.store.mooncake_config import load_mooncake_config, parse_size
    from layerkv.store.mooncake_master import tcp_reachable

    try:
        native_log.configure(args.mooncake_log)
        size = parse_size(args.size, "--size")
        config = dict(load_mooncake_config(args.config), local_hostname=args.host, global_segment_size=size)
        master = str(config["master_server_address"])
        master_host, _, master_port = master.rpartition(":")
        if not master_host or not master_port.isdigit():
            raise ConfigError(f"{args.config}: master_server_address={master!r} must be host:port")
    except ConfigError as exc:
        print(f"layerkv segment: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        holder = MooncakeStore.from_mooncake_config(config)
    except (StoreError, ConfigError) as exc:
        print(f"layerkv segment: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            json.dumps(
                {"segment": holder.segment_name, "host": args.host, "bytes": size, "master": master, "pid": os.getpid()}
            ),
            flush=True,
        )
        silent_s = 0.0
        while not stop.wait(timeout=WATCH_INTERVAL_S):
            if tcp_reachable(master_host, int(master_port), 1.0) is None:
                silent_s = 0.0
                continue
            silent_s += WATCH_INTERVAL_S
            if silent_s >= args.give_up_s:
                print(
                    f"layerkv segment: master {master} has not answered for {silent_s:.0f} s; giving up",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        print("layerkv segment: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        holder.close()
