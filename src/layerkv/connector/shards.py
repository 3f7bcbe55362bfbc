"""A rank that holds several shards of each block: one engine-neutral worker per shard, composed so
that the engine sees one worker. Objects hold a head range of a block (objects/keys.py
`storage_role`); when the split (config store_shards) is finer than this server's TP size, e.g. a
TP=1 decode server reading what a TP=2 prefill server wrote, each shard's worker registers the
shard's heads of every cache (a view of the live cache, no copy) and loads and saves them as its
own objects. The plan, the hooks and the verdicts go to every shard's worker; a block failed in any
shard is reported (the engine recomputes it, and the scheduler's verdict revokes what requests that
attended to it wrote, in every shard); a step is reported once every shard's worker ran it.

Slicing needs the heads outermost in each cache block (vLLM's HND byte order, the reference
engine's `kv_layout="HND"`): a shard's heads are then one dense byte run of each block, as every
object entry must be. Other layouts are refused at registration, naming the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layerkv.config import LayerKVConfig
from layerkv.connector.hooks import WorkerHooks
from layerkv.connector.hybrid import GroupedWorker
from layerkv.connector.worker import WorkerConnector
from layerkv.errors import ConfigError, UnsupportedSetupError
from layerkv.messages import Deployment
from layerkv.objects.keys import storage_role, with_store_shards
from layerkv.store.checked import CheckedStore


def worker_connector(config: LayerKVConfig, deployment: Deployment, store: CheckedStore) -> WorkerHooks:
    """The worker for one rank: a `WorkerConnector`, or with several shards on the rank a
    `ShardedWorker` over one per shard (all on `store`)."""
    role = storage_role(with_store_shards(deployment, config.store_shards))
    if len(role.storage_ranks) == 1:
        return WorkerConnector(config, deployment, store)
    if config.register_kv_cache:
        raise ConfigError(
            f"register_kv_cache with store_shards={role.num_storage_ranks} finer than tp_size="
            f"{deployment.tp_size}: each shard would register the same live cache; leave it false"
        )
    local_heads = deployment.num_kv_heads // deployment.tp_size
    subs = [WorkerConnector(config, deployment, store, shard=s) for s in role.storage_ranks]
    return ShardedWorker(subs, local_heads)


class ShardedWorker(GroupedWorker):
    """Worker hooks over one `WorkerConnector` per shard of this rank's heads (in head order)."""

    def __init__(self, subs: list[WorkerConnector], local_heads: int) -> None:
        if len(subs) < 2 or local_heads % len(subs):
            raise ValueError(f"{len(subs)} shards of {local_heads} KV heads")
        super().__init__(subs, [[] for _ in subs])
        self._local_heads = local_heads

    @property
    def namespace(self) -> Any:
        """The shards' namespace (one for all of them: the split, not the shard, is in it)."""
        return self.subs[0].namespace  # type: ignore[attr-defined]

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        k = len(self.subs)
        for i, sub in enumerate(self.subs):
            sub.register_kv_caches(
                {
                    name: _head_slice(name, value, i, k, self._local_heads, num_blocks)
                    for name, value in kv_caches.items()
                },
                num_blocks,
            )

    def bind_connector_metadata(self, meta: Any) -> None:
        for sub in self.subs:
            sub.bind_connector_metadata(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for sub in self.subs:
            sub.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        for sub in self.subs:
            sub.save_kv_layer(layer_name)

    def loads_settled(self) -> bool:
        """Every shard's load can fail no more (WorkerConnector.loads_settled)."""
        return all(sub.loads_settled() for sub in self.subs)  # type: ignore[attr-defined]

    def open_sessions(self) -> dict[str, int]:
        """Every shard's `WorkerConnector.open_sessions`, summed."""
        total: dict[str, int] = {}
        for sub in self.subs:
            for name, n in sub.open_sessions().items():  # type: ignore[attr-defined]
                total[name] = total.get(name, 0) + n
        return total


def _head_slice(name: str, value: Any, i: int, k: int, heads: int, num_blocks: int) -> Any:
    """Heads [i * heads / k, (i + 1) * heads / k) of every block of one registered cache (a
    torch tensor, numpy array, or a tuple of them): a view, no copy."""
    if isinstance(value, (tuple, list)):
        return type(value)(_head_slice(name, v, i, k, heads, num_blocks) for v in value)
    shape = tuple(int(n) for n in value.shape)
    strides = tuple(int(s) for s in (value.stride() if callable(getattr(value, "stride", None)) else value.strides))
    first = (
        2 if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks else 1
    )  # [2, num_blocks, ...] or [num_blocks, ...]
    dims = [d for d in range(first, len(shape)) if shape[d] > 1]
    outer = max(dims, key=lambda d: strides[d], default=None)
    if outer is None or shape[outer] != heads:
        raise UnsupportedSetupError(
            f"store_shards splits this rank's {heads} KV heads into {k} objects, which needs the heads outermost "
            f"in each cache block (vLLM's HND layout, [heads, block_size, head_size] per block in memory); cache "
            f"{name!r} has shape {list(shape)} and strides {list(strides)}: use that layout or a store_shards equal "
            f"to the TP size"
        )
    per = heads // k
    index = (slice(None),) * outer + (slice(i * per, (i + 1) * per),)
    return value[index]
