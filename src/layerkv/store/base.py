"""The batch session protocol every store backend implements, and its result validation.

Names and per-key result codes are Mooncake Store's (>= 0.3.13). Pure definitions: any thread
may call these helpers; backends document their own thread-safety (all shipped ones are safe).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

ObjectKey = str


class Code(IntEnum):
    """Per-key result codes (Mooncake's ErrorCode values) plus layerkv's own MALFORMED."""

    OK = 0
    NO_SPACE = -200  # allocation failed (Mooncake NO_AVAILABLE_HANDLE)
    INVALID_PARAMS = -600  # no session, range overflow, duplicate put session on this client
    NO_COMPLETE_REPLICA = -702
    REPLICA_NOT_READY = -703  # object exists but is still PROCESSING (get start before end)
    OBJECT_NOT_FOUND = -704
    OBJECT_EXISTS = -705  # already COMPLETE, or another writer holds it
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900  # master unreachable
    # layerkv's own: the backend's answer could not be trusted (wrong count, non-int, bool, raised)
    MALFORMED = -10_000


def code_name(value: int) -> str:
    """'OBJECT_NOT_FOUND(-704)' for known codes, the bare number otherwise; bytes for >= 0."""
    try:
        return f"{Code(value).name}({value})"
    except ValueError:
        return str(value)


# The seven session/range methods layerkv needs, plus the exists query.
SESSION_METHODS: tuple[str, ...] = (
    "batch_is_exist",
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a put session's objects should be allocated (Mooncake's ReplicateConfig)."""

    replica_num: int = 1
    preferred_segment: str = ""
    prefer_alloc_in_same_node: bool = False


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

    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]: ...

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]: ...

    def batch_put_session_end(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def batch_put_session_revoke(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[int]: ...

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int: ...

    # Whole-object calls (benchmarks, doctor, non-layerwise comparison).
    def batch_put_from(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        placement: Placement | None = None,
    ) -> list[int]: ...

    def batch_get_into(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]: ...

    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]: ...

    def close(self) -> None: ...


def validate_results(results: object, num_keys: int, call: str) -> list[int]:
    """Return `results` as a list of exactly `num_keys` ints, or `[Code.MALFORMED] * num_keys`.

    A backend answer is trusted only if it is a list/tuple of exactly one `int` per key (`bool`
    is not an int; numpy integers are accepted). Anything else fails the whole call for every
    key: a partial answer cannot say which key it belongs to. Never raises.
    """
    ok = isinstance(results, (list, tuple)) and len(results) == num_keys
    if ok:
        out: list[int] = []
        for value in results:  # type: ignore[attr-defined]
            if isinstance(value, bool) or not _is_integer(value):
                ok = False
                break
            out.append(int(value))
        if ok:
            return out
    log.error(
        "layerkv: %s returned a malformed result for %d keys (%r); failing every key",
        call,
        num_keys,
        _short(results),
    )
    return [int(Code.MALFORMED)] * num_keys


def validate_single(result: object, call: str) -> int:
    """The one-int answer of `batch_get_session_end`; MALFORMED for anything else."""
    if isinstance(result, bool) or not _is_integer(result):
        log.error("layerkv: %s returned a malformed result (%r)", call, _short(result))
        return int(Code.MALFORMED)
    return int(result)  # type: ignore[call-overload]


def _is_integer(value: object) -> bool:
    if isinstance(value, int):
        return True
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu"  # type: ignore[attr-defined]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
