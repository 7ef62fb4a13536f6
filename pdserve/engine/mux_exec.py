"""Launching multiplex work without waiting for it: decode steps and prefill pieces.

Each launch ends by copying its sampled tokens into a pinned host buffer (asynchronously)
and recording an event on its stream. The loop reads the buffer only after
``event.query()`` says the launch is done, so the host never blocks on one phase while
the other could be launched. There is one buffer pair per lane (decode, prefill): a lane
has at most one launch in flight and its buffer is read before the lane launches again.

A prefill batch runs as pieces, layer ranges [start, end) with hidden and residual kept
between pieces. Its inputs are built on the stream of its first piece; a later piece on
another stream (after a partition switch) marks every tensor it touches for that stream
too (``keep_alive``): the caching allocator is per stream (DESIGN.md §3a).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.batch import HostBatch, build_host_batch
from pdserve.engine.graph_runner import GraphRunner
from pdserve.engine.sampler import SamplingBatch, sample
from pdserve.engine.streams import Event, StreamOps, same_stream
from pdserve.gpu.partitions import Partition
from pdserve.sched.base import Plan, StepOutput
from pdserve.sched.mux_planner import DecodeLoad

log = logging.getLogger(__name__)


@dataclass
class HostBuffers:
    """Pinned landing places for one lane's sampled tokens and logprobs."""

    tokens: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def make(cls, ops: StreamOps, size: int) -> HostBuffers:
        return cls(ops.host_buffer(size, torch.int64), ops.host_buffer(size, torch.float32))


@dataclass
class Launch:
    """One decode step or prefill piece in flight."""

    kind: str  # "decode" | "prefill"
    plan: Plan
    partition: Partition
    event: Event
    buffers: HostBuffers | None  # None: this launch samples nothing
    num_sampled: int
    want_logprobs: bool
    final: bool  # decode steps, and the piece that runs a prefill batch's last layer
    launch_ms: float  # host time spent issuing it (a bubble if longer than a decode step)
    issued: float = field(default_factory=time.monotonic)
    load: DecodeLoad | None = None

    def output(self) -> StepOutput:
        """Sampled tokens; only valid once ``event.query()`` is True."""
        if self.buffers is None or self.num_sampled == 0:
            return StepOutput(token_ids=[])
        n = self.num_sampled
        tokens = self.buffers.tokens[:n].tolist()
        logprobs = self.buffers.logprobs[:n].tolist() if self.want_logprobs else None
        return StepOutput(token_ids=tokens, logprobs=logprobs)


@dataclass
class SamplingInputs:
    """Device inputs of sampling, copied before the forward is issued: a host-to-device copy
    from pageable memory waits for the stream to drain, which must not happen behind a
    layer's kernels (the host would block for the whole launch)."""

    rows: torch.Tensor
    batch: SamplingBatch

    @classmethod
    def of(cls, plan: Plan, logits_indices, vocab_size: int, device: torch.device
           ) -> SamplingInputs | None:
        requests = [s.request for s in plan.sampling]
        if not requests:
            return None
        rows = torch.from_numpy(logits_indices)
        if device.type == "cuda":
            rows = rows.pin_memory()
        return cls(rows.to(device, non_blocking=True),
                   SamplingBatch.from_requests(requests, vocab_size, device))


def sample_into(model, hidden: torch.Tensor, inputs: SamplingInputs | None,
                buffers: HostBuffers) -> tuple[int, bool]:
    """Samples on the current stream and copies the tokens to the pinned buffers without a
    host sync. Returns (rows sampled, logprobs wanted)."""
    if inputs is None:
        return 0, False
    logits = model.compute_logits(hidden.index_select(0, inputs.rows))
    tokens, logprobs = sample(logits, inputs.batch)
    n = tokens.shape[0]
    buffers.tokens[:n].copy_(tokens, non_blocking=True)
    if logprobs is not None:
        buffers.logprobs[:n].copy_(logprobs, non_blocking=True)
    return n, logprobs is not None


class DecodeLane:
    """Decode steps on a partition's decode stream, replaying that partition's graphs."""

    def __init__(self, runner, ops: StreamOps, max_batch: int):
        self.runner, self.ops = runner, ops
        self.model, self.device = runner.model, runner.device
        self.buffers = HostBuffers.make(ops, max_batch)
        self.graphs: dict[int, GraphRunner] = {}  # by decode SMs (the whole GPU: all SMs)

    def capture(self, partitions: list[Partition], buckets: list[int]) -> None:
        """One graph set per partition, captured on its own decode stream (a graph keeps the
        SM limit of the stream it was captured on), all in one memory pool."""
        if self.device.type != "cuda" or not buckets:
            return
        pool = torch.cuda.graph_pool_handle()
        runner = self.runner
        for part in partitions:
            graphs = GraphRunner(self.model, runner.kv_caches, max(buckets), runner.tables.width,
                                 runner.block_size, self.device, stream=part.decode_stream,
                                 pool=pool)
            graphs.buckets = list(buckets)  # replay picks among the captured buckets only
            graphs.capture(buckets)
            self.graphs[part.decode_sms] = graphs
        log.info("decode graphs: %d partitions x batches %s", len(partitions), buckets)

    def launch(self, plan: Plan, part: Partition, waits: list[Event],
               load: DecodeLoad | None = None) -> Launch:
        started = time.perf_counter()
        batch = build_host_batch(plan, self.runner.tables, self.runner.block_size)
        stream = part.decode_stream
        with self.ops.on(stream):
            for event in waits:
                self.ops.wait(stream, event)
            inputs = SamplingInputs.of(plan, batch.logits_indices, self.runner.arch.vocab_size,
                                       self.device)
            hidden = self._forward(batch, part)
            num, want = sample_into(self.model, hidden, inputs, self.buffers)
            event = self.ops.record(stream)
        return Launch("decode", plan, part, event, self.buffers, num, want, True,
                      (time.perf_counter() - started) * 1e3, load=load)

    def _forward(self, batch: HostBatch, part: Partition) -> torch.Tensor:
        graphs = self.graphs.get(part.decode_sms)
        if graphs is not None and graphs.can_run(batch):
            return graphs.run(batch)
        input_ids, positions, meta = batch.metadata(self.device)
        return self.model.forward(input_ids, positions, meta, self.runner.kv_caches)


class PrefillBatch:
    """A prefill batch part-way through the model's layers."""

    def __init__(self, plan: Plan, runner, ops: StreamOps, buffers: HostBuffers):
        self.plan, self.runner, self.ops, self.buffers = plan, runner, ops, buffers
        self.num_layers = runner.model.num_layers
        self.layers_done = 0  # layers launched (the last piece may still be running)
        self.host: HostBatch = build_host_batch(plan, runner.tables, runner.block_size)
        self.num_tokens = int(self.host.query_start_loc[-1])
        self._inputs: tuple | None = None  # positions, metadata (device)
        self._hidden: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None
        self._stream: Any = None
        self._last_event: Event | None = None

    @property
    def started(self) -> bool:
        return self._inputs is not None

    def launch_piece(self, part: Partition, num_layers: int, waits: list[Event]) -> Launch:
        """Issues layers [layers_done, layers_done + num_layers) on the prefill stream; the
        last piece also samples the batch's finishing requests."""
        started = time.perf_counter()
        end = min(self.num_layers, self.layers_done + max(1, num_layers))
        stream = part.prefill_stream
        with self.ops.on(stream):
            self._order_after(stream, waits)
            final = end == self.num_layers
            inputs = self._sampling_inputs() if final else None  # copies before kernels
            if not self.started:
                self._embed(stream)
            else:
                self._follow(stream)
            positions, meta = self._inputs
            self._hidden, self._residual = self.runner.model.forward_layers(
                self._hidden, self._residual, positions, meta, self.runner.kv_caches,
                self.layers_done, end)
            self.layers_done = end
            num, want = self._finish(inputs) if final else (0, False)
            event = self.ops.record(stream)
        self._last_event = event
        return Launch("prefill", self.plan, part, event, self.buffers if num else None, num,
                      want, final, (time.perf_counter() - started) * 1e3)

    def _order_after(self, stream: Any, waits: list[Event]) -> None:
        for event in waits:
            self.ops.wait(stream, event)
        if self._last_event is not None and not same_stream(stream, self._stream):
            self.ops.wait(stream, self._last_event)

    def _embed(self, stream: Any) -> None:
        input_ids, positions, meta = self.host.metadata(self.runner.device)
        self._inputs = (positions, meta)
        self._hidden, self._residual = self.runner.model.embed(input_ids), None
        self._stream = stream

    def _follow(self, stream: Any) -> None:
        if same_stream(stream, self._stream):
            return
        self.ops.keep_alive(self._tensors(), stream)
        self._stream = stream

    def _tensors(self) -> list[torch.Tensor]:
        positions, meta = self._inputs
        return [positions, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.slot_mapping, self._hidden, self._residual]

    def _sampling_inputs(self) -> SamplingInputs | None:
        return SamplingInputs.of(self.plan, self.host.logits_indices,
                                 self.runner.arch.vocab_size, self.runner.device)

    def _finish(self, inputs: SamplingInputs | None) -> tuple[int, bool]:
        model = self.runner.model
        hidden = model.final_norm(self._hidden, self._residual)
        result = sample_into(model, hidden, inputs, self.buffers)
        self._hidden = self._residual = None  # free activations as soon as the stream allows
        return result


def decode_load_of(plan: Plan) -> DecodeLoad:
    return DecodeLoad(len(plan.decodes), sum(s.request.num_tokens for s in plan.decodes))
