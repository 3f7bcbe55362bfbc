"""`layerkv master`: a Mooncake deployment: on loopback for development and demos (the default),
or on one address of this host (`--host`) for a pool that engines and storage holders on other
hosts join (`layerkv segment` adds a holder there; docs/deployment.md).

Starts `mooncake_master` (HTTP metadata server built in) and, in this process, one Mooncake
client that mounts the global segment where objects live; prints the client config as one JSON
line only once its own child is alive and serving the ports (checked by pid); runs until SIGINT /
SIGTERM, then closes the client and stops the master. A taken port fails with the port's holder
and the fix; the child's death at any time ends the command with exit 1 and the log tail.
Main thread only.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from layerkv.commands import add_mooncake_log_flag
from layerkv.errors import ConfigError, PortInUseError, StoreError
from layerkv.store.mooncake_master import DEFAULT_LOCAL_BUFFER_BYTES, LOOPBACK, MasterProcess, start_master

DEFAULT_RPC_PORT = 50051
DEFAULT_HTTP_PORT = 8080
WATCH_INTERVAL_S = 0.5  # how fast the death of mooncake_master is noticed


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "master",
        help="run a mooncake_master (+ a segment holder) on 127.0.0.1 or --host",
        description="Run mooncake_master on 127.0.0.1 (or --host) with an HTTP metadata server and a client that "
        "mounts the global segment; print the Mooncake client config (one JSON line); stop on Ctrl-C. "
        "Fails (exit 1) if a port is taken or the master dies.",
    )
    parser.add_argument(
        "--host",
        type=host_address,
        default=LOOPBACK,
        help="the IPv4 address of this host that the master publishes and other hosts dial (default "
        "127.0.0.1: this host only). Mooncake listens on every interface whatever this says: "
        "expose it only on a network of trusted peers (docs/deployment.md)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_RPC_PORT, help="master RPC port (0: any free port)")
    parser.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP metadata port (0: any free port)"
    )
    parser.add_argument(
        "--segment-size",
        default="1GB",
        help="global segment mounted by this process (e.g. 512MB, 1GB; 0: none, storage on other hosts)",
    )
    parser.add_argument("--client-segment-size", default="0", help="global_segment_size in the printed client config")
    parser.add_argument("--lease-ttl-ms", type=int, default=None, help="master --default_kv_lease_ttl")
    parser.add_argument("--config-out", type=Path, default=None, help="also write the client config JSON here")
    parser.add_argument(
        "--info-out",
        type=Path,
        default=None,
        help="write the deployment's addresses here (JSON: master, metadata_url, metrics_url, pid)",
    )
    parser.add_argument("--log-file", type=Path, default=None, help="mooncake_master log (default: a temp file)")
    parser.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="multi-tenant mode: this tenant (a layerkv `tenant` / mooncake_tenant_id) may hold up to "
        "SIZE (e.g. 512MB); repeat per tenant. Tenants then never see each other's objects and "
        "others cannot write; Mooncake does not authenticate tenant ids (docs/security.md)",
    )
    add_mooncake_log_flag(parser)
    parser.set_defaults(func=run)


def host_address(text: str) -> str:
    """An IPv4 address (argparse type): the address a process publishes to other hosts."""
    try:
        return str(ipaddress.IPv4Address(text))
    except ipaddress.AddressValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address (e.g. 10.0.0.5)") from None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.host)  # before mooncake is imported
    from layerkv.store import native_log
    from layerkv.store.mooncake import MooncakeStore  # imports mooncake lazily
    from layerkv.store.mooncake_config import parse_size

    try:
        native_log.configure(args.mooncake_log)
        segment_bytes = parse_size(args.segment_size, "--segment-size")
        client_segment_bytes = parse_size(args.client_segment_size, "--client-segment-size")
        quotas = _tenant_quotas(args.tenant, parse_size)
    except ConfigError as exc:
        print(f"layerkv master: {exc}", file=sys.stderr)
        return 2
    stop = _stop_on_signals()
    master: MasterProcess | None = None
    holder = None
    try:
        master = start_master(
            args.lease_ttl_ms,
            rpc_port=args.port or None,
            http_port=args.http_port or None,
            log_path=args.log_file,
            tenant_quotas=quotas,
            host=args.host,
        )
        if segment_bytes:  # 0: storage lives only in holders on other hosts (`layerkv segment`)
            holder = MooncakeStore.from_mooncake_config(
                master.config(global_segment_size=segment_bytes), tenant_id=next(iter(quotas)) if quotas else None
            )
        master.check_serving()  # still ours after the holder mounted: only then announce it
        client_config = master.config(
            global_segment_size=client_segment_bytes, local_buffer_size=DEFAULT_LOCAL_BUFFER_BYTES
        )
        if args.info_out is not None:  # before the config line: whoever reads that line may read this
            _write_info(master, args.info_out)
        _announce(master, client_config, segment_bytes, args.config_out)
        return _watch(master, stop)
    except PortInUseError as exc:
        print(f"layerkv master: {exc}\n{_port_fix(exc.port, args)}", file=sys.stderr)
        return 1
    except (StoreError, ConfigError) as exc:
        print(f"layerkv master: {exc}{_death_note(master)}", file=sys.stderr)
        return 1
    finally:
        if holder is not None:
            holder.close()
        if master is not None:
            master.stop()


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set (main thread: the handlers are process-wide)."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _watch(master: MasterProcess, stop: threading.Event) -> int:
    """Until `stop` is set (exit 0), checking that mooncake_master lives; its death: exit 1 and the log tail."""
    while not stop.wait(timeout=WATCH_INTERVAL_S):
        if not master.running():
            print(
                f"layerkv master: {master.describe_exit()} after start; clients of {master.address} "
                f"have no pool now.\nlog {master.log_path} (last lines):\n{master.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    print("layerkv master: stopping", file=sys.stderr, flush=True)
    return 0


def _death_note(master: MasterProcess | None) -> str:
    """How mooncake_master ended and its log tail, if it did ("" while it runs or never started)."""
    if master is None or master.running():
        return ""
    return f"\n{master.describe_exit()}; log {master.log_path}:\n{master.log_tail()}"


def _write_info(master: MasterProcess, path: Path) -> None:
    """The deployment's addresses (--info-out), one JSON line."""
    info = {
        "master": master.address,
        "metadata_url": master.metadata_url,
        "metrics_url": master.metrics_url,
        "pid": master.pid,
    }
    path.write_text(json.dumps(info) + "\n")


def _tenant_quotas(specs: list[str], parse_size: Any) -> dict[str, int] | None:
    """--tenant NAME=SIZE ... -> {name: bytes} (None: single-tenant). ConfigError names the flag."""
    if not specs:
        return None
    quotas: dict[str, int] = {}
    for spec in specs:
        name, sep, size = spec.partition("=")
        if not sep or not name or name in quotas:
            raise ConfigError(f"--tenant {spec!r} must be NAME=SIZE (e.g. tenant-a=512MB), each name once")
        quotas[name] = parse_size(size, f"--tenant {name}")
    return quotas


def _port_fix(port: int, args: argparse.Namespace) -> str:
    """The fix for a taken port, naming the flag that chose it."""
    flag = {args.port: "--port", args.http_port: "--http-port"}.get(port)
    if flag is None:  # an auto-picked port lost three times in a row
        return "Fix: run `layerkv master` again (it picks other free ports)."
    return (
        f"Fix: if that is another `layerkv master`, use the config it printed; or start this one on "
        f"other ports with {flag} <port> (0 picks a free one), e.g. `layerkv master --port 0 --http-port 0`."
    )


def _announce(
    master: MasterProcess, client_config: dict[str, Any], segment_bytes: int, config_out: Path | None
) -> None:
    line = json.dumps(client_config)
    if config_out is not None:
        config_out.write_text(json.dumps(client_config, indent=2) + "\n")
    print(
        f"layerkv master: mooncake_master pid {master.pid} serving {master.address} and metadata "
        f"{master.metadata_url}, "
        + (
            f"{segment_bytes / (1 << 20):.0f} MiB segment held by pid {os.getpid()}"
            if segment_bytes
            else "no segment here (storage: `layerkv segment` on other hosts)"
        )
        + f"; log {master.log_path}.\n"
        f"Metrics and the key listing (/get_all_keys, unauthenticated) on {master.metrics_url}.\n"
        f"Clients: save the JSON below and export MOONCAKE_CONFIG_PATH=<file>"
        + (f" (written to {config_out})" if config_out else "")
        + ". Ctrl-C stops.",
        file=sys.stderr,
        flush=True,
    )
    print(line, flush=True)
