"""The Mooncake client's configuration: the JSON config file (MOONCAKE_CONFIG_PATH), the
arguments `MooncakeDistributedStore.setup` takes built from it, the loopback bind and the
preflight that fails in seconds where Mooncake's own setup retries for ~90 s. Functions of
dicts, files and the environment (the loopback bind sets MC_TCP_BIND_ADDRESS; the preflight
connects), called on the thread that opens a client; no mooncake import (store/mooncake.py is
the only module with one). A bad config is a ConfigError naming the key (or the path); an
unreachable master or metadata server a StoreError naming it.

Loopback: if the client config's local_hostname is a loopback address and MC_TCP_BIND_ADDRESS
is unset, it is set to 127.0.0.1 before mooncake is imported (the address the client publishes
and connects from). That does NOT keep 0.3.13's listeners on loopback: its transfer-engine data
port listens on `*` and its RPC port on 0.0.0.0 whatever it is told, and any peer that reaches
them can read and write every buffer this client registered (the HTTP metadata server publishes
their addresses and lengths). So the worker registers only its staging areas, never the live KV
cache unless `register_kv_cache` (docs/data-safety.md §1), and the test suite runs inside a
network namespace with only loopback (scripts/isolated.sh).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from layerkv.errors import ConfigError, StoreError
from layerkv.store.mooncake_master import MIN_SEGMENT_BYTES, tcp_reachable

REQUIRED_KEYS = ("local_hostname", "metadata_server", "master_server_address")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PREFLIGHT_TIMEOUT_S = 2.0
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1 << 10,
    "MB": 1 << 20,
    "GB": 1 << 30,
    "TB": 1 << 40,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(value: int | str, key: str) -> int:
    """`1073741824`, `"1GB"`, `"512MB"`, `"512 MiB"` -> bytes (binary units). ConfigError names key."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"mooncake config {key}={value!r} must be >= 0")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value)) if isinstance(value, str) else None
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"mooncake config {key}={value!r} must be bytes as an int or a string like '512MB' / '1GB'")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def load_mooncake_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a MOONCAKE_CONFIG_PATH JSON file. ConfigError names the path on any problem."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"mooncake_config_path={str(path)!r} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"mooncake_config_path={str(path)!r} must hold a JSON object, not {type(data).__name__}")
    return data


def setup_args(
    mooncake_config: Mapping[str, Any], master_address: str | None = None, tenant_id: str | None = None
) -> dict[str, Any]:
    """Mooncake JSON config (+ optional master and tenant overrides) -> the dict `setup(config)`
    accepts. The tenant: `tenant_id` (layerkv config mooncake_tenant_id, default the tenant
    label), else the file's `tenant_id`, else Mooncake's "default". A master started with
    --enable_multi_tenants keeps tenants' objects and quotas apart; it does not authenticate them."""
    missing = [key for key in REQUIRED_KEYS if not mooncake_config.get(key)]
    if missing:
        raise ConfigError(f"mooncake config lacks required key(s) {', '.join(missing)}; got {sorted(mooncake_config)}")
    return {
        "local_hostname": str(mooncake_config["local_hostname"]),
        "metadata_server": str(mooncake_config["metadata_server"]),
        "global_segment_size": parse_size(
            mooncake_config.get("global_segment_size", MIN_SEGMENT_BYTES), "global_segment_size"
        ),
        "local_buffer_size": parse_size(
            mooncake_config.get("local_buffer_size", MIN_SEGMENT_BYTES), "local_buffer_size"
        ),
        "protocol": str(mooncake_config.get("protocol") or "tcp"),
        "rdma_devices": str(mooncake_config.get("device_name") or ""),
        "master_server_addr": master_address or str(mooncake_config["master_server_address"]),
        "tenant_id": tenant_id or str(mooncake_config.get("tenant_id") or "default"),
    }


def bind_loopback_if_local(local_hostname: str) -> None:
    """MC_TCP_BIND_ADDRESS=127.0.0.1 for a loopback client unless the user set it already."""
    host = local_hostname.rsplit(":", 1)[0] if local_hostname.count(":") == 1 else local_hostname
    if host in LOOPBACK_HOSTS and not os.environ.get("MC_TCP_BIND_ADDRESS"):
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"


def preflight(args: Mapping[str, Any]) -> None:
    """Fail in seconds if the master (or an HTTP metadata server) does not accept connections:
    Mooncake's own setup retries for ~90 s against a dead master."""
    master = args["master_server_addr"]
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"master_server_address={master!r} must be host:port, e.g. 127.0.0.1:50051")
    error = tcp_reachable(host, int(port), PREFLIGHT_TIMEOUT_S)
    if error is not None:
        raise StoreError(
            f"mooncake master at {master} is not reachable ({error}); start one with `layerkv master` "
            "or fix master_server_address / MOONCAKE_MASTER"
        )
    url = urlsplit(args["metadata_server"])
    if url.scheme == "http" and url.hostname:
        error = tcp_reachable(url.hostname, url.port or 80, PREFLIGHT_TIMEOUT_S)
        if error is not None:
            raise StoreError(f"mooncake metadata server {args['metadata_server']} is not reachable ({error})")
