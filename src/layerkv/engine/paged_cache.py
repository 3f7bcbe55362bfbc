"""One TP rank's paged KV caches in vLLM's layouts: per attention layer either K/V
[2, num_blocks, block_size, num_kv_heads_on_rank, head_dim] (stored in that order, NHD, or with
the heads outermost in a block, HND) or one flat entry per token
[num_blocks, block_size, dim] (MLA latent, sparse-attention indexer keys); slot-mapping writes
and block gathers for attention. Worker side; written by the compute thread, and by a connector's
transfer threads for blocks the scheduler handed it (never concurrently for the same block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_SLOT = -1  # vLLM's PAD_SLOT_ID: a token this rank does not cache


@dataclass(frozen=True, slots=True)
class CPShare:
    """A rank's share under decode context parallelism (vLLM's DCP): an engine block of
    block_size * size tokens is dealt to CP ranks 0, 1, ..., size-1 in runs of `interleave`
    tokens; each rank's block of the same id holds its `block_size` tokens in position order."""

    size: int = 1  # decode_context_parallel_size
    rank: int = 0  # this rank's CP rank (tp_rank % size)
    interleave: int = 1  # cp_kv_cache_interleave_size (divides block_size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, heads_outer: bool, device: str) -> torch.Tensor:
    if heads_outer and len(shape) == 5:  # [2, num_blocks, block_size, heads, head_dim] over HND memory
        two, num_blocks, block_size, heads, head_dim = shape
        return torch.zeros((two, num_blocks, heads, block_size, head_dim), dtype=dtype, device=device).transpose(2, 3)
    return torch.zeros(shape, dtype=dtype, device=device)


def slot_mapping(block_ids: Sequence[int], start_token: int, end_token: int, block_size: int) -> torch.Tensor:
    """Flat slot (block_id * block_size + offset) of each token position in [start, end): the
    mapping without context parallelism."""
    return cp_slot_mapping(block_ids, torch.arange(start_token, end_token), block_size, CPShare())


def cp_slot_mapping(block_ids: Sequence[int], positions: torch.Tensor, block_size: int, share: CPShare) -> torch.Tensor:
    """Flat slot of each position [n] in `share`'s cache, PAD_SLOT for positions another CP rank
    holds (vLLM's slot-mapping formula; with size 1 it is `slot_mapping`)."""
    d, i = share.size, share.interleave
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    engine_block, offset = positions // (block_size * d), positions % (block_size * d)
    local = (offset // i) % d == share.rank
    local_offset = (offset // (i * d)) * i + offset % i
    slots = table[engine_block] * block_size + local_offset
    return torch.where(local, slots, torch.full_like(slots, PAD_SLOT))


def local_slots(
    block_ids: Sequence[int], num_tokens: int, block_size: int, share: CPShare
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [t], absolute positions [t]) of the tokens among the first `num_tokens` that
    `share`'s cache holds, in position order."""
    positions = torch.arange(num_tokens)
    slots = cp_slot_mapping(block_ids, positions, block_size, share)
    mine = slots != PAD_SLOT
    return slots[mine], positions[mine]


class RankKVCache:
    """Caches of every layer on one rank; `tensors` is what `register_kv_caches` receives."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        block_size: int,
        dtype: torch.dtype,
        heads_outer: bool = False,
        device: str = "cpu",
    ) -> None:
        """`shapes`: cache name -> full tensor shape (see the module docstring), in layer order.
        `heads_outer`: K/V blocks stored as [heads, block_size, head_dim] (vLLM's HND) behind the
        same [2, num_blocks, block_size, heads, head_dim] tensor shape."""
        self.block_size = block_size
        self.tensors: dict[str, torch.Tensor] = {
            name: _zeros(shape, dtype, heads_outer, device) for name, shape in shapes.items()
        }

    def _block_index(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        return torch.as_tensor(list(block_ids[: -(-num_tokens // self.block_size)]), dtype=torch.long)

    def write_kv(self, name: str, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [n, hkv, d] into flat slots [n]."""
        cache = self.tensors[name]
        blocks, offsets = slots // self.block_size, slots % self.block_size
        cache[0, blocks, offsets] = k
        cache[1, blocks, offsets] = v

    def gather_kv(self, name: str, block_ids: Sequence[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, hkv, d] of the first `num_tokens` positions of `block_ids`."""
        cache = self.tensors[name]
        kv = cache[:, self._block_index(block_ids, num_tokens)]  # [2, nb, block_size, hkv, d]
        kv = kv.reshape(2, -1, cache.shape[3], cache.shape[4])[:, :num_tokens]
        return kv[0], kv[1]

    def gather_kv_slots(self, name: str, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [t, hkv, d] at flat `slots` [t]."""
        cache = self.tensors[name]
        kv = cache[:, slots // self.block_size, slots % self.block_size]  # [2, t, hkv, d]
        return kv[0], kv[1]

    def write_flat(self, name: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x [n, dim] into flat slots [n] of a [num_blocks, block_size, dim] cache."""
        cache = self.tensors[name]
        cache.view(-1, cache.shape[-1])[slots] = x

    def gather_flat(self, name: str, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens, dim] of the first `num_tokens` positions of `block_ids`."""
        cache = self.tensors[name]
        return cache[self._block_index(block_ids, num_tokens)].reshape(-1, cache.shape[-1])[:num_tokens]

    def gather_flat_slots(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """[t, dim] at flat `slots` [t] of a [num_blocks, block_size, dim] cache."""
        cache = self.tensors[name]
        return cache.view(-1, cache.shape[-1])[slots]
