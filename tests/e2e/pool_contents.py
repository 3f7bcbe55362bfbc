"""What a run left in the pool, for the "no poisoned object" checks (test_rank_faults.py,
test_context_parallel.py): every readable object of some prompts' full blocks, under every
worker's own namespace and storage rank, less what each write makes new (nonce, MAC, tags)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerkv.engine import block_hashes
from layerkv.objects.header import NONCE_OFFSET
from layerkv.objects.keys import block_keys
from layerkv.store.base import KVStore
from tests.e2e.harness import PooledRun


def pool_objects(client: KVStore, run: PooledRun, prompts: Sequence[Sequence[int]]) -> dict[str, bytes]:
    """What every readable object of `prompts`' full blocks holds, for every (stage and CP
    namespace, storage rank) of `run`: its header's fixed fields and every layer's bytes (the
    write's nonce, and the header MAC and tags that depend on it, differ between writes)."""
    found: dict[str, bytes] = {}
    block_size = run.engine.config.scheduler_block_size
    for worker in run.workers:
        assert worker.layout is not None
        keys = [
            k
            for prompt in prompts
            for k in block_keys(
                worker.namespace, block_hashes(list(prompt), block_size), worker.storage_role.storage_rank
            )
        ]
        objects = read_objects(client, sorted(set(keys) - set(found)), worker.layout.object_nbytes)
        found.update({k: content(v, worker.layout.header_nbytes) for k, v in objects.items()})
    return found


def read_objects(client: KVStore, keys: list[str], nbytes: int) -> dict[str, bytes]:
    """The whole objects of `keys` that exist, by key."""
    present = [k for k, e in zip(keys, client.batch_is_exist(keys)) if e == 1]
    if not present:
        return {}
    buf = np.zeros((len(present), nbytes), dtype=np.uint8)  # [objects, object bytes]
    client.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        got = client.batch_get_into(present, [buf[i].ctypes.data for i in range(len(present))], [nbytes] * len(present))
    finally:
        client.unregister_buffer(buf.ctypes.data)
    assert all(n == nbytes for n in got), f"whole-object reads returned {sorted(set(got))}"
    return {k: buf[i].tobytes() for i, k in enumerate(present)}


def content(obj: bytes, header_nbytes: int) -> bytes:
    """An object without what each write makes new: the header's nonce, MAC and tags."""
    return obj[:NONCE_OFFSET] + obj[header_nbytes:]


def assert_pool_is_clean(pool: dict[str, bytes], clean: dict[str, bytes]) -> None:
    """The same objects as a clean run left (`pool_objects` of each), each holding the same bytes."""
    assert set(pool) == set(clean), (
        f"objects only here: {sorted(set(pool) - set(clean))[:2]}, only clean: {sorted(set(clean) - set(pool))[:2]}"
    )
    poisoned = [k for k in pool if pool[k] != clean[k]]
    assert not poisoned, f"{len(poisoned)} objects differ from a clean run's: {poisoned[:2]}"
