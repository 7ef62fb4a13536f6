"""A stand-in P/D instance: speaks the ``/pd/*`` protocol of ``pdserve/server/pd.py`` and
answers at once, with no model behind it. It measures what the gateway costs: with
instances that take no time, a request's latency and the request rate the gateway sustains
are the gateway's own (and the HTTP hops').

``/pd/prefill`` checks the offer's fields as the real route does and answers a first token;
``/pd/decode`` answers an OpenAI completion (or chat completion) of that one token,
streamed when the request asks for it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.server import protocol as P

FIRST_TOKEN = 1


def build_standin_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/pd/prefill", _prefill)
    app.router.add_post("/pd/decode", _decode)
    return app


async def _offer(http: web.Request, *required: str) -> dict[str, Any]:
    body = P.parse_json_body(await http.read())
    for name in required:
        if not isinstance(body.get(name), str) or not body[name]:
            raise P.bad_request(f"'{name}' must be a non-empty string", param=name)
    if not isinstance(body.get("request"), dict):
        raise P.bad_request("'request' must be an OpenAI request body (an object)",
                            param="request")
    return body


async def _prefill(http: web.Request) -> web.Response:
    try:
        await _offer(http, "kind", "transfer_id", "kv_target")
    except P.APIError as exc:
        return _error(exc)
    answer = {"first_token": FIRST_TOKEN, "first_logprob": None, "finished": False,
              "finish_reason": None, "num_prompt_tokens": 1, "num_cached_tokens": 0}
    return web.Response(body=P.dumps(answer), content_type="application/json")


async def _decode(http: web.Request) -> web.StreamResponse:
    try:
        body = await _offer(http, "kind", "transfer_id")
    except P.APIError as exc:
        return _error(exc)
    chat = body["kind"] == "chat"
    choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}} if chat
              else {"index": 0, "text": "x"}) | {"finish_reason": "length"}
    answer = {"id": body["transfer_id"], "object": "chat.completion" if chat
              else "text_completion", "created": P.now_s(), "model": "standin",
              "choices": [choice]}
    if not body["request"].get("stream"):
        return web.Response(body=P.dumps(answer), content_type="application/json")
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(http)
    await out.write(P.sse(answer) + P.SSE_DONE)
    await out.write_eof()
    return out


def _error(exc: P.APIError) -> web.Response:
    return web.Response(status=exc.status, body=P.dumps(exc.body()),
                        content_type="application/json")
