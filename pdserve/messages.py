"""Every message that crosses between the HTTP process and the engine process, and what the
engine returns to any caller (``RequestUpdate`` per step, ``EngineStats``): defined once, below
both the engine and the server, so neither mirrors the other's types.

The channel pickles lists of these (one list per send), so a step's outputs for all running
requests travel as one message. Times are ``time.monotonic()`` values: both processes share
the host's monotonic clock, which lets the server (and the overhead benchmark) compare
engine-side and client-side latencies token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.handoff import KVHandoff
from pdserve.sampling_params import PromptLogprob, SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later (HTTP 429)."""


# ---- HTTP process -> engine process -------------------------------------------------------


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """When the HTTP server received the request."""
    handoff: KVHandoff | None = None
    """P/D across instances: this instance runs only the prefill, or only the decode."""


@dataclass(slots=True)
class AbortRequests:
    """Free these requests and their KV blocks (client gone, stop string hit, shutdown)."""

    request_ids: list[str]


@dataclass(slots=True)
class Shutdown:
    """Leave the engine loop and exit; anything still running is dropped."""


@dataclass(slots=True)
class TimelineQuery:
    """Asks for ``EngineCore.timeline(since)``; answered by a ``TimelineReply``."""

    query_id: int
    since: float | None = None


@dataclass(slots=True)
class DescribeQuery:
    """Asks for ``EngineCore.describe()`` now (counters as of this moment); answered by a
    ``DescribeReply``."""

    query_id: int


@dataclass(slots=True)
class ResetPrefixCacheQuery:
    """Asks for ``EngineCore.reset_prefix_cache()``; answered by a ``ResetPrefixCacheReply``."""

    query_id: int


@dataclass(slots=True)
class RequestMetricsQuery:
    """Asks for the request metrics summed over every HTTP process; answered by a
    ``RequestMetricsReply``."""

    query_id: int


@dataclass(slots=True)
class HistogramCounts:
    """A histogram as plain numbers: ``counts[i]`` values fell in bucket i (the last bucket
    is +Inf), ``total`` is their sum. The bucket bounds are the server's (``metrics.py``)."""

    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def add(self, other: HistogramCounts) -> None:
        if not self.counts:
            self.counts = [0] * len(other.counts)
        for i, count in enumerate(other.counts):
            self.counts[i] += count
        self.total += other.total


@dataclass(slots=True)
class RequestMetrics:
    """What the HTTP side observed of finished requests (latency histograms, finish
    reasons, error answers). With several HTTP processes each sends the engine process what
    every finished request added, and ``/metrics`` on any of them shows the sum."""

    ttft: HistogramCounts = field(default_factory=HistogramCounts)
    itl: HistogramCounts = field(default_factory=HistogramCounts)
    e2e: HistogramCounts = field(default_factory=HistogramCounts)
    finished: dict[str, int] = field(default_factory=dict)
    """Finish reason -> requests."""
    errors: dict[str, int] = field(default_factory=dict)
    """HTTP status -> answers."""

    def add(self, other: RequestMetrics) -> None:
        self.ttft.add(other.ttft)
        self.itl.add(other.itl)
        self.e2e.add(other.e2e)
        for mine, theirs in ((self.finished, other.finished), (self.errors, other.errors)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count


# ---- engine process -> HTTP process -------------------------------------------------------


@dataclass(slots=True)
class EngineReady:
    model_name: str
    max_model_len: int
    pid: int
    tokenizer: object = None
    """The engine's own tokenizer, pickled, so the server detokenizes with exactly it."""
    vocab_size: int | None = None
    """Token ids at or past this are refused before they reach the engine."""
    kv_address: str | None = None
    """"host:port" of the engine's KV receiver; None when it takes no part in KV transfer."""
    setup: dict = field(default_factory=dict)
    """What actually runs (``EngineCore.describe()``): schedule, attention backend, SM
    partitions (real or emulated), latency predictor; results record it."""


@dataclass(slots=True)
class EngineDead:
    """The engine failed (at load time or in a step) and its process is exiting."""

    message: str


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    time: float = 0.0
    """``time.monotonic()`` when the step finished, on the engine's side."""
    engine_arrival_time: float | None = None
    """Set on a request's first update only, by the engine process: when it received it."""
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """On the first update of a request that asked for them: one entry per prompt token
    (None for the first, which nothing predicts)."""
    embedding: list[float] | None = None
    """On the first update of a request with ``return_embedding``: the prompt's embedding."""

    def __reduce__(self) -> tuple:
        # Positional fields pickle in about half the time of the default slots state, on
        # both sides of the pipe: there is one of these per running request per step.
        return (RequestUpdate, (self.request_id, self.new_token_ids, self.new_logprobs,
                             self.finished, self.finish_reason, self.num_prompt_tokens,
                             self.num_cached_tokens, self.time, self.engine_arrival_time,
                             self.prompt_logprobs, self.embedding))


@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestUpdate]
    time: float
    """When the step's tokens were ready in the engine process."""


@dataclass(slots=True)
class RequestRejected:
    """``add_request`` refused the request; ``status`` is the HTTP status to answer."""

    request_id: str
    status: int
    message: str


@dataclass(slots=True)
class TimelineReply:
    query_id: int
    entries: list[dict]
    """One dict per multiplex planning decision (time, mode, SM split, batch sizes);
    empty under the other policies."""


@dataclass(slots=True)
class DescribeReply:
    query_id: int
    info: dict


@dataclass(slots=True)
class ResetPrefixCacheReply:
    query_id: int
    counts: dict
    """``EngineCore.reset_prefix_cache()``'s: blocks forgotten, cached blocks kept in use."""


@dataclass(slots=True)
class RequestMetricsReply:
    query_id: int
    metrics: RequestMetrics
    """Summed over every HTTP process."""
    others_in_flight: int
    """Requests the engine holds for the other HTTP processes."""


MUX_MODES = ("spatial", "temporal", "time_slice", "prefill_only", "decode_only", "idle",
             "disagg")
"""The multiplex planner's modes (``MuxMode`` values), listed here so that the server's
``/metrics`` offers every mode's series from the start without importing the engine."""


@dataclass(slots=True)
class EngineStats:
    """The engine's counters (``EngineCore.stats()``); the engine process sends them at most
    every few hundred ms while it is busy."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    last_batch_decode: int = 0
    """Decode requests in the latest step (multiplex: the decode launch in flight); 0 idle."""
    last_batch_prefill_tokens: int = 0
    """Prompt tokens in the latest step (multiplex: the prefill piece in flight); 0 idle."""
    mux_mode: str = ""
    """Multiplex only: the latest split's mode (``MUX_MODES``); empty under other policies."""
    decode_sms: int = 0
    """Multiplex only: SMs of the decode partition; 0 under other policies."""
    prefill_sms: int = 0
    """Multiplex only: SMs of the prefill partition; 0 under other policies."""
    kv_transfers: int = 0
    """KV buffers sent and received (disagg: hand-offs between the two pools)."""
    kv_transfer_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


ToEngine = (AddRequest | AbortRequests | Shutdown | TimelineQuery | DescribeQuery
            | ResetPrefixCacheQuery | RequestMetrics | RequestMetricsQuery)
FromEngine = (EngineReady | EngineDead | StepOutputs | RequestRejected | EngineStats
              | TimelineReply | DescribeReply | ResetPrefixCacheReply | RequestMetricsReply)
