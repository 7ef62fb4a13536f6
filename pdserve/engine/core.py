"""The engine loop's core: validate and queue requests, run one scheduled step at a time.

It never detokenizes: stop strings are matched by whoever streams the text (the server or
the offline ``LLM``), which aborts the request when one hits.
"""

from __future__ import annotations

import logging
import time

from pdserve.cache.block_manager import BlockManager
from pdserve.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.handoff import HANDOFF_FINISH_REASON, KVHandoff
from pdserve.messages import EngineStats, QueueFullError, RequestUpdate
from pdserve.model.arch import get_arch, is_checkpoint_dir
from pdserve.model.tokenizer import load_tokenizer
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.sched.base import Plan, StepOutput
from pdserve.sched.policies import make_scheduler

log = logging.getLogger(__name__)


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
        self._queued: list[RequestUpdate] = []  # aborts and first tokens, out with the next step
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
        self.kv_link = self._open_kv_link(config)
        self._awaiting_kv: dict[str, Request] = {}  # decode side: by transfer id, FCFS

    def _open_kv_link(self, config: EngineConfig):
        if config.transfer.kv_transfer_port is None:
            return None
        if self.mux is not None:
            raise ValueError("KV transfer across instances needs --schedule chunked or "
                             f"prefill-first, not {config.scheduler.schedule}")
        from pdserve.engine.kv_link import KVLink

        link = KVLink(config.transfer, self.runner.kv_caches)
        log.info("KV receiver listening on %s", link.address)
        return link

    @property
    def kv_address(self) -> str | None:
        """"host:port" of this instance's KV receiver; None without KV transfer."""
        return self.kv_link.address if self.kv_link is not None else None

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, handoff: KVHandoff | None = None) -> None:
        """Queues a request. ``handoff``: its prefill or its decode runs on another instance
        (``pdserve/handoff.py``)."""
        self._validate(request_id, prompt_token_ids, params)
        self._validate_handoff(handoff)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests already waiting")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                          arrival_time if arrival_time is not None else time.monotonic())
        request.handoff = handoff
        self.requests[request_id] = request
        if handoff is not None and handoff.is_decode:
            self._add_prefilled(request, handoff)
            return
        self.scheduler.add(request)
        self._counters["prompt"] += len(prompt_token_ids)

    def _validate_handoff(self, handoff: KVHandoff | None) -> None:
        if handoff is None:
            return
        if self.kv_link is None:
            raise InvalidRequestError("this instance takes no part in KV transfer (start it "
                                      "with --kv-transfer-port)")
        try:
            handoff.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if handoff.is_decode and not 0 <= handoff.first_token < self.arch.vocab_size:
            raise InvalidRequestError(f"first token {handoff.first_token} is not in the "
                                      f"vocabulary [0, {self.arch.vocab_size})")

    def _add_prefilled(self, request: Request, handoff: KVHandoff) -> None:
        """Decode side: the first token is known now; decoding waits for the prompt's KV."""
        request.append_token(handoff.first_token, handoff.first_logprob)
        request.first_token_time = time.monotonic()
        request.num_cached_tokens = handoff.num_cached_tokens
        reason = request.check_stop(self.max_model_len)
        if reason is not None:  # nothing left to decode: the KV is not needed
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
            self.kv_link.discard(handoff.transfer_id)
            self._forget(request)
        else:
            request.deadline = time.monotonic() + self.kv_link.timeout_s
            self._awaiting_kv[handoff.transfer_id] = request
        wanted = [handoff.first_logprob] if request.params.logprobs and \
            handoff.first_logprob is not None else None
        self._queued.append(self._update(request, [handoff.first_token], wanted))

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
        request = self.scheduler.abort(request_id) or self._abort_awaiting(request_id)
        if request is not None:
            self._queued.append(self._update(request, [], None))
            self._forget(request)

    def _abort_awaiting(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.handoff is None:
            return None
        if self._awaiting_kv.pop(request.handoff.transfer_id, None) is None:
            return None
        self.kv_link.discard(request.handoff.transfer_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
        return request

    # ---- the loop ----

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._queued) or bool(self._awaiting_kv)

    def step(self) -> list[RequestUpdate]:
        updates, self._queued = self._queued, []
        if self.mux is not None:
            return updates + self.mux.step()
        if self._awaiting_kv:
            updates += self._take_arrived_kv()
        plan = self.scheduler.schedule()
        self._last_plan = plan
        if plan.is_empty():
            if self._awaiting_kv and not updates:
                self.kv_link.wait_briefly(next(iter(self._awaiting_kv)))
            return updates
        try:
            output = self.runner.execute(plan)
        except Exception:
            # One bad step must not take the engine down: fail the requests it carried.
            log.exception("step failed; aborting its %d requests", len(plan.scheduled))
            return updates + self._fail(plan)
        exports = self._export_candidates(plan)
        finished = self.scheduler.update(plan, output)
        self._counters["steps"] += 1
        self._counters["generation"] += len(output.token_ids)
        updates += self._collect(plan, output)
        for request in finished:
            if request.finish_reason == HANDOFF_FINISH_REASON:
                self._export(request, exports[request.request_id])
            self._forget(request)
        return updates

    # ---- P/D across instances ----

    def _export_candidates(self, plan: Plan) -> dict[str, list[int]]:
        # Page ids of requests that may hand off in this step, read before ``update`` frees
        # them; the pages keep their contents until the next ``schedule()`` hands them out.
        if self.kv_link is None:  # the common engine: no pass over the batch per step
            return {}
        return {s.request.request_id: list(s.request.block_ids) for s in plan.sampling
                if s.request.handoff is not None and s.request.handoff.is_prefill}

    def _export(self, request: Request, block_ids: list[int]) -> None:
        handoff = request.handoff
        self.kv_link.export(handoff.transfer_id, handoff.target, block_ids,
                            request.num_prompt_tokens)

    def _take_arrived_kv(self) -> list[RequestUpdate]:
        """Decode side: requests whose KV is here join the running batch, in arrival order
        of their requests, while pages and batch slots last; late ones fail."""
        failed, now = [], time.monotonic()
        for transfer_id, request in list(self._awaiting_kv.items()):
            if request.kv_buffer is None:
                request.kv_buffer = self.kv_link.arrived(transfer_id)
            if request.kv_buffer is None:
                if now > request.deadline:
                    failed.append(self._fail_awaiting(transfer_id, "its KV never arrived"))
                continue
            admitted = self._admit_prefilled(request)
            if admitted is None:
                break  # out of pages or slots: keep FCFS order, try again next step
            del self._awaiting_kv[transfer_id]
            if not admitted:
                failed.append(self._fail_request(request))
        return failed

    def _admit_prefilled(self, request: Request) -> bool | None:
        """Scatters the received KV into fresh pages. None: no room yet; False: bad buffer."""
        buffer, num_prompt = request.kv_buffer, request.num_prompt_tokens
        if buffer.shape[2] != num_prompt:
            log.error("%s: received KV for %d tokens, the prompt has %d", request.request_id,
                      buffer.shape[2], num_prompt)
            return False
        if len(self.scheduler.running) >= self.config.scheduler.max_num_seqs or \
                not self.blocks.grow(request, num_prompt):
            return None
        self.kv_link.scatter(buffer, request.block_ids)
        request.kv_buffer = None
        request.num_computed = num_prompt
        self.blocks.commit(request)
        request.status = RequestStatus.RUNNING
        self.scheduler.running.append(request)
        return True

    def _fail_awaiting(self, transfer_id: str, why: str) -> RequestUpdate:
        request = self._awaiting_kv.pop(transfer_id)
        log.error("%s: %s within %.0f s", request.request_id, why, self.kv_link.timeout_s)
        self.kv_link.discard(transfer_id)
        return self._fail_request(request)

    def _fail_request(self, request: Request) -> RequestUpdate:
        self.blocks.free(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, "error"
        update = self._update(request, [], None)
        self._forget(request)
        return update

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
        if self.kv_link is not None:
            stats.num_waiting += len(self._awaiting_kv)
            link = self.kv_link
            sent, received = link.sender.stats, link.receiver.stats
            stats.kv_transfers = sent.num_transfers + received.num_transfers
            stats.kv_transfer_bytes = sent.num_bytes + received.num_bytes
        return stats

    def close(self) -> None:
        """Stops background threads (KV transfer); the engine is unusable afterwards."""
        if self.kv_link is not None:
            self.kv_link.close()

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
