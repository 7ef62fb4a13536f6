"""OpenAI's Responses API through the gateway: ``/v1/responses`` runs as the P/D chat request
of the same conversation, read and answered by the instance's own code
(``pdserve/server/responses.py``): the request becomes the chat an instance would run, and
the chat's answer - whole, or its stream's deltas as they come, resumed on another
instance like any stream - becomes the Responses answer and events.

Stored responses live in the gateway (``--max-stored-responses``): a continuation
(``previous_response_id``) must reach the gateway that stored what it continues.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdserve.cluster.gateway import ClientGone, Gateway, sse_chunks
from pdserve.server import protocol as P
from pdserve.server import responses as R
from pdserve.server import responses_store as S


class GatewayResponses(S.ResponsesEndpoint):
    def __init__(self, gateway: Gateway, max_stored: int) -> None:
        super().__init__(max_stored)
        self.gateway = gateway

    async def create(self, http: web.Request) -> web.StreamResponse:
        request = R.ResponsesRequest.read(P.parse_json_body(await http.read()), self.store)
        body = request.body
        models = self.gateway.models()
        model = body.get("model") or (models[0] if models else "")
        answer = R.skeleton(request, R.new_id("resp"), P.now_s(), model,
                            body.get("temperature"), body.get("top_p"))
        builder = R.ResponseBuilder(answer, logprobs=request.logprobs)
        chat = {**request.chat, "stream": request.stream}
        if request.background:
            return self.in_background(request, builder,
                                      lambda: self._whole(http, builder, chat))
        try:
            if request.stream:
                chat["stream_options"] = {"include_usage": True}
                return await self._stream(http, request, builder, chat)
            await self._whole(http, builder, chat)
        except P.APIError as exc:
            raise R.responses_error(exc) from None
        self.keep(request, builder.response)
        return S.json_response(builder.response)

    async def _whole(self, http: web.Request, builder: R.ResponseBuilder,
                     chat: dict[str, Any]) -> None:
        answer = await self.gateway.run(http, "chat", chat)
        completion = json.loads(answer.body)
        choice = completion["choices"][0]
        builder.push_deltas(_message_deltas(choice["message"]), _logprobs(choice))
        builder.finish(choice["finish_reason"], completion["usage"])

    async def _stream(self, http: web.Request, request: R.ResponsesRequest,
                      builder: R.ResponseBuilder, chat: dict[str, Any]) -> web.StreamResponse:
        sink = ResponsesSink(http, builder)
        await self.gateway.run(http, "chat", chat, sink)
        if sink.completed:
            self.keep(request, builder.response)
        return sink.out


class ResponsesSink:
    """A streamed chat's events, as the gateway relays them, written to the client as the
    Responses events; the stream opens with the chat's first event."""

    def __init__(self, http: web.Request, builder: R.ResponseBuilder) -> None:
        self.http = http
        self.builder = builder
        self.out: web.StreamResponse | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed = False
        self.completed = False

    async def prepare(self, http: web.Request) -> None:
        self.out = await S.event_stream(http)
        await self._send(self.builder.start())

    async def write(self, data: bytes) -> None:
        await self._send([event for chunk in sse_chunks(data) for event in self._events(chunk)])

    def _events(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:  # the gateway gave up on the request mid-answer
            self.failed = True
            return self.builder.fail(chunk["error"].get("message", "the request failed"))
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return []
        events = []
        for choice in chunk.get("choices", ()):
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            events += self.builder.push_deltas([choice.get("delta") or {}], _logprobs(choice))
        return events

    async def write_eof(self) -> None:
        if not self.failed:
            await self._send(self.builder.finish(self.finish_reason, self.usage))
            self.completed = True
        await self.out.write_eof()

    async def _send(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        try:
            await self.out.write(S.sse_events(events))
        except OSError as exc:
            raise ClientGone(str(exc)) from None


def _message_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message as the deltas a stream of it would carry (its thought first,
    from an instance under ``--reasoning-parser``)."""
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]
    return [{"reasoning": message.get("reasoning") or "",
             "content": message.get("content") or "", "tool_calls": calls}]


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    return (choice.get("logprobs") or {}).get("content") or []
