"""HTTP limits of the server and the gateway (one module, ``pdserve/server/limits.py``, used by
both): each excess gets its own 4xx with a message, over real sockets."""

from __future__ import annotations

import json
import socket

import pytest

from pdserve.cluster.registry import MemoryRegistry
from tests.cluster.test_pd_e2e import GatewayThread
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

LIMITS = {"max_request_bytes": 4096, "body_timeout_s": 1.0, "max_concurrent_requests": 1}


@pytest.fixture(scope="module", params=["server", "gateway"])
def target(request):
    """(port, stop) of a server or a gateway with small limits."""
    if request.param == "server":
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
        server = start_server(*flags)
        yield server
        server.stop()
        return
    registry = MemoryRegistry()
    gateway = GatewayThread(registry, **LIMITS)
    yield gateway.http
    gateway.stop()
    registry.close()


def _raw(port: int, data: bytes, wait_s: float = 10.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        return _answer(sock, wait_s)


def _answer(sock: socket.socket, wait_s: float) -> tuple[int, bytes]:
    sock.settimeout(wait_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _expected_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return 0


def _post(body: bytes, length: int | None = None, extra: bytes = b"") -> bytes:
    size = len(body) if length is None else length
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % size + body)


def test_oversized_body_is_413(target):
    body = json.dumps({"prompt": "x" * 8000}).encode()
    status, raw = _raw(target.port, _post(body))
    assert status == 413 and "larger than 4096 bytes" in json.loads(raw)["error"]["message"]


def test_deeply_nested_json_is_400(target):
    body = b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}"
    status, raw = _raw(target.port, _post(body))
    assert status == 400 and "nests deeper than 32" in json.loads(raw)["error"]["message"]
    # brackets inside strings are text, not nesting: this one gets past the limit
    status, raw = _raw(target.port, _post(json.dumps({"prompt": "[" * 40, "suffix": "s"}).encode()))
    assert _past_the_limits(status, raw)


def test_oversized_header_is_400_naming_the_limit(target):
    status, raw = _raw(target.port, _post(b"{}", extra=b"X-Big: " + b"a" * 20000 + b"\r\n"))
    assert status == 400 and b"Got more than" in raw


def test_slow_client_is_408_and_holds_the_only_slot_until_then(target):
    with socket.create_connection(("127.0.0.1", target.port)) as slow:
        slow.sendall(_post(b'{"prompt": ', length=100))  # the rest never comes
        # the slow request holds the one slot: another one is refused meanwhile
        status, raw = _raw(target.port, _post(b'{"prompt": "a", "suffix": "s"}'))
        assert status == 429 and "limit" in json.loads(raw)["error"]["message"]
        status, raw = _answer(slow, wait_s=10.0)
    assert status == 408 and "did not arrive within 1 s" in json.loads(raw)["error"]["message"]
    status, raw = _raw(target.port, _post(b'{"prompt": "a", "suffix": "s"}'))  # the slot is free
    assert _past_the_limits(status, raw)


def _past_the_limits(status: int, raw: bytes) -> bool:
    """Answered by what is behind the limits: the server refuses a suffix (400), the
    gateway, with no instance listed, has nobody to send it to (503)."""
    error = json.loads(raw)["error"]
    refused_suffix = status == 400 and error.get("param") == "suffix"
    return refused_suffix or (status == 503 and "no decode instance" in error["message"])
