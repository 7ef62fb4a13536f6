"""The gateway: one OpenAI-compatible front for P/D groups (P/D-Serve).

Per request: pick the scenario (a header, else the default), pick the decode instance of
that scenario's group with the fewest requests placed on it from here (counted from the
pick), then offer the prefill to the
group's prefill instances, least busy first. A prefill instance that could not start it in
time answers 429 at once (``pdserve/server/pd.py``); the gateway offers it to the next one.
When all refuse, the request waits in line here (first come, first served) and is offered
again as soon as a prefill this gateway placed ends, or after ``retry_poll_ms``, until
``max_wait_s`` - it waits where every instance is a candidate, never blindly in one
instance's queue. The chosen prefill instance ships the
KV straight to the decode instance; the gateway then asks the decode instance for the
answer and relays it.

Nothing is lost to a failed instance: a request one fails (it dies, hangs up, loses the
KV, answers 5xx) runs again on others, up to ``max_attempts``. A stream resumes where it
broke: the decode instance's chunks name their token ids (``pdserve_token_ids``, stripped
here), and the next attempt prefills prompt + the tokens sent and goes on in the same
stream (``docs/reliability.md``); one that broke after its last token ends here, with the
usage its finish chunk named (``pdserve_usage``).

A batch of prompts, or ``n`` choices, fans out: a P/D request per prompt and choice (each
with its own attempts), merged into one answer as an instance would give it
(``_fan_out``; streamed, ``MergedStream``).

``--dispatch least-connections`` and ``round-robin`` are the blind baselines P/D-Serve
compares against: the gateway places each prefill by its own count of prefills in flight,
or in turn, and the instance queues whatever it gets.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from pdserve.aio import gather_or_cancel
from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.dispatch import DISPATCH, order_prefill
from pdserve.cluster.metrics import GatewayMetrics
from pdserve.cluster.registry import Instance, Registry
from pdserve.server import protocol as P
from pdserve.server.pd import resolve_secret, secret_headers

log = logging.getLogger("pdserve.gateway")

RELAYED_ERRORS = (400, 401, 404, 413)  # the request itself is wrong: no other instance helps
INSTANCE_COOLDOWN_S = 5.0  # an instance that failed to answer is skipped this long
# A role whose every instance vanished from the registry is served from the members last
# listed for this long: when ZooKeeper regains quorum it deletes the nodes of sessions that
# lapsed before their instances (alive all along) register again. A member that is really
# gone fails on contact and is skipped like any failed instance.
MEMBERSHIP_GRACE_S = 30.0


class ClientGone(Exception):
    """The client hung up mid-answer: nobody is left to answer (no retry)."""


class InstanceFailed(Exception):
    """An instance failed a request it had taken (it died, hung up, lost the KV, answered
    5xx): the gateway gives the request to another one, and skips this one a while unless
    ``busy`` (a full queue is no failure)."""

    def __init__(self, instance: Instance, message: str, busy: bool = False) -> None:
        super().__init__(f"{instance.role} instance {instance.instance_id} {message}")
        self.instance = instance
        self.busy = busy


@dataclass
class Prefilled:
    instance: Instance
    answer: dict[str, Any] | None  # None: the decode instance prefills it itself


@dataclass
class Job:
    """One client request on its way through the group, over as many attempts as it needs.
    ``sent_ids`` are the output tokens the client already has: a later attempt resumes
    after them."""

    http: web.Request
    kind: str
    body: dict[str, Any]
    scenario: str
    start: float
    sent_ids: list[int] = field(default_factory=list)
    sent_chars: int = 0  # characters of text the client got (may lag ``sent_ids``)
    out: web.StreamResponse | None = None  # the client's stream, once its headers are out
    identity: tuple[Any, Any] | None = None  # the first chunk's id and created
    first_at: float | None = None
    finished: bool = False  # the answer's finish reason went out
    done: bool = False  # [DONE] went out
    # The usage chunk the answer ends with (from its finish chunk's usage), until the
    # instance's own went out: what the gateway sends itself if the instance fails between.
    usage_owed: bytes = b""
    prefilled: bool = False  # counted once in the ratio window, however many attempts
    # Where a streamed answer's events go instead of a stream of its own: a part of a
    # fan-out (``PartStream``), or a chat turned into Responses events.
    part: EventSink | None = None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


class Gateway:
    def __init__(self, registry: Registry, config: GatewayConfig) -> None:
        if config.dispatch not in DISPATCH:
            raise ValueError(f"--dispatch must be one of {', '.join(DISPATCH)}, "
                             f"not {config.dispatch!r}")
        if config.max_attempts < 1:
            raise ValueError(f"--max-attempts must be at least 1, not {config.max_attempts}")
        self.registry = registry
        self.config = config
        self.metrics = GatewayMetrics()
        self.prefill_load: Counter[str] = Counter()  # prefills in flight, by instance id
        # Requests placed on each decode instance, counted from the moment of the pick (not
        # when their answer starts), so that a burst spreads over the instances.
        self.decode_load: Counter[str] = Counter()
        self._failed_at: dict[str, float] = {}
        self._last_listed: dict[tuple[str, str], tuple[float, list[Instance]]] = {}
        self._turn = 0  # round-robin position
        self._lines: dict[str, WaitLine] = {}  # refused requests, by scenario
        self._session: aiohttp.ClientSession | None = None
        self._model_lens: dict[str, int] = {}  # max_model_len, by instance id
        self._secret_headers = secret_headers(resolve_secret(config.cluster_secret))

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout,
                                        sock_read=self.config.stall_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # every stream holds a connection
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- one request --------------------------------------------------------------------

    async def forward(self, http: web.Request, kind: str) -> web.StreamResponse:
        body = P.with_request_id_header(P.parse_json_body(await http.read()), http.headers)
        # The prompts as an instance reads them (one unless a batch; a bad one, its 400).
        prompts = P.read_prompts(body.get("prompt")) if kind == "completions" else []
        choices = max(_count(body, "n"), _count(body, "best_of"))
        if len(prompts) > 1 or choices > 1:
            return await self._fan_out(http, kind, body, prompts if len(prompts) > 1
                                       else [None], choices)
        return await self._run(Job(http, kind, body, self._scenario(http), time.monotonic()))

    async def run(self, http: web.Request, kind: str, body: dict[str, Any],
                  sink: EventSink | None = None) -> web.StreamResponse:
        """One P/D request of ``kind`` (one prompt, one choice) from a route of its own;
        ``sink``: where its streamed events go."""
        job = Job(http, kind, body, self._scenario(http), time.monotonic(), part=sink)
        return await self._run(job)

    async def _fan_out(self, http: web.Request, kind: str, body: dict[str, Any],
                       prompts: list[Any], choices: int) -> web.Response:
        """A batch of prompts, ``n`` choices each: every (prompt, choice) its own P/D
        request (a hand-off each; choice j samples with ``seed + j``, as an instance does),
        the answers merged as one instance answers - choices numbered prompt by prompt, each
        prompt counted once in the usage; streamed, ``_fan_out_stream``."""
        if choices > P.MAX_CHOICES:
            raise P.bad_request(f"'n' must be at most {P.MAX_CHOICES}", param="n")
        if len(prompts) * choices > P.MAX_BATCH_REQUESTS:
            raise P.bad_request(f"{len(prompts)} prompts of {choices} choices each are more "
                                f"than the {P.MAX_BATCH_REQUESTS} generations one request may "
                                "ask for", param="prompt")
        ranked = _count(body, "best_of") > _count(body, "n")  # the best n by logprobs
        if ranked and body.get("stream") is True:
            raise P.bad_request("'best_of' larger than 'n' cannot stream: the best choices "
                                "are known only at the end", param="best_of")
        if ranked and body.get("echo") is True:  # ranking asks the parts for logprobs
            raise P.bad_request("'best_of' larger than 'n' with 'echo' is not served through "
                                "the gateway (echo with logprobs needs the prompt's scores, "
                                "which stay on the prefill instance); send 'echo': false",
                                param="echo")
        scenario, start = self._scenario(http), time.monotonic()
        jobs = [Job(http, kind, _part(body, prompt, j, ranked), scenario, start)
                for prompt in prompts for j in range(choices)]
        if body.get("stream") is True:
            return await self._fan_out_stream(http, jobs, choices)
        answers = await gather_or_cancel(self._run(job) for job in jobs)
        parts = [json.loads(answer.body) for answer in answers]
        usage = P.summed_usage([part["usage"] for part in parts], choices)
        if ranked:
            parts = _best_of(parts, choices, _count(body, "n"), body.get("logprobs") is None)
        return web.Response(body=P.dumps(_merged(parts, usage)),
                            content_type="application/json")

    async def _fan_out_stream(self, http: web.Request, jobs: list[Job], choices: int
                              ) -> web.StreamResponse:
        """The parts streamed into one answer: each part's events, renumbered, as they come
        (each part resumes on its own, as any stream); then the usage of all, and [DONE].
        A part that fails before anything went out fails the request with its status."""
        merged = MergedStream(http, len(jobs))
        for i, job in enumerate(jobs):
            job.part = PartStream(merged, i)
        try:
            await gather_or_cancel(self._run(job) for job in jobs)
        except P.APIError as exc:
            if merged.out is None:
                raise
            await merged.end(P.sse(exc.body()))
            return merged.out
        await merged.end(merged.usage_event(jobs, choices))
        return merged.out

    async def _run(self, job: Job) -> web.StreamResponse:
        # The ratio controller's window follows each request through prefill and decode.
        self.metrics.arrived(job.scenario)
        try:
            return await self._attempts(job)
        except ClientGone:
            log.info("client hung up mid-answer")
            return job.out
        except P.APIError as exc:
            if exc.status in RELAYED_ERRORS:  # the request's own fault, not load
                self.metrics.withdrawn(job.scenario)
            if job.out is None:
                raise
            return await self._end_with_error(job, exc)
        finally:
            if job.prefilled:
                self.metrics.decode_ended(job.scenario)

    async def _attempts(self, job: Job) -> web.StreamResponse:
        """Runs the request until one attempt answers it, each failed one on other
        instances (a failed instance is skipped for ``INSTANCE_COOLDOWN_S``)."""
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                return await self._attempt(job)
            except InstanceFailed as exc:
                if not exc.busy:
                    self._failed_at[exc.instance.instance_id] = time.monotonic()
                stage = "resume" if job.out is not None else "prefill"
                log.warning("attempt %d of %d failed (%s): %s", attempt,
                            self.config.max_attempts, stage, exc)
                if job.finished:  # every token is out: only the stream's end was lost
                    return await self._finish(job, job.usage_owed)
                self.metrics.count_retry(job.scenario, stage)
        raise P.APIError(503, f"the request failed on {self.config.max_attempts} instances; "
                         "retry it", code="instances_failed")

    async def _attempt(self, job: Job) -> web.StreamResponse:
        decode = self._pick_decode(job.scenario)
        self.decode_load[decode.instance_id] += 1  # taken now, before any await
        try:
            transfer_id = uuid.uuid4().hex  # fresh per attempt: a failed one's KV may linger
            prefilled = await self._prefill(job, transfer_id, decode)
            if not job.prefilled:
                job.prefilled = True
                self.metrics.prefilled(job.scenario, time.monotonic() - job.start)
            return await self._decode(job, transfer_id, decode, prefilled)
        finally:
            self.decode_load[decode.instance_id] -= 1

    def _scenario(self, http: web.Request) -> str:
        scenario = http.headers.get(self.config.scenario_header, self.config.default_scenario)
        try:
            self.registry.instances(scenario, "decode")
        except ValueError as exc:  # not a name the registry can hold
            raise P.bad_request(f"bad {self.config.scenario_header} header: {exc}") from None
        return scenario

    def _pick_decode(self, scenario: str) -> Instance:
        candidates = self._live(scenario, "decode")
        if not candidates:
            raise P.APIError(503, f"no decode instance serves scenario '{scenario}'"
                             + self._cooling(scenario, "decode"))
        return min(candidates, key=lambda i: (self.decode_load[i.instance_id], i.instance_id))

    def _cooling(self, scenario: str, role: str) -> str:
        listed = len(self._listed(scenario, role))
        return f" ({listed} listed, each failed in the last {INSTANCE_COOLDOWN_S:.0f} s)" \
            if listed else ""

    def _live(self, scenario: str, role: str) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self._listed(scenario, role)
                if now - self._failed_at.get(i.instance_id, -1e9) > INSTANCE_COOLDOWN_S]

    def _listed(self, scenario: str, role: str) -> list[Instance]:
        listed, now = self.registry.instances(scenario, role), time.monotonic()
        if listed:
            self._last_listed[(scenario, role)] = (now, listed)
            return listed
        seen_at, seen = self._last_listed.get((scenario, role), (-1e9, []))
        return seen if now - seen_at < MEMBERSHIP_GRACE_S else []

    async def _prefill(self, job: Job, transfer_id: str, decode: Instance) -> Prefilled:
        """Offers the prefill round the group until one instance takes it. Refused requests
        wait in line at the gateway, first come first served, and a newcomer queues behind
        them rather than jumping ahead."""
        line = self._lines.setdefault(job.scenario, WaitLine())
        poll_s = self.config.retry_poll_ms / 1e3
        if len(line):
            await line.wait(poll_s, first=False)
        for round_number in itertools.count():
            for instance in self._prefill_order(job.scenario, decode):
                answer = await self._offer(instance, job, transfer_id, decode)
                if answer is not None:
                    return Prefilled(instance, answer)
            if decode.schedule == "multiplex":
                # Last resort, in no other system: a multiplexing decode instance prefills
                # beside its decodes, its planner holding their ITL SLO; no KV moves.
                self.metrics.count_local_prefill(job.scenario)
                return Prefilled(decode, None)
            if round_number == 0:
                self.metrics.count_refused_request(job.scenario)
            if time.monotonic() - job.start + poll_s > self.config.max_wait_s:
                self.metrics.count_unserved(job.scenario)
                raise P.APIError(503, f"every prefill instance of scenario '{job.scenario}' "
                                 f"stayed busy for {self.config.max_wait_s:.0f} s")
            await line.wait(poll_s, first=True)

    def _prefill_order(self, scenario: str, decode: Instance) -> list[Instance]:
        candidates = self._live(scenario, "prefill")
        if not candidates and decode.schedule == "multiplex":
            return []  # the multiplexing decode instance takes it (see ``_prefill``)
        if not candidates:
            raise P.APIError(503, f"no prefill instance serves scenario '{scenario}'"
                             + self._cooling(scenario, "prefill"))
        self._turn += 1
        return order_prefill(candidates, self.config.dispatch, self.prefill_load, self._turn)

    async def _offer(self, instance: Instance, job: Job, transfer_id: str,
                     decode: Instance) -> dict[str, Any] | None:
        """The prefill's answer, or None if this instance refused or failed."""
        offer = {"kind": job.kind, "request": job.body, "transfer_id": transfer_id,
                 "kv_target": decode.kv, "ttft_budget_ms": self._ttft_budget_ms(job.start),
                 "resume_token_ids": job.sent_ids}
        self.prefill_load[instance.instance_id] += 1
        try:
            async with self._session.post(f"http://{instance.http}/pd/prefill", json=offer,
                                          headers=self._headers()) as resp:
                data = await resp.read()
                return self._prefill_answer(instance, resp.status, data)
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("prefill instance %s failed: %s", instance.instance_id, exc)
            self._failed_at[instance.instance_id] = time.monotonic()
            self.metrics.count_retry(instance.scenario, "prefill")
            return None
        finally:
            self.prefill_load[instance.instance_id] -= 1

    def _prefill_ended(self, instance: Instance) -> None:
        """A prefill this gateway placed is done: its instance has room for the next one."""
        line = self._lines.get(instance.scenario)
        if line is not None:
            line.wake_one()

    def _ttft_budget_ms(self, start: float) -> float | None:
        """What is left of the TTFT SLO; None (never refuse) when dispatch is blind."""
        if self.config.dispatch != "on-demand":
            return None
        return max(0.0, self.config.ttft_slo_ms - (time.monotonic() - start) * 1e3)

    def _prefill_answer(self, instance: Instance, status: int, data: bytes
                        ) -> dict[str, Any] | None:
        if status != 429:
            self._prefill_ended(instance)  # taken and finished (or failed): room again
        if status == 200:
            return P.parse_json_body(data)
        if status in RELAYED_ERRORS:
            raise _relayed_error(status, data)
        if status == 429:
            self.metrics.count_rejection(instance.instance_id)
        else:
            log.warning("prefill instance %s answered %d", instance.instance_id, status)
            self._failed_at[instance.instance_id] = time.monotonic()
        return None

    async def _decode(self, job: Job, transfer_id: str, decode: Instance,
                      prefilled: Prefilled) -> web.StreamResponse:
        answer = prefilled.answer
        ask = {"kind": job.kind, "request": job.body,
               "resume_token_ids": job.sent_ids, "resume_text_chars": job.sent_chars}
        if answer is None:
            ask["prefill_here"] = True
        else:
            ask.update(transfer_id=transfer_id, first_token=answer["first_token"],
                       first_logprob=answer.get("first_logprob"),
                       num_cached_tokens=answer.get("num_cached_tokens", 0))
        try:
            async with self._session.post(f"http://{decode.http}/pd/decode", json=ask,
                                          headers=self._headers()) as resp:
                if resp.status != 200:
                    return self._decode_refused(job, decode, resp.status, await resp.read())
                if job.stream:
                    return await self._relay_stream(job, resp, decode)
                return await self._relay_whole(job, resp)
        except (aiohttp.ClientError, OSError) as exc:
            raise InstanceFailed(decode, f"failed: {exc or type(exc).__name__}") from None

    def _decode_refused(self, job: Job, decode: Instance, status: int,
                        data: bytes) -> web.StreamResponse:
        if status in RELAYED_ERRORS:
            raise _relayed_error(status, data)
        raise InstanceFailed(decode, f"answered {status}: {_relayed_error(status, data).message}",
                             busy=status == 429)

    async def _relay_whole(self, job: Job, resp: aiohttp.ClientResponse) -> web.Response:
        """A non-streamed answer: all of it or nothing reaches the client, so a failed
        attempt is simply run again."""
        data = await resp.read()
        end = time.monotonic()
        self.metrics.answered(job.scenario, resp.status, end - job.start, end - job.start,
                              job.start)
        return web.Response(body=data, status=resp.status, headers=_relay_headers(resp))

    async def _relay_stream(self, job: Job, resp: aiohttp.ClientResponse,
                            decode: Instance) -> web.StreamResponse:
        """Relays the decode instance's events; keeps their token ids (and strips them)
        so that a later attempt can resume right after the last token the client got."""
        async for line in _upstream_lines(resp, decode):
            event = self._client_event(job, decode, line)
            if event:
                await self._send(job, resp, event)
            if job.done:
                return await self._finish(job)
        raise InstanceFailed(decode, "ended the stream early")

    def _client_event(self, job: Job, decode: Instance, line: bytes) -> bytes:
        """The event to send the client for one line of the decode instance's stream."""
        payload = line.removeprefix(b"data:").strip()
        if not line.startswith(b"data:") or not payload:
            return b""
        if payload == b"[DONE]":
            job.done = True
            return b""
        chunk = json.loads(payload)
        if "error" in chunk:
            raise InstanceFailed(decode, f"failed mid-answer: {chunk['error'].get('message')}")
        job.sent_ids += chunk.pop("pdserve_token_ids", [])
        owed = chunk.pop("pdserve_usage", None)
        # Where the deltas' text is not the model's (a thought apart, tool calls), the
        # instance counts the model's characters itself.
        counted = chunk.pop("pdserve_text_chars", None)
        for choice in chunk.get("choices", ()):
            job.sent_chars += len(_choice_text(choice)) if counted is None else 0
            job.finished = job.finished or bool(choice.get("finish_reason"))
        job.sent_chars += counted or 0
        chunk = _continuing(job, chunk)
        if chunk.get("usage") and not chunk.get("choices"):  # the usage chunk: nothing owed
            job.usage_owed = b""
        elif owed is not None:
            job.usage_owed = P.sse({**chunk, "choices": [], "usage": owed})
        return P.sse(chunk)

    async def _send(self, job: Job, resp: aiohttp.ClientResponse, event: bytes) -> None:
        if job.out is None:
            job.first_at = time.monotonic()
            job.out = job.part or web.StreamResponse(status=200, headers=_relay_headers(resp))
            await job.out.prepare(job.http)
        try:
            await job.out.write(event)
        except OSError as exc:  # kept apart from the decode instance's failures
            raise ClientGone(str(exc)) from None

    async def _finish(self, job: Job, tail: bytes = b"") -> web.StreamResponse:
        await job.out.write(tail + P.SSE_DONE)
        await job.out.write_eof()
        end = time.monotonic()
        self.metrics.answered(job.scenario, 200, (job.first_at or end) - job.start,
                              end - job.start, job.start)
        return job.out

    async def _end_with_error(self, job: Job, error: P.APIError) -> web.StreamResponse:
        """Headers are out: the stream ends with an error event, as a server's own failure
        mid-stream would."""
        self.metrics.answered(job.scenario, error.status, 0.0, 0.0, job.start)
        await job.out.write(P.sse(error.body()) + P.SSE_DONE)
        await job.out.write_eof()
        return job.out

    def _headers(self) -> dict[str, str]:
        return self._secret_headers

    # ---- what the group looks like ------------------------------------------------------

    async def relay(self, http: web.Request, path: str,
                    roles: tuple[str, ...] = ("decode", "prefill")) -> web.Response:
        """``/tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/score`` and ``/rerank``:
        answered whole by an instance of the request's scenario (any one: they share the
        model and its tokenizer; those of ``roles``' first role tried first), the next one
        if it cannot be reached; the client's API key goes with it, for an instance that
        asks."""
        body, scenario = await http.read(), self._scenario(http)
        headers = {**self._headers(), "Content-Type": "application/json"}
        if "Authorization" in http.headers:
            headers["Authorization"] = http.headers["Authorization"]
        instances = [i for role in roles for i in self._live(scenario, role)]
        for instance in instances:
            try:
                async with self._session.post(f"http://{instance.http}{path}", data=body,
                                              headers=headers) as resp:
                    return web.Response(status=resp.status, body=await resp.read(),
                                        content_type="application/json")
            except (aiohttp.ClientError, OSError) as exc:
                self._failed_at[instance.instance_id] = time.monotonic()
                log.warning("%s on %s failed: %s", path, instance.instance_id, exc)
        raise P.APIError(503, f"no instance of scenario '{scenario}' answered {path}"
                         f" ({len(instances)} tried)", code="no_instance")

    def models(self) -> list[str]:
        names = {i.model for s in self.registry.scenarios() for role in ("prefill", "decode")
                 for i in self.registry.instances(s, role) if i.model}
        return sorted(names)

    async def model_cards(self) -> list[dict]:
        """``/v1/models``: each served model with its ``max_model_len``, as one instance
        lists it; the smallest when instances differ, so a request that fits it fits all."""
        created = P.now_s()
        cards = []
        for name in self.models():
            lengths = [await self._max_model_len(i) for i in self._instances_of(name)]
            known = [n for n in lengths if n is not None]
            if not known:
                raise P.APIError(503, f"no instance of model '{name}' answered /v1/models")
            cards.append({"id": name, "object": "model", "created": created,
                          "owned_by": "pdserve", "root": name, "max_model_len": min(known)})
        return cards

    def _instances_of(self, model: str) -> list[Instance]:
        return [i for s in self.registry.scenarios() for role in ("prefill", "decode")
                for i in self.registry.instances(s, role) if i.model == model]

    async def _max_model_len(self, instance: Instance) -> int | None:
        """The instance's own ``/v1/models`` answer (kept: it never changes while the
        instance lives); None if it does not answer."""
        known = self._model_lens.get(instance.instance_id)
        if known is not None:
            return known
        try:
            async with self._session.get(f"http://{instance.http}/v1/models",
                                         headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                body = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("instance %s did not list its models: %s", instance.instance_id, exc)
            return None
        lengths = [card.get("max_model_len") for card in body.get("data", [])
                   if card.get("id") == instance.model]
        if lengths and isinstance(lengths[0], int):
            self._model_lens[instance.instance_id] = lengths[0]
            return lengths[0]
        return None

    def group_sizes(self) -> dict[tuple[str, str], int]:
        return {(s, role): len(self.registry.instances(s, role))
                for s in self.registry.scenarios() for role in ("prefill", "decode")}


class WaitLine:
    """Requests waiting for a prefill instance to take them. One is woken each time a
    prefill placed by this gateway ends; each also looks again after ``timeout_s`` (room
    freed by requests from elsewhere)."""

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, timeout_s: float, first: bool) -> None:
        """Waits to be woken or for ``timeout_s``; ``first`` keeps the head of the line."""
        future = asyncio.get_running_loop().create_future()
        (self._waiting.appendleft if first else self._waiting.append)(future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            pass
        finally:
            if future in self._waiting:
                self._waiting.remove(future)

    def wake_one(self) -> None:
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                return


async def _upstream_lines(resp: aiohttp.ClientResponse, decode: Instance
                          ) -> AsyncIterator[bytes]:
    """The decode instance's stream line by line; its failures become ``InstanceFailed``
    (a failure to write to the client is not one: that happens outside this iterator)."""
    try:
        async for line in resp.content:
            yield line
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise InstanceFailed(decode, f"failed mid-answer: {exc or type(exc).__name__}"
                             ) from None


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    text = choice.get("text") if delta is None else delta.get("content")
    return text or ""


def _continuing(job: Job, chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk as part of the client's one stream: the first attempt's id and created on
    every chunk, and no second "role" delta from a resumed attempt."""
    if job.identity is None:
        job.identity = (chunk.get("id"), chunk.get("created"))
    elif job.out is not None:
        for choice in chunk.get("choices", ()):
            choice.get("delta", {}).pop("role", None)
    for key, value in zip(("id", "created"), job.identity, strict=True):
        if key in chunk:
            chunk[key] = value
    return chunk


def sse_chunks(data: bytes) -> list[dict[str, Any]]:
    """The chunks of an answer's server-sent events as the gateway relays them (whole
    events, ``data: `` lines), ``[DONE]`` left out."""
    payloads = (line.removeprefix(b"data: ").strip() for line in data.split(b"\n\n"))
    return [json.loads(p) for p in payloads if p and p != b"[DONE]"]


class EventSink(Protocol):
    """Takes a streamed answer's SSE bytes in place of the client's stream."""

    async def prepare(self, http: web.Request) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


class MergedStream:
    """The client's one stream of a fanned-out request, every event under the id and time
    of the first. It opens once every part has sent its first event (as an instance
    answers a batch once every prompt has its first token), so a part refused at the start
    fails the request with its own status; then events go out in the order they come."""

    def __init__(self, http: web.Request, parts: int) -> None:
        self.http = http
        self.out: web.StreamResponse | None = None
        self.identity: dict[str, Any] = {}
        self.usages: dict[int, dict[str, Any]] = {}  # by part
        self._started: set[int] = set()
        self._parts = parts
        self._held: list[dict[str, Any]] = []  # until every part has started

    async def write(self, events: list[dict[str, Any]], part: int | None = None) -> None:
        if part is not None:
            self._started.add(part)
        if self.out is None and len(self._started) < self._parts:
            self._held += events
            return
        if self.out is None:
            self.out = web.StreamResponse(status=200, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await self.out.prepare(self.http)
            events, self._held = self._held + events, []
        data = b"".join(P.sse({**event, **self.identity}) for event in events)
        if data:
            try:
                await self.out.write(data)
            except OSError as exc:
                raise ClientGone(str(exc)) from None

    def usage_event(self, jobs: list[Job], choices: int) -> bytes:
        """The usage of all parts, each prompt counted once (its first choice's), when the
        parts' answers carried one (``stream_options.include_usage``)."""
        if len(self.usages) != len(jobs):
            return b""
        total = P.summed_usage([self.usages[i] for i in range(len(jobs))], choices)
        return P.sse({**self.identity, "choices": [], "usage": total})

    async def end(self, tail: bytes) -> None:
        self._parts = 0  # whatever is held goes out now
        await self.write([])
        await self.out.write(tail + P.SSE_DONE)
        await self.out.write_eof()


class PartStream:
    """Where one part's events go: renumbered to the part's place and handed to the merged
    stream; its own [DONE] and usage chunk are kept back for the merged end."""

    def __init__(self, merged: MergedStream, index: int) -> None:
        self.merged, self.index = merged, index

    async def prepare(self, http: web.Request) -> None:
        return None

    async def write(self, data: bytes) -> None:
        events = []
        for event in sse_chunks(data):
            if "error" in event:  # the part failed for good: so does the whole answer
                error = event["error"]
                raise P.APIError(503, error.get("message", "a part failed"),
                                 code=_str_or_none(error.get("code")))
            if not self.merged.identity:
                self.merged.identity = {k: event[k] for k in ("id", "object", "created",
                                                               "model") if k in event}
            if event.get("usage") and not event.get("choices"):
                self.merged.usages[self.index] = event["usage"]
                continue
            for choice in event.get("choices", ()):
                choice["index"] = self.index
            events.append(event)
        await self.merged.write(events, self.index)

    async def write_eof(self) -> None:
        return None


def _count(body: dict[str, Any], name: str) -> int:
    """``n`` or ``best_of`` as a count of choices (1 unless a larger integer; the instance
    refuses what is not one)."""
    value = body.get(name)
    return value if P.is_int(value) and value > 1 else 1


def _part(body: dict[str, Any], prompt: Any, choice: int, ranked: bool = False
          ) -> dict[str, Any]:
    """One (prompt, choice) of a fanned-out request, as its own request; ``ranked``: one
    of ``best_of``, so it returns its tokens' logprobs."""
    part = {**body, "n": 1}
    if prompt is not None:
        part["prompt"] = prompt
    if P.is_int(body.get("seed")):
        part["seed"] = body["seed"] + choice
    if ranked:
        part.update(best_of=1, logprobs=body.get("logprobs") or 0)
    return part


def _best_of(parts: list[dict[str, Any]], group: int, n: int, drop_logprobs: bool
             ) -> list[dict[str, Any]]:
    """Of each prompt's ``group`` answers, the ``n`` with the highest sum of token logprobs,
    best first (as an instance ranks ``best_of``); the logprobs dropped where the client
    did not ask for them."""
    kept = []
    for first in range(0, len(parts), group):
        ranked = sorted(parts[first:first + group], key=_logprob_sum, reverse=True)[:n]
        for part in ranked:
            if drop_logprobs:
                part["choices"][0]["logprobs"] = None
        kept += ranked
    return kept


def _logprob_sum(answer: dict[str, Any]) -> float:
    logprobs = answer["choices"][0].get("logprobs") or {}
    return sum(v for v in logprobs.get("token_logprobs") or [] if v is not None)


def _merged(answers: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """Answers of one choice each as one: their choices renumbered in order."""
    merged = answers[0]
    merged["choices"] = [{**answer["choices"][0], "index": i}
                         for i, answer in enumerate(answers)]
    merged["usage"] = usage
    return merged


def _relay_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    keep = ("Content-Type", "Cache-Control", "Retry-After")
    return {k: resp.headers[k] for k in keep if k in resp.headers}


def _relayed_error(status: int, data: bytes) -> P.APIError:
    """The instance's error as it named it: message, param and code."""
    try:
        error = P.parse_json_body(data)["error"]
        message = error["message"]
    except (P.APIError, KeyError, TypeError):
        return P.APIError(status, data.decode(errors="replace")[:500])
    return P.APIError(status, message, _str_or_none(error.get("param")),
                      _str_or_none(error.get("code")))


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None
