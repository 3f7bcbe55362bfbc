"""`layerkv pool`: what is in a Mooncake pool, per layerkv namespace (model, tenant label,
settings digest, objects, bytes; from the manifests layerkv writes, objects/manifest.py), the
master's capacity and usage, and `--purge NAMESPACE`. Main thread only.

Where each figure comes from (Mooncake 0.3.13, the master's metrics port, unauthenticated):
`/get_all_keys` (every key), `/batch_query_keys` (each object's replicas and their sizes),
`/metrics` (capacity, allocated bytes, key count). Manifests are read, and a purge removes, with
a Mooncake client of the pool's config that mounts no memory (global_segment_size 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from layerkv.commands import add_mooncake_log_flag
from layerkv.errors import ConfigError, StoreError
from layerkv.objects.manifest import MANIFEST_MAX_BYTES, is_manifest_key, parse_manifest
from layerkv.store.base import Code, KVStore, ObjectKey, code_name

HTTP_TIMEOUT_S = 30.0
QUERY_BATCH_KEYS = 100  # keys per /batch_query_keys request (one URL: ~8 KB of layerkv keys)
REMOVE_BATCH_KEYS = 1000
OTHER = "(not layerkv)"  # keys without '@': another user of the pool
_QUERYABLE_KEY = re.compile(r"[A-Za-z0-9._@:/-]+")  # sent in a URL unquoted, ',' separated
_USAGE_METRICS = ("master_total_capacity_bytes", "master_allocated_bytes", "master_key_count")  # PoolUsage's order
_METRIC = re.compile(rf"^({'|'.join(_USAGE_METRICS)}) (\S+)$", re.MULTILINE)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pool",
        help="list what uses a Mooncake pool per namespace (model, tenant, bytes); --purge one",
        description="List the pool's layerkv namespaces (model, tenant label, settings digest, objects, bytes) "
        "and the master's capacity and usage; --purge NAMESPACE removes every object of one.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--metrics-url",
        default=None,
        help="the master's metrics port, e.g. http://10.0.0.1:9003 (`layerkv master` prints it)",
    )
    where.add_argument(
        "--master-info", type=Path, default=None, help="the JSON `layerkv master --info-out` wrote (its metrics_url)"
    )
    parser.add_argument("--config", default=None, help="Mooncake JSON config (default: $MOONCAKE_CONFIG_PATH)")
    parser.add_argument("--json", action="store_true", help="print the listing as one JSON object")
    parser.add_argument(
        "--purge",
        default=None,
        metavar="NAMESPACE",
        help="remove every object of NAMESPACE (its manifest too); asks first unless --yes",
    )
    parser.add_argument("--yes", action="store_true", help="with --purge: remove without asking")
    add_mooncake_log_flag(parser)
    parser.set_defaults(func=run)


@dataclass(slots=True)
class NamespaceUsage:
    """One namespace's objects; `manifest`: its parsed manifest (None: none, or unreadable)."""

    namespace: str
    num_objects: int = 0
    nbytes: int = 0  # memory its objects' replicas take
    manifest_key: ObjectKey | None = None
    manifest: dict[str, Any] | None = None
    keys: list[ObjectKey] = field(default_factory=list, repr=False)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    capacity_bytes: int
    used_bytes: int
    num_keys: int


class MasterHttp:
    """The master's metrics port. Every method raises StoreError naming the URL on failure."""

    def __init__(self, metrics_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.url = metrics_url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as answer:
                return str(answer.read().decode())
        except (OSError, urllib.error.URLError, UnicodeDecodeError) as exc:
            raise StoreError(
                f"the master's metrics port {self.url} did not answer {path.split('?')[0]} ({exc}); "
                "fix --metrics-url / --master-info (`layerkv master` prints the URL)"
            ) from exc

    def keys(self) -> list[ObjectKey]:
        return [key for key in self._get("/get_all_keys").splitlines() if key]

    def object_sizes(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, int]:
        """Bytes per key that still exists (the sum over its memory replicas); keys that are
        gone, or that a URL cannot carry unquoted, are left out."""
        queryable = [k for k in keys if _QUERYABLE_KEY.fullmatch(k)]
        sizes: dict[ObjectKey, int] = {}
        for start in range(0, len(queryable), QUERY_BATCH_KEYS):
            text = self._get("/batch_query_keys?keys=" + ",".join(queryable[start : start + QUERY_BATCH_KEYS]))
            try:
                data = json.loads(text)["data"]
                for key, entry in data.items():
                    if entry.get("ok"):
                        sizes[key] = sum(int(replica["size_"]) for replica in entry.get("values") or ())
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise StoreError(
                    f"{self.url}/batch_query_keys answered {text[:200]!r}: not Mooncake 0.3.13's format ({exc!r})"
                ) from exc
        return sizes

    def usage(self) -> PoolUsage:
        found = {name: int(float(value)) for name, value in _METRIC.findall(self._get("/metrics"))}
        missing = [name for name in _USAGE_METRICS if name not in found]
        if missing:
            raise StoreError(f"{self.url}/metrics lacks {', '.join(missing)}: not Mooncake 0.3.13's master")
        return PoolUsage(*(found[name] for name in _USAGE_METRICS))


def group_by_namespace(keys: Sequence[ObjectKey], sizes: dict[ObjectKey, int]) -> dict[str, NamespaceUsage]:
    """Keys (those `sizes` has) by namespace, the part before the first '@'; keys without one
    under OTHER."""
    groups: dict[str, NamespaceUsage] = {}
    for key in keys:
        if key not in sizes:
            continue
        name, at, _ = key.partition("@")
        usage = groups.setdefault(name if at else OTHER, NamespaceUsage(name if at else OTHER))
        usage.num_objects += 1
        usage.nbytes += sizes[key]
        usage.keys.append(key)
        if at and is_manifest_key(key):
            usage.manifest_key = key
    return groups


def read_manifests(store: KVStore, groups: dict[str, NamespaceUsage]) -> None:
    """Fill each group's `manifest` from its manifest object (left None if it cannot be read)."""
    having = [g for g in groups.values() if g.manifest_key is not None]
    if not having:
        return
    buffer = np.zeros(len(having) * MANIFEST_MAX_BYTES, dtype=np.uint8)  # [manifests * max bytes]
    base = buffer.ctypes.data
    store.register_buffer(base, buffer.nbytes)
    try:
        got = store.batch_get_into(
            [g.manifest_key for g in having if g.manifest_key is not None],
            [base + i * MANIFEST_MAX_BYTES for i in range(len(having))],
            [MANIFEST_MAX_BYTES] * len(having),
        )
    finally:
        store.unregister_buffer(base)
    for i, (group, nbytes) in enumerate(zip(having, got)):
        if nbytes > 0:
            group.manifest = parse_manifest(buffer[i * MANIFEST_MAX_BYTES : i * MANIFEST_MAX_BYTES + nbytes].tobytes())


def run(args: argparse.Namespace) -> int:
    if args.yes and args.purge is None:
        raise ConfigError("--yes only goes with --purge NAMESPACE")
    if args.purge is not None and not args.yes and not sys.stdin.isatty():
        raise ConfigError(
            f"--purge {args.purge} asks before removing anything, and stdin is not a terminal: "
            "add --yes to remove without asking"
        )
    http = MasterHttp(_metrics_url(args))
    config = _mooncake_config(args.config)
    from layerkv.store import native_log
    from layerkv.store.checked import CheckedStore
    from layerkv.store.mooncake import MooncakeStore  # imports mooncake lazily

    native_log.configure(args.mooncake_log)
    usage = http.usage()
    keys = http.keys()
    groups = group_by_namespace(keys, http.object_sizes(keys))
    if args.purge is not None:
        namespace_usage(groups, args.purge)  # an unknown one fails before a client starts
    store = CheckedStore(
        MooncakeStore.from_mooncake_config(dict(config, global_segment_size=0)), max_batch_keys=REMOVE_BATCH_KEYS
    )
    try:
        read_manifests(store, groups)
        if args.purge is not None:
            return purge(store, groups, args.purge, ask=not args.yes)
        listing = _listing(config, http.url, usage, groups)
        print(json.dumps(listing) if args.json else render(listing), flush=True)
        return 0
    finally:
        store.close()


def purge(store: KVStore, groups: dict[str, NamespaceUsage], namespace: str, *, ask: bool) -> int:
    """Remove every object of `namespace`; 0 if all went (or were gone already), 1 otherwise.
    Raises ConfigError for a namespace the pool does not hold."""
    group = namespace_usage(groups, namespace)
    what = (
        f"{group.num_objects} objects ({_size(group.nbytes)}) of namespace {namespace} "
        f"(model {_label(group, 'model')}, tenant {_label(group, 'tenant')})"
    )
    if ask:
        try:
            answer = input(f"layerkv pool: remove {what}? Engines using it recompute. [y/N] ").strip().lower()
        except EOFError:  # the terminal closed: no answer is no
            answer = ""
        if answer not in ("y", "yes"):
            print("layerkv pool: nothing removed", flush=True)
            return 1
    got = store.batch_remove(group.keys)
    gone = sum(1 for code in got if code == int(Code.OBJECT_NOT_FOUND))
    failed = sorted({code_name(code) for code in got if code not in (0, int(Code.OBJECT_NOT_FOUND))})
    removed = sum(1 for code in got if code == 0)
    print(
        f"layerkv pool: removed {removed} of {what}"
        + (f"; {gone} were gone already" if gone else "")
        + (f"; {len(got) - removed - gone} failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


def namespace_usage(groups: dict[str, NamespaceUsage], namespace: str) -> NamespaceUsage:
    """`groups[namespace]`; ConfigError naming the known namespaces for one the pool lacks."""
    group = groups.get(namespace) if namespace != OTHER else None
    if group is None:
        known = ", ".join(sorted(n for n in groups if n != OTHER)) or "none"
        raise ConfigError(
            f"namespace {namespace!r} is not in the pool (its namespaces: {known}); `layerkv pool` lists them"
        )
    return group


def _listing(
    config: dict[str, Any], metrics_url: str, usage: PoolUsage, groups: dict[str, NamespaceUsage]
) -> dict[str, Any]:
    """The listing as plain data (what --json prints)."""
    rows = []
    for group in sorted(groups.values(), key=lambda g: (g.namespace == OTHER, -g.nbytes, g.namespace)):
        manifest = group.manifest or {}
        rows.append(
            {
                "namespace": group.namespace,
                "model": manifest.get("model"),
                "tenant": manifest.get("tenant"),
                "digest": manifest.get("digest"),
                "pp_rank": manifest.get("pp_rank"),
                "cp_rank": manifest.get("cp_rank"),
                "settings": manifest.get("settings"),
                "created_at": manifest.get("created_at"),
                "num_objects": group.num_objects,
                "nbytes": group.nbytes,
            }
        )
    return {
        "master": config.get("master_server_address"),
        "metrics_url": metrics_url,
        **asdict(usage),
        "num_listed": sum(g.num_objects for g in groups.values()),
        "namespaces": rows,
    }


def render(listing: dict[str, Any]) -> str:
    """The listing as a table, headed by the master's capacity and usage."""
    cap, used = listing["capacity_bytes"], listing["used_bytes"]
    share = f" ({100 * used / cap:.1f}%)" if cap else ""
    lines = [
        (
            f"master {listing['master']} (metrics {listing['metrics_url']}): {_size(used)} of {_size(cap)} used"
            f"{share}, {listing['num_keys']} objects"
        )
    ]
    if listing["num_keys"] > listing["num_listed"]:
        lines.append(
            f"  {listing['num_keys'] - listing['num_listed']} objects are not in the master's key listing "
            "(a multi-tenant master lists no tenant's keys)"
        )
    table = [("NAMESPACE", "MODEL", "TENANT", "SETTINGS", "DIGEST", "OBJECTS", "BYTES")]
    for row in listing["namespaces"]:
        unknown = "-" if row["namespace"] == OTHER else "?"
        table.append(
            (
                row["namespace"],
                row["model"] or unknown,
                row["tenant"] or unknown,
                _settings(row),
                row["digest"] or ("-" if row["namespace"] == OTHER else "? (no manifest)"),
                str(row["num_objects"]),
                _size(row["nbytes"]),
            )
        )
    if len(table) == 1:
        return "\n".join([*lines, "no objects"])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        cells = [c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _settings(row: dict[str, Any]) -> str:
    s = row.get("settings") or {}
    if not s:
        return "-" if row["namespace"] == OTHER else "?"
    shards = s.get("store_shards")
    parts = [
        f"block {s.get('block_size')}",
        str(s.get("kv_dtype")),
        f"{shards} shard{'s' if shards != 1 else ''}",
        f"tp {s.get('tp_size')}",
    ]
    if (s.get("pp_size") or 1) > 1:
        parts.append(f"pp {row.get('pp_rank')}/{s.get('pp_size')}")
    if (s.get("dcp_size") or 1) > 1:
        parts.append(f"dcp {row.get('cp_rank')}/{s.get('dcp_size')} interleave {s.get('cp_interleave')}")
    parts += [name for name in ("keyed", "encrypted") if s.get(name)]
    return ", ".join(parts)


def _label(group: NamespaceUsage, name: str) -> str:
    return str((group.manifest or {}).get(name) or "?")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _metrics_url(args: argparse.Namespace) -> str:
    if args.metrics_url:
        return str(args.metrics_url)
    if args.master_info is None:
        raise ConfigError(
            "give --metrics-url URL (the master's metrics port) or --master-info FILE "
            "(what `layerkv master --info-out FILE` wrote)"
        )
    try:
        return str(json.loads(args.master_info.read_text())["metrics_url"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--master-info {args.master_info}: no metrics_url in it ({exc!r}); "
            "it is the JSON `layerkv master --info-out` writes"
        ) from exc


def _mooncake_config(path: str | None) -> dict[str, Any]:
    from layerkv.store.mooncake_config import load_mooncake_config

    path = path or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        raise ConfigError("no --config given and MOONCAKE_CONFIG_PATH is unset: give the pool's Mooncake JSON config")
    return load_mooncake_config(path)
