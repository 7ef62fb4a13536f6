"""OpenAI's Responses API on one instance, as vLLM serves it: ``POST /v1/responses`` (whole,
or streamed as the Responses events ``response.created`` ... ``response.completed``),
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

Stored responses (``store``: true unless the request says false) are kept in memory, the
last ``--max-stored-responses`` of them (``responses_store.py``): ``previous_response_id``
continues one (the conversation it ended precedes the new input; its instructions do not
carry over, as OpenAI's do not). A server of several HTTP processes keeps none: each
process would hold its own.

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
    new_id,
    responses_error,
    skeleton,
)
from pdserve.server.responses_store import (
    ResponsesEndpoint,
    event_stream,
    json_response,
    sse_events,
)
from pdserve.server.serving import Format, Generation, OpenAIServing
from pdserve.server.tool_calls import ToolStream


class ResponsesRoutes(ResponsesEndpoint):
    def __init__(self, serving: OpenAIServing, max_stored: int) -> None:
        super().__init__(max_stored)
        self.serving = serving

    async def create(self, http: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = P.parse_json_body(await http.read())
        request = ResponsesRequest.read(body, self.store)
        fmt, prompt_ids, params = await self._prepare(request)
        response_id = new_id("resp")
        builder = ResponseBuilder(
            skeleton(request, response_id, P.now_s(), self.serving.model_name,
                     params.temperature, params.top_p),
            ThinkSplitter(fmt.reasoning) if fmt.reasoning else None,
            ToolStream(fmt.tools) if fmt.tools is not None else None, request.logprobs)
        stream = self.serving.client.add(response_id, prompt_ids, params, arrival)
        gen = Generation(self.serving.client, stream, self.serving.tokenizer, prompt_ids,
                         params)
        if request.background:
            return self.in_background(request, builder,
                                      lambda: self._collect(builder, gen, fmt))
        if request.stream:
            try:
                return await self._stream(http, request, builder, gen)
            finally:
                self._done(fmt, gen)
        await self._collect(builder, gen, fmt)
        self.keep(request, builder.response)
        return json_response(builder.response)

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

    async def _collect(self, builder: ResponseBuilder, gen: Generation, fmt: Format) -> None:
        try:
            finish = None
            async for piece in gen.pieces():
                builder.push(piece)
                finish = piece.finish_reason
            builder.finish(finish, gen.usage())
        finally:
            self._done(fmt, gen)

    def _done(self, fmt: Format, gen: Generation) -> None:
        gen.close()  # the engine's copy freed if the client left (or cancelled) early
        self.serving.record(fmt, gen)

    async def _stream(self, http: web.Request, request: ResponsesRequest,
                      builder: ResponseBuilder, gen: Generation) -> web.StreamResponse:
        pieces = gen.pieces()
        # Awaited before the response starts: a refused request still gets a plain status.
        first = await anext(pieces)
        response = await event_stream(http)
        try:
            await _write(response, builder.start() + builder.push(first))
            finish = first.finish_reason
            async for piece in pieces:
                await _write(response, builder.push(piece))
                finish = piece.finish_reason
            await _write(response, builder.finish(finish, gen.usage()))
            self.keep(request, builder.response)
        except P.APIError as exc:
            await _write(response, builder.fail(exc.message))
        await response.write_eof()
        return response


async def _write(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    if events:
        await response.write(sse_events(events))
