"""The one validated layerkv config, built once at startup from the engine's extra config dict
plus the environment. The only reader of user / engine dicts. Frozen: never mutated after
construction; derived sizes live in the layout object. Any thread may read it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from layerkv.errors import ConfigError
from layerkv.store.base import Placement

MiB = 1 << 20
GiB = 1 << 30
Backend = Literal["embedded", "mooncake"]
_BACKENDS = ("embedded", "mooncake")


def _rule(rule: str, check: Any, fix: str = "") -> dict[str, Any]:
    return {"rule": rule, "check": check, "fix": fix}


@dataclass(frozen=True, slots=True)
class LayerKVConfig:
    """Build with `LayerKVConfig.from_dict(extra_config)`; the defaults work for one process."""

    backend: Backend = field(default="embedded", metadata=_rule("one of embedded, mooncake", lambda v: v in _BACKENDS))
    # Mooncake client config file (JSON: local_hostname, metadata_server, master_server_address,
    # protocol, device_name, global_segment_size, local_buffer_size). Default: $MOONCAKE_CONFIG_PATH.
    mooncake_config_path: str | None = field(default=None, metadata=_rule("a path or null", lambda v: True))
    # Master address override (host:port); default: $MOONCAKE_MASTER, else the config file's.
    mooncake_master: str | None = field(default=None, metadata=_rule("host:port or null", lambda v: v is None or ":" in v, "e.g. 127.0.0.1:50051"))
    prefetch_layers: int = field(default=2, metadata=_rule("1 <= value <= 64", lambda v: 1 <= v <= 64))
    # Load side: read this many layers per range per key into a host staging row, then scatter
    # (layer 0 alone first). 1 = one range per cache entry per layer. Host (CPU) caches only.
    read_layers_per_range: int = field(default=1, metadata=_rule("1 <= value <= 64", lambda v: 1 <= v <= 64, "default is 1"))
    max_transfer_blocks: int = field(default=64, metadata=_rule("1 <= value <= 65536", lambda v: 1 <= v <= 65536, "default is 64"))
    max_transfer_bytes: int = field(default=16 * MiB, metadata=_rule("4096 <= value <= 4 GiB", lambda v: 4096 <= v <= 4 * GiB, "default is 16 MiB"))
    exists_window_blocks: int = field(default=32, metadata=_rule("1 <= value <= 65536", lambda v: 1 <= v <= 65536, "default is 32"))
    load_timeout_s: float = field(default=30.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    save_timeout_s: float = field(default=60.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    # After the store answers RPC_FAIL (master unreachable), serve without the pool this long
    # before probing it again (Mooncake spends ~4.4 s per call reconnecting to a dead master).
    store_retry_interval_s: float = field(default=5.0, metadata=_rule("0 < value <= 600", lambda v: 0 < v <= 600))
    tenant: str = field(default="default", metadata=_rule("a non-empty string without '@'", lambda v: bool(v) and "@" not in v))
    # Placement of new objects (Mooncake ReplicateConfig).
    replica_num: int = field(default=1, metadata=_rule("1 <= value <= 16", lambda v: 1 <= v <= 16))
    preferred_segment: str = field(default="", metadata=_rule("a segment name or ''", lambda v: True))
    prefer_alloc_in_same_node: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # Embedded backend.
    embedded_capacity_bytes: int = field(default=1 * GiB, metadata=_rule("16 MiB <= value <= 1 TiB", lambda v: 16 * MiB <= v <= (1 << 40)))
    embedded_lease_ttl_s: float = field(default=10.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    embedded_put_timeout_s: float = field(default=600.0, metadata=_rule("0 < value <= 86400", lambda v: 0 < v <= 86400))
    # LAYERKV_RANGE_DEBUG: one JSON line per range call / commit / whole-object call.
    range_debug: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    range_debug_path: str | None = field(default=None, metadata=_rule("a file path or null (stderr)", lambda v: True))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, f.type)
            if not f.metadata["check"](value):
                fix = f"; {f.metadata['fix']}" if f.metadata["fix"] else ""
                raise ConfigError(f"{f.name}={value!r} must be {f.metadata['rule']}{fix}")

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LayerKVConfig:
        """Validate `extra` (the engine's kv_connector_extra_config) and the environment.

        Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the key.
        Environment: MOONCAKE_CONFIG_PATH, MOONCAKE_MASTER, LAYERKV_RANGE_DEBUG (exactly 0 or 1).
        """
        env = os.environ if env is None else env
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ConfigError(
                f"unknown layerkv config key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(names))}"
            )
        values: dict[str, Any] = {}
        if env.get("MOONCAKE_CONFIG_PATH"):
            values["mooncake_config_path"] = env["MOONCAKE_CONFIG_PATH"]
        if env.get("MOONCAKE_MASTER"):
            values["mooncake_master"] = env["MOONCAKE_MASTER"]
        values.update(extra)
        debug = env.get("LAYERKV_RANGE_DEBUG")
        if debug is not None:
            if debug not in ("0", "1"):
                raise ConfigError(f"LAYERKV_RANGE_DEBUG={debug!r} must be exactly '0' or '1'")
            values["range_debug"] = debug == "1"
        return cls(**values)

    @property
    def placement(self) -> Placement:
        return Placement(self.replica_num, self.preferred_segment, self.prefer_alloc_in_same_node)

    def replace(self, **changes: Any) -> LayerKVConfig:
        """A validated copy with `changes` applied (the original is untouched)."""
        return dataclasses.replace(self, **changes)


def _check_type(name: str, value: Any, annotation: Any) -> None:
    text = str(annotation)
    allowed: tuple[type, ...]
    if text.startswith("Backend") or text.startswith("str"):
        allowed = (str,)
    elif text.startswith("int"):
        allowed = (int,)
    elif text.startswith("float"):
        allowed = (int, float)
    elif text.startswith("bool"):
        allowed = (bool,)
    else:  # pragma: no cover - a field with a type this checker does not know
        raise AssertionError(f"config field {name} has unchecked type {text}")
    if value is None and "None" in text:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{name}={value!r} must be of type {text}, not bool")
    if not isinstance(value, allowed):
        raise ConfigError(f"{name}={value!r} must be of type {text}, not {type(value).__name__}")
