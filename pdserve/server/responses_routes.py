"""OpenAI's Responses API on one instance, as vLLM serves it: ``POST /v1/responses`` (whole,
or streamed as the Responses events ``response.created`` ... ``response.completed``),
``GET`` and ``DELETE /v1/responses/{id}``.

Stored responses (``store``: true unless the request says false) are kept in memory, the
last ``--max-stored-responses`` of them: ``previous_response_id`` continues one (the
conversation it ended precedes the new input; its instructions do not carry over, as
OpenAI's do not), ``GET`` returns one, ``DELETE`` forgets it. A server of several HTTP
processes keeps none: each process would hold its own.

How a request and its answer map to a chat completion: ``responses.py``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from pdserve.server import protocol as P
from pdserve.server.reasoning import ThinkSplitter
from pdserve.server.responses import (
    ResponseBuilder,
    ResponsesRequest,
    ResponseStore,
    Stored,
    new_id,
    not_found,
    output_messages,
    responses_error,
    skeleton,
)
from pdserve.server.serving import Format, Generation, OpenAIServing
from pdserve.server.tool_calls import ToolStream

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class ResponsesRoutes:
    def __init__(self, serving: OpenAIServing, max_stored: int) -> None:
        self.serving = serving
        self.store = ResponseStore(max_stored)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def create(self, http: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = P.parse_json_body(await http.read())
        request = ResponsesRequest.read(body, self.store)
        fmt, prompt_ids, params = await self._prepare(request)
        response_id = new_id("resp")
        builder = ResponseBuilder(
            skeleton(request, response_id, P.now_s(), self.serving.model_name,
                     params.temperature, params.top_p),
            ThinkSplitter() if fmt.reasoning else None,
            ToolStream(fmt.tools) if fmt.tools is not None else None, request.logprobs)
        stream = self.serving.client.add(response_id, prompt_ids, params, arrival)
        gen = Generation(self.serving.client, stream, self.serving.tokenizer, prompt_ids,
                         params)
        try:
            if request.stream:
                return await self._stream(http, request, builder, gen)
            await self._collect(builder, gen)
        finally:
            gen.close()
            self.serving.record(fmt, gen)
        self._keep(request, builder.response)
        return _json(builder.response)

    async def _prepare(self, request: ResponsesRequest):
        """The chat format, prompt and sampling this response runs with; the chat's
        errors under the Responses API's names."""
        try:
            fmt: Format
            fmt, prompt_ids, default_max_tokens = await self.serving.prepare("chat",
                                                                             request.chat)
            return fmt, prompt_ids, self.serving.params(fmt, prompt_ids, default_max_tokens)
        except P.APIError as exc:
            raise responses_error(exc) from None

    async def _collect(self, builder: ResponseBuilder, gen: Generation) -> None:
        finish = None
        async for piece in gen.pieces():
            builder.push(piece)
            finish = piece.finish_reason
        builder.finish(finish, gen.usage())

    async def _stream(self, http: web.Request, request: ResponsesRequest,
                      builder: ResponseBuilder, gen: Generation) -> web.StreamResponse:
        pieces = gen.pieces()
        # Awaited before the response starts: a refused request still gets a plain status.
        first = await anext(pieces)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        try:
            await _write(response, builder.start() + builder.push(first))
            finish = first.finish_reason
            async for piece in pieces:
                await _write(response, builder.push(piece))
                finish = piece.finish_reason
            await _write(response, builder.finish(finish, gen.usage()))
            self._keep(request, builder.response)
        except P.APIError as exc:
            await _write(response, builder.fail(exc.message))
        await response.write_eof()
        return response

    def _keep(self, request: ResponsesRequest, response: dict[str, Any]) -> None:
        if request.store:
            conversation = request.conversation + output_messages(response)
            self.store.put(Stored(response, conversation))

    async def retrieve(self, http: web.Request) -> web.Response:
        response_id = http.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return _json(stored.response)

    async def delete(self, http: web.Request) -> web.Response:
        response_id = http.match_info["response_id"]
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})


async def _write(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    if events:
        await response.write(b"".join(b"event: %s\n%s" % (e["type"].encode(), P.sse(e))
                                      for e in events))


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=P.dumps(body), content_type="application/json")
