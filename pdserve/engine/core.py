"""The engine loop: validate and queue requests, and one ``step()`` for every policy.

A step (1) collects launches whose event reports done and applies their tokens through the
policy's ``update_work``; (2) lets requests whose KV arrived from a prefill instance join;
(3) issues the policy's KV moves; (4) asks the policy for work on its idle lanes and launches
it; (5) with nothing to return, waits a little for the next completion. Synchronous policies
(``waits_for_launches``) have each launch waited for at once. Nothing here depends on which
policy runs.

Ordering across lanes: every launch waits on the events of launches the host has seen
complete since that lane last launched, and on KV copies issued since. Lanes of multiplex
and disagg run on other streams, so a decode step never reads KV a prefill is still writing
and a page freed by one lane is never overwritten before a pending gather reads it.

Overlap scheduling (on unless ``--no-overlap-schedule``): a launch the policy marks
``overlapped`` advances the counters when issued, its sampled tokens standing as
placeholders; the lane counts as idle while that is its only launch in flight, so the next
step on the lane is planned and issued before it is collected, and reads those tokens on the
device. Its results are applied one step late: a request that stopped then has one more
token computed by the launch already issued, which is dropped, never emitted. Synchronous
policies collect an overlapped launch only after the next step is issued; the others
(multiplex, disagg: their decode lane) collect it as soon as its event reports done.

It never detokenizes: stop strings are matched by whoever streams the text (the server or
the offline ``LLM``), which aborts the request when one hits.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.cache.block_manager import BlockManager
from pdserve.config import EngineConfig
from pdserve.engine.allocator_watch import AllocatorWatch
from pdserve.engine.compile_watch import WATCH
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.launch import HostBuffers, Launch
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import bad_word_token_ids
from pdserve.engine.setup import EngineSetup, policy_args
from pdserve.engine.streams import Event
from pdserve.engine.warmup import warm_up_eager_steps
from pdserve.handoff import HANDOFF_FINISH_REASON, KVHandoff
from pdserve.messages import EngineStats, QueueFullError, RequestUpdate
from pdserve.model.arch import get_arch, is_checkpoint_dir
from pdserve.model.tokenizer import load_tokenizer
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.sched.base import StepOutput, Work
from pdserve.sched.policies import make_scheduler, role_refusal
from pdserve.structured.grammars import GrammarCompiler

log = logging.getLogger(__name__)
WAIT_FOR_COMPLETION_S = 0.002  # longest a step spins on events before returning empty


class EngineCore:
    def __init__(self, config: EngineConfig, setup: EngineSetup | None = None):
        setup = setup or EngineSetup()
        self.config = config
        self._check_role(config)
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
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        self.runner = ModelRunner(config, self.arch, self.max_model_len, setup.ops)
        self._check_graph_steps()
        self.config = config = self._with_graph_steps_resolved(config)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching)
        self.scheduler = make_scheduler(config.scheduler, self.blocks, self.max_model_len,
                                        **policy_args(config, self.runner, setup))
        self.runner.configure(self.scheduler.pool_layout(), self.scheduler.decode_pool,
                              self.scheduler.graph_partitions())
        if self.runner.comm.size > 1:
            # Workers sample a stand-in token (rank 0 alone samples for real): an input id
            # resolved on a worker's device would not be rank 0's token.
            self.scheduler.overlap.enabled = False
        self.kv = KVConnector(self.runner, config.transfer)
        self.requests: dict[str, Request] = {}
        self._queued: list[RequestUpdate] = []  # aborts and first tokens, out with the next step
        self._counters = {"prompt": 0, "generation": 0, "steps": 0}
        self._in_flight: dict[str, list[Launch]] = {}  # by lane, oldest first (two: overlap)
        self._buffers = {lane: self._lane_buffers() for lane in self.scheduler.lanes}
        self._fences: dict[str, list[Event]] = {lane: [] for lane in self.scheduler.lanes}
        self._awaiting_kv: dict[str, Request] = {}  # decode side: by transfer id, FCFS
        self.compiles = WATCH if self.runner.device.type == "cuda" else None
        if self.compiles is not None:
            self.compiles.install()
        self.warmup = warm_up_eager_steps(self)
        if self.compiles is not None:
            self.compiles.serving()
        self.allocations = AllocatorWatch(self.runner.device)
        self.allocations.serving()
        self._watch_launches = (self.scheduler.watches_allocations
                                and self.runner.device.type == "cuda")

    def _lane_buffers(self) -> list[HostBuffers]:
        """Two pinned buffers (an overlapped launch fills one while the host reads the other)
        sharing one device copy of the sampled tokens."""
        size, device_tokens = self.config.scheduler.max_num_seqs, None
        if self.scheduler.overlap.enabled:
            device_tokens = self.runner.sampled_tokens_buffer()
        return [HostBuffers.make(self.runner.ops, size, device_tokens) for _ in range(2)]

    @staticmethod
    def _check_role(config: EngineConfig) -> None:
        """A schedule that cannot serve a P/D role is refused before the model loads."""
        if config.transfer.kv_transfer_port is None:
            return
        why = role_refusal(config.scheduler.schedule)
        if why is not None:
            raise ValueError(why)

    def _with_graph_steps_resolved(self, config: EngineConfig) -> EngineConfig:
        """Multiplexing's graph steps default to the prefill-step graphs this runner
        captured (none on the CPU, under tensor parallelism or with --enforce-eager): on
        the H200 they raised Mooncake goodput probes at every rate (docs/results.md)."""
        if config.scheduler.mux_graph_step_tokens is not None:
            return config
        captured = self.runner.piecewise_tokens() if self.runner.device.type == "cuda" else 0
        scheduler = dataclasses.replace(config.scheduler, mux_graph_step_tokens=captured)
        return dataclasses.replace(config, scheduler=scheduler)

    def _check_graph_steps(self) -> None:
        """Multiplexing's graph steps need the prefill-step graphs this runner captures (none
        under tensor parallelism or with --enforce-eager). The CPU captures none either; there
        the steps within the bound are planned as graph steps and run like every CPU step (the
        decision logic's reference, which tests use; the CLI refuses the flag on the CPU)."""
        wanted = self.config.scheduler.mux_graph_step_tokens or 0
        captured = self.runner.piecewise_tokens()
        if wanted > captured and self.runner.device.type == "cuda":
            raise ValueError(f"--mux-graph-step-tokens {wanted}: this runner captures "
                             f"prefill-step graphs of at most {captured} tokens (none under "
                             "tensor parallelism); larger steps run eagerly")

    @property
    def kv_address(self) -> str | None:
        """"host:port" of this instance's KV receiver; None without KV transfer."""
        return self.kv.address

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, handoff: KVHandoff | None = None) -> None:
        """Queues a request. ``handoff``: its prefill or its decode runs on another instance
        (``pdserve/handoff.py``)."""
        self._validate(request_id, prompt_token_ids, params)
        self._validate_handoff(handoff, params)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests already waiting")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                          arrival_time if arrival_time is not None else time.monotonic())
        request.handoff = handoff
        if params.grammar is not None:  # structured output: the request's own matcher
            request.grammar = self.grammars.matcher(params.grammar)
        request.bad_words = bad_word_token_ids(params.bad_words, self.tokenizer.encode)
        self.requests[request_id] = request
        if handoff is not None and handoff.is_decode:
            self._add_prefilled(request, handoff)
            return
        self.scheduler.add(request)
        self._counters["prompt"] += len(prompt_token_ids)

    def _validate_handoff(self, handoff: KVHandoff | None, params: SamplingParams) -> None:
        if handoff is None:
            return
        if not self.kv.links_instances:
            raise InvalidRequestError("this instance takes no part in KV transfer (start it "
                                      "with --kv-transfer-port)")
        try:
            handoff.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported when prefill and "
                                      "decode run on different instances")
        if params.return_embedding:
            raise InvalidRequestError("an embedding is not split between instances: send "
                                      "it as a request of its own")
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
            self.kv.discard(handoff.transfer_id)
            self._forget(request)
        else:
            request.deadline = time.monotonic() + self.kv.timeout_s
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
        params.check_vocab(vocab)
        if params.priority != 0 and self.scheduler.prefill_order.order != "priority":
            raise InvalidRequestError("priority other than 0 needs an engine started with "
                                      "--prefill-order priority")
        limit = self.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequestError(f"the prompt has {len(prompt)} tokens; this model's context "
                                      f"is {limit} tokens, which must also fit one output token")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(prompt)} tokens exceeds "
                f"the model's context of {limit} tokens")
        why = self.scheduler.fits(len(prompt) + params.max_tokens)
        if why is not None:
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
        self.kv.discard(request.handoff.transfer_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
        return request

    # ---- the loop ----

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._queued) or bool(self._awaiting_kv)
                or bool(self._in_flight))

    def step(self) -> list[RequestUpdate]:
        updates, self._queued = self._queued, []
        updates += self._collect()
        if self._awaiting_kv:
            updates += self._take_arrived_kv()
        for move in self.scheduler.take_moves():
            self.runner.note_move(move)
            self.kv.move(move)
        launched, failed = self._launch_idle_lanes()
        updates += failed
        if self.scheduler.waits_for_launches:
            updates += self._settle(launched)
        elif not updates and self._in_flight:
            self._wait_any()
            updates += self._collect()
        if not updates and not self._in_flight and self._awaiting_kv:
            self.kv.wait_briefly(next(iter(self._awaiting_kv)))
        return updates

    def _launch_idle_lanes(self) -> tuple[dict[str, Launch], list[RequestUpdate]]:
        """Launches the policy's work on lanes with nothing in flight but one overlapped
        launch. Returns (launches by lane, updates of requests whose launch failed)."""
        idle = tuple(lane for lane in self.scheduler.lanes if self._lane_idle(lane))
        launched, failed = {}, []
        for lane, work in self.scheduler.schedule(idle).items():
            waits, self._fences[lane] = self._fences[lane], []
            try:
                before = self.allocations.segments() if self._watch_launches else 0
                launch = self.runner.launch(work, waits, self._next_buffers(lane))
                if self._watch_launches:
                    work.cuda_mallocs = self.allocations.segments() - before
            except Exception:
                # One bad launch must not take the engine down: fail the requests it carried.
                log.exception("launch failed; failing its %d requests", len(work.plan.scheduled))
                failed += self._end(self.scheduler.fail(work), sampled=())
                continue
            self.scheduler.issued(work)
            self._in_flight.setdefault(lane, []).append(launch)
            launched[lane] = launch
        return launched, failed

    def _lane_idle(self, lane: str) -> bool:
        # Two in flight at most: the lane's two pinned buffers hold their tokens.
        launches = self._in_flight.get(lane, ())
        return not launches or (len(launches) == 1 and launches[0].work.overlapped)

    def _next_buffers(self, lane: str) -> HostBuffers:
        pair = self._buffers[lane]
        pair.reverse()
        return pair[0]

    def _collect(self) -> list[RequestUpdate]:
        """Launches that are done, oldest first; under a synchronous policy an overlapped one
        waits for ``_settle``."""
        updates, settles = [], self.scheduler.waits_for_launches
        for lane, launches in list(self._in_flight.items()):
            while launches and not (settles and launches[0].work.overlapped) \
                    and launches[0].event.query():
                updates += self._retire(lane)
        return updates

    def _settle(self, launched: dict[str, Launch]) -> list[RequestUpdate]:
        """Synchronous policies: waits for and applies every launch but an overlapped one just
        issued, which runs on while the next step is planned."""
        updates = []
        for lane, launches in list(self._in_flight.items()):
            keep = launched.get(lane)
            keep = keep if keep is not None and keep.work.overlapped else None
            while launches and launches[0] is not keep:
                launches[0].event.synchronize()
                updates += self._retire(lane)
        return updates

    def _retire(self, lane: str) -> list[RequestUpdate]:
        """Applies the lane's oldest launch (done)."""
        launches = self._in_flight[lane]
        launch = launches.pop(0)
        if launches:
            # The next one on this lane could start on the device only now: its measured
            # time runs from here, not from its issue (see Launch.output).
            launches[0].issued = max(launches[0].issued, time.perf_counter())
        else:
            del self._in_flight[lane]
        self._fence(launch.event)
        return self._complete(launch.work, launch)

    def _fence(self, event: Event) -> None:
        for fences in self._fences.values():
            fences.append(event)

    def _complete(self, work: Work, launch: Launch) -> list[RequestUpdate]:
        try:
            output = launch.output()
        except Exception:
            log.exception("launch failed; failing its %d requests", len(work.plan.scheduled))
            return self._end(self.scheduler.fail(work), sampled=())
        if launch.prompt is not None:  # before the updates: the first one carries them
            launch.prompt.store()
        if launch.embed is not None:
            launch.embed.store()
        exports = self._export_candidates(work)
        # Ended while this launch ran (overlap: a stop seen one step late, an abort): their
        # tokens are dropped by the policy and never emitted.
        ended_before = [s.request.is_finished for s in work.plan.sampling]
        ended = self.scheduler.update_work(work, output)
        self.scheduler.observe_launch(work, output)
        self._counters["steps"] += 1
        sampled, output = _kept(work, output, ended_before)
        self._counters["generation"] += len(output.token_ids)
        updates = self._sampled_updates(sampled, output)
        for request in ended:
            if request.finish_reason == HANDOFF_FINISH_REASON:
                self._export(request, exports[request.request_id], work.pool)
        return updates + self._end(ended, sampled)

    def _sampled_updates(self, sampled: list[Request], output) -> list[RequestUpdate]:
        updates = []
        logprobs = output.logprobs or [None] * len(output.token_ids)
        for request, token_id, logprob in zip(sampled, output.token_ids, logprobs, strict=True):
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            wanted = [logprob] if request.params.logprobs and logprob is not None else None
            updates.append(self._update(request, [token_id], wanted))
        return updates

    def _end(self, ended: list[Request], sampled) -> list[RequestUpdate]:
        """Forgets ended requests; those without a token in this step get an update of their
        own (aborted, failed)."""
        with_token = {id(r) for r in sampled}
        updates = [self._update(r, [], None) for r in ended if id(r) not in with_token]
        for request in ended:
            self._forget(request)
        return updates

    def in_flight(self, lane: str) -> Launch | None:
        """The newest launch in flight on ``lane``, if any."""
        launches = self._in_flight.get(lane)
        return launches[-1] if launches else None

    def _wait_any(self) -> None:
        """Spins (yielding the GIL) until one launch completes, or a short deadline."""
        deadline = time.monotonic() + WAIT_FOR_COMPLETION_S
        while time.monotonic() < deadline:
            if any(launches[0].event.query() for launches in self._in_flight.values()):
                return
            time.sleep(0)

    # ---- P/D across instances ----

    def _export_candidates(self, work: Work) -> dict[str, list[int]]:
        # Page ids of requests that may hand off in this launch, read before ``update`` frees
        # them; a fence keeps later launches off those pages until the gather has run.
        if not self.kv.links_instances:  # the common engine: no pass over the batch
            return {}
        return {s.request.request_id: list(s.request.block_ids) for s in work.plan.sampling
                if s.request.handoff is not None and s.request.handoff.is_prefill}

    def _export(self, request: Request, block_ids: list[int], pool: str) -> None:
        handoff = request.handoff
        self._fence(self.kv.export(handoff.transfer_id, handoff.target, pool, block_ids,
                                   request.num_prompt_tokens))

    def _take_arrived_kv(self) -> list[RequestUpdate]:
        """Decode side: requests whose KV is here join through the policy, in arrival order,
        while pages and batch slots last; late ones fail."""
        failed, now = [], time.monotonic()
        for transfer_id, request in list(self._awaiting_kv.items()):
            if request.kv_buffer is None:
                request.kv_buffer = self.kv.arrived(transfer_id)
            if request.kv_buffer is None:
                if self.kv.dropped(transfer_id):
                    failed.append(self._fail_awaiting(transfer_id, "its KV came corrupt"))
                elif now > request.deadline:
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
        """Scatters the received KV into pages the policy reserved. None: no room yet;
        False: a bad buffer."""
        buffer = request.kv_buffer
        why = self.kv.misfit(buffer, request.num_prompt_tokens)
        if why is not None:
            log.error("%s: %s", request.request_id, why)
            return False
        pages = self.scheduler.reserve_received(request)
        if pages is None:
            return None
        self._fence(self.kv.scatter(buffer, self.scheduler.received_pool, pages))
        request.kv_buffer = None
        self.scheduler.join_received(request)
        return True

    def _fail_awaiting(self, transfer_id: str, why: str) -> RequestUpdate:
        request = self._awaiting_kv.pop(transfer_id)
        log.error("%s: %s within %.0f s", request.request_id, why, self.kv.timeout_s)
        self.kv.discard(transfer_id)
        return self._fail_request(request)

    def _fail_request(self, request: Request) -> RequestUpdate:
        self.blocks.free(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, "error"
        update = self._update(request, [], None)
        self._forget(request)
        return update

    # ---- bookkeeping ----

    def _update(self, request: Request, tokens: list[int], logprobs) -> RequestUpdate:
        # The prompt's logprobs go out with its first token (none with an abort before it).
        prompt = request.take_prompt_logprobs() if tokens else None
        return RequestUpdate(request.request_id, tokens, logprobs, request.is_finished,
                             request.finish_reason, request.num_prompt_tokens,
                             request.num_cached_tokens, time.monotonic(),
                             prompt_logprobs=prompt,
                             embedding=request.take_embedding() if tokens else None)

    def _forget(self, request: Request) -> None:
        request.take_prompt_logprobs()  # ended before its first token: no longer scoring
        request.claim_embedding()
        self.requests.pop(request.request_id, None)
        self.runner.forget(request.request_id)

    def stats(self) -> EngineStats:
        pools = list(self.scheduler.pools().values())
        free = sum(p.num_free_blocks for p in pools)
        total = sum(p.num_blocks for p in pools)
        transfers, transfer_bytes = self.kv.transfer_totals()
        stats = EngineStats(
            num_running=self.scheduler.num_running(),
            num_waiting=len(self.scheduler.waiting) + len(self._awaiting_kv),
            kv_usage=1.0 - free / total, num_free_blocks=free, num_total_blocks=total,
            prefix_cache_queries=sum(p.prefix_queries for p in pools),
            prefix_cache_hits=sum(p.prefix_hits for p in pools),
            prompt_tokens_total=self._counters["prompt"],
            generation_tokens_total=self._counters["generation"],
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._counters["steps"],
            last_batch_decode=0, last_batch_prefill_tokens=0, kv_transfers=transfers,
            kv_transfer_bytes=transfer_bytes)
        self.scheduler.fill_stats(stats)
        self.kv.fill_stats(stats)
        return stats

    def close(self) -> None:
        """Stops background threads (KV transfer) and tensor-parallel workers; the engine
        is unusable afterwards."""
        self.kv.close()
        self.runner.close()

    def _describe_compiles(self) -> dict:
        if self.compiles is None:
            return {"watched": False, "why": "not on a CUDA device"}
        return self.compiles.describe()

    def describe(self) -> dict:
        """What actually runs, for results to record: never a silent fallback."""
        return {"schedule": self.config.scheduler.schedule, "device": str(self.runner.device),
                "attention_backend": type(self.runner.attn_backend).__name__,
                "extend_kernel": self._describe_extend_kernel(),
                "cuda_graphs": any(pool.graphs for pool in self.runner.pools.values()),
                "tensor_parallel_size": self.runner.comm.size,
                "overlap_schedule": self._describe_overlap(), "eager_warmup": self.warmup,
                "kernels_compiled_while_serving": self._describe_compiles(),
                "allocator_while_serving": self.allocations.describe(),
                **self.scheduler.prefill_order.describe(), **self.scheduler.describe(),
                **self.kv.describe()}

    def _describe_extend_kernel(self) -> dict | None:
        """The prompt-attention kernel's tiles, layouts and launch options (splits, the tail
        launch) where the Triton backend runs it; None for the torch reference."""
        if self.runner.attn_backend.name != "triton":
            return None
        from pdserve.ops.triton_attention import default_extend_config

        config = default_extend_config(self.arch.head_dim, self.runner.device)
        return dataclasses.asdict(config)

    def _describe_overlap(self) -> dict:
        overlap = self.scheduler.overlap.describe()
        if not self.config.scheduler.overlap_schedule:
            overlap["off_because"] = "--no-overlap-schedule"
        elif not overlap["enabled"] and self.runner.comm.size > 1:
            overlap["off_because"] = "not implemented under --tensor-parallel-size > 1"
        else:
            overlap["lanes"] = self.scheduler.overlap_lanes()
        return overlap

    def timeline(self, since: float | None = None) -> list[dict]:
        """Policies that split the GPU: the split over time (time, mode, decode/prefill SMs,
        decode batch, prefill tokens); the others: their steps (``pdserve.sched.steps``)."""
        return self.scheduler.timeline(since)

    def reset_prefix_cache(self) -> dict:
        """``BlockManager.reset_prefix_cache`` on every KV pool: counts summed."""
        forgotten = kept = 0
        for pool in self.scheduler.pools().values():
            dropped, in_use = pool.reset_prefix_cache()
            forgotten, kept = forgotten + dropped, kept + in_use
        return {"forgotten_blocks": forgotten, "cached_blocks_in_use": kept}

    def check_integrity(self) -> None:
        for name, pool in self.scheduler.pools().items():
            pool.check_integrity(self.scheduler.live_requests(name))


def _kept(work: Work, output: StepOutput, dropped: list[bool]
          ) -> tuple[list[Request], StepOutput]:
    """The sampled requests whose tokens count, and the output cut to them."""
    if not output.token_ids:
        return [], output
    sampling = work.plan.sampling
    if not any(dropped):
        return [s.request for s in sampling], output
    keep = [i for i, gone in enumerate(dropped) if not gone]
    logprobs = [output.logprobs[i] for i in keep] if output.logprobs else None
    return ([sampling[i].request for i in keep],
            StepOutput([output.token_ids[i] for i in keep], logprobs, output.elapsed_ms,
                       output.device_ms))
