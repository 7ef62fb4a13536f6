"""A stand-in OpenAI-style streaming server whose latency grows with load.

Prefill is a FIFO single server (``prefill_ms`` per request, one at a time), decode streams
one token every ``itl_ms``. Below ``1000 / prefill_ms`` req/s nothing queues and TTFT is
about ``prefill_ms``; above it the queue, and TTFT, grow with every request: a known knee.
Runnable as a script so ``bench compare`` can launch it like a real server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading

from aiohttp import web


class StandIn:
    def __init__(self, prefill_ms: float = 50.0, itl_ms: float = 5.0) -> None:
        self.prefill_s = prefill_ms / 1000.0
        self.itl_s = itl_ms / 1000.0
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
            await self._stream(resp, len(body["prompt"]), int(body["max_tokens"]))
        finally:
            self.running -= 1
        return resp

    async def _stream(self, resp: web.StreamResponse, prompt_len: int, max_tokens: int) -> None:
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.itl_s)
            last = i == max_tokens - 1
            choice = {"index": 0, "text": "x", "finish_reason": "length" if last else None}
            await _send(resp, {"object": "text_completion", "choices": [choice]})
        usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens}
        await _send(resp, {"object": "text_completion", "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")


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
    web.run_app(StandIn(args.prefill_ms, args.itl_ms).app(), host=args.host, port=args.port,
                print=None)


if __name__ == "__main__":
    main()
