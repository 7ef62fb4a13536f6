"""KV buffers over TCP between processes: one header, then the raw bytes, on real sockets."""

from __future__ import annotations

import gc
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
import xxhash

from pdserve.cache.kv_pool import allocate_kv_pool
from pdserve.config import ModelConfig
from pdserve.model.arch import get_arch
from pdserve.transfer import (
    KVLayout,
    TcpKVReceiver,
    TcpKVSender,
    gather_blocks,
    kv_blocks,
    scatter_blocks,
    tcp,
)
from pdserve.transfer.kv_blocks import host_empty

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
                 version: object = 2) -> bytes:
    """A message built from the documented wire format alone, not from the module's code;
    the payload's XXH3-64 digest follows it."""
    header = json.dumps({"version": version, "transfer_id": transfer_id,
                         "layout": layout}).encode()
    digest = struct.pack(">Q", xxhash.xxh3_64_intdigest(payload)) if payload else b""
    return b"PDKV" + struct.pack(">I", len(header)) + header + payload + digest


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
    "version-1": _raw_message("x", GOOD_LAYOUT, version=1),
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


@pytest.mark.parametrize("where", ["first", "middle", "last", "digest"])
def test_corrupted_bytes_are_dropped_and_the_connection_goes_on(receiver, caplog, where):
    """One flipped bit anywhere in the payload or its digest: the buffer never reaches the
    engine; the next message on the same connection arrives intact."""
    bad = _random_kv((2, 2, 5, 2, 8), torch.float32, seed=3)
    good = _random_kv((2, 2, 5, 2, 8), torch.float32, seed=4)
    message = bytearray(_raw_message("bad", KV_LAYOUT_JSON, bad.numpy().tobytes()))
    payload_start = len(message) - KVLayout.of(bad).num_bytes - 8
    index = {"first": payload_start, "middle": payload_start + KVLayout.of(bad).num_bytes // 2,
             "last": len(message) - 9, "digest": len(message) - 1}[where]
    message[index] ^= 0x01
    with caplog.at_level(logging.ERROR, logger="pdserve.transfer.tcp"), \
            socket.create_connection(tcp.split_address(receiver.address)) as raw:
        raw.sendall(bytes(message) + _raw_message("good", KV_LAYOUT_JSON, good.numpy().tobytes()))
        _assert_same_bits(receiver.recv("good", timeout=WAIT_S), good)
    assert receiver.poll("bad") is None and receiver.stats.num_corrupt == 1
    assert any("checksum" in record.message for record in caplog.records)
    # Its waiter hears of the drop once; the good one was never dropped.
    assert receiver.take_dropped("bad") and not receiver.take_dropped("bad")
    assert not receiver.take_dropped("good")


def test_a_corrupt_buffer_already_discarded_is_not_reported(receiver):
    bad = _random_kv((1, 2, 2, 1, 4), torch.float32)
    message = bytearray(_raw_message("gone", GOOD_LAYOUT, bad.numpy().tobytes()))
    message[-1] ^= 0x01
    receiver.discard("gone")  # its request was aborted before the buffer came
    with socket.create_connection(tcp.split_address(receiver.address)) as raw:
        raw.sendall(bytes(message) + _raw_message("next", GOOD_LAYOUT, bad.numpy().tobytes()))
        receiver.recv("next", timeout=WAIT_S)
    assert receiver.stats.num_corrupt == 1 and not receiver.take_dropped("gone")


KV_LAYOUT_JSON = {"num_layers": 2, "num_tokens": 5, "kv_heads": 2, "head_dim": 8,
                  "dtype": "float32"}


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
import json, random, socket, struct, sys, xxhash
host, port = sys.argv[1].rsplit(":", 1)
payload = random.Random(5).randbytes(3 * 2 * 10 * 2 * 8 * 2)
layout = {"num_layers": 3, "num_tokens": 10, "kv_heads": 2, "head_dim": 8, "dtype": "float16"}
header = json.dumps({"version": 2, "transfer_id": "from-script", "layout": layout}).encode()
digest = struct.pack(">Q", xxhash.xxh3_64_intdigest(payload))
with socket.create_connection((host, int(port))) as sock:
    sock.sendall(b"PDKV" + struct.pack(">I", len(header)) + header + payload + digest)
"""


def test_round_trip_from_a_script_without_torch(receiver):
    """A fresh interpreter speaking only the documented wire format (no torch, so quick;
    xxhash for the digest)."""
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


# --- speed-relevant behaviour: no copies on the send side, cheap pages on the receive side ---


def _address_of(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0


def test_cpu_buffer_is_sent_from_its_own_memory(receiver, sender, monkeypatch):
    """Zero-copy on the sending side: the socket is handed a view of the tensor itself."""
    sent: list[tuple[int, int]] = []
    real_send_payload = tcp._send_payload

    def spy(sock, payload, copied):
        sent.append((_address_of(payload), len(payload)))
        return real_send_payload(sock, payload, copied)

    monkeypatch.setattr(tcp, "_send_payload", spy)
    buffer = _random_kv((4, 2, 512, 8, 128), torch.bfloat16, seed=6)  # 8 MiB
    sender.send(receiver.address, "own", buffer)
    _assert_same_bits(receiver.recv("own", timeout=WAIT_S), buffer)
    assert sent == [(buffer.data_ptr(), KVLayout.of(buffer).num_bytes)]


class _FakeEvent:
    """Stands in for a CUDA event of a staged device buffer: records how many payload bytes
    the receiving end had when the sender waited on it."""

    def __init__(self, log: list[int], received: list[int]) -> None:
        self.log, self.received = log, received

    def synchronize(self) -> None:
        self.log.append(self.received[0])


def test_staged_payload_goes_piece_by_piece_after_each_copy():
    """The device path's send loop, on CPU: piece i is written only after its event, and
    the pieces (and a tail with no event) make up the payload in order."""
    payload = bytes(random.Random(8).randbytes(5 * 2**20 + 123))
    ends = [2**20, 3 * 2**20, 5 * 2**20]  # the last 123 bytes have no event
    waited: list[int] = []
    received = [0]
    events = [(end, _FakeEvent(waited, received)) for end in ends]
    got = bytearray(len(payload))
    left, right = socket.socketpair()
    with left, right:
        def read_all() -> None:
            view = memoryview(got)
            while received[0] < len(got):
                received[0] += right.recv_into(view[received[0]:])

        reader = threading.Thread(target=read_all)
        reader.start()
        tcp._send_payload(left, memoryview(payload), events)
        reader.join(WAIT_S)
    assert bytes(got) == payload
    # Each wait came before the bytes of its own piece could have been written.
    assert len(waited) == 3 and all(
        seen <= start for seen, start in zip(waited, [0, *ends[:-1]], strict=True))


class _Event:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails

    def synchronize(self) -> None:
        if self.fails:
            raise RuntimeError("device copy failed")


def test_failure_between_pieces_drops_the_connection(receiver, sender, monkeypatch):
    """A staged send that fails after some of its bytes were written reports the error, and
    the cut-short message cannot make the next one on that address arrive corrupted."""
    good = _random_kv((2, 2, 256, 8, 64), torch.float16, seed=14)  # 1 MiB
    sender.send(receiver.address, "warm", good)  # a cached connection, reused below
    receiver.recv("warm", timeout=WAIT_S)
    half = KVLayout.of(good).num_bytes // 2
    real_stage = tcp._stage_on_host
    monkeypatch.setattr(tcp, "_stage_on_host", lambda tensor: (
        real_stage(tensor)[0], [(half, _Event()), (2 * half, _Event(fails=True))]))
    with pytest.raises(RuntimeError, match="device copy failed"):
        sender.send(receiver.address, "cut", good)
    assert not sender._connections and sender.stats.num_transfers == 1
    monkeypatch.undo()
    sender.send(receiver.address, "next", good)
    _assert_same_bits(receiver.recv("next", timeout=WAIT_S), good)
    assert receiver.poll("cut") is None and receiver.pending() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_empty_big_and_small(dtype):
    for shape in [(1, 2, 3, 1, 4), (8, 2, 1024, 4, 64)]:  # tiny, and 4-16 MiB
        buffer = host_empty(shape, dtype)
        assert buffer.shape == shape and buffer.dtype == dtype and buffer.device.type == "cpu"
        assert buffer.is_contiguous()
        want = _random_kv(shape, dtype, seed=9)
        buffer.copy_(want)
        view = buffer[1:]  # the mapping must outlive the tensor it came from
        del buffer
        gc.collect()
        _assert_same_bits(view.contiguous(), want[1:])


@pytest.fixture
def fresh_pool(monkeypatch):
    """An empty host buffer pool for this test alone (both modules see it)."""
    pool = kv_blocks.HostBufferPool(kv_blocks.HOST_POOL_MAX_IDLE_BYTES)
    monkeypatch.setattr(kv_blocks, "HOST_POOL", pool)
    yield pool
    pool.clear()


def test_big_receive_buffers_reuse_freed_memory(receiver, sender, fresh_pool):
    """Fresh pages faulted in by recv_into cost as much as the copy: once a big received
    buffer is freed, the next one of about its size lands in the same memory, and never
    in memory a live buffer (or a view of one) still uses."""
    first = _random_kv((2, 2, 1024, 8, 128), torch.float16, seed=7)  # 8 MiB
    second = _random_kv((2, 2, 1000, 8, 128), torch.float16, seed=8)  # a little smaller
    sender.send(receiver.address, "first", first)
    got_first = receiver.recv("first", timeout=WAIT_S)
    _assert_same_bits(got_first, first)
    address = got_first.data_ptr()
    kept = got_first[1]  # a view keeps the memory in use
    del got_first
    gc.collect()
    sender.send(receiver.address, "second", second)
    got_second = receiver.recv("second", timeout=WAIT_S)
    _assert_same_bits(got_second, second)
    assert got_second.data_ptr() != address
    _assert_same_bits(kept.contiguous(), first[1])
    del kept, got_second
    gc.collect()
    assert fresh_pool.idle_bytes() == (KVLayout.of(first).num_bytes
                                       + KVLayout.of(second).num_bytes)
    sender.send(receiver.address, "third", second)
    got_third = receiver.recv("third", timeout=WAIT_S)
    _assert_same_bits(got_third, second)
    assert fresh_pool.hits == 1 and fresh_pool.misses == 2
    small = host_empty((1, 2, 2, 1, 4), torch.float32)  # below the threshold: torch's own
    assert small.untyped_storage().resizable()


def test_gather_output_comes_from_the_pool(fresh_pool):
    arch = get_arch(ModelConfig())
    pool = allocate_kv_pool(arch, 160, 16, torch.bfloat16, torch.device("cpu"))
    pool[0][0].normal_()
    gathered = gather_blocks(pool, list(range(160)), 160 * 16)  # 5 MiB
    assert KVLayout.of(gathered).num_bytes >= kv_blocks.HOST_POOL_MIN_BYTES
    assert fresh_pool.misses == 1 and fresh_pool.idle_bytes() == 0
    address = gathered.data_ptr()
    del gathered
    gc.collect()
    again = gather_blocks(pool, list(range(160)), 160 * 16)
    assert again.data_ptr() == address and fresh_pool.hits == 1
    assert torch.equal(again[0, 0], pool[0][0].flatten(0, 1))


def test_pool_keeps_at_most_its_idle_budget():
    pool = kv_blocks.HostBufferPool(max_idle_bytes=20 * 2**20)
    buffers = [pool.tensor(n * 2**20, torch.uint8) for n in (8, 8, 8, 30)]
    for buffer in buffers:
        buffer.fill_(1)
    del buffers, buffer
    gc.collect()
    # Two 8 MiB fit, a third pushes the oldest out, 30 MiB alone is over the budget.
    assert pool.idle_bytes() == 16 * 2**20
    assert pool.tensor(3 * 2**20, torch.uint8).numel() == 3 * 2**20  # 8 MiB is over 2x
    assert pool.misses == 5 and pool.hits == 0
    reused = pool.tensor(5 * 2**20, torch.uint8)
    assert pool.hits == 1 and reused.numel() == 5 * 2**20
    del reused
    pool.clear()
    assert pool.idle_bytes() == 0


def test_receiver_device_must_be_usable():
    with pytest.raises(ValueError, match="cpu or cuda"):
        TcpKVReceiver(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            TcpKVReceiver(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("to_device", [False, True], ids=["to-host", "to-device"])
def test_cuda_buffers_are_staged_in_pieces(monkeypatch, to_device):
    """Device to host to wire in pieces (the last one partial), and on a CUDA receiver from
    the wire through two pinned chunks to the device."""
    monkeypatch.setattr(tcp, "STAGE_CHUNK_BYTES", 2**20)
    whole = _random_kv((3, 2, 700, 8, 128), torch.bfloat16, seed=12).cuda()  # ~8.2 MiB
    strided = whole[:, :, 100:650]
    with TcpKVReceiver(device="cuda" if to_device else "cpu") as rx, TcpKVSender() as tx:
        for transfer_id, buffer in (("whole", whole), ("strided", strided)):
            tx.send(rx.address, transfer_id, buffer)
            got = rx.recv(transfer_id, timeout=WAIT_S)
            assert got.device.type == ("cuda" if to_device else "cpu")
            _assert_same_bits(got.cpu(), buffer.cpu().contiguous())
        done = threading.Event()
        tx.send_async(rx.address, "async", whole, on_done=lambda error: done.set())
        whole.zero_()  # queued after the staging copies on the same stream
        assert done.wait(WAIT_S)
        got = rx.recv("async", timeout=WAIT_S)
        assert got.reshape(-1).view(torch.uint8).any()
