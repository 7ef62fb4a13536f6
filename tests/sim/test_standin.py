"""The stand-in instance behind the real gateway, over real HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from pdserve.cluster.app import start_gateway, stop_gateway
from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.registry import Instance, MemoryRegistry
from pdserve.sim.standin import build_standin_app
from tests.server.conftest import free_port


async def _through_gateway(body: dict) -> tuple[int, str, str]:
    standin_port, gateway_port = free_port(), free_port()
    runner = web.AppRunner(build_standin_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", standin_port).start()
    registry = MemoryRegistry()
    address = f"127.0.0.1:{standin_port}"
    for name, role in (("p", "prefill"), ("d", "decode")):
        registry.register(Instance(name, "default", role, address, address))
    gateway = await start_gateway(GatewayConfig(host="127.0.0.1", port=gateway_port), registry)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json=body) as resp:
            return resp.status, resp.content_type, await resp.text()
    finally:
        await stop_gateway(*gateway)
        await runner.cleanup()


def test_a_chat_request_goes_through_prefill_and_decode_of_the_standin():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, _, text = asyncio.run(_through_gateway(body))
    assert status == 200
    answer = json.loads(text)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == "x"


def test_a_streamed_request_gets_server_sent_events():
    body = {"model": "m", "prompt": "hi", "stream": True}
    status, content_type, text = asyncio.run(_through_gateway(body))
    assert status == 200 and content_type == "text/event-stream"
    assert text.rstrip().endswith("data: [DONE]")


def test_an_offer_without_a_transfer_id_is_a_400_naming_it():
    async def post() -> tuple[int, dict]:
        port = free_port()
        runner = web.AppRunner(build_standin_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{port}/pd/prefill",
                    json={"kind": "chat", "request": {}, "kv_target": "a:1"}) as resp:
                return resp.status, await resp.json()
        finally:
            await runner.cleanup()

    status, body = asyncio.run(post())
    assert status == 400 and body["error"]["param"] == "transfer_id"
