"""Turns a plan into model inputs: token ids, positions, KV slots, block tables.

Built with numpy over the whole batch (no per-token Python loops) so that host work per
decode step stays well under a millisecond at batch 256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.ops.metadata import AttentionMetadata
from pdserve.request import Request
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
    has_placeholders: bool = False  # input ids < 0: tokens of the launch before (overlap)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def max_extend_prefix_len(self, new_tokens: np.ndarray | None = None) -> int:
        """Longest cached prefix among the prefill / extend sequences (0: none);
        ``new_tokens``: each sequence's, where the caller has them."""
        first = self.num_decode_seqs
        if first >= self.num_seqs:
            return 0
        if new_tokens is None:
            new_tokens = np.diff(self.query_start_loc)
        return int((self.seq_lens[first:] - new_tokens[first:]).max())

    def metadata(self, device: torch.device, launch_sms: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The batch's ids, positions and attention metadata on ``device``; ``launch_sms``:
        the SMs of the partition it runs on (None: the whole device)."""
        put = lambda array: staged(array, device).to(device, non_blocking=True)
        new_tokens = np.diff(self.query_start_loc)
        meta = AttentionMetadata(
            num_seqs=self.num_seqs,
            num_decode_seqs=self.num_decode_seqs,
            query_start_loc=put(self.query_start_loc),
            seq_lens=put(self.seq_lens),
            block_tables=put(self.block_tables),
            slot_mapping=put(self.slot_mapping),
            max_query_len=int(new_tokens.max()),
            max_seq_len=int(self.seq_lens.max()),
            block_size=self.block_size,
            max_extend_prefix_len=self.max_extend_prefix_len(new_tokens),
            launch_sms=launch_sms,
        )
        return put(self.input_ids), put(self.positions), meta


def staged(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array ready to copy to ``device`` without waiting for the stream: in pinned
    memory for a GPU (a copy from pageable memory waits for every kernel queued before it)."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if device.type == "cuda" else tensor


# A step's block tables are as wide as its longest sequence needs, rounded up to this many
# pages. Triton specialises a kernel on each integer argument being 1, a multiple of 16 or
# neither; the row stride the attention kernels take used to follow the batch, so each
# kernel had up to three variants and the start-up warm-up could not meet them all: on the
# H200 at 176e3dc fresh multiplex servers still compiled the decode kernel inside serving
# steps (9+ decodes beside a prompt chunk), with the warm-up's split counts and constants.
# The extra columns hold page 0 and are never read past a sequence's length.
# ``PDSERVE_BLOCK_TABLE_ALIGN=1`` restores the width that follows the batch (for A/B runs).
BLOCK_TABLE_ALIGN = int(os.environ.get("PDSERVE_BLOCK_TABLE_ALIGN", "16"))


def aligned_width(blocks: int) -> int:
    align = max(BLOCK_TABLE_ALIGN, 1)
    return -(-max(blocks, 1) // align) * align


class BlockTables:
    """Page ids of every live request, one row each of a table kept between steps.

    A request keeps its row while it lives, and a row is written only where blocks were
    added since it was last read, so a decode step copies no page ids except a new last
    block now and then. A step's block tables are then one gather of its requests' rows.
    """

    def __init__(self, max_blocks_per_seq: int):
        self.width = aligned_width(max_blocks_per_seq)
        self._table = np.zeros((16, self.width), dtype=np.int32)
        self._free_rows = list(range(15, -1, -1))  # popped from the end: row 0 first
        # request id -> (row index, blocks written, request.num_preemptions when written)
        self._rows: dict[str, tuple[int, int, int]] = {}

    def row(self, request: Request) -> np.ndarray:
        """The request's row, up to date (a view into the table: read it before the next
        call, which may reallocate the table)."""
        return self._table[self.row_indices([request])[0]]

    def row_indices(self, requests: list[Request]) -> np.ndarray:
        """Each request's row index in ``table``, writing blocks added since the last call."""
        rows, indices = self._rows, []
        for request in requests:
            state = rows.get(request.request_id)
            if state is None or state[1] != len(request.block_ids) \
                    or state[2] != request.num_preemptions:
                state = self._refresh(request, state)
            indices.append(state[0])
        return np.fromiter(indices, dtype=np.intp, count=len(indices))

    @property
    def table(self) -> np.ndarray:
        """[rows, width] int32: row ``row_indices(...)[i]`` holds request i's page ids."""
        return self._table

    def drop(self, request_id: str) -> None:
        state = self._rows.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state[0])

    def _refresh(self, request: Request, state: tuple[int, int, int] | None
                 ) -> tuple[int, int, int]:
        blocks = request.block_ids
        if state is None:
            index, filled = self._take_row(), 0
        else:
            index, filled, preemptions = state
            # A preempted request was given new blocks when re-admitted: rewrite its whole row
            # (and zero the pages past its new end, so rows stay padded with page 0).
            if preemptions != request.num_preemptions or len(blocks) < filled:
                self._table[index, len(blocks) : filled] = 0
                filled = 0
        if len(blocks) > filled:
            self._table[index, filled : len(blocks)] = blocks[filled:]
        state = (index, len(blocks), request.num_preemptions)
        self._rows[request.request_id] = state
        return state

    def _take_row(self) -> int:
        """A zeroed row (block tables are padded with page 0), growing the table if full."""
        if not self._free_rows:
            size = len(self._table)
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._free_rows = list(range(2 * size - 1, size - 1, -1))
        index = self._free_rows.pop()
        self._table[index] = 0
        return index


def build_host_batch(plan: Plan, tables: BlockTables, block_size: int) -> HostBatch:
    scheduled = plan.scheduled
    requests = [s.request for s in scheduled]
    num_seqs = len(requests)
    starts = np.fromiter([r.num_computed for r in requests], dtype=np.int64, count=num_seqs)
    positions, seq_of_token, query_start_loc, seq_lens = _token_layout(plan, starts)
    row_indices = tables.row_indices(requests)
    row_of_token = row_indices if seq_of_token is None else row_indices[seq_of_token]
    slot_mapping = tables.table[row_of_token, positions // block_size].astype(np.int64)
    slot_mapping *= block_size
    slot_mapping += positions % block_size
    max_blocks = min(aligned_width(int(-(-seq_lens.max() // block_size))), tables.width)
    input_ids = _gather_input_ids(plan, len(positions))
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables.table[row_indices, :max_blocks],
        logits_indices=_logits_indices(scheduled, query_start_loc),
        num_decode_seqs=len(plan.decodes),
        block_size=block_size,
        has_placeholders=bool(len(input_ids)) and int(input_ids.min()) < 0,
    )


def _token_layout(plan: Plan, starts: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Position of each new token, its sequence (None: token i is sequence i),
    ``query_start_loc`` and each sequence's length after the step (int64).

    A decode-only step, the common one, needs no per-token arrays."""
    num_seqs = len(starts)
    if not plan.prefills:  # one new token per sequence
        return starts, None, np.arange(num_seqs + 1, dtype=np.int32), starts + 1
    counts = np.fromiter([s.num_new_tokens for s in plan.scheduled], dtype=np.int64,
                         count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(counts)
    seq_of_token = np.repeat(np.arange(num_seqs), counts)
    positions = (starts[seq_of_token] + np.arange(int(query_start_loc[-1]))
                 - query_start_loc[:-1][seq_of_token])
    return positions, seq_of_token, query_start_loc, starts + counts


def _logits_indices(scheduled: list, query_start_loc: np.ndarray) -> np.ndarray:
    """Row of each sampling request's last new token, in ``plan.sampling`` order."""
    samples = [s.samples for s in scheduled]
    if all(samples):
        return query_start_loc[1:].astype(np.int64) - 1
    rows = [i for i, sampled in enumerate(samples) if sampled]
    return query_start_loc[1:][rows].astype(np.int64) - 1


def _gather_input_ids(plan: Plan, num_tokens: int) -> np.ndarray:
    ids = [_decode_input_id(s.request) for s in plan.decodes]
    for item in plan.prefills:
        start = item.request.num_computed
        ids.extend(item.request.token_ids[start : start + item.num_new_tokens])
    assert len(ids) == num_tokens
    return np.fromiter(ids, dtype=np.int64, count=num_tokens)


def _decode_input_id(request: Request) -> int:
    """The token a decode feeds in; one still being sampled by the launch before (overlap)
    is ``-1 - row``: its row in the lane's device buffer of sampled tokens."""
    if request.num_computed < len(request.token_ids):
        return request.token_ids[request.num_computed]
    return -1 - request.placeholder_row


def resolve_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Input ids with every placeholder replaced by the token it names, on the device."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, sampled.index_select(0, rows), input_ids)
