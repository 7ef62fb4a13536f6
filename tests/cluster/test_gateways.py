"""Several gateways serve one P/D group at once, each reading the group from ZooKeeper; a
gateway that stops loses only its own streams: another gateway's stream, in flight through
the same instances, completes with the tokens one instance gives alone."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from pdserve.cluster.registry import ZooKeeperRegistry
from tests.cluster.conftest import GROUP_ROOT
from tests.cluster.group import stream, wait_until
from tests.cluster.test_pd_e2e import BODY, GatewayThread

pytestmark = pytest.mark.slow
LONG = {**BODY, "max_tokens": 48, "stream_options": {"include_usage": True}}


def _ids(registry, role: str) -> list[str]:
    return [i.instance_id for i in registry.instances("chat", role)]


def test_two_gateways_share_a_group_and_one_stopping_spares_the_other(zookeeper, zk_group):
    servers = zk_group
    registries = [ZooKeeperRegistry(zookeeper, GROUP_ROOT) for _ in range(2)]
    gateways = [GatewayThread(r, default_scenario="chat") for r in registries]
    stopped = False
    try:
        for registry in registries:
            wait_until(timeout=30, predicate=lambda r=registry: _ids(r, "prefill") == ["p0"]
                       and _ids(r, "decode") == ["d0"])
        want = json.loads(servers[0].request("POST", "/v1/completions", LONG)[2])
        answers = [json.loads(g.http.request("POST", "/v1/completions", LONG)[2])
                   for g in gateways for _ in range(2)]
        assert {a["choices"][0]["text"] for a in answers} == {want["choices"][0]["text"]}

        # Stopping a gateway drains its own connections first; B's stream must not wait.
        stopper = threading.Thread(target=gateways[0].stop)

        def stop_first() -> None:  # may be called for each line of the third event
            nonlocal stopped
            if not stopped:
                stopper.start()
                stopped = True

        async def run():
            async with aiohttp.ClientSession() as session:
                return await stream(session, gateways[1].http.url, LONG, after_chunks=3,
                                    on_chunks=stop_first)

        got = asyncio.run(run())
        stopper.join(120)
        assert stopped and got.status == 200 and got.error is None and got.done
        assert got.text == want["choices"][0]["text"]
        assert got.usage["completion_tokens"] == LONG["max_tokens"]
    finally:
        for gateway in gateways[int(stopped):]:
            gateway.stop()
        for registry in registries:
            registry.close()
