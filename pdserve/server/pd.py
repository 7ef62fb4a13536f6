"""An instance's side of P/D across instances (P/D-Serve): two internal routes the gateway
(``pdserve/cluster/gateway.py``) calls, and on-demand admission of prefills.

- ``POST /pd/prefill`` ``{"kind", "request", "transfer_id", "kv_target", "ttft_budget_ms"}``:
  runs the prompt of ``request`` (an OpenAI completions or chat body), samples the first
  token, ships the prompt's KV to ``kv_target`` and answers ``{"first_token", ...}``. It
  answers 429 at once instead, without queueing, when the prefills already in flight here
  and its own prompt would keep its first token from coming within ``ttft_budget_ms``
  (what is left of the TTFT SLO): the gateway then offers the
  request to another prefill instance (on-demand forwarding, no blind queueing).
- ``GET /pd/info``: the KV receiver's address and the admission counters.
- ``POST /pd/decode`` with ``"prefill_here": true`` instead of a transfer: a multiplexing
  instance runs the whole request itself (prefill beside its decodes, no KV transfer).
- ``POST /pd/decode`` ``{"kind", "request", "transfer_id", "first_token", ...}``: answers
  ``request`` exactly as ``/v1/completions`` or ``/v1/chat/completions`` would (streamed or
  not), decoding from the second token on with the KV that arrived under ``transfer_id``.
  Each streamed chunk also carries ``pdserve_token_ids``, the ids of its tokens: the
  gateway keeps them (and strips them) so that it can resume the answer elsewhere; the
  chunk with the finish reason also ``pdserve_usage``, the usage the answer ends with.

Resuming: both routes take ``resume_token_ids``, output tokens an instance that failed had
already streamed, and ``/pd/decode`` also ``resume_text_chars``, the characters of text the
client got. The tokens follow the prompt's ids as if they were prompt, the sampling budget
shrinks by as many, and the answer counts them as output (usage, stop strings); text the
failed instance's detokenizer still held back goes out first: the client's stream goes on
exactly where it broke.

With a cluster secret set (``--cluster-secret`` or ``PDSERVE_CLUSTER_SECRET``), every
``/pd/`` route needs the header ``X-PDServe-Cluster-Secret`` (compared in constant time);
user API keys never open them.

Both instances tokenize the same body with the same tokenizer and template, so they agree
on the prompt's token ids without sending them.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.handoff import HANDOFF_FINISH_REASON, KVHandoff
from pdserve.server import protocol as P
from pdserve.server.admission import PrefillAdmission
from pdserve.server.serving import OpenAIServing, Resumed, refuse_split_features, resumed_params

SECRET_HEADER = "X-PDServe-Cluster-Secret"
SECRET_ENV = "PDSERVE_CLUSTER_SECRET"


def resolve_secret(flag: str | None) -> str | None:
    """The cluster secret: the flag, else the environment (kept out of ``ps``), else None."""
    return flag or os.environ.get(SECRET_ENV) or None


def secret_headers(secret: str | None) -> dict[str, str]:
    """What a caller of the ``/pd/`` routes sends."""
    return {SECRET_HEADER: secret} if secret else {}


class AdmissionCollector:
    """``/metrics`` series of the on-demand admission, read at scrape time."""

    def __init__(self, admission: PrefillAdmission) -> None:
        self.admission = admission

    def collect(self) -> Iterable[Metric]:
        a = self.admission
        offers = CounterMetricFamily("pdserve_pd_prefill_offers", "Prefills offered by a "
                                     "gateway, by outcome.", labels=["outcome"])
        offers.add_metric(["accepted"], a.accepted)
        offers.add_metric(["refused"], a.rejected)
        yield offers
        yield GaugeMetricFamily("pdserve_pd_queued_prefill_tokens", "Prompt tokens of the "
                                "offered prefills in flight here.", value=a.queued_tokens)
        yield GaugeMetricFamily("pdserve_pd_prefill_tokens_per_second", "Prefill throughput "
                                "the admission predicts with (0 until measured).",
                                value=a.tokens_per_s or 0.0)


class PDRoutes:
    def __init__(self, serving: OpenAIServing, secret: str | None = None) -> None:
        self.serving = serving
        self.secret = resolve_secret(secret)
        self.admission = PrefillAdmission()
        serving.metrics.registry.register(AdmissionCollector(self.admission))

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/pd/prefill", self._guarded(self.prefill))
        app.router.add_post("/pd/decode", self._guarded(self.decode))
        app.router.add_get("/pd/info", self._guarded(self.info))

    def _guarded(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        secret = self.secret.encode() if self.secret else None

        async def guarded(http: web.Request) -> web.StreamResponse:
            if secret is not None:
                given = http.headers.get(SECRET_HEADER, "").encode()
                if not hmac.compare_digest(given, secret):
                    raise P.APIError(401, f"the internal /pd/ routes need the cluster secret "
                                     f"in the {SECRET_HEADER} header", code="invalid_secret")
            return await handler(http)

        return guarded

    async def info(self, http: web.Request) -> web.Response:
        """What a launcher or registry needs to list this instance in a P/D group."""
        client, admission = self.serving.client, self.admission
        body = {"model": self.serving.model_name, "kv_address": client.kv_address,
                "schedule": client.setup.get("schedule", ""),
                "tensor_parallel_size": client.setup.get("tensor_parallel_size", 1),
                "queued_prefill_tokens": admission.queued_tokens,
                "prefill_tokens_per_s": admission.tokens_per_s,
                "accepted": admission.accepted, "rejected": admission.rejected}
        return web.Response(body=P.dumps(body), content_type="application/json")

    async def prefill(self, http: web.Request) -> web.Response:
        body = P.parse_json_body(await http.read())
        transfer_id, target = _get_str(body, "transfer_id"), _get_str(body, "kv_target")
        budget_ms = P.get_number(body, "ttft_budget_ms")
        fmt, prompt_ids, default_max = await self.serving.prepare(*_inner(body))
        refuse_split_features(fmt)
        resumed = self._resumed(body).token_ids
        params = resumed_params(self.serving.params(fmt, prompt_ids, default_max), len(resumed))
        prompt_ids = prompt_ids + resumed
        self.admission.admit(len(prompt_ids), budget_ms)
        arrival, computed = time.monotonic(), None
        try:
            first = await self._run_prefill(fmt.engine_key, prompt_ids, params,
                                            KVHandoff(transfer_id, target=target), arrival)
            computed = len(prompt_ids) - first["num_cached_tokens"]
        finally:
            self.admission.done(len(prompt_ids), computed, arrival)
        return web.Response(body=P.dumps(first), content_type="application/json")

    async def _run_prefill(self, request_id: str, prompt_ids: list[int], params,
                           handoff: KVHandoff, arrival: float) -> dict[str, Any]:
        client = self.serving.client
        stream = client.add(request_id, prompt_ids, params, arrival, handoff)
        try:
            return await _first_token(stream)
        finally:
            if not stream.finished:  # the gateway hung up, or the engine failed
                client.abort(request_id)

    async def decode(self, http: web.Request) -> web.StreamResponse:
        body = P.parse_json_body(await http.read())
        if body.get("prefill_here") is True:
            return await self._prefill_and_decode(http, body)
        handoff = KVHandoff(_get_str(body, "transfer_id"),
                            first_token=_get_count(body, "first_token"),
                            first_logprob=P.get_number(body, "first_logprob"),
                            num_cached_tokens=_get_count(body, "num_cached_tokens", 0))
        fmt, prompt_ids, default_max = await self.serving.prepare(*_inner(body))
        fmt.with_token_ids = True
        return await self.serving.run(http, fmt, prompt_ids, default_max, handoff,
                                      self._resumed(body))

    async def _prefill_and_decode(self, http: web.Request, body: dict) -> web.StreamResponse:
        """The whole request here, no KV transfer: what the gateway asks of a multiplexing
        decode instance when every prefill instance refused. Its planner keeps the decodes
        it runs within their ITL SLO while the prompt is prefilled beside them."""
        if self.serving.client.setup.get("schedule") != "multiplex":
            raise P.bad_request("'prefill_here' needs an instance running --schedule multiplex",
                                param="prefill_here")
        fmt, prompt_ids, default_max = await self.serving.prepare(*_inner(body))
        fmt.with_token_ids = True
        return await self.serving.run(http, fmt, prompt_ids, default_max, None,
                                      self._resumed(body))

    def _resumed(self, body: dict) -> Resumed:
        token_ids = P.get_int_list(body, "resume_token_ids")
        P.check_token_ids(token_ids, self.serving.client.vocab_size)
        return Resumed(token_ids, _get_count(body, "resume_text_chars", 0))


async def _first_token(stream) -> dict[str, Any]:
    """The prefill's outcome, from the engine's deltas; raises ``APIError`` if it failed."""
    while True:
        items = await stream.get()
        for delta, _ in items:
            if delta.finish_reason == "error":
                raise P.APIError(500, "the engine failed while prefilling this request")
            if delta.new_token_ids:
                reason = delta.finish_reason if delta.finished else None
                return {"first_token": delta.new_token_ids[0],
                        "first_logprob": (delta.new_logprobs or [None])[0],
                        "finished": reason not in (None, HANDOFF_FINISH_REASON),
                        "finish_reason": reason,
                        "num_prompt_tokens": delta.num_prompt_tokens,
                        "num_cached_tokens": delta.num_cached_tokens}
            if delta.finished:
                raise P.APIError(503, f"the prefill ended without a token ({delta.finish_reason})")


def _inner(body: dict) -> tuple[str, dict]:
    kind, request = _get_str(body, "kind"), body.get("request")
    if not isinstance(request, dict):
        raise P.bad_request("'request' must be an OpenAI request body (an object)",
                            param="request")
    return kind, request


def _get_str(body: dict, name: str) -> str:
    value = P.get_str(body, name)
    if not value:
        raise P.bad_request(f"'{name}' must be a non-empty string", param=name)
    return value


def _get_count(body: dict, name: str, default: int | None = None) -> int:
    value = P.get_int(body, name, default)
    if value is None or value < 0:
        raise P.bad_request(f"'{name}' must be a non-negative integer", param=name)
    return value
