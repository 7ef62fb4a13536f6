"""KV buffers over TCP between processes: one header, then the raw bytes, on real sockets."""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.cache.kv_pool import allocate_kv_pool
from pdserve.config import ModelConfig
from pdserve.model.arch import get_arch
from pdserve.transfer import (
    KVLayout,
    TcpKVReceiver,
    TcpKVSender,
    gather_blocks,
    scatter_blocks,
    tcp,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WAIT_S = 10.0  # generous upper bound; every wait returns as soon as the bytes are in


def _random_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random BITS, not random values: NaN payloads, infinities and denormals must survive."""
    element = torch.empty((), dtype=dtype).element_size()
    count = element * torch.Size(shape).numel()
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu"
    assert got.is_contiguous()
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def _free_port_address() -> str:
    """An address nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _closed_by_peer(sock: socket.socket) -> bool:
    """Closing with unread bytes in its buffer makes the receiver send a reset, not a FIN."""
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _raw_message(transfer_id: object, layout: object, payload: bytes = b"",
                 version: object = 1) -> bytes:
    """A message built from the documented wire format alone, not from the module's code."""
    header = json.dumps({"version": version, "transfer_id": transfer_id,
                         "layout": layout}).encode()
    return b"PDKV" + struct.pack(">I", len(header)) + header + payload


@pytest.fixture
def receiver():
    with TcpKVReceiver() as rx:
        yield rx


@pytest.fixture
def sender():
    with TcpKVSender() as tx:
        yield tx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_each_dtype(receiver, sender, dtype):
    buffer = _random_kv((3, 2, 7, 2, 8), dtype, seed=1)
    sender.send(receiver.address, "req-1", buffer)
    _assert_same_bits(receiver.recv("req-1", timeout=WAIT_S), buffer)
    num_bytes = KVLayout.of(buffer).num_bytes
    assert (sender.stats.num_transfers, sender.stats.num_bytes) == (1, num_bytes)
    assert (receiver.stats.num_transfers, receiver.stats.num_bytes) == (1, num_bytes)
    assert receiver.pending() == 0


def test_strided_buffer_is_sent_by_value(receiver, sender):
    whole = _random_kv((2, 2, 9, 3, 8), torch.float16, seed=4)
    part = whole[:, :, 2:7].transpose(3, 4)  # a view: neither contiguous nor at offset 0
    assert not part.is_contiguous()
    sender.send(receiver.address, "part", part)
    _assert_same_bits(receiver.recv("part", timeout=WAIT_S), part.contiguous())


def test_address_is_the_bound_port():
    rx = TcpKVReceiver(port=0)
    with pytest.raises(RuntimeError):
        _ = rx.address
    with rx.start():
        host, port = rx.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0


def test_documented_wire_format_from_a_raw_socket(receiver):
    buffer = _random_kv((2, 2, 3, 1, 4), torch.bfloat16, seed=2)
    layout = {"num_layers": 2, "num_tokens": 3, "kv_heads": 1, "head_dim": 4,
              "dtype": "bfloat16"}
    payload = buffer.reshape(-1).view(torch.uint8).numpy().tobytes()
    with socket.create_connection(tcp.split_address(receiver.address)) as raw:
        raw.sendall(_raw_message("raw", layout, payload))
        _assert_same_bits(receiver.recv("raw", timeout=WAIT_S), buffer)


def test_many_buffers_over_one_connection(receiver, sender):
    buffers = {f"r{i}": _random_kv((2, 2, 1 + 5 * i, 2, 4), torch.float16, seed=i)
               for i in range(6)}
    for transfer_id, buffer in buffers.items():
        sender.send(receiver.address, transfer_id, buffer)
    for transfer_id, buffer in buffers.items():
        _assert_same_bits(receiver.recv(transfer_id, timeout=WAIT_S), buffer)
    assert len(sender._connections) == 1 and len(receiver._connections) == 1


@pytest.mark.parametrize("shared", [False, True], ids=["two-senders", "one-shared-sender"])
def test_parallel_threads(receiver, shared):
    senders = [TcpKVSender()] if shared else [TcpKVSender(), TcpKVSender()]
    buffers = {f"t{thread}-{i}": _random_kv((2, 2, 64, 4, 16), torch.bfloat16, 10 * thread + i)
               for thread in range(2) for i in range(4)}
    errors: list[BaseException] = []

    def send_mine(thread: int) -> None:
        tx = senders[thread % len(senders)]
        try:
            for transfer_id, buffer in buffers.items():
                if transfer_id.startswith(f"t{thread}-"):
                    tx.send(receiver.address, transfer_id, buffer)
        except BaseException as exc:  # surfaced below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=send_mine, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors
    for transfer_id, buffer in buffers.items():
        _assert_same_bits(receiver.recv(transfer_id, timeout=WAIT_S), buffer)
    for tx in senders:
        tx.close()


def test_64_mb_buffer_arrives_intact(receiver, sender):
    buffer = _random_kv((8, 2, 2048, 8, 128), torch.bfloat16, seed=3)
    assert KVLayout.of(buffer).num_bytes == 64 * 2**20
    sender.send(receiver.address, "big", buffer)
    _assert_same_bits(receiver.recv("big", timeout=WAIT_S), buffer)


def test_send_async_runs_fifo_on_one_background_thread(receiver, sender):
    done: list[tuple[str, BaseException | None, str]] = []
    finished = threading.Event()
    buffers = {f"a{i}": _random_kv((1, 2, 4 + i, 2, 4), torch.float32, seed=i) for i in range(5)}

    def on_done_for(transfer_id: str):
        def on_done(error: BaseException | None) -> None:
            done.append((transfer_id, error, threading.current_thread().name))
            if len(done) == len(buffers):
                finished.set()
        return on_done

    for transfer_id, buffer in buffers.items():
        sender.send_async(receiver.address, transfer_id, buffer, on_done=on_done_for(transfer_id))
    assert finished.wait(WAIT_S)
    assert [transfer_id for transfer_id, _, _ in done] == list(buffers)
    assert all(error is None for _, error, _ in done)
    assert {name for _, _, name in done} == {"pdkv-sender"}
    for transfer_id, buffer in buffers.items():
        _assert_same_bits(receiver.recv(transfer_id, timeout=WAIT_S), buffer)


def test_send_async_reports_a_failure_to_on_done(sender):
    address = _free_port_address()
    result: list[BaseException | None] = []
    finished = threading.Event()
    sender.send_async(address, "lost", _random_kv((1, 2, 1, 1, 4), torch.float32),
                      on_done=lambda error: (result.append(error), finished.set()))
    assert finished.wait(WAIT_S)
    assert isinstance(result[0], ConnectionError) and address in str(result[0])


def test_poll_before_and_after_arrival(receiver, sender):
    assert receiver.poll("p") is None
    buffer = _random_kv((1, 2, 3, 2, 4), torch.float16)
    sender.send(receiver.address, "p", buffer)
    deadline = time.monotonic() + WAIT_S
    while (got := receiver.poll("p")) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert got is not None
    _assert_same_bits(got, buffer)
    assert receiver.poll("p") is None  # handed over, not kept


def test_recv_timeout_names_the_id(receiver):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="never-sent"):
        receiver.recv("never-sent", timeout=0.05)
    assert time.monotonic() - start >= 0.05


def test_discard_before_arrival_drops_it_on_arrival(receiver, sender):
    receiver.discard("gone")
    sender.send(receiver.address, "gone", _random_kv((1, 2, 2, 1, 4), torch.float32))
    # One connection is FIFO: once "next" is in, "gone" has been read (and dropped).
    sender.send(receiver.address, "next", _random_kv((1, 2, 2, 1, 4), torch.float32))
    receiver.recv("next", timeout=WAIT_S)
    assert receiver.pending() == 0 and receiver.poll("gone") is None
    assert receiver.stats.num_transfers == 2


def test_discard_after_arrival(receiver, sender):
    sender.send(receiver.address, "gone", _random_kv((1, 2, 2, 1, 4), torch.float32))
    sender.send(receiver.address, "next", _random_kv((1, 2, 2, 1, 4), torch.float32))
    receiver.recv("next", timeout=WAIT_S)
    assert receiver.pending() == 1
    receiver.discard("gone")
    assert receiver.pending() == 0 and receiver.poll("gone") is None
    assert not receiver._discarded  # it had arrived: no mark left behind


def test_untaken_buffers_and_discard_marks_expire():
    with TcpKVReceiver(ttl_s=0.1) as receiver, TcpKVSender() as sender:
        receiver.discard("late")  # never sent within the TTL
        for transfer_id in ("old", "ping"):
            sender.send(receiver.address, transfer_id, _random_kv((1, 2, 2, 1, 4), torch.float32))
        receiver.recv("ping", timeout=WAIT_S)
        assert receiver.pending() == 1
        time.sleep(0.15)
        assert receiver.pending() == 0 and receiver.poll("old") is None
        # The discard mark expired too: a later buffer with that id is kept.
        sender.send(receiver.address, "late", _random_kv((1, 2, 2, 1, 4), torch.float32))
        assert receiver.recv("late", timeout=WAIT_S).shape == (1, 2, 2, 1, 4)


GOOD_LAYOUT = {"num_layers": 1, "num_tokens": 2, "kv_heads": 1, "head_dim": 4,
               "dtype": "float32"}
BAD_STREAMS = {
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad-magic": b"PDXX" + struct.pack(">I", 10) + b"0123456789",
    "header-too-long": b"PDKV" + struct.pack(">I", 64 * 1024 + 1) + b"{}",
    "empty-header": b"PDKV" + struct.pack(">I", 0),
    "not-utf8": b"PDKV" + struct.pack(">I", 4) + b"\xff\xfe{]",
    "json-list": b"PDKV" + struct.pack(">I", 2) + b"[]",
    "version-2": _raw_message("x", GOOD_LAYOUT, version=2),
    "id-not-string": _raw_message(7, GOOD_LAYOUT),
    "layout-not-dict": _raw_message("x", [1, 2, 2, 1, 4]),
    "int8": _raw_message("x", {**GOOD_LAYOUT, "dtype": "int8"}),
    "dtype-list": _raw_message("x", {**GOOD_LAYOUT, "dtype": ["float32"]}),
    "zero-tokens": _raw_message("x", {**GOOD_LAYOUT, "num_tokens": 0}),
    "negative-layers": _raw_message("x", {**GOOD_LAYOUT, "num_layers": -1}),
    "float-size": _raw_message("x", {**GOOD_LAYOUT, "head_dim": 4.0}),
    "bool-size": _raw_message("x", {**GOOD_LAYOUT, "kv_heads": True}),
    "missing-size": _raw_message("x", {k: v for k, v in GOOD_LAYOUT.items() if k != "kv_heads"}),
    "huge": _raw_message("x", {**GOOD_LAYOUT, "num_tokens": 2**40}),
}


@pytest.mark.parametrize("stream", BAD_STREAMS.values(), ids=BAD_STREAMS.keys())
def test_malformed_stream_closes_only_its_connection(receiver, sender, caplog, stream):
    good = _random_kv((1, 2, 2, 1, 4), torch.float32)
    sender.send(receiver.address, "before", good)  # an open connection that must survive
    receiver.recv("before", timeout=WAIT_S)
    with caplog.at_level(logging.WARNING, logger="pdserve.transfer.tcp"), \
            socket.create_connection(tcp.split_address(receiver.address)) as raw:
        raw.sendall(stream)
        assert _closed_by_peer(raw)
    assert any("closing KV connection" in record.message for record in caplog.records)
    sender.send(receiver.address, "after", good)
    _assert_same_bits(receiver.recv("after", timeout=WAIT_S), good)
    assert receiver.pending() == 0


def test_truncated_message_is_dropped(receiver, sender):
    buffer = _random_kv((1, 2, 2, 1, 4), torch.float32)
    whole = _raw_message("cut", GOOD_LAYOUT, buffer.numpy().tobytes())
    assert len(whole) > 3 + KVLayout.of(buffer).num_bytes
    with socket.create_connection(tcp.split_address(receiver.address)) as raw:
        raw.sendall(whole[:-3])
    sender.send(receiver.address, "ok", buffer)
    receiver.recv("ok", timeout=WAIT_S)
    assert receiver.poll("cut") is None and receiver.pending() == 0


def test_send_to_a_closed_port_names_the_address(sender):
    address = _free_port_address()
    with pytest.raises(ConnectionError, match=re.escape(address)):
        sender.send(address, "nowhere", _random_kv((1, 2, 1, 1, 4), torch.float32))
    assert sender.stats.num_transfers == 0


@pytest.mark.parametrize("liveness_check", [True, False], ids=["peek", "retry-on-error"])
def test_sender_reconnects_after_the_receiver_restarts(sender, monkeypatch, liveness_check):
    if not liveness_check:
        # Without the peek, the dead connection is found by a failing write: big enough
        # that the kernel cannot buffer it all before the peer's reset comes back.
        monkeypatch.setattr(tcp, "_peer_closed", lambda sock: False)
    buffer = _random_kv((4, 2, 256, 8, 128), torch.bfloat16)  # 4 MB
    with TcpKVReceiver() as first:
        address = first.address
        sender.send(address, "one", buffer)
        first.recv("one", timeout=WAIT_S)
    with TcpKVReceiver(port=int(address.rsplit(":", 1)[1])).start() as second:
        sender.send(address, "two", buffer)
        _assert_same_bits(second.recv("two", timeout=WAIT_S), buffer)


def test_buffers_it_cannot_carry_are_rejected(sender):
    address = _free_port_address()
    for bad in (torch.zeros(2, 2, 3, 4), torch.zeros(1, 3, 2, 1, 4),
                torch.zeros(1, 2, 2, 1, 4, dtype=torch.int32), torch.zeros(1, 2, 0, 1, 4)):
        with pytest.raises(ValueError):
            sender.send(address, "bad", bad)
    with pytest.raises(TypeError):
        sender.send(address, 7, torch.zeros(1, 2, 1, 1, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host:port"):
        sender.send("no-port", "bad", torch.zeros(1, 2, 1, 1, 4))


def test_close_is_idempotent_and_wakes_a_waiting_recv():
    receiver = TcpKVReceiver().start()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            receiver.recv("never", timeout=WAIT_S)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.02)
    receiver.close()
    receiver.close()
    waiter.join(WAIT_S)
    assert isinstance(errors[0], RuntimeError) and "closed" in str(errors[0])
    with pytest.raises(RuntimeError):
        receiver.start()
    sender = TcpKVSender()
    sender.close()
    sender.close()
    with pytest.raises(RuntimeError):
        sender.send_async("127.0.0.1:1", "x", torch.zeros(1, 2, 1, 1, 4))


def _send_from_child(address: str, buffer: torch.Tensor) -> None:
    with TcpKVSender() as tx:
        tx.send(address, "from-child", buffer)


def test_round_trip_from_a_forked_process(receiver):
    """The real sender in a second process. Forked, so the child skips importing torch
    (3-6 s on a CI core); it runs no parallel torch op, which is what fork cannot survive."""
    buffer = _random_kv((2, 2, 33, 4, 16), torch.bfloat16, seed=11)
    child = multiprocessing.get_context("fork").Process(target=_send_from_child,
                                                        args=(receiver.address, buffer))
    child.start()
    child.join(WAIT_S)
    assert child.exitcode == 0
    _assert_same_bits(receiver.recv("from-child", timeout=WAIT_S), buffer)


STDLIB_CHILD = """
import json, random, socket, struct, sys
host, port = sys.argv[1].rsplit(":", 1)
payload = random.Random(5).randbytes(3 * 2 * 10 * 2 * 8 * 2)
layout = {"num_layers": 3, "num_tokens": 10, "kv_heads": 2, "head_dim": 8, "dtype": "float16"}
header = json.dumps({"version": 1, "transfer_id": "from-script", "layout": layout}).encode()
with socket.create_connection((host, int(port))) as sock:
    sock.sendall(b"PDKV" + struct.pack(">I", len(header)) + header + payload)
"""


def test_round_trip_from_a_script_without_torch(receiver):
    """A fresh interpreter speaking only the documented wire format (no torch, so quick)."""
    child = subprocess.run([sys.executable, "-c", STDLIB_CHILD, receiver.address],
                           timeout=WAIT_S, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    payload = random.Random(5).randbytes(3 * 2 * 10 * 2 * 8 * 2)
    want = torch.frombuffer(bytearray(payload), dtype=torch.float16).reshape(3, 2, 10, 2, 8)
    _assert_same_bits(receiver.recv("from-script", timeout=WAIT_S), want)


def test_gather_tcp_scatter_into_another_pool(receiver, sender):
    arch = get_arch(ModelConfig())
    src = allocate_kv_pool(arch, 12, 4, torch.bfloat16, torch.device("cpu"))
    dst = allocate_kv_pool(arch, 9, 8, torch.bfloat16, torch.device("cpu"))  # other page size
    for layer, (k_pages, v_pages) in enumerate(src):
        k_pages.copy_(_random_kv(tuple(k_pages.shape), torch.bfloat16, seed=2 * layer))
        v_pages.copy_(_random_kv(tuple(v_pages.shape), torch.bfloat16, seed=2 * layer + 1))
    src_ids, dst_ids, num_tokens = [9, 2, 11, 0, 5], [7, 1, 4], 19
    sent = gather_blocks(src, src_ids, num_tokens)
    assert sent.reshape(-1).view(torch.uint8).any()
    sender.send(receiver.address, "kv", sent)
    scatter_blocks(receiver.recv("kv", timeout=WAIT_S), dst, dst_ids)
    _assert_same_bits(gather_blocks(dst, dst_ids, num_tokens), sent)
