"""Whole-GPU prefill and mixed steps as CUDA graphs of the parts between the attentions.

A decode step is one graph (``graph_runner.py``), but a step that carries prompt tokens
cannot be: its attention depends on every sequence's query and context lengths. Everything
else in a layer (norms, the q/k/v, output and MLP GEMMs, rotary and the KV store) depends
on the step's token count only. So a step of T tokens (padded to a bucket) runs as L + 1
graph segments with the L attentions between them, eager:

    segment 0:      embed -> norm -> q/k/v of layer 0 (rotated, stored)
    segment i:      output projection, norm and MLP of layer i - 1 -> norm -> q/k/v of layer i
    segment L:      output projection, norm and MLP of the last layer -> final norm

About 3 launches per layer instead of ~12, so a small mixed step is no longer bounded by
how fast the host can issue kernels (on the H200, codellama-34b: a step of 64 prompt
tokens and 16 decodes took 38 ms eagerly, 25 ms as graphs, 23 ms of kernels; steps of 256
tokens and more ran eagerly within 3-10% of their kernels' time, so graphs stop there).

Segments hand tensors to each other through static
buffers (q/k/v, residual, attention output, the final hidden states); the attention reads
the real T rows only. Padding rows store no KV (slot -1) and are never read back: every
operation inside a segment is row-wise, so whatever they hold cannot reach a real row.

All segments of all buckets share one memory pool, captured largest bucket first; they
only ever run one after another on one stream. ``capture=False`` runs the same segments
without graphs (the CPU and tests check the segmentation against the model's forward).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from pdserve.engine.batch import HostBatch, resolve_placeholders, staged
from pdserve.ops.metadata import AttentionMetadata
from pdserve.progress import progress

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int, stride: int = 16) -> list[int]:
    """Step sizes captured: every ``stride`` tokens up to ``max_tokens``. Padding is compute
    spent for nothing: on the H200 a 258-token step padded to 320 ran 12% slower as graphs
    than eagerly, so buckets are fine and the graphs stop where eager steps already run at
    their kernels' speed (a few hundred tokens)."""
    return list(range(stride, max_tokens, stride)) + [max_tokens]


class PiecewiseGraphs:
    def __init__(self, model, kv_caches: list, max_tokens: int, device: torch.device,
                 capture: bool = True):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = token_buckets(max_tokens)
        self.use_graphs = capture
        self.layers = list(model.model.layers)
        self._alloc_buffers(max(self.buckets))
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _alloc_buffers(self, size: int) -> None:
        arch, dtype = self.model.arch, self.model.lm_head.weight.dtype
        zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, device=self.device)
        self.input_ids = zeros(size, dtype=torch.int64)
        self.positions = zeros(size, dtype=torch.int64)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=self.device)
        self.qkv = zeros(size, arch.q_size + 2 * arch.kv_size)
        self.residual = zeros(size, arch.hidden_size)
        self.attn_out = zeros(size, arch.q_size)
        self.hidden_out = zeros(size, arch.hidden_size)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def can_run(self, batch: HostBatch) -> bool:
        """A step with prompt tokens that fits a bucket (pure decode has its own graphs)."""
        return (bool(self.graphs) or not self.use_graphs) and \
            batch.num_decode_seqs < batch.num_seqs and len(batch.input_ids) <= self.max_tokens

    # ---- the segments ----

    def _segment(self, index: int, size: int) -> None:
        """Runs segment ``index`` on the first ``size`` rows of the static buffers."""
        rows = slice(0, size)
        if index == 0:
            hidden, residual = self.model.embed(self.input_ids[rows]), None
        else:
            hidden, residual = self.layers[index - 1].post_attention(self.attn_out[rows],
                                                                     self.residual[rows])
        if index == len(self.layers):
            self.hidden_out[rows].copy_(self.model.final_norm(hidden, residual))
            return
        qkv, residual = self.layers[index].pre_attention(
            hidden, residual, self.positions[rows], self.slot_mapping[rows],
            self.kv_caches[index], self.model.rotary.cos_sin_cache)
        self.qkv[rows].copy_(qkv)
        self.residual[rows].copy_(residual)

    def _runner(self, size: int) -> list[Callable[[], None]]:
        if self.use_graphs:
            return [graph.replay for graph in self.graphs[size]]
        return [lambda i=i: self._segment(i, size) for i in range(len(self.layers) + 1)]

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in progress(sorted(self.buckets, reverse=True),
                             desc="capturing prefill graphs", unit="size"):
            self.graphs[size] = [self._capture_one(i, size, stream, pool)
                                 for i in range(len(self.layers) + 1)]
        torch.cuda.synchronize(self.device)
        log.info("captured prefill/mixed step graphs: %d sizes x %d segments",
                 len(self.graphs), len(self.layers) + 1)

    def _capture_one(self, index: int, size: int, stream, pool) -> torch.cuda.CUDAGraph:
        with torch.cuda.stream(stream):
            self._segment(index, size)  # warm-up: Triton compiles outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._segment(index, size)
        return graph

    # ---- a step ----

    @torch.inference_mode()
    def run(self, batch: HostBatch, meta: AttentionMetadata,
            sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; ``meta`` is the real batch's;
        ``sampled``: the device tokens that placeholder input ids name (overlap)."""
        num_tokens = len(batch.input_ids)
        size = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        self._copy_in(batch, num_tokens, size)
        if batch.has_placeholders:
            ids = self.input_ids[:num_tokens]
            ids.copy_(resolve_placeholders(ids, sampled))
        segments = self._runner(size)
        segments[0]()
        for index, layer in enumerate(self.layers):
            out = layer.self_attn.attend(self.qkv[:num_tokens], meta, self.kv_caches[index])
            self.attn_out[:num_tokens].copy_(out.reshape(num_tokens, -1))
            segments[index + 1]()
        return self.hidden_out[:num_tokens]

    def _copy_in(self, batch: HostBatch, num_tokens: int, size: int) -> None:
        put = lambda dst, array: dst.copy_(staged(array, self.device), non_blocking=True)

        put(self.input_ids[:num_tokens], batch.input_ids)
        put(self.positions[:num_tokens], batch.positions)
        put(self.slot_mapping[:num_tokens], batch.slot_mapping)
        if size > num_tokens:  # padding rows: no KV store, a valid position
            self.slot_mapping[num_tokens:size].fill_(-1)
            self.positions[num_tokens:size].fill_(0)
