"""KV heads of a transfer buffer under tensor parallelism.

What travels between instances is always the whole model's buffer, ``[layers, 2, tokens,
kv_heads, head_dim]`` with every KV head in the model's order: the layout a single-GPU
instance sends. A tensor-parallel sender joins its ranks' head shards into it; a
tensor-parallel receiver cuts out each rank's heads. Neither side needs to know the other's
group size, so any pair of sizes works, and a group of one is the plain path.

Rank ``r`` holds the ``count`` heads from ``starts[r]`` (``TPShard.kv_head_start``); with
fewer KV heads than ranks, neighbouring ranks hold replicas of one head, and only the first
rank of each replica set contributes to the joined buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HEAD_DIM = 3  # the heads axis of a transfer buffer


def join_head_shards(shards: Sequence[torch.Tensor], starts: Sequence[int],
                     num_kv_heads: int) -> torch.Tensor:
    """The whole buffer from each rank's gathered buffer (in rank order)."""
    parts, next_head = [], 0
    for shard, start in zip(shards, starts, strict=True):
        if start == next_head:  # a later rank with the same start holds a replica
            parts.append(shard)
            next_head += shard.shape[HEAD_DIM]
    if next_head != num_kv_heads:
        raise ValueError(f"rank shards from heads {list(starts)} cover {next_head} KV heads, "
                         f"not the model's {num_kv_heads}")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=HEAD_DIM)


def head_shard(buffer: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Heads ``start .. start + count - 1`` of a whole buffer, contiguous."""
    if start + count > buffer.shape[HEAD_DIM]:
        raise ValueError(f"a KV buffer of {buffer.shape[HEAD_DIM]} heads has no heads "
                         f"{start}..{start + count - 1}")
    return buffer.narrow(HEAD_DIM, start, count).contiguous()
