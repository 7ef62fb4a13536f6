"""Launches that the host does not wait for: whole batches and pieces of a prefill batch.

Each launch ends by copying its sampled tokens into a pinned host buffer (asynchronously)
and recording an event on its stream. The engine reads the buffer only after
``event.query()`` says the launch is done, so the host never blocks on one lane while
another could be launched. There is one buffer pair per lane: a lane has one launch in
flight (two under overlap scheduling), one per buffer, and a buffer is read before the lane
launches into it again.

A prefill batch runs as pieces, layer ranges [start, end) with hidden and residual kept
between pieces. Its inputs are built on the stream of its first piece; a later piece on
another stream (after a partition switch) marks every tensor it touches for that stream
too (``keep_alive``): the caching allocator is per stream, so memory made on one stream and
used on another must be marked or it is handed out again under a kernel still using it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.engine.batch import BlockTables, HostBatch, build_host_batch
from pdserve.engine.graph_runner import GraphRunner
from pdserve.engine.sampler import SamplingBatch, num_top_logprobs, sample
from pdserve.engine.streams import Event, StreamOps, same_stream
from pdserve.request import Request
from pdserve.sampling_params import MAX_TOP_LOGPROBS, PromptLogprob, TokenLogprob
from pdserve.sched.base import Plan, StepOutput, Work

log = logging.getLogger(__name__)


@dataclass
class HostBuffers:
    """Pinned landing places for one lane's sampled tokens, logprobs and top alternatives
    (``top_*``: flat, a step's rows each ``K`` wide, K the most any of them asked for).

    ``device_tokens``: the lane's sampled tokens also kept on the device, where the next
    launch's placeholder input ids read them (overlap scheduling); None: not kept."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    device_tokens: torch.Tensor | None = None
    prompt: PromptRows | None = None  # the last launch's prompt scores (its own host copy)
    embed: EmbedRows | None = None  # the last launch's embeddings (their own host copy)

    @classmethod
    def make(cls, ops: StreamOps, size: int, device_tokens: torch.Tensor | None = None
             ) -> HostBuffers:
        top = size * MAX_TOP_LOGPROBS
        return cls(ops.host_buffer(size, torch.int64), ops.host_buffer(size, torch.float32),
                   ops.host_buffer(top, torch.int64), ops.host_buffer(top, torch.float32),
                   device_tokens)


@dataclass
class KVPool:
    """A range of the engine's KV pages as one policy pool sees it: its own page ids from 0,
    its own block tables, decode graphs captured over it (by decode SMs) and, on the whole
    GPU, the graphs of steps with prompt tokens (``piecewise.py``)."""

    kv_caches: list
    tables: BlockTables
    graphs: dict[int, GraphRunner] = field(default_factory=dict)
    piecewise: Any = None  # PiecewiseGraphs: whole-GPU steps with prompt tokens


@dataclass
class Launch:
    """One launch in flight: a whole batch, or a piece of a prefill batch."""

    work: Work
    event: Event
    buffers: HostBuffers
    num_sampled: int
    want_logprobs: bool
    launch_ms: float  # host time spent issuing it (a bubble if longer than a decode step)
    # When the host began issuing; for a launch issued behind its lane's previous one
    # (overlap), when that one was seen to complete.
    issued: float = field(default_factory=time.perf_counter)
    # A timing event recorded on the stream just before the launch's kernels (whole launches
    # on CUDA), with ``event`` its end: the launch's time on the device.
    device_start: Any = None
    prompt: PromptRows | None = field(init=False, default=None)
    embed: EmbedRows | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # Taken now: the lane's next launch with these buffers sets its own.
        self.prompt, self.buffers.prompt = self.buffers.prompt, None
        self.embed, self.buffers.embed = self.buffers.embed, None

    @property
    def plan(self) -> Plan:
        return self.work.plan

    def output(self) -> StepOutput:
        """Sampled tokens; only valid once ``event.query()`` is True. ``elapsed_ms`` runs from
        the start of issuing to now (the caller reads it as soon as the event is done)."""
        elapsed = (time.perf_counter() - self.issued) * 1e3
        device = self.device_start.elapsed_time(self.event) if self.device_start is not None \
            else None
        if self.num_sampled == 0:
            return StepOutput(token_ids=[], elapsed_ms=elapsed, device_ms=device)
        n = self.num_sampled
        tokens = self.buffers.tokens[:n].tolist()
        logprobs = self._logprobs() if self.want_logprobs else None
        return StepOutput(token_ids=tokens, logprobs=logprobs, elapsed_ms=elapsed,
                          device_ms=device)

    def _logprobs(self) -> list[float]:
        logprobs = self.buffers.logprobs[:self.num_sampled].tolist()
        params = [s.request.params for s in self.plan.sampling]
        width = num_top_logprobs(params)
        if width == 0:
            return logprobs
        size = self.num_sampled * width
        ids = self.buffers.top_ids[:size].view(-1, width).tolist()
        values = self.buffers.top_logprobs[:size].view(-1, width).tolist()
        return [TokenLogprob(lp, list(zip(i[:p.top_logprobs], v[:p.top_logprobs], strict=True)))
                if p.logprobs and p.top_logprobs else lp
                for lp, i, v, p in zip(logprobs, ids, values, params, strict=True)]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


PROMPT_SCORE_ROWS = 256
"""Prompt positions scored per pass: their float32 logits over the vocabulary ([rows,
vocab], 128 MiB at 128K tokens) are the largest tensor prompt logprobs add to a step."""


@dataclass
class PromptRows:
    """The rows of a step whose logits score a prompt token: for each request that asked for
    prompt logprobs, the positions this step computes whose next token is in its prompt
    (position p scores token p + 1). Scored on the device, copied to ``host`` in one copy."""

    requests: list[Request]
    starts: list[int]  # first scored position of each request
    counts: list[int]  # positions scored of each request
    rows: torch.Tensor  # [R] int64: rows of the step's hidden states
    targets: torch.Tensor  # [R] int64: the prompt token each row scores
    width: int  # alternatives per row: the most any of these requests asked for
    host: torch.Tensor | None = None  # [R, 2 + 2 * width] float64, once scored

    @classmethod
    def of(cls, plan: Plan, query_start_loc: np.ndarray, device: torch.device
           ) -> PromptRows | None:
        if not Request.num_scoring:  # the common step: nobody asked
            return None
        spans = [span for i, item in enumerate(plan.scheduled)
                 if item.request.params.prompt_logprobs is not None
                 and (span := _scored_span(item, int(query_start_loc[i]))) is not None]
        if not spans:
            return None
        requests = [request for request, _, _, _ in spans]
        rows = np.concatenate([np.arange(count) + row for _, _, count, row in spans])
        targets = np.concatenate([r.prompt_token_ids[start + 1:start + 1 + count]
                                  for r, start, count, _ in spans]).astype(np.int64)
        return cls(requests, [start for _, start, _, _ in spans],
                   [count for _, _, count, _ in spans], _to_device(rows, device),
                   _to_device(targets, device), max(r.params.prompt_logprobs for r in requests))

    @classmethod
    def worst_case(cls, num_tokens: int, device: torch.device) -> PromptRows:
        """The most a step scores in one pass, with 20 alternatives (memory profiling)."""
        rows = torch.arange(min(num_tokens, PROMPT_SCORE_ROWS), device=device)
        return cls([], [], [], rows, torch.zeros_like(rows), MAX_TOP_LOGPROBS)

    def score(self, model, hidden: torch.Tensor) -> None:
        """Logprob and rank of each row's prompt token and the top ``width``, in float32 on
        the device; one copy of all of them to the host, not waited for."""
        parts = [self._score_slice(model, hidden, start)
                 for start in range(0, self.rows.shape[0], PROMPT_SCORE_ROWS)]
        packed = torch.cat(parts)
        self.host = torch.empty(packed.shape, dtype=packed.dtype,
                                pin_memory=packed.device.type == "cuda")
        self.host.copy_(packed, non_blocking=True)

    def _score_slice(self, model, hidden: torch.Tensor, start: int) -> torch.Tensor:
        rows = self.rows[start:start + PROMPT_SCORE_ROWS]
        targets = self.targets[start:start + PROMPT_SCORE_ROWS, None]
        logprobs = model.compute_logits(hidden.index_select(0, rows)).float().log_softmax(-1)
        chosen = logprobs.gather(1, targets)
        # vLLM's rank: 1 + the tokens strictly more likely (ties share the better rank).
        rank = (logprobs > chosen).sum(-1, keepdim=True) + 1
        # float64 holds token ids and ranks exactly: everything goes in one tensor.
        parts = [chosen.double(), rank.double()]
        if self.width:
            top = logprobs.topk(self.width, dim=-1)
            parts += [top.values.double(), top.indices.double()]
        return torch.cat(parts, dim=1)

    def store(self) -> None:
        """Writes the scores into the requests (the launch is done); a request that has sent
        its prompt logprobs meanwhile (aborted, finished) is skipped."""
        table, offset = self.host.tolist(), 0
        for request, start, count in zip(self.requests, self.starts, self.counts, strict=True):
            if request.prompt_logprobs is not None:
                request.prompt_logprobs[start + 1:start + 1 + count] = [
                    self._entry(row, request.params.prompt_logprobs)
                    for row in table[offset:offset + count]]
            offset += count

    def _entry(self, row: list[float], keep: int) -> PromptLogprob:
        """(logprob, rank, top ``keep``) from a packed row."""
        width = self.width
        top = zip(map(int, row[2 + width:2 + width + keep]), row[2:2 + keep], strict=True)
        return row[0], int(row[1]), list(top)


@dataclass
class EmbedRows:
    """The rows of a step that sample a ``return_embedding`` request's first token: its last
    prompt token's hidden state (after the final norm), its embedding. L2-normalized in
    float32 on the device, copied to ``host`` in one copy, stored into the requests once
    the launch is done."""

    requests: list[Request]
    rows: torch.Tensor  # [E] int64: rows of the step's hidden states
    host: torch.Tensor | None = None  # [E, hidden] float32, once taken

    @classmethod
    def of(cls, plan: Plan, host: HostBatch, device: torch.device) -> EmbedRows | None:
        if not Request.num_embedding:  # the common step: nobody asked
            return None
        picks = [i for i, item in enumerate(plan.sampling) if item.request.claim_embedding()]
        if not picks:
            return None
        return cls([plan.sampling[i].request for i in picks],
                   _to_device(np.asarray(host.logits_indices)[picks], device))

    def take(self, hidden: torch.Tensor) -> None:
        rows = torch.nn.functional.normalize(hidden.index_select(0, self.rows).float(), dim=-1)
        self.host = torch.empty(rows.shape, dtype=torch.float32,
                                pin_memory=rows.device.type == "cuda")
        self.host.copy_(rows, non_blocking=True)

    def store(self) -> None:
        for request, row in zip(self.requests, self.host.tolist(), strict=True):
            request.embedding = row


def _scored_span(item, first_row: int) -> tuple[Request, int, int, int] | None:
    """(request, first position, positions, first row) of the positions this step computes
    for ``item`` whose next token is in its prompt; None when it scores none."""
    request = item.request
    if not request.scores_prompt:  # scored and sent already (a recompute after preemption)
        return None
    start = request.num_computed
    end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
    return (request, start, end - start, first_row) if end > start else None


@dataclass
class SamplingInputs:
    """Device inputs of sampling (and of prompt scoring), copied before the forward is
    issued: a host-to-device copy from pageable memory waits for the stream to drain, which
    must not happen behind a layer's kernels (the host would block for the whole launch)."""

    rows: torch.Tensor | None
    batch: SamplingBatch | None
    prompt: PromptRows | None = None
    embed: EmbedRows | None = None

    @classmethod
    def of(cls, plan: Plan, host: HostBatch, vocab_size: int, device: torch.device
           ) -> SamplingInputs | None:
        requests = [s.request for s in plan.sampling]
        prompt = PromptRows.of(plan, host.query_start_loc, device)
        if not requests:
            return None if prompt is None else cls(None, None, prompt)
        return cls(_to_device(host.logits_indices, device),
                   SamplingBatch.from_requests(requests, vocab_size, device), prompt,
                   EmbedRows.of(plan, host, device))


def sample_into(model, hidden: torch.Tensor, inputs: SamplingInputs | None,
                buffers: HostBuffers) -> tuple[int, bool]:
    """Samples on the current stream and copies the tokens to the pinned buffers without a
    host sync (and scores prompt tokens, for requests that asked). Returns (rows sampled,
    logprobs wanted)."""
    buffers.prompt = inputs.prompt if inputs is not None else None
    if buffers.prompt is not None:
        buffers.prompt.score(model, hidden)
    buffers.embed = inputs.embed if inputs is not None else None
    if buffers.embed is not None:
        buffers.embed.take(hidden)
    if inputs is None or inputs.batch is None:
        return 0, False
    logits = model.compute_logits(hidden.index_select(0, inputs.rows))
    if inputs.batch.grammar is not None:
        # The forward and the LM head are queued on the device: the host fills the grammar
        # bitmask meanwhile, then its copy and the sampling kernels follow them.
        inputs.batch.grammar.fill()
    tokens, logprobs = sample(logits, inputs.batch)
    n = tokens.shape[0]
    if buffers.device_tokens is not None:
        buffers.device_tokens[:n].copy_(tokens)
    buffers.tokens[:n].copy_(tokens, non_blocking=True)
    if logprobs is not None:
        buffers.logprobs[:n].copy_(logprobs.sampled, non_blocking=True)
    if logprobs is not None and logprobs.top_ids is not None:
        size = logprobs.top_ids.numel()
        buffers.top_ids[:size].copy_(logprobs.top_ids.flatten(), non_blocking=True)
        buffers.top_logprobs[:size].copy_(logprobs.top_values.flatten(), non_blocking=True)
    return n, logprobs is not None


class PrefillBatch:
    """A prefill batch part-way through the model's layers (hidden and residual kept)."""

    def __init__(self, plan: Plan, runner, pool: KVPool):
        self.plan, self.runner, self.pool, self.ops = plan, runner, pool, runner.ops
        self.host: HostBatch = build_host_batch(plan, pool.tables, runner.block_size)
        self._inputs: tuple | None = None  # positions, metadata (device)
        self._hidden: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None
        self._stream: Any = None
        self._last_event: Event | None = None

    @property
    def started(self) -> bool:
        return self._inputs is not None

    def launch_piece(self, stream: Any, layers: tuple[int, int], final: bool,
                     buffers: HostBuffers, sms: int | None = None) -> tuple[int, bool, Event]:
        """Issues layers [start, end) on ``stream`` (the caller made it wait on what it must),
        which runs on ``sms`` SMs (None: the whole device); the final piece also samples the
        batch's finishing requests. Returns (rows sampled, logprobs wanted, the piece's
        event)."""
        if self._last_event is not None and not same_stream(stream, self._stream):
            self.ops.wait(stream, self._last_event)
        inputs = self._sampling_inputs() if final else None  # copies before kernels
        if not self.started:
            self._embed(stream)
        else:
            self._follow(stream)
        positions, meta = self._inputs
        if meta.launch_sms != sms:  # the pieces of one batch may run on several partitions
            meta = dataclasses.replace(meta, launch_sms=sms)
            self._inputs = (positions, meta)
        self._hidden, self._residual = self.runner.model.forward_layers(
            self._hidden, self._residual, positions, meta, self.pool.kv_caches, *layers)
        num, want = self._finish(inputs, buffers) if final else (0, False)
        self._last_event = self.ops.record(stream)
        return num, want, self._last_event

    def _embed(self, stream: Any) -> None:
        if self.host.has_placeholders:  # only whole-batch launches of one lane overlap
            raise RuntimeError("a prefill batch run as pieces cannot take placeholder ids")
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
        return SamplingInputs.of(self.plan, self.host,
                                 self.runner.arch.vocab_size, self.runner.device)

    def _finish(self, inputs: SamplingInputs | None, buffers: HostBuffers) -> tuple[int, bool]:
        model = self.runner.model
        hidden = model.final_norm(self._hidden, self._residual)
        result = sample_into(model, hidden, inputs, buffers)
        self._hidden = self._residual = None  # free activations as soon as the stream allows
        return result
