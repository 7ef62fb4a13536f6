"""P/D across instances with KV over torch.distributed point-to-point (gloo between the two
CPU instances): the same answer as one instance alone, and an explicit transport a peer
cannot take fails at start-up or in the open, never silently over another one."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdserve.cluster.registry import MemoryRegistry
from tests.cluster.group import wait_until
from tests.cluster.test_pd_e2e import BODY, GatewayThread, _complete, _instance
from tests.server.conftest import Server, start_servers, stop_servers

pytestmark = pytest.mark.slow


def test_p2p_pair_through_the_gateway_equals_one_instance():
    # Both explicit: each receiver refuses plain TCP, so an answer proves the p2p path.
    prefill, decode = start_servers(*[("--kv-transfer-port", "0", "--kv-transport", "p2p")] * 2)
    registry = MemoryRegistry()
    registry.register(_instance(prefill, "prefill"))
    registry.register(_instance(decode, "decode"))
    gateway = GatewayThread(registry)
    try:
        splits = [_complete(gateway.http, BODY) for _ in range(2)]  # one group, reused
        alone = _complete(prefill, BODY)  # also wakes the prefill engine to report stats
        for split in splits:
            assert split["choices"][0]["text"] == alone["choices"][0]["text"]
            assert split["usage"]["completion_tokens"] == BODY["max_tokens"]
        wait_until(lambda: _sent_by_transport(prefill) == {"p2p": 2.0})
    finally:
        gateway.stop()
        registry.close()
        stop_servers((prefill, decode))


def _sent_by_transport(server: Server) -> dict[str, float]:
    _, _, raw = server.request("GET", "/metrics")
    found = re.findall(r'^pdserve_kv_sent_by_transport_total\{transport="(\w+)"\} (\S+)$',
                       raw.decode(), re.MULTILINE)
    return {transport: float(value) for transport, value in found}


@pytest.mark.parametrize("flags, reason", [
    (["--kv-transport", "ipc", "--kv-transfer-port", "0"], "ipc needs KV on a CUDA device"),
    (["--kv-transport", "p2p"], "--kv-transport p2p needs --kv-transfer-port"),
])
def test_an_explicit_transport_that_cannot_work_stops_start_up(flags, reason):
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "tiny", "--device", "cpu",
                           "--port", "0", *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and reason in done.stderr, done.stderr
