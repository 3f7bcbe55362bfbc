"""The batch session protocol every store backend implements (`KVStore`), what a backend class
declares besides (`StoreBackend`: how it opens, where its pool lives, where a hit comes from; the
classes store/registry.py resolves by name), and result validation.

Names and per-key result codes are Mooncake Store's (>= 0.3.13). Pure definitions: any thread
may call these helpers; backends document their own thread-safety (all shipped ones are safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])

ObjectKey = str


class Code(IntEnum):
    """Per-key result codes (Mooncake's ErrorCode values) plus layerkv's own MALFORMED."""

    OK = 0
    NO_SPACE = -200  # allocation failed (Mooncake NO_AVAILABLE_HANDLE)
    INVALID_PARAMS = -600  # no session, range overflow, duplicate put session on this client
    ILLEGAL_CLIENT = -601  # put end / revoke of a released put session: another client's object now
    INVALID_WRITE = -700  # put revoke of a released put session: this client's own whole put committed it
    NO_COMPLETE_REPLICA = -702
    REPLICA_NOT_READY = -703  # object exists but is still PROCESSING (get start before end)
    OBJECT_NOT_FOUND = -704
    OBJECT_EXISTS = -705  # already COMPLETE, or another writer holds it
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900  # master unreachable
    RPC_TIMEOUT = -901  # the master did not answer in time (Mooncake: ~30 s; layerkv: store_call_timeout_s)
    TENANT_QUOTA_EXCEEDED = -1700  # multi-tenant master: one object larger than the tenant's quota
    TENANT_NOT_REGISTERED = -1701  # multi-tenant master: a write by a tenant its quota file does not list
    # layerkv's own: the backend's answer could not be trusted (wrong count, non-int, bool, raised)
    MALFORMED = -10_000
    # layerkv's own: not sent, the store is down (a short-circuited call); nothing to undo
    NOT_SENT = -10_001


# The store did not answer: an outage (metadata calls short-circuit for store_retry_interval_s,
# sessions opened before it are fenced).
OUTAGE_CODES = frozenset({int(Code.RPC_FAIL), int(Code.RPC_TIMEOUT)})
# Answers that do not say whether the store applied the call: clean up as if it had (revoke a
# put start, end a get start).
UNCERTAIN_CODES = frozenset({int(Code.MALFORMED), *OUTAGE_CODES})


def code_name(value: int) -> str:
    """'OBJECT_NOT_FOUND(-704)' for known codes, the bare number otherwise; bytes for >= 0."""
    try:
        return f"{Code(value).name}({value})"
    except ValueError:
        return str(value)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a put session's objects should be allocated (Mooncake's ReplicateConfig)."""

    replica_num: int = 1
    preferred_segment: str = ""
    prefer_alloc_in_same_node: bool = False

    @classmethod
    def from_config(cls, config: Any) -> Placement:
        """From a LayerKVConfig's `replica_num`, `preferred_segment`, `prefer_alloc_in_same_node`
        (read by name: the store does not import the config)."""
        return cls(config.replica_num, config.preferred_segment, config.prefer_alloc_in_same_node)


@dataclass(frozen=True, slots=True)
class StoreCall:
    """What layerkv needs to know of one batch call of the protocol (marked with @store_call)."""

    name: str
    session: bool  # one of the Mooncake (>= 0.3.13) session/range methods layerkv requires
    talks_to_master: bool  # reaches the master: outage-checked
    needs_master: bool  # short-circuited while the master is down (releases are not)
    moves_data: bool  # moves payload into / out of local memory: never abandoned on a time bound

    @property
    def bounded(self) -> bool:
        """Run with the store_call_timeout_s bound. Never a data call: one abandoned at its
        bound would go on writing into local memory that the caller already reuses."""
        return self.talks_to_master and not self.moves_data


def store_call(
    *, session: bool = False, needs_master: bool = False, talks_to_master: bool = False, moves_data: bool = False
) -> Callable[[_F], _F]:
    """Mark a KVStore protocol method; the tables below are derived from the marks."""

    def mark(fn: _F) -> _F:
        call = StoreCall(fn.__name__, session, talks_to_master or needs_master, needs_master, moves_data)
        fn.__store_call__ = call  # type: ignore[attr-defined]
        return fn

    return mark


@runtime_checkable
class KVStore(Protocol):
    """A batch session store. Every batch call returns exactly one int per key, except
    `batch_get_session_end`, which returns one int for the call. Range calls return the bytes
    moved per key (>= 0) or a negative `Code`. Implementations must be thread-safe.

    Buffers passed as pointers must be host memory registered with `register_buffer` (the
    embedded store also accepts unregistered host memory).
    """

    name: str

    def register_buffer(self, ptr: int, nbytes: int) -> None: ...

    def unregister_buffer(self, ptr: int) -> None: ...

    @store_call(session=True, needs_master=True)
    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    @store_call(session=True, needs_master=True)
    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]: ...

    @store_call(session=True, moves_data=True)
    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]: ...

    @store_call(session=True, needs_master=True)
    def batch_put_session_end(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    @store_call(session=True, talks_to_master=True)
    def batch_put_session_revoke(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    @store_call(session=True, needs_master=True)
    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    @store_call(session=True, moves_data=True)
    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[int]: ...

    @store_call(session=True, talks_to_master=True)
    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int: ...

    # Whole-object calls (benchmarks, doctor, non-layerwise comparison).
    @store_call(needs_master=True, moves_data=True)
    def batch_put_from(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]: ...

    @store_call(needs_master=True, moves_data=True)
    def batch_get_into(self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]: ...

    @store_call(needs_master=True)
    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def close(self) -> None: ...


class PoolScope(StrEnum):
    """Which processes one pool of a backend reaches (a `StoreBackend` class property)."""

    PROCESS = "process"  # this process only: an engine's scheduler and its workers must share the process
    SHARED = "shared"  # other processes and hosts: engines and their workers anywhere share it


class HitSource(StrEnum):
    """Where a pool hit's KV is read from (a `StoreBackend` class property); the values are vLLM's
    `CacheHitSource` (metrics: `prompt_tokens_cached_by_source`)."""

    HOST = "host"  # host memory of this process
    P2P = "p2p"  # memory other processes or hosts lend, read over the network
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"  # none of these, or not known


class StoreBackend(KVStore, Protocol):
    """A store backend class, as `backend` names it (store/registry.py): the `KVStore` methods,
    and on the class itself:

    * `pool_scope`: `PoolScope.PROCESS` when its objects live in the opening process (the vLLM
      integration then refuses executors that put workers in other processes);
    * `hit_source`: where a hit is read from (`HitSource`, vLLM's metrics);
    * `from_config(config)`: a new client of the pool a `LayerKVConfig` names, closed by its
      caller. A PROCESS backend hands every client opened in one process with equal settings
      the same objects (the scheduler side and the worker sides each open their own);
    * `pool_address(config)`: where that pool is (e.g. its server's host:port), part of the
      pool's identity (integrations/vllm/pools.py); no secret.

    The config is read by name: the store does not import it (config.py reads the registry).
    """

    pool_scope: ClassVar[PoolScope]
    hit_source: ClassVar[HitSource]

    @classmethod
    def from_config(cls, config: Any) -> KVStore: ...

    @staticmethod
    def pool_address(config: Any) -> str: ...


# The one method table: every batch call of the protocol, in declaration order.
STORE_CALLS: dict[str, StoreCall] = {
    name: fn.__store_call__ for name, fn in vars(KVStore).items() if hasattr(fn, "__store_call__")
}
# The session/range methods layerkv requires of a Mooncake client, plus the exists query.
SESSION_METHODS: tuple[str, ...] = tuple(name for name, call in STORE_CALLS.items() if call.session)


def validate_results(results: object, num_keys: int, call: str) -> list[int]:
    """Return `results` as a list of exactly `num_keys` ints, or `[Code.MALFORMED] * num_keys`.

    A backend answer is trusted only if it is a list/tuple of exactly one `int` per key (`bool`
    is not an int; numpy integers are accepted) within int64 (callers keep answers in int64
    arrays). Anything else fails the whole call for every key: a partial answer cannot say which
    key it belongs to. Never raises.
    """
    ok = isinstance(results, (list, tuple)) and len(results) == num_keys
    if ok:
        out: list[int] = []
        for value in results:  # type: ignore[attr-defined]
            if isinstance(value, bool) or not _is_integer(value) or not _INT64_MIN <= int(value) <= _INT64_MAX:
                ok = False
                break
            out.append(int(value))
        if ok:
            return out
    log.error(
        "layerkv: %s returned a malformed result for %d keys (%r); failing every key", call, num_keys, _short(results)
    )
    return [int(Code.MALFORMED)] * num_keys


def validate_single(result: object, call: str) -> int:
    """The one-int answer of `batch_get_session_end`; MALFORMED for anything else."""
    in_range = _is_integer(result) and not isinstance(result, bool)
    if not in_range or not _INT64_MIN <= int(result) <= _INT64_MAX:  # type: ignore[call-overload]
        log.error("layerkv: %s returned a malformed result (%r)", call, _short(result))
        return int(Code.MALFORMED)
    return int(result)  # type: ignore[call-overload]


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _is_integer(value: object) -> bool:
    if isinstance(value, int):
        return True
    dtype = getattr(value, "dtype", None)
    return type(value).__module__ == "numpy" and dtype is not None and dtype.kind in "iu"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
