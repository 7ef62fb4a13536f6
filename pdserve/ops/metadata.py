"""What one forward pass needs to know about its batch, passed explicitly to every layer.

There is no module-level "current batch": in multiplex mode a decode batch and a prefill
piece are in flight at the same time, each with its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Layout of a flattened batch of new tokens over a paged KV cache.

    Sequences are ordered decode-first: the first ``num_decode_seqs`` sequences have exactly
    one new token each, the rest (prefill or extend) have one or more. Token ``t`` of the
    flattened batch belongs to the sequence ``i`` with
    ``query_start_loc[i] <= t < query_start_loc[i + 1]``.
    """

    num_seqs: int
    num_decode_seqs: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative count of new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, page ids, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, page * block_size + offset; -1 = padding
    max_query_len: int  # host-side maxima size kernel grids without a device sync
    max_seq_len: int
    block_size: int
    # Longest cached prefix of the extend (non-decode) sequences, a host int for the extend
    # kernel's split count; None where the batch's builder does not say (the kernel then
    # bounds it by max_seq_len - max_query_len).
    max_extend_prefix_len: int | None = None
    # SMs the launch runs on where that is a partition's (multiplexing's prefill beside a
    # decode slice), for the extend kernel's split count; None: the whole device.
    launch_sms: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
