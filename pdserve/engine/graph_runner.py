"""Decode steps as CUDA graphs over batch-size buckets.

Inputs live in static buffers; a step copies its batch in, pads up to the bucket, and replays.
Padding rows write no KV (slot -1) and attend to one token of page 0, so they are harmless.
All buckets share one memory pool, captured largest first so smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging

import torch

from pdserve.engine.batch import HostBatch, resolve_placeholders
from pdserve.ops.metadata import AttentionMetadata
from pdserve.progress import progress

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({b for b in buckets if b <= max_batch} | {max_batch})


class GraphRunner:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, stream: torch.cuda.Stream | None = None,
                 pool=None):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.stream = stream
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._alloc_buffers(max_batch, max_blocks_per_seq)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _alloc_buffers(self, max_batch: int, width: int) -> None:
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=self.device)
        self.input_ids = zeros(max_batch, dtype=torch.int64)
        self.positions = zeros(max_batch, dtype=torch.int64)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self.block_tables = zeros(max_batch, width, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=batch_size, num_decode_seqs=batch_size,
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size], max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size, block_size=self.block_size)

    def _forward(self, batch_size: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:batch_size], self.positions[:batch_size],
                                  self._meta(batch_size), self.kv_caches)

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int] | None = None) -> None:
        stream = self.stream or torch.cuda.Stream(self.device)
        sizes = sorted(batch_sizes or self.buckets, reverse=True)
        for batch_size in progress(sizes, desc="capturing decode graphs", unit="graph"):
            with torch.cuda.stream(stream):
                self._forward(batch_size)  # warm-up: Triton compiles outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[batch_size] = self._forward(batch_size)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch %s)", len(self.graphs), sorted(self.graphs))

    def can_run(self, batch: HostBatch) -> bool:
        return (batch.num_decode_seqs == batch.num_seqs and self.graphs
                and batch.num_seqs <= self.buckets[-1]
                and batch.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, batch: HostBatch, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the smallest bucket that fits; returns hidden states [B, hidden].
        ``sampled``: the device tokens that placeholder input ids name (overlap)."""
        size = batch.num_seqs
        bucket = self.buckets[bisect.bisect_left(self.buckets, size)]
        self._copy_in(batch, size, bucket)
        if batch.has_placeholders:  # one small kernel before the replay, on the same stream
            ids = self.input_ids[:size]
            ids.copy_(resolve_placeholders(ids, sampled))
        self.graphs[bucket].replay()
        return self.outputs[bucket][:size]

    def _copy_in(self, batch: HostBatch, size: int, bucket: int) -> None:
        # Pinned: a copy from pageable memory waits for the stream to drain, which under
        # overlap scheduling means for the launch before this one.
        pinned = self.device.type == "cuda"
        put = lambda dst, array: dst.copy_(_host(array, pinned), non_blocking=True)
        put(self.input_ids[:size], batch.input_ids)
        put(self.positions[:size], batch.positions)
        put(self.slot_mapping[:size], batch.slot_mapping)
        put(self.seq_lens[:size], batch.seq_lens)
        width = batch.block_tables.shape[1]
        put(self.block_tables[:size, :width], batch.block_tables)
        if bucket > size:
            self.slot_mapping[size:bucket].fill_(-1)
            self.seq_lens[size:bucket].fill_(1)


def _host(array, pinned: bool) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pinned else tensor
