"""Turns a plan into model inputs: token ids, positions, KV slots, block tables.

Built with numpy over the whole batch (no per-token Python loops) so that host work per
decode step stays well under a millisecond at batch 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.ops.metadata import AttentionMetadata
from pdserve.sched.base import Plan


@dataclass
class HostBatch:
    """A step's inputs on the host; ``to_device`` makes the model's view of it."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, W] int32
    logits_indices: np.ndarray  # [S] int64, last token of each sampling request
    num_decode_seqs: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def metadata(self, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        def put(array):
            tensor = torch.from_numpy(array)
            if device.type == "cuda":
                tensor = tensor.pin_memory().to(device, non_blocking=True)
            return tensor

        meta = AttentionMetadata(
            num_seqs=self.num_seqs,
            num_decode_seqs=self.num_decode_seqs,
            query_start_loc=put(self.query_start_loc),
            seq_lens=put(self.seq_lens),
            block_tables=put(self.block_tables),
            slot_mapping=put(self.slot_mapping),
            max_query_len=int(np.diff(self.query_start_loc).max()),
            max_seq_len=int(self.seq_lens.max()),
            block_size=self.block_size,
        )
        return put(self.input_ids), put(self.positions), meta


class BlockTables:
    """One int32 row of page ids per live request, updated only where blocks were added."""

    def __init__(self, max_blocks_per_seq: int):
        self.width = max_blocks_per_seq
        self._rows: dict[str, tuple[np.ndarray, int, int]] = {}

    def row(self, request: Request) -> np.ndarray:
        row, filled, preemptions = self._rows.get(request.request_id, (None, 0, 0))
        if row is None:
            row = np.zeros(self.width, dtype=np.int32)
        blocks = request.block_ids
        # A preempted request was given new blocks when re-admitted: rewrite its whole row.
        if preemptions != request.num_preemptions or len(blocks) < filled:
            filled = 0
        if len(blocks) > filled:
            row[filled : len(blocks)] = blocks[filled:]
        self._rows[request.request_id] = (row, len(blocks), request.num_preemptions)
        return row

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


def build_host_batch(plan: Plan, tables: BlockTables, block_size: int) -> HostBatch:
    scheduled = plan.scheduled
    starts = np.array([s.request.num_computed for s in scheduled], dtype=np.int64)
    counts = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(len(scheduled)), counts)
    positions = starts[seq_of_token] + np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
    rows = np.stack([tables.row(s.request) for s in scheduled])
    slot_mapping = rows[seq_of_token, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size
    max_blocks = int(-(-(starts + counts).max() // block_size))
    sampling_rows = [i for i, s in enumerate(scheduled) if s.samples]
    return HostBatch(
        input_ids=_gather_input_ids(plan, num_tokens),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=(starts + counts).astype(np.int32),
        block_tables=np.ascontiguousarray(rows[:, :max_blocks]),
        logits_indices=query_start_loc[1:][sampling_rows].astype(np.int64) - 1,
        num_decode_seqs=len(plan.decodes),
        block_size=block_size,
    )


def _gather_input_ids(plan: Plan, num_tokens: int) -> np.ndarray:
    ids = [s.request.token_ids[s.request.num_computed] for s in plan.decodes]
    for item in plan.prefills:
        start = item.request.num_computed
        ids.extend(item.request.token_ids[start : start + item.num_new_tokens])
    assert len(ids) == num_tokens
    return np.asarray(ids, dtype=np.int64)
