"""The preallocated KV page pool: one tensor, viewed per layer as (K pages, V pages)."""

from __future__ import annotations

import torch

from pdserve.model.arch import ModelArch

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


def allocate_kv_pool(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device) -> list[KVCache]:
    """Per layer, K and V pages of shape [num_blocks, block_size, kv_heads, head_dim]."""
    pool = torch.zeros(arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads,
                       arch.head_dim, dtype=dtype, device=device)
    return [(pool[layer, 0], pool[layer, 1]) for layer in range(arch.num_layers)]
