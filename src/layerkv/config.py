"""The one validated layerkv config, built once at startup from the engine's extra config dict
plus the environment. The only reader of user / engine dicts. Frozen: never mutated after
construction; derived sizes live in the layout object. Any thread may read it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from layerkv.errors import ConfigError
from layerkv.store.registry import backend_rule, is_backend

MiB = 1 << 20
GiB = 1 << 30


class PlanMode(StrEnum):
    """How a step's loads read (`transfer_plan`; the planner's plan kinds are the last three)."""

    AUTO = "auto"  # chosen per step from measured costs (transfer/planner.py)
    LAYERS = "layers"  # one range call per layer (straight into the cache only with register_kv_cache)
    GROUPS = "groups"  # groups of layers, one range per key per group, through staging
    WHOLE = "whole"  # one whole-object read per key into staging, then scatter (no session)


_PLAN_MODES = tuple(m.value for m in PlanMode)


def _rule(rule: str, check: Any, fix: str = "") -> dict[str, Any]:
    return {"rule": rule, "check": check, "fix": fix}


@dataclass(frozen=True, slots=True)
class LayerKVConfig:
    """Build with `LayerKVConfig.from_dict(extra_config)`; the defaults work for one process."""

    # The store: a built-in backend's name (store/registry.py), or an out-of-tree backend's
    # "package.module:Class" (a store/base.py StoreBackend; imported when a store is opened).
    backend: str = field(default="embedded", metadata=_rule(backend_rule(), is_backend))
    # Mooncake client config file (JSON: local_hostname, metadata_server, master_server_address,
    # protocol, device_name, global_segment_size, local_buffer_size). Default: $MOONCAKE_CONFIG_PATH.
    mooncake_config_path: str | None = field(default=None, metadata=_rule("a path or null", lambda v: True))
    # Master address override (host:port); default: $MOONCAKE_MASTER, else the config file's.
    mooncake_master: str | None = field(
        default=None, metadata=_rule("host:port or null", lambda v: v is None or ":" in v, "e.g. 127.0.0.1:50051")
    )
    # How a step's loads read: "auto" chooses per step (per layer, layer groups through host
    # staging, or whole objects, and the concurrent calls) from measured transfer and compute
    # times; "layers" reads layer by layer (prefetch_layers ahead; through staging, or straight
    # into the cache with register_kv_cache); "groups" reads read_layers_per_range layers per
    # range through staging; "whole" reads whole objects through staging.
    transfer_plan: str = field(
        default=PlanMode.AUTO.value, metadata=_rule(f"one of {', '.join(_PLAN_MODES)}", lambda v: v in _PLAN_MODES)
    )
    # Register the engine's live KV cache with the store for zero-copy per-layer transfers
    # straight into / out of it ("layers" plans). Any peer that reaches the store's transfer
    # ports can then read and write that memory (Mooncake serves every registered byte to any
    # peer and listens on all interfaces): only on a fabric where every peer is trusted. False:
    # only the staging area below is registered and every byte is verified there first.
    register_kv_cache: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # Host memory per worker for staging (registered once at start-up): a quarter for loads
    # (they stream through it a wave at a time), the rest for saves (a step's new blocks beyond
    # it are not saved), each at most what the KV cache could use; mapped as it is used. The
    # loads' quarter must hold one object (checked at registration, naming the minimum).
    staging_nbytes: int = field(
        default=512 * MiB,
        metadata=_rule("4 KiB <= value <= 1 TiB", lambda v: 4096 <= v <= (1 << 40), "default is 512 MiB"),
    )
    # "layers" / "groups" plans: read at most this many layers ahead of compute
    prefetch_layers: int = field(default=2, metadata=_rule("1 <= value <= 64", lambda v: 1 <= v <= 64))
    # "groups" plans: layers per range per key into a host staging slot, then scattered (layer 0
    # alone first).
    read_layers_per_range: int = field(
        default=1, metadata=_rule("1 <= value <= 64", lambda v: 1 <= v <= 64, "default is 1")
    )
    # concurrent range calls per transfer (Mooncake's TCP transport serialises the ranges of one
    # call); 0 = auto (up to 4, at least 8 keys per call)
    transfer_lanes: int = field(
        default=0, metadata=_rule("0 <= value <= 8", lambda v: 0 <= v <= 8, "default is 0 (auto)")
    )
    max_transfer_blocks: int = field(
        default=64, metadata=_rule("1 <= value <= 65536", lambda v: 1 <= v <= 65536, "default is 64")
    )
    max_transfer_bytes: int = field(
        default=16 * MiB, metadata=_rule("4096 <= value <= 4 GiB", lambda v: 4096 <= v <= 4 * GiB, "default is 16 MiB")
    )
    exists_window_blocks: int = field(
        default=32, metadata=_rule("1 <= value <= 65536", lambda v: 1 <= v <= 65536, "default is 32")
    )
    # Bounds on the compute thread's waits: a layer not read in time is recomputed, a save not
    # written in time is revoked. Never an exception into the engine.
    load_timeout_s: float = field(default=5.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    save_timeout_s: float = field(default=10.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    # Save the blocks a request's answer fills (decode steps) as well as its prompt's: a later turn
    # that sends the answer back as its prompt hits them. False: prompts only (as vLLM's
    # MooncakeStoreConnector by default), no save work in decode steps.
    save_decode_blocks: bool = field(default=True, metadata=_rule("true or false", lambda v: True))
    # A step's written objects wait for the scheduler's verdict (every rank and stage clean) at
    # most this long, then they are revoked (Mooncake discards put starts after 30 s).
    commit_timeout_s: float = field(
        default=20.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600, "default is 20")
    )
    # Prefill/decode: a request whose kv_transfer_params name the prefix a prefill server commits
    # (layerkv_prefix_tokens) waits this long for it in the pool (its lookup answers "ask again",
    # the engine serves other requests), then loads what is there and computes the rest. 0: no wait.
    prefill_wait_s: float = field(
        default=5.0, metadata=_rule("0 <= value <= 600", lambda v: 0 <= v <= 600, "default is 5")
    )
    # Objects per block: the KV heads split into this many head ranges (0: one per head group of
    # this server, min(tp_size, num_kv_heads)). Servers of different TP sizes share objects when
    # they split alike: set it on each to the largest TP size among them (e.g. 2 for a TP=2
    # prefill server and a TP=1 decode server). Must divide the KV heads.
    store_shards: int = field(
        default=0, metadata=_rule("0 <= value <= 1024", lambda v: 0 <= v <= 1024, "default is 0 (one per head group)")
    )
    # A load that has held its get sessions this long restarts them (below the store's lease
    # TTL: Mooncake's default_kv_lease_ttl is 10 s, the embedded store's embedded_lease_ttl_s).
    lease_renew_after_s: float = field(
        default=5.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600, "default is 5")
    )
    # Bound on every call that talks to the master (metadata, session start / end / revoke);
    # past it the call counts as an outage (Mooncake answers a hung master after ~30 s).
    store_call_timeout_s: float = field(
        default=2.0, metadata=_rule("0 < value <= 600", lambda v: 0 < v <= 600, "default is 2")
    )
    # After the store answers RPC_FAIL / RPC_TIMEOUT (master unreachable or hung), serve without
    # the pool this long before probing it again.
    store_retry_interval_s: float = field(default=5.0, metadata=_rule("0 < value <= 600", lambda v: 0 < v <= 600))
    # Pins the identity of the model weights in the namespace (default: the engine's revision,
    # else a fingerprint of the checkpoint files). Deployments with different values never share.
    model_fingerprint: str = field(default="", metadata=_rule("a string", lambda v: True))
    tenant: str = field(
        default="default", metadata=_rule("a non-empty string without '@'", lambda v: bool(v) and "@" not in v)
    )
    # The Mooncake tenant this engine's client claims (empty: the `tenant` label). A master
    # started with multi-tenant mode (`layerkv master --tenant NAME=BYTES`) keeps each tenant's
    # objects apart and within its quota; Mooncake does not authenticate it (any client can claim
    # any tenant): it bounds what a tenant's own bugs can do, the tenant key protects the bytes.
    mooncake_tenant_id: str = field(default="", metadata=_rule("a string", lambda v: True))
    # vLLM engines on a shared pool (Mooncake) with --prefix-caching-hash-algo xxhash*: refused
    # at start-up (crafted prompts can collide with another user's prefix) unless true.
    allow_weak_block_hashes: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # The tenant's secret (a file readable by its owner only, as `layerkv keygen` writes it;
    # default $LAYERKV_TENANT_KEY_FILE). With it object names are keyed hashes nobody else can
    # compute and every object is authenticated (BLAKE3-keyed MACs); engines share objects only
    # with engines holding the same key. Without it, anyone who reaches the pool can read, list
    # and forge objects (docs/security.md).
    tenant_key_file: str | None = field(default=None, metadata=_rule("a path or null", lambda v: v is None or bool(v)))
    # Encrypt every layer (AES-256-GCM under a subkey of the tenant key, a fresh key per object
    # write), in private memory before it reaches staging; readers decrypt in private memory
    # before the cache. Needs tenant_key_file. Nothing stored in clear says anything of the KV.
    encrypt_objects: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # Retired (accepted, ignored, a startup warning): vLLM keeps its full CUDA graphs on every
    # role now; a decode step carries no per-layer work (connector/graphs.py, docs/gpu.md).
    full_cudagraphs: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # Placement of new objects (Mooncake ReplicateConfig).
    replica_num: int = field(default=1, metadata=_rule("1 <= value <= 16", lambda v: 1 <= v <= 16))
    preferred_segment: str = field(default="", metadata=_rule("a segment name or ''", lambda v: True))
    prefer_alloc_in_same_node: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    # Embedded backend.
    embedded_capacity_bytes: int = field(
        default=1 * GiB, metadata=_rule("16 MiB <= value <= 1 TiB", lambda v: 16 * MiB <= v <= (1 << 40))
    )
    embedded_lease_ttl_s: float = field(default=10.0, metadata=_rule("0 < value <= 3600", lambda v: 0 < v <= 3600))
    embedded_put_timeout_s: float = field(default=600.0, metadata=_rule("0 < value <= 86400", lambda v: 0 < v <= 86400))
    # LAYERKV_RANGE_DEBUG: one JSON line per range call / commit / whole-object call.
    range_debug: bool = field(default=False, metadata=_rule("true or false", lambda v: True))
    range_debug_path: str | None = field(default=None, metadata=_rule("a file path or null (stderr)", lambda v: True))

    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, hints[f.name])
            if not f.metadata["check"](value):
                fix = f"; {f.metadata['fix']}" if f.metadata["fix"] else ""
                raise ConfigError(f"{f.name}={value!r} must be {f.metadata['rule']}{fix}")
        if self.backend == "embedded" and self.lease_renew_after_s >= self.embedded_lease_ttl_s:
            raise ConfigError(
                f"lease_renew_after_s={self.lease_renew_after_s!r} must be below embedded_lease_ttl_s="
                f"{self.embedded_lease_ttl_s!r}: a load's leases would expire before it renews them"
            )
        if self.encrypt_objects and not self.tenant_key_file:
            raise ConfigError(
                "encrypt_objects=true needs tenant_key_file (the key the objects are encrypted with; "
                "`layerkv keygen FILE` writes one)"
            )

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LayerKVConfig:
        """Validate `extra` (the engine's kv_connector_extra_config) and the environment.

        Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the key.
        Environment: MOONCAKE_CONFIG_PATH, MOONCAKE_MASTER, LAYERKV_TENANT_KEY_FILE (each
        overridden by the key in `extra`), LAYERKV_RANGE_DEBUG (exactly 0 or 1).
        """
        env = os.environ if env is None else env
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ConfigError(
                f"unknown layerkv config key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(names))}"
            )
        values: dict[str, Any] = {}
        if env.get("MOONCAKE_CONFIG_PATH"):
            values["mooncake_config_path"] = env["MOONCAKE_CONFIG_PATH"]
        if env.get("MOONCAKE_MASTER"):
            values["mooncake_master"] = env["MOONCAKE_MASTER"]
        if env.get("LAYERKV_TENANT_KEY_FILE"):
            values["tenant_key_file"] = env["LAYERKV_TENANT_KEY_FILE"]
        values.update(extra)
        debug = env.get("LAYERKV_RANGE_DEBUG")
        if debug is not None:
            if debug not in ("0", "1"):
                raise ConfigError(f"LAYERKV_RANGE_DEBUG={debug!r} must be exactly '0' or '1'")
            values["range_debug"] = debug == "1"
        return cls(**values)

    def replace(self, **changes: Any) -> LayerKVConfig:
        """A validated copy with `changes` applied (the original is untouched)."""
        return dataclasses.replace(self, **changes)


def _check_type(name: str, value: Any, hint: Any) -> None:
    """ConfigError unless `value` is of the (resolved) annotation `hint`: int, float (an int is
    fine), bool, str, a Literal, or a union of them (`X | None`). A bool is never an int."""
    if not _is_instance(value, hint):
        raise ConfigError(f"{name}={value!r} must be of type {_type_text(hint)}, not {type(value).__name__}")


def _is_instance(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:  # the type here; which values are allowed is the field's rule
        return any(type(value) is type(arg) for arg in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    raise AssertionError(f"config type {hint!r} has no check")  # a field with a type this checker does not know


def _type_text(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(sorted({type(a).__name__ for a in typing.get_args(hint)}))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


@functools.cache
def _hints() -> dict[str, Any]:
    """The resolved field annotations of LayerKVConfig (computed once)."""
    return typing.get_type_hints(LayerKVConfig)
