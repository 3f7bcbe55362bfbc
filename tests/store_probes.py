"""Store probes shared by the connector and e2e tests (test code, not a product API)."""

from __future__ import annotations

from collections.abc import Sequence

from layerkv.store.base import Code, KVStore, ObjectKey


def processing_keys(probe: KVStore, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
    """Keys of `keys` still PROCESSING: a get start answers REPLICA_NOT_READY (-703) for them.
    Ends every session the probe opens."""
    keys = sorted(set(keys))
    if not keys:
        return []
    codes = probe.batch_get_session_start(keys)
    opened = [k for k, c in zip(keys, codes) if c == 0]
    if opened:
        probe.batch_get_session_end(opened)
    return [k for k, c in zip(keys, codes) if c == int(Code.REPLICA_NOT_READY)]
