"""Stored responses of ``/v1/responses`` (an instance's or a gateway's, in memory): what
``previous_response_id`` continues, and the ``GET``, ``DELETE`` and ``input_items`` routes
over them."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdserve.server import protocol as P

if TYPE_CHECKING:
    from pdserve.server.responses import ResponseBuilder, ResponsesRequest

MAX_LISTED_ITEMS = 100  # OpenAI's largest input_items page

@dataclass
class Stored:
    """A stored response, the conversation it ends (chat messages: its input, the
    conversation it continued and its output; no instructions) and its input items (as
    ``input_items`` lists them)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    items: list[dict[str, Any]]


class ResponseStore:
    """The last ``capacity`` stored responses, in memory (the oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        self._responses[stored.response["id"]] = stored
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None


def not_found(response_id: str) -> P.APIError:
    return P.APIError(404, f"no stored response '{response_id}' (never stored, deleted, or "
                      "forgotten: this server keeps the last --max-stored-responses)",
                      param="response_id", code="not_found")


class ResponsesEndpoint:
    """``/v1/responses`` over one store of responses (an instance's or a gateway's):
    ``GET`` and ``DELETE`` here, ``POST`` (``create``) in the subclass that runs them."""

    def __init__(self, max_stored: int) -> None:
        self.store = ResponseStore(max_stored)
        self._background: dict[str, asyncio.Task] = {}  # running, by response id

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)

    async def create(self, http: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    def keep(self, request: ResponsesRequest, response: dict[str, Any]) -> None:
        if request.store:
            self.store.put(Stored(response, request.conversation_after(response),
                                  input_items(request.body["input"])))

    def in_background(self, request: ResponsesRequest, builder: ResponseBuilder,
                      answer: Callable[[], Awaitable[None]]) -> web.Response:
        """Answers ``queued`` at once and runs ``answer`` (which fills ``builder``) apart
        from the request; the response is stored from the start, so ``GET`` follows it."""
        response = builder.response
        response["status"] = "queued"
        self.store.put(Stored(response, [], input_items(request.body["input"])))
        task = asyncio.ensure_future(self._run_in_background(request, builder, answer))
        self._background[response["id"]] = task
        return json_response(response)

    async def _run_in_background(self, request: ResponsesRequest, builder: ResponseBuilder,
                                 answer: Callable[[], Awaitable[None]]) -> None:
        response_id = builder.response["id"]
        builder.response["status"] = "in_progress"
        try:
            await answer()
        except asyncio.CancelledError:
            builder.cancel()
        except P.APIError as exc:
            builder.fail(exc.message)
        finally:
            self._background.pop(response_id, None)
        if self.store.get(response_id) is not None:  # not deleted meanwhile
            self.keep(request, builder.response)  # with what it wrote, to continue from

    async def cancel(self, http: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: a background response stops where it is (one
        that already ended is answered as it is)."""
        stored = self._stored(http)
        if not stored.response.get("background"):
            raise P.bad_request("only a background response can be cancelled",
                                param="response_id")
        await self._stop(stored.response["id"])
        return json_response(stored.response)

    async def _stop(self, response_id: str) -> None:
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    def _stored(self, http: web.Request) -> Stored:
        response_id = http.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    async def retrieve(self, http: web.Request) -> web.Response:
        return json_response(self._stored(http).response)

    async def input_items(self, http: web.Request) -> web.Response:
        """A stored response's input items, a page at a time (OpenAI's ``limit``, ``order``
        and ``after``)."""
        items = self._stored(http).items
        query = http.query
        unknown = set(query) - {"limit", "order", "after"}
        if unknown:
            name = sorted(unknown)[0]
            raise P.bad_request(f"unknown query parameter '{name}'", param=name)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise P.bad_request("'order' must be 'asc' or 'desc'", param="order")
        items = items[::-1] if order == "desc" else items
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise P.bad_request(f"'after' names no input item of this response: "
                                    f"{query['after']!r}", param="after")
            items = items[ids.index(query["after"]) + 1:]
        limit = _limit(query.get("limit", "20"))
        page = items[:limit]
        return json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > limit})

    async def delete(self, http: web.Request) -> web.Response:
        response_id = http.match_info["response_id"]
        await self._stop(response_id)  # a background response still running
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return json_response({"id": response_id, "object": "response.deleted",
                              "deleted": True})


def json_response(body: dict[str, Any]) -> web.Response:
    return web.Response(body=P.dumps(body), content_type="application/json")


async def event_stream(http: web.Request) -> web.StreamResponse:
    """The client's stream of events, its headers sent."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
    await response.prepare(http)
    return response


def sse_events(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events, each named by its type (as OpenAI's Responses stream names them)."""
    return b"".join(b"event: %s\n%s" % (e["type"].encode(), P.sse(e)) for e in events)


def _limit(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= MAX_LISTED_ITEMS:
        raise P.bad_request(f"'limit' must be an integer from 1 to {MAX_LISTED_ITEMS}",
                            param="limit")
    return int(value)


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}


def input_items(value: str | list) -> list[dict[str, Any]]:
    """A request's ``input`` (already read: a string or valid items) as the items
    ``input_items`` lists: each with its type, an id (its own, or one made here), a status,
    and a message's content as parts."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return [_listed(item) for item in value]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    listed = {"type": kind, **item}
    listed.setdefault("id", f"{_ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}")
    if kind != "reasoning":
        listed.setdefault("status", "completed")
    if kind == "message" and isinstance(item["content"], str):
        assistant = item["role"] == "assistant"
        part = {"type": "output_text", "text": item["content"], "annotations": []} \
            if assistant else {"type": "input_text", "text": item["content"]}
        listed["content"] = [part]
    return listed
