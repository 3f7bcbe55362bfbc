"""The namespace manifest: one small whole object per namespace, `<namespace>@manifest`, saying
which model, tenant label and settings its objects belong to (namespace digests are one-way;
`layerkv pool` reads manifests to name what uses the pool). Written by the scheduler side
(`ManifestWriter`, the scheduler thread), read by `layerkv pool`. Holds labels only, never a
tenant key or anything derived from one besides the namespace digest that every object header
carries already.

    key  = <namespace>@manifest        (a block key is <namespace>@<hex>@<rank>: never equal)
    body = {"format": 1, "namespace", "digest", "model", "tenant", "pp_rank", "settings", "created_at"}
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerkv.messages import Deployment
from layerkv.objects.keys import Namespace, storage_role
from layerkv.store.base import Code, KVStore, ObjectKey, code_name

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
MANIFEST_SUFFIX = "@manifest"  # not hex and one '@': no block key ends so
MANIFEST_MAX_BYTES = 4096  # a reader's buffer per manifest; bodies are cut to fit (model name)
_MAX_MODEL_CHARS = 512
_EXISTS, _ABSENT = 1, 0
_OBJECT_EXISTS = int(Code.OBJECT_EXISTS)


def manifest_key(namespace: Namespace | str) -> ObjectKey:
    """`<namespace>@manifest` (a Namespace or its name)."""
    name = namespace.name if isinstance(namespace, Namespace) else namespace
    return f"{name}{MANIFEST_SUFFIX}"


def is_manifest_key(key: ObjectKey) -> bool:
    return key.endswith(MANIFEST_SUFFIX) and key.count("@") == 1


@dataclass(frozen=True, slots=True)
class ManifestInfo:
    """What the scheduler side knows of its namespaces' settings: `model` (Deployment.model_id),
    `tenant` (config `tenant`: the label, never a tenant key), and the settings that name objects.
    Build with `from_deployment`."""

    model: str
    tenant: str
    block_size: int
    kv_dtype: str
    store_shards: int  # objects per block (storage_role's num_storage_ranks)
    tp_size: int
    pp_size: int
    keyed: bool = False  # names keyed with a tenant key (config tenant_key_file)
    encrypted: bool = False  # config encrypt_objects
    dcp_size: int = 1  # decode context parallel ranks (each namespace holds one rank's share)
    cp_interleave: int = 1

    @classmethod
    def from_deployment(
        cls, deployment: Deployment, tenant: str, *, keyed: bool = False, encrypted: bool = False
    ) -> ManifestInfo:
        """From the deployment the scheduler names objects with (config store_shards applied:
        `with_store_shards`). Raises what `storage_role` raises for a bad split."""
        d = deployment
        return cls(
            d.model_id[:_MAX_MODEL_CHARS],
            tenant,
            d.block_size,
            d.kv_dtype,
            storage_role(d).num_storage_ranks,
            d.tp_size,
            d.pp_size,
            keyed,
            encrypted,
            d.dcp_size,
            d.cp_interleave,
        )

    def settings(self) -> dict[str, Any]:
        skip = {"model", "tenant"} | ({"dcp_size", "cp_interleave"} if self.dcp_size == 1 else set())
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


def manifest_body(namespace: Namespace, info: ManifestInfo, pp_rank: int, created_at: float, cp_rank: int = 0) -> bytes:
    """The manifest's bytes (compact JSON, at most MANIFEST_MAX_BYTES). `created_at`: Unix s;
    `cp_rank` recorded only with decode context parallelism (info.dcp_size > 1)."""
    stamp = datetime.datetime.fromtimestamp(created_at, datetime.UTC).isoformat(timespec="seconds")
    body = {
        "format": MANIFEST_FORMAT,
        "namespace": namespace.name,
        "digest": namespace.digest.hex(),
        "model": info.model,
        "tenant": info.tenant,
        "pp_rank": pp_rank,
        "settings": info.settings(),
        "created_at": stamp,
    }
    if info.dcp_size > 1:
        body["cp_rank"] = cp_rank
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert len(raw) <= MANIFEST_MAX_BYTES, f"manifest of {namespace.name} is {len(raw)} bytes"
    return raw


def parse_manifest(raw: bytes) -> dict[str, Any] | None:
    """A manifest body as a dict, or None for anything that is not one of this format (never
    raises: a manifest is informational, and anyone who can write the pool can write one)."""
    try:
        body = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        return None
    if not all(isinstance(body.get(name), str) for name in ("namespace", "model", "tenant")):
        return None
    if not isinstance(body.get("settings", {}), dict):
        return None
    return body


@dataclass(slots=True)
class ManifestStats:
    written: int = 0  # manifests this writer put
    existed: int = 0  # found in the pool already (another process, or an earlier run)
    failed_attempts: int = 0  # attempts that left a manifest unwritten (retried later)


class ManifestWriter:
    """Writes each namespace's manifest once per process, "put if absent": an exists query
    first (bounded by CheckedStore's call timeout), a whole-object put only for an absent one
    (a put that finds it there meanwhile counts as existing). One thread (the scheduler's)."""

    def __init__(
        self,
        store: KVStore,
        info: ManifestInfo,
        *,
        retry_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.info = info
        self.retry_interval_s = retry_interval_s
        self._clock, self._wall_clock = clock, wall_clock
        self._done: set[str] = set()  # namespace names whose manifest is in the pool
        self._next_try = 0.0  # monotonic time before which a failed attempt is not repeated
        self.stats = ManifestStats()

    def ensure(self, namespaces: Sequence[Namespace]) -> None:
        """Make sure every namespace's manifest is in the pool; `namespaces[i]` is pipeline
        stage i // dcp_size's, CP rank i % dcp_size's (stage-major). Cheap once they are (a set
        lookup each); after a failure it tries again at most once per `retry_interval_s`. Never
        raises: a failure logs a warning."""
        pending = [(i, ns) for i, ns in enumerate(namespaces) if ns.name not in self._done]
        if not pending or self._clock() < self._next_try:
            return
        try:
            failed = self._write(pending)
        except Exception as exc:  # noqa: BLE001 -- never into the engine: the manifest is informational
            failed = f"raised {exc!r}"
        if failed:
            self.stats.failed_attempts += 1
            self._next_try = self._clock() + self.retry_interval_s
            log.warning(
                "layerkv: namespace manifest not written (%s); retrying in %.0f s", failed, self.retry_interval_s
            )

    def _write(self, pending: list[tuple[int, Namespace]]) -> str:
        """Write the absent manifests of `pending`; '' when all are in the pool, else what failed."""
        keys = [manifest_key(ns) for _, ns in pending]
        found = self._store.batch_is_exist(keys)
        absent = []
        for (i, ns), code in zip(pending, found):
            if code == _EXISTS:
                self._done.add(ns.name)
                self.stats.existed += 1
            elif code == _ABSENT:
                absent.append((i, ns))
        problems = [f"exists {code_name(code)}" for code in found if code not in (_EXISTS, _ABSENT)]
        if absent:
            problems += self._put(absent)
        return ", ".join(problems)

    def _put(self, absent: list[tuple[int, Namespace]]) -> list[str]:
        dcp = self.info.dcp_size
        bodies = [manifest_body(ns, self.info, i // dcp, self._wall_clock(), i % dcp) for i, ns in absent]
        offsets = np.cumsum([0] + [len(b) for b in bodies])
        buffer = np.frombuffer(b"".join(bodies), dtype=np.uint8).copy()  # [total bytes], writable, registered
        base = buffer.ctypes.data
        self._store.register_buffer(base, buffer.nbytes)
        try:
            got = self._store.batch_put_from(
                [manifest_key(ns) for _, ns in absent], [base + int(o) for o in offsets[:-1]], [len(b) for b in bodies]
            )
        finally:
            self._store.unregister_buffer(base)
        problems = []
        for (_, ns), code in zip(absent, got):
            if code in (0, _OBJECT_EXISTS):
                self._done.add(ns.name)
                if code == 0:
                    self.stats.written += 1
                else:
                    self.stats.existed += 1
            else:
                problems.append(f"put {manifest_key(ns)} {code_name(code)}")
        return problems
