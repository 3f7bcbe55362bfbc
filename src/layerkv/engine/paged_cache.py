"""One TP rank's paged KV caches, one tensor per attention layer in vLLM's layout
[2 (K/V), num_blocks, block_size, num_kv_heads_on_rank, head_dim]; slot-mapping writes and
block gathers for attention. Worker side; written by the compute thread, and by a connector's
transfer threads for blocks the scheduler handed it (never concurrently for the same block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_mapping(block_ids: Sequence[int], start_token: int, end_token: int, block_size: int) -> torch.Tensor:
    """Flat slot (block_id * block_size + offset) of each token position in [start, end)."""
    positions = torch.arange(start_token, end_token)  # [n]
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


class RankKVCache:
    """Caches of every layer on one rank; `tensors` is what `register_kv_caches` receives."""

    def __init__(
        self,
        layer_names: Sequence[str],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.tensors: dict[str, torch.Tensor] = {
            # [2, num_blocks, block_size, num_kv_heads, head_dim]
            name: torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
            for name in layer_names
        }

    def write(self, layer_name: str, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [n, hkv, d] into flat slots [n]."""
        cache = self.tensors[layer_name]
        flat = cache.view(2, -1, cache.shape[3], cache.shape[4])  # [2, num_blocks*block_size, hkv, d]
        flat[0, slots] = k
        flat[1, slots] = v

    def gather(self, layer_name: str, block_ids: Sequence[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, hkv, d] of the first `num_tokens` positions of `block_ids`."""
        cache = self.tensors[layer_name]
        num_needed = -(-num_tokens // self.block_size)
        ids = torch.as_tensor(list(block_ids[:num_needed]), dtype=torch.long)
        kv = cache[:, ids]  # [2, nb, block_size, hkv, d]
        kv = kv.reshape(2, -1, cache.shape[3], cache.shape[4])[:, :num_tokens]
        return kv[0], kv[1]
