"""The KV heads of a transfer buffer under tensor parallelism: each rank's shard (its own
heads, or a replica when there are fewer KV heads than ranks) joins into the whole model's
buffer and splits back, for the group sizes and head counts a model can be split into."""

from __future__ import annotations

import pytest
import torch

from pdserve.dist.shard import TPShard
from pdserve.model.arch import PRESETS
from pdserve.transfer.heads import head_shard, join_head_shards


@pytest.mark.parametrize("kv_heads, size", [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_rank_shards_join_to_the_whole_buffer_and_split_back(kv_heads, size):
    arch = PRESETS["tiny"]
    arch = type(arch)(**{**arch.__dict__, "num_heads": 8, "num_kv_heads": kv_heads})
    shards = [TPShard(arch, rank, size) for rank in range(size)]
    whole = torch.randn(2, 2, 5, kv_heads, 16)
    pieces = [head_shard(whole, s.kv_head_start, s.num_kv_heads) for s in shards]
    assert all(p.is_contiguous() and p.shape[3] == shards[0].num_kv_heads for p in pieces)
    assert torch.equal(join_head_shards(pieces, [s.kv_head_start for s in shards],
                                        kv_heads), whole)


def test_shards_that_miss_a_head_are_refused():
    pieces = [torch.zeros(1, 2, 3, 1, 4)] * 2
    with pytest.raises(ValueError, match="cover 1 KV heads, not the model's 2"):
        join_head_shards(pieces, [0, 0], 2)
