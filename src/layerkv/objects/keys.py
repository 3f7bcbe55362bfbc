"""Namespaces, storage ranks and block keys (pure functions, no state). Used on both sides: the
scheduler builds every storage rank's keys for exists queries, the worker builds its own rank's
keys for sessions. Any thread.

    key = <namespace>@<block_id_hex>@<storage_rank>      namespace = <model-basename>-<digest16hex>

A storage rank is a shard of the block's KV heads: shard i of S holds heads [i * H / S, (i + 1) * H / S)
(`storage_role`; the namespace binds H and S, so the index names the head range).

With a tenant key (layerkv.objects.tenant_key) the digest and every block id are keyed BLAKE3 hashes
under the key's names subkey: nobody without the key can compute, probe or squat the keys.
Without one, the digest is a sha256 of the deployment and the block id is the engine's hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import blake3

from layerkv.errors import ConfigError, UnsupportedSetupError
from layerkv.messages import Deployment
from layerkv.objects.header import DIGEST_NBYTES, SCHEMA_VERSION
from layerkv.store.base import ObjectKey

if TYPE_CHECKING:
    from layerkv.objects.layout import CacheLayout
    from layerkv.objects.tenant_key import TenantKeys

_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._-]+")
_SHORT_DIGEST_HEX = 16
_MAX_BASENAME = 64
_KEYED_ID_NBYTES = 16


@dataclass(frozen=True, slots=True)
class StorageRole:
    """Which objects this TP rank's KV goes to. A block's KV heads are split into
    `num_storage_ranks` equal head ranges (shards, `Deployment.store_shards`), one object each;
    the split does not depend on the TP size, so deployments of different TP sizes with the same
    split share objects. A rank holds `storage_ranks` (the shards inside its heads: one, or several
    when the split is finer than this deployment's); `put_step` ranks hold the same heads
    (replicated KV heads, MLA) and one of them writes."""

    put_step: int
    storage_ranks: tuple[int, ...]  # the shards this rank loads (and writes, if `writes`), ascending
    writes: bool  # the first of the put_step ranks holding the same heads (and, under DCP, the same CP share)
    num_storage_ranks: int  # shards per block; every one must be COMPLETE for a block to count as a hit

    @property
    def storage_rank(self) -> int:
        """The rank's first shard (its only one unless the split is finer than the TP size)."""
        return self.storage_ranks[0]


@dataclass(frozen=True, slots=True)
class Namespace:
    """`name` prefixes every key; `digest` (16 bytes) goes into the object header; `names_key`
    (a tenant key's names subkey, never shown) keys the block ids."""

    name: str
    digest: bytes
    names_key: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def keyed(self) -> bool:
        return self.names_key is not None

    def block_id(self, block_hash: bytes) -> bytes:
        """What names a block in keys and headers: the engine's hash, or with a key its keyed
        hash (16 bytes) bound to this namespace."""
        raw = block_hash_bytes(block_hash)
        if self.names_key is None:
            return raw
        return blake3.blake3(b"B" + self.digest + raw, key=self.names_key).digest(_KEYED_ID_NBYTES)


def storage_role(deployment: Deployment) -> StorageRole:
    """Which rank stores what. KV heads split over TP ranks form `min(tp_size, num_kv_heads)`
    head groups (MLA: one latent, one group; only tp_rank 0 of a group's ranks writes); the block's
    shards (`deployment.store_shards`, 0: one per head group) split the heads evenly, a whole
    number of them inside each group. With decode context parallelism (dcp_size > 1) the replicas of a
    head group hold `dcp_size` different token shares (CP rank tp_rank % dcp_size, in the namespace):
    the first rank of each share writes. Raises ConfigError for out-of-range ranks,
    UnsupportedSetupError for splits that do not divide."""
    d = deployment
    _check_ranks(d)
    if d.is_mla:
        if d.store_shards > 1:
            raise UnsupportedSetupError(
                f"store_shards={d.store_shards}: an MLA latent is one head for every rank (store_shards must be 0 or 1)"
            )
        # the latent's replicas that hold the same CP share: ranks dcp_size apart; the first of each writes
        return StorageRole(d.tp_size, (0,), d.tp_rank < d.dcp_size, 1)
    if d.num_kv_heads < 1:
        raise ConfigError(f"num_kv_heads={d.num_kv_heads} must be >= 1 (MLA: set is_mla=True)")
    if d.num_kv_heads >= d.tp_size:
        if d.num_kv_heads % d.tp_size:
            raise UnsupportedSetupError(
                f"num_kv_heads={d.num_kv_heads} is not divisible by tp_size={d.tp_size}: "
                f"uneven KV head partitions are not supported"
            )
        put_step = 1
    else:
        if d.tp_size % d.num_kv_heads:
            raise UnsupportedSetupError(
                f"tp_size={d.tp_size} is not a multiple of num_kv_heads={d.num_kv_heads}: "
                f"replicated KV heads must be shared by equal groups of ranks"
            )
        put_step = d.tp_size // d.num_kv_heads
    if put_step % d.dcp_size:
        raise UnsupportedSetupError(
            f"decode context parallel size {d.dcp_size} with tp_size={d.tp_size} and num_kv_heads="
            f"{d.num_kv_heads}: DCP shards tokens over the ranks that replicate a KV head, so "
            f"tp_size // num_kv_heads must be a multiple of it (vLLM's own rule)"
        )
    groups = d.tp_size // put_step
    shards = d.store_shards or groups
    if d.num_kv_heads % shards or shards % groups:
        raise UnsupportedSetupError(
            f"store_shards={shards} must divide num_kv_heads={d.num_kv_heads} and be a multiple of this "
            f"deployment's {groups} KV head groups (min(tp_size={d.tp_size}, num_kv_heads)): set it to the "
            f"largest such TP size among the servers that share the pool"
        )
    if d.dcp_size > 1 and shards != groups:
        raise UnsupportedSetupError(
            f"store_shards={shards} with decode context parallelism: a rank holds one CP share of "
            f"its KV heads, so the split must be this deployment's {groups} KV head groups (store_shards 0)"
        )
    per_group, group = shards // groups, d.tp_rank // put_step
    # of a head group's put_step replicas, ranks dcp_size apart hold the same CP share: the first writes
    writes = (d.tp_rank % put_step) // d.dcp_size == 0
    return StorageRole(put_step, tuple(range(group * per_group, (group + 1) * per_group)), writes, shards)


def share_deployment(deployment: Deployment, pp_rank: int, cp_rank: int) -> Deployment:
    """`deployment` as the worker of pipeline stage `pp_rank` and CP share `cp_rank` that names
    its objects (tp_rank `cp_rank`: the first TP rank holding that share; the scheduler side names
    every share's objects with it)."""
    return dataclasses.replace(deployment, pp_rank=pp_rank, tp_rank=cp_rank, dcp_rank=cp_rank)


def _check_ranks(d: Deployment) -> None:
    if d.tp_size < 1 or not 0 <= d.tp_rank < d.tp_size:
        raise ConfigError(f"tp_rank={d.tp_rank} must be 0 <= tp_rank < tp_size={d.tp_size} (and tp_size >= 1)")
    if d.pp_size < 1 or not 0 <= d.pp_rank < d.pp_size:
        raise ConfigError(f"pp_rank={d.pp_rank} must be 0 <= pp_rank < pp_size={d.pp_size} (and pp_size >= 1)")
    if d.dcp_rank != d.tp_rank % d.dcp_size:
        raise ConfigError(
            f"dcp_rank={d.dcp_rank} must be tp_rank % dcp_size = {d.tp_rank % d.dcp_size} (vLLM's DCP groups "
            f"without prefill context parallelism are consecutive TP ranks)"
        )
    if d.dcp_size > 1 and d.tp_size % d.dcp_size:
        raise UnsupportedSetupError(
            f"decode context parallel size {d.dcp_size} must divide tp_size={d.tp_size} (DCP reuses TP ranks)"
        )


def with_store_shards(deployment: Deployment, store_shards: int) -> Deployment:
    """`deployment` with config store_shards applied (0 leaves the deployment's own)."""
    return dataclasses.replace(deployment, store_shards=store_shards) if store_shards else deployment


def namespace_for(
    deployment: Deployment,
    tenant: str,
    layout: CacheLayout | None = None,
    model_fingerprint: str = "",
    names_key: bytes | None = None,
    encrypted: bool = False,
    epoch: str = "",
) -> Namespace:
    """The namespace of objects written by this deployment: a stable digest (sha256 of a canonical
    JSON; never Python's hash()) of everything that makes objects incompatible. Objects hold a
    head range (a shard of `storage_role`), named by the number of shards; `kv_signature`
    describes the whole model's cache (every KV head), not one rank's. The TP size is in it
    unless `deployment.store_shards` is set: then servers of any TP size that split alike share.

    `model_fingerprint` (the user's pin, config `model_fingerprint`) replaces the engine's
    `deployment.model_fingerprint` when set. The cache layout enters as `deployment.kv_signature` (both sides can
    compute it; the
    scheduler has no tensors) or, when that is empty, as the registered `layout`'s signature.
    The object header carries the exact layout digest, checked on every read. `names_key`: the
    digest is keyed with it (and so are the block ids). `encrypted` (config encrypt_objects):
    encrypted objects get a namespace of their own (a reader accepts only its own kind of
    object, so sharing names would make each side refuse, and remove, the other's). `epoch`: set
    by a cache reset (SchedulerConnector.reset_cache): objects written before it are never named again."""
    role = storage_role(deployment)
    if model_fingerprint:
        deployment = dataclasses.replace(deployment, model_fingerprint=model_fingerprint)
    if not tenant or "@" in tenant:
        raise ConfigError(f"tenant={tenant!r} must be a non-empty string without '@'")
    fields = _namespace_fields(deployment, tenant, layout, role.num_storage_ranks)
    if encrypted:  # only then: the names of unencrypted objects stay what they were
        fields["encrypted"] = True
    if epoch:  # only after a reset: names before any reset stay what they were
        fields["epoch"] = epoch
    canonical = json.dumps(fields, sort_keys=True).encode()
    if names_key is None:
        digest = hashlib.sha256(canonical).digest()[:DIGEST_NBYTES]
    else:
        digest = blake3.blake3(b"N" + canonical, key=names_key).digest(DIGEST_NBYTES)
    return Namespace(f"{model_basename(deployment.model_id)}-{digest.hex()[:_SHORT_DIGEST_HEX]}", digest, names_key)


def _namespace_fields(
    deployment: Deployment, tenant: str, layout: CacheLayout | None, num_storage_ranks: int
) -> dict[str, object]:
    """What names a namespace (namespace_for's canonical JSON, less the encrypted and epoch marks)."""
    d = deployment
    fields: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "tenant": tenant,
        "model_id": d.model_id,
        "model_fingerprint": d.model_fingerprint,
        "model_settings": d.model_settings,
        "kv_dtype": d.kv_dtype,
        "block_size": d.block_size,
        "kv_signature": _kv_signature(deployment, layout),
        "num_kv_heads": d.num_kv_heads,
        "is_mla": d.is_mla,
        "store_shards": num_storage_ranks,
        # TP-private objects unless the split is chosen (config store_shards): KV computed at another TP
        # size differs from this server's own by the rounding of the TP reductions, so sharing
        # across TP sizes is what an operator opts into (a P/D deployment continues the prefill's KV)
        **({} if d.store_shards else {"tp_size": d.tp_size}),
        "pp_size": d.pp_size,
        "pp_rank": d.pp_rank,  # each pipeline stage holds different layers
    }
    if d.dcp_size > 1:  # only then: names without context parallelism stay what they were
        # each CP rank holds its own interleaved share of a block's tokens
        fields.update(dcp_size=d.dcp_size, cp_interleave=d.cp_interleave, cp_rank=d.dcp_rank)
    return fields


def tenant_namespace(
    deployment: Deployment,
    tenant: str,
    model_fingerprint: str,
    keys: TenantKeys | None,
    encrypted: bool = False,
    epoch: str = "",
) -> Namespace:
    """`namespace_for` under the current tenant key's names subkey (None: unkeyed)."""
    return tenant_namespaces(deployment, tenant, model_fingerprint, keys, encrypted, epoch)[0]


def tenant_namespaces(
    deployment: Deployment,
    tenant: str,
    model_fingerprint: str,
    keys: TenantKeys | None,
    encrypted: bool = False,
    epoch: str = "",
) -> tuple[Namespace, ...]:
    """One namespace per key of the key file, in its order (generation 0: the current key,
    which writes; the older ones only read, after a rotation). Unkeyed: the one plain namespace.
    `encrypted`: config encrypt_objects (which needs a key); `epoch`: namespace_for's."""
    if keys is None:
        return (namespace_for(deployment, tenant, model_fingerprint=model_fingerprint, epoch=epoch),)
    return tuple(
        namespace_for(
            deployment,
            tenant,
            model_fingerprint=model_fingerprint,
            names_key=k.names_key,
            encrypted=encrypted,
            epoch=epoch,
        )
        for k in keys.all
    )


def _kv_signature(deployment: Deployment, layout: CacheLayout | None) -> str:
    if deployment.kv_signature:
        return deployment.kv_signature
    if layout is not None:
        return layout.signature
    raise ConfigError(
        "Deployment.kv_signature is empty and no cache layout was given: the scheduler side needs "
        "the engine's per-layer cache signature to name objects (set Deployment.kv_signature)"
    )


def model_basename(model_id: str) -> str:
    """Last path component of a model id / path, with anything but [A-Za-z0-9._-] replaced by '_'."""
    base = model_id.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    base = _UNSAFE_RE.sub("_", base).strip("_")[:_MAX_BASENAME]
    return base or "model"


def block_hash_bytes(block_hash: bytes) -> bytes:
    """The engine's block hash as bytes. Block hashes are bytes end to end (object keys, headers,
    plans); an engine adapter converts other hash types once, at its boundary."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        raw = bytes(block_hash)
        if not raw:
            raise ConfigError("block hash must not be empty")
        return raw
    raise ConfigError(
        f"block hash must be bytes (convert engine hashes at the adapter), got {type(block_hash).__name__}"
    )


def block_key(namespace: Namespace, block_hash: bytes, storage_rank: int) -> ObjectKey:
    """`<namespace>@<block_id_hex>@<storage_rank>`."""
    return f"{namespace.name}@{namespace.block_id(block_hash).hex()}@{storage_rank}"


def block_keys(namespace: Namespace, block_hashes: Iterable[bytes], storage_rank: int) -> list[ObjectKey]:
    """Keys of many blocks for one storage rank, in the order of `block_hashes`."""
    suffix = f"@{storage_rank}"
    return [f"{namespace.name}@{namespace.block_id(h).hex()}{suffix}" for h in block_hashes]
