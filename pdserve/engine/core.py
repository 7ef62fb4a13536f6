"""The engine loop's core: validate and queue requests, run one scheduled step at a time.

It never detokenizes: stop strings are matched by whoever streams the text (the server or
the offline ``LLM``), which aborts the request when one hits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.cache.block_manager import BlockManager
from pdserve.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.model.arch import get_arch, is_checkpoint_dir
from pdserve.model.tokenizer import load_tokenizer
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.sched.base import Plan, StepOutput
from pdserve.sched.policies import make_scheduler

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later (HTTP 429)."""


@dataclass
class RequestUpdate:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    time: float  # time.monotonic() when the step finished, on the engine's side


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_steps: int
    last_batch_decode: int
    last_batch_prefill_tokens: int
    # multiplex only: the latest SM split (``EngineCore.timeline()`` has the history)
    mux_mode: str = ""
    decode_sms: int = 0
    prefill_sms: int = 0
    # disagg only: KV hand-offs from the prefill pool to the decode pool since start
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.arch = get_arch(config.model)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            log.warning("max_model_len %d is past the %d positions the model was trained on",
                        self.max_model_len, self.arch.max_position_embeddings)
        self.model_name = config.model.model
        tokenizer_path = config.model.tokenizer or (
            config.model.model if is_checkpoint_dir(config.model.model) else None)
        self.tokenizer = load_tokenizer(tokenizer_path, self.arch)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(config, self.arch, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching)
        self.scheduler = make_scheduler(config.scheduler, self.blocks, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestUpdate] = []
        self._counters = {"prompt": 0, "generation": 0, "steps": 0}
        self._last_plan = Plan()
        self.mux = None
        self.disagg = None
        if config.scheduler.schedule == "multiplex":
            from pdserve.engine.multiplex import MultiplexLoop

            self.mux = MultiplexLoop(self)
        elif config.scheduler.schedule == "disagg":
            from pdserve.engine.disagg import DisaggLoop

            self.mux = self.disagg = DisaggLoop(self)

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self._validate(request_id, prompt_token_ids, params)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests already waiting")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                          arrival_time if arrival_time is not None else time.monotonic())
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._counters["prompt"] += len(prompt_token_ids)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        limit = self.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequestError(f"the prompt has {len(prompt)} tokens; this model's context "
                                      f"is {limit} tokens, which must also fit one output token")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(prompt)} tokens exceeds "
                f"the model's context of {limit} tokens")
        needed = self.blocks.blocks_needed(len(prompt) + params.max_tokens)
        if needed > self.blocks.num_blocks:
            raise InvalidRequestError(f"the request needs {needed} KV blocks; the pool has "
                                      f"{self.blocks.num_blocks}")
        total = len(prompt) + params.max_tokens
        if self.disagg is not None and (why := self.scheduler.fits(total)):
            raise InvalidRequestError(why)

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._aborted.append(self._update(request, [], None))
            self._forget(request)

    # ---- the loop ----

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    def step(self) -> list[RequestUpdate]:
        updates, self._aborted = self._aborted, []
        if self.mux is not None:
            return updates + self.mux.step()
        plan = self.scheduler.schedule()
        self._last_plan = plan
        if plan.is_empty():
            return updates
        try:
            output = self.runner.execute(plan)
        except Exception:
            # One bad step must not take the engine down: fail the requests it carried.
            log.exception("step failed; aborting its %d requests", len(plan.scheduled))
            return updates + self._fail(plan)
        finished = self.scheduler.update(plan, output)
        self._counters["steps"] += 1
        self._counters["generation"] += len(output.token_ids)
        updates += self._collect(plan, output)
        for request in finished:
            self._forget(request)
        return updates

    def _collect(self, plan: Plan, output: StepOutput) -> list[RequestUpdate]:
        updates = []
        logprobs = output.logprobs or [None] * len(output.token_ids)
        for item, token_id, logprob in zip(plan.sampling, output.token_ids, logprobs, strict=True):
            request = item.request
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            wanted = [logprob] if request.params.logprobs and logprob is not None else None
            updates.append(self._update(request, [token_id], wanted))
        return updates

    def _fail(self, plan: Plan) -> list[RequestUpdate]:
        failed = []
        for item in plan.scheduled:
            request = item.request
            if request.request_id in self.requests:
                self.scheduler.abort(request.request_id)
                request.finish_reason = "error"
                failed.append(self._update(request, [], None))
                self._forget(request)
        return failed

    def _update(self, request: Request, tokens: list[int], logprobs) -> RequestUpdate:
        return RequestUpdate(request.request_id, tokens, logprobs, request.is_finished,
                             request.finish_reason, request.num_prompt_tokens,
                             request.num_cached_tokens, time.monotonic())

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.runner.forget(request.request_id)

    def stats(self) -> EngineStats:
        plan = self._last_plan
        stats = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage(), num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            prompt_tokens_total=self._counters["prompt"],
            generation_tokens_total=self._counters["generation"],
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._counters["steps"],
            last_batch_decode=len(plan.decodes),
            last_batch_prefill_tokens=plan.num_tokens - len(plan.decodes))
        last = self.mux.last() if self.mux is not None else None
        if last is not None:
            stats.mux_mode, stats.decode_sms, stats.prefill_sms = (
                last.mode, last.decode_sms, last.prefill_sms)
            stats.last_batch_decode = last.decode_batch
            stats.last_batch_prefill_tokens = last.prefill_tokens
        if self.disagg is not None:
            self._disagg_stats(stats)
        return stats

    def _disagg_stats(self, stats: EngineStats) -> None:
        """Both pools together; the prefix cache is the prefill pool's."""
        prefill, decode = self.scheduler.prefill.blocks, self.scheduler.decode.blocks
        stats.num_free_blocks = prefill.num_free_blocks + decode.num_free_blocks
        stats.num_total_blocks = prefill.num_blocks + decode.num_blocks
        stats.kv_usage = 1.0 - stats.num_free_blocks / stats.num_total_blocks
        stats.prefix_cache_queries = prefill.prefix_queries
        stats.prefix_cache_hits = prefill.prefix_hits
        stats.kv_transfers = self.disagg.num_transfers
        stats.kv_transfer_bytes = self.disagg.transfer_bytes

    def timeline(self, since: float | None = None) -> list[dict]:
        """Multiplex: the SM split over time (time, mode, decode/prefill SMs, decode batch,
        prefill tokens); empty under other policies."""
        return self.mux.timeline(since) if self.mux is not None else []

    def check_integrity(self) -> None:
        if self.disagg is not None:
            return self.scheduler.check_integrity()
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.blocks.check_integrity(live)
