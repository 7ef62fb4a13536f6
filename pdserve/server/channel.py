"""Both ends of the message channel between the HTTP process and the engine process.

Two one-way OS pipes carry pickled lists of ``messages``, framed as
``multiprocessing.connection`` frames (a 4-byte big-endian length; -1 then an 8-byte length
for huge ones), so the engine side can use ``Connection.recv_bytes``/``send_bytes``.

Neither side ever blocks on the other:
- the server end lives on the event loop: non-blocking pipe transports that buffer what
  the pipe cannot take yet;
- the engine end has a receiver thread (which also stamps when each message arrived, even
  while the engine is busy in a long step); the engine loop writes to the non-blocking pipe
  itself and leaves what the pipe cannot take to a sender thread.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import queue
import select
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

CHANNEL_CLOSED = object()
"""What the engine end takes from a channel whose server end has gone."""

# A thread waiting for the GIL gets it after at most this long (Python's default is 5 ms);
# the engine's helper threads must not add that to every token's delivery.
ENGINE_SWITCH_INTERVAL_S = 0.0005


def frame(payload: bytes) -> bytes:
    if len(payload) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(payload)) + payload
    return struct.pack("!i", len(payload)) + payload


def encode(batch: list[Any]) -> bytes:
    return frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))


# ---- engine end ---------------------------------------------------------------------------


class EngineChannel:
    """One HTTP process's pipe pair at the engine end: ``send`` never waits on the server.

    ``send`` writes the frame itself when the pipe takes it at once (the usual case: a step's
    outputs are a few KiB and the server reads continuously), so a token is on its way the
    moment its step ends. Handing it to a thread instead cost a GIL hand-off, up to the
    switch interval while the engine loop runs Python. What the pipe cannot take goes to the
    sender thread, which writes it (and everything sent after it, in order) as the pipe
    drains.

    The receiver thread puts ``(index, arrival time, messages)`` into ``inbox`` (shared by
    every channel of an ``EngineChannels``), and ``(index, time, CHANNEL_CLOSED)`` once the
    server end is gone.
    """

    def __init__(self, reader: Connection, writer: Connection,
                 inbox: queue.SimpleQueue | None = None, index: int = 0) -> None:
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self.index = index
        self._reader = reader
        self._writer = writer
        self._fd = writer.fileno()
        os.set_blocking(self._fd, False)
        self._inbox = inbox if inbox is not None else queue.SimpleQueue()
        self._lock = threading.Condition()
        self._backlog = bytearray()  # for the sender thread, in order
        self._sender_busy = False  # the thread holds bytes that must go before new ones
        self._closing = False
        self._broken = False  # the server is gone: nothing more to write
        self._threads = [threading.Thread(target=self._recv_loop, name=f"engine-recv-{index}",
                                          daemon=True),
                         threading.Thread(target=self._send_loop, name=f"engine-send-{index}",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, message: Any) -> None:
        self.send_encoded(encode([message]))

    def send_encoded(self, data: bytes) -> None:
        """Sends a frame made by ``encode`` (one encoding can go to several channels)."""
        with self._lock:
            if self._broken or self._closing:
                return
            if not self._backlog and not self._sender_busy:
                data = data[self._write_some(data):]
            if data:
                self._backlog += data
                self._lock.notify()

    def _write_some(self, data: bytes) -> int:
        """Bytes of ``data`` the pipe took without waiting."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # the server is gone; nothing left to tell it
            self._broken = True
            return len(data)

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the pipes."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._threads[1].join(timeout)
        self._reader.close()

    def _recv_loop(self) -> None:
        while True:
            try:
                data = self._reader.recv_bytes()
            # close() from another thread during a blocked recv leaves the connection's
            # handle None mid-read, which multiprocessing reports as a TypeError.
            except (EOFError, OSError, TypeError):
                self._inbox.put((self.index, time.monotonic(), CHANNEL_CLOSED))
                return
            self._inbox.put((self.index, time.monotonic(), pickle.loads(data)))

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and not self._closing:
                    self._lock.wait()
                data, self._backlog = bytes(self._backlog), bytearray()
                self._sender_busy = bool(data)
                closing = self._closing and not data
            if closing:
                self._writer.close()
                return
            self._write_all(data)
            with self._lock:
                self._sender_busy = False

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._broken:
            select.select([], [self._fd], [])  # until the server has read some
            with self._lock:
                view = view[self._write_some(view):]


class EngineChannels:
    """The engine's ends of the channels of all HTTP processes (``--api-server-count``): one
    inbox for what they send, each one's messages tagged with its index."""

    def __init__(self, pipes: list[tuple[Connection, Connection]]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.channels = [EngineChannel(reader, writer, self._inbox, index)
                         for index, (reader, writer) in enumerate(pipes)]
        self.open = set(range(len(pipes)))
        """Channels whose server end has not closed yet."""

    def take(self, timeout: float | None) -> list[tuple[int, float, Any]]:
        """(channel index, arrival time, message) triples; waits up to ``timeout`` for the
        first. A channel whose server end closed gives one ``CHANNEL_CLOSED`` message.

        Raises EOFError once every server end is gone and everything they sent was taken.
        """
        if not self.open and self._inbox.empty():
            raise EOFError
        try:
            item = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return []
        out: list[tuple[int, float, Any]] = []
        while True:
            index, arrived, batch = item
            if batch is CHANNEL_CLOSED:
                self.open.discard(index)
                out.append((index, arrived, CHANNEL_CLOSED))
            else:
                out += [(index, arrived, message) for message in batch]
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return out

    def send(self, index: int, message: Any) -> None:
        self.channels[index].send(message)

    def broadcast(self, message: Any) -> None:
        data = encode([message])
        for index in self.open:
            self.channels[index].send_encoded(data)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


# ---- server end ---------------------------------------------------------------------------


class ServerChannel:
    """The HTTP process's end, on the event loop."""

    def __init__(self, read_transport: asyncio.ReadTransport,
                 write_transport: asyncio.WriteTransport) -> None:
        self._read_transport = read_transport
        self._write_transport = write_transport

    @classmethod
    async def open(cls, reader: Connection, writer: Connection,
                   on_batch: Callable[[list[Any]], None],
                   on_eof: Callable[[], None]) -> ServerChannel:
        loop = asyncio.get_running_loop()
        read_transport, _ = await loop.connect_read_pipe(
            lambda: _FrameReader(on_batch, on_eof), reader)
        write_transport, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, writer)
        return cls(read_transport, write_transport)

    def send(self, message: Any) -> None:
        if not self._write_transport.is_closing():
            self._write_transport.write(encode([message]))

    def close(self) -> None:
        self._write_transport.close()
        self._read_transport.close()


class _FrameReader(asyncio.Protocol):
    def __init__(self, on_batch: Callable[[list[Any]], None], on_eof: Callable[[], None]) -> None:
        self._on_batch = on_batch
        self._on_eof = on_eof
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        used = 0
        messages: list[Any] = []
        while (parsed := self._next_frame(used)) is not None:
            start, end = parsed
            messages += pickle.loads(self._buffer[start:end])
            used = end
        if used:
            del self._buffer[:used]
        if messages:
            # Frames that queued up while the event loop was busy are handed over as one
            # batch, so a stream that missed several steps gets one chunk, not several.
            self._on_batch(messages)

    def _next_frame(self, offset: int) -> tuple[int, int] | None:
        buffer = self._buffer
        if len(buffer) - offset < 4:
            return None
        (size,) = struct.unpack_from("!i", buffer, offset)
        start = offset + 4
        if size == -1:
            if len(buffer) - offset < 12:
                return None
            (size,) = struct.unpack_from("!Q", buffer, start)
            start += 8
        end = start + size
        return (start, end) if len(buffer) >= end else None

    def eof_received(self) -> bool:
        self._on_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()
