"""A stand-in OpenAI-style streaming server whose latency grows with load.

Prefill is a FIFO single server (``prefill_ms`` per request, one at a time), decode streams
one chunk every ``itl_ms``. Below ``1000 / prefill_ms`` req/s nothing queues and TTFT is
about ``prefill_ms``; above it the queue, and TTFT, grow with every request: a known knee.
Runnable as a script so ``bench compare`` can launch it like a real server.

Chunks follow ``chunk_tokens`` (tokens per chunk, cycled); the chunks numbered in ``held_back``
carry their tokens with empty text, as a server holding back a partial character does. Token
counts are stated as vLLM does: a running ``usage`` when the request asks for
``continuous_usage_stats`` (and ``usage_stats`` is on), ``logprobs`` when asked for.
Requests for another model get 404, prompts past ``max_context`` 400.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading

from aiohttp import web


class StandIn:
    def __init__(self, prefill_ms: float = 50.0, itl_ms: float = 5.0,
                 chunk_tokens: tuple[int, ...] = (1,), held_back: frozenset[int] = frozenset(),
                 usage_stats: bool = True, max_context: int = 4096) -> None:
        self.prefill_s = prefill_ms / 1000.0
        self.itl_s = itl_ms / 1000.0
        self.chunk_tokens = chunk_tokens
        self.held_back = held_back
        self.usage_stats = usage_stats
        self.max_context = max_context
        self.running = 0
        self.waiting = 0
        self.requests: list[dict] = []
        self._prefill: asyncio.Lock | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "standin"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        text = ("# TYPE standin_num_requests_running gauge\n"
                f"standin_num_requests_running {self.running}\n"
                "# TYPE standin_num_requests_waiting gauge\n"
                f"standin_num_requests_waiting {self.waiting}\n")
        return web.Response(text=text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        refusal = self._refusal(body)
        if refusal is not None:
            return refusal
        if self._prefill is None:
            self._prefill = asyncio.Lock()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.waiting += 1
        async with self._prefill:
            self.waiting -= 1
            self.running += 1
            await asyncio.sleep(self.prefill_s)
        try:
            await self._stream(resp, body)
        finally:
            self.running -= 1
        return resp

    def _refusal(self, body: dict) -> web.Response | None:
        if body.get("model") != "standin":
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if len(body["prompt"]) + int(body["max_tokens"]) > self.max_context:
            return _error(400, f"This model's maximum context length is {self.max_context} "
                               "tokens.")
        return None

    async def _stream(self, resp: web.StreamResponse, body: dict) -> None:
        max_tokens, sent = int(body["max_tokens"]), 0
        options = body.get("stream_options") or {}
        continuous = self.usage_stats and options.get("continuous_usage_stats")
        for index, tokens in enumerate(self.chunk_sizes(max_tokens)):
            if index:
                await asyncio.sleep(self.itl_s)
            sent += tokens
            event = self._chunk(index, tokens, sent == max_tokens,
                                body.get("logprobs") is not None)
            if continuous:
                event["usage"] = _usage(len(body["prompt"]), sent)
            await _send(resp, event)
        final = {"object": "text_completion", "choices": [],
                 "usage": _usage(len(body["prompt"]), sent)}
        await _send(resp, final)
        await resp.write(b"data: [DONE]\n\n")

    def chunk_sizes(self, max_tokens: int) -> list[int]:
        """Tokens per chunk of a ``max_tokens`` answer: ``chunk_tokens`` cycled, cut to fit."""
        sizes: list[int] = []
        while sum(sizes) < max_tokens:
            size = self.chunk_tokens[len(sizes) % len(self.chunk_tokens)]
            sizes.append(min(size, max_tokens - sum(sizes)))
        return sizes

    def _chunk(self, index: int, tokens: int, last: bool, logprobs: bool) -> dict:
        text = "" if index in self.held_back else "x" * tokens
        choice = {"index": 0, "text": text, "finish_reason": "length" if last else None}
        if logprobs:
            choice["logprobs"] = {"tokens": ["x"] * tokens, "token_logprobs": [0.0] * tokens}
        return {"object": "text_completion", "choices": [choice]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


async def _send(resp: web.StreamResponse, event: dict) -> None:
    await resp.write(f"data: {json.dumps(event)}\n\n".encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """Serves a StandIn from a background thread (its own event loop) for in-process tests."""

    def __init__(self, standin: StandIn) -> None:
        self.standin = standin
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.standin.app())
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="standin")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    args = parser.parse_args()
    # No graceful drain: aiohttp's default waits up to 60 s for in-flight handlers, and a
    # stopped stand-in's queued prefills (sleeps) have no one left to answer.
    web.run_app(StandIn(args.prefill_ms, args.itl_ms).app(), host=args.host, port=args.port,
                print=None, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
