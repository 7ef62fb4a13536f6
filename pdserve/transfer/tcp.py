"""Block-free KV transfer between processes (or hosts) over TCP, host-staged.

A request's gathered KV buffer travels as ONE message, never page by page. Messages follow
one another on a persistent connection per (sender, receiver) pair:

    offset 0      4 bytes   magic b"PDKV"
    offset 4      4 bytes   header length H, unsigned big-endian, 1 <= H <= 64 KiB
    offset 8      H bytes   UTF-8 JSON header:
                            {"version": 2, "transfer_id": "req-42",
                             "layout": {"num_layers": 32, "num_tokens": 4096, "kv_heads": 8,
                                        "head_dim": 128, "dtype": "bfloat16"}}
    offset 8 + H            exactly ``KVLayout.num_bytes`` raw bytes: the contiguous buffer
                            ``[num_layers, 2, num_tokens, kv_heads, head_dim]`` (K at index 0,
                            V at 1) in the hosts' native byte order (little-endian on every
                            host torch supports for serving)
    then          8 bytes   XXH3-64 digest of the raw bytes, unsigned big-endian

dtype is one of float32, float16, bfloat16; every size is a positive integer.

The digest is checked on receipt: a buffer whose bytes changed on the way (a faulty NIC or
switch, a bug in a proxy) is dropped and counted (``TransferStats.num_corrupt``), never
handed to the engine, so no token is ever computed from wrong KV; its id is reported
(``take_dropped``) so the decode engine fails the waiting request at once. The connection
stays up: the framing does not depend on the bytes.

The receiver allocates the CPU tensor from the header and ``recv_into``s the payload straight
into its memory: a long prompt's KV is hundreds of MB, so no intermediate ``bytes`` exist on
either side. A message that fails validation closes its connection (a byte stream cannot be
resynchronised after a bad header); the receiver keeps serving every other connection.

Speed (measured on loopback, see ``benchmarks/bench_kv_transfer.py``): the kernel copies
the bytes once on each side and Python adds no copy, so what was left to lose is page
faults. A fresh buffer of hundreds of MB, faulted in page by page while ``recv_into`` fills
it, cost as much as the copy itself; large receive buffers therefore come from
``kv_blocks.host_empty``, which reuses the memory of buffers already freed. ``recv_into``
fills the whole remaining buffer per call (a few dozen calls for 128 MiB). The sender
writes a CPU buffer from a memoryview of its own memory; a CUDA buffer is staged in pinned
host memory in ``STAGE_CHUNK_BYTES`` pieces, each sent as soon as its device-to-host copy
has landed, so the copy of one piece overlaps the send of the one before. A receiver made
with a CUDA ``device`` reads into two pinned chunks in turn and copies each to the device
buffer while the next is read. Socket buffers are left to the kernel's autotuning: setting
SO_SNDBUF / SO_RCVBUF caps them at ``net.core.[rw]mem_max`` and was no faster.

There is no acknowledgement on the wire: ``send`` returns once the kernel has taken every
byte. Delivery is confirmed by the application (the decode side polls for the id and reports
the request), and an untaken buffer is dropped after ``ttl_s`` so an aborted request cannot
leak receiver memory.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from pdserve.transfer.kv_blocks import host_empty
from pdserve.transfer.transport import KVLayout, SendQueue, TransferStats

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 2
PREFIX = struct.Struct(">4sI")
DIGEST = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 * 1024
# A sanity bound, not a memory budget: 128k tokens of a 70B model (80 layers, 8 KV heads,
# head_dim 128, bf16) are 40 GiB. CPU pages are only touched as bytes arrive, so a lying
# header cannot take more memory than the peer actually sends.
MAX_BUFFER_BYTES = 1 << 37
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
LAYOUT_FIELDS = ("num_layers", "num_tokens", "kv_heads", "head_dim")
# Device <-> host staging piece: big enough that a piece costs one or two syscalls, small
# enough that the first piece is on the wire while the rest is still being copied.
STAGE_CHUNK_BYTES = 16 << 20

OnDone = Callable[[BaseException | None], None]


class ProtocolError(ValueError):
    """A peer sent something that is not a PDKV message; its connection gets closed."""


# --- wire format --------------------------------------------------------------------------


def layout_of(buffer: torch.Tensor) -> KVLayout:
    """The layout of a buffer this transport can carry; ValueError for anything else."""
    if buffer.dim() != 5 or buffer.shape[1] != 2:
        raise ValueError(f"a KV buffer is [layers, 2, tokens, heads, dim], not "
                         f"{tuple(buffer.shape)}")
    if buffer.dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot send {buffer.dtype}; choose from {', '.join(DTYPES)}")
    if buffer.numel() == 0:
        raise ValueError(f"empty KV buffer {tuple(buffer.shape)}")
    return KVLayout.of(buffer)


def encode_header(transfer_id: str, layout: KVLayout) -> bytes:
    """The 8-byte prefix and the JSON header that precede a buffer's bytes."""
    if not isinstance(transfer_id, str):
        raise TypeError(f"transfer_id must be a str, not {type(transfer_id).__name__}")
    fields: dict[str, Any] = {name: getattr(layout, name) for name in LAYOUT_FIELDS}
    fields["dtype"] = DTYPE_NAMES[layout.dtype]
    header = json.dumps({"version": VERSION, "transfer_id": transfer_id,
                         "layout": fields}).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"transfer id too long ({len(transfer_id)} characters)")
    return PREFIX.pack(MAGIC, len(header)) + header


def header_length(prefix: bytes | bytearray) -> int:
    magic, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {length} outside 1..{MAX_HEADER_BYTES}")
    return length


def decode_header(raw: bytes | bytearray) -> tuple[str, KVLayout]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise ProtocolError(f"unsupported header {header!r:.200}")
    transfer_id = header.get("transfer_id")
    if not isinstance(transfer_id, str):
        raise ProtocolError(f"transfer_id is not a string: {transfer_id!r:.200}")
    return transfer_id, layout_from_json(header.get("layout"))


def layout_from_json(fields: Any) -> KVLayout:
    dtype = fields.get("dtype") if isinstance(fields, dict) else None
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"bad layout or dtype: {fields!r:.200}")
    sizes = [fields.get(name) for name in LAYOUT_FIELDS]
    # bool is an int subclass; JSON true is not a size.
    if not all(type(size) is int and size > 0 for size in sizes):
        raise ProtocolError(f"layout sizes must be positive integers: {fields!r:.200}")
    layout = KVLayout(*sizes, DTYPES[dtype])
    if layout.num_bytes > MAX_BUFFER_BYTES:
        raise ProtocolError(f"buffer of {layout.num_bytes} bytes exceeds {MAX_BUFFER_BYTES}")
    return layout


def byte_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared, not copied (bf16 included: numpy has no
    bf16, but it has uint8)."""
    # reshape would silently copy a strided tensor, and recv_into would fill the copy.
    if not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy())


def recv_exactly(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fills ``view`` from ``sock``. False on a clean end of stream before the first byte
    when ``eof_ok``; ConnectionError on any other short read."""
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if count == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"stream ended after {got} of {len(view)} bytes")
        got += count
    return True


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as a socket address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- receiver -----------------------------------------------------------------------------


class TcpKVReceiver:
    """Listens for KV buffers; a background thread accepts connections (each may carry many
    buffers, one after another) and a thread per connection reads them.

    Buffers are CPU tensors by default. With a CUDA ``device`` they are device tensors,
    received through pinned staging chunks (the device buffer is allocated whole when the
    header arrives) and complete when handed over."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 120.0,
                 device: str | torch.device = "cpu", links: Any = None) -> None:
        self.host, self.port, self.ttl_s = host, port, ttl_s
        # ``links.LinkServer``: connections that open with a hello get a device transport.
        self.links = links
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"a KV receiver delivers to cpu or cuda, not {self.device}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"KV receiver for {self.device}: CUDA is not available")
        self.stats = TransferStats()
        self._cond = threading.Condition()  # guards the four dicts, _closed and stats
        self._arrived: dict[str, tuple[torch.Tensor, float]] = {}  # id -> (buffer, arrival)
        self._discarded: dict[str, float] = {}  # ids to drop on arrival -> when discarded
        self._dropped: dict[str, float] = {}  # ids whose buffer failed its checksum -> when
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._listener: socket.socket | None = None
        self._address: str | None = None
        self._wake_reader: socket.socket | None = None
        self._wake_writer: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None

    def start(self) -> TcpKVReceiver:
        """Binds and starts accepting; calling it again does nothing."""
        if self._closed:
            raise RuntimeError("receiver is closed")
        if self._listener is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._listener = socket.create_server((self.host, self.port), family=family)
            self._address = join_address(*self._listener.getsockname()[:2])
            self._wake_reader, self._wake_writer = socket.socketpair()
            self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                                   name=f"pdkv-accept-{self.address}")
            self._accept_thread.start()
        return self

    @property
    def address(self) -> str:
        """``host:port`` actually bound (the real port when 0 was asked for)."""
        if self._address is None:
            raise RuntimeError("receiver not started")
        return self._address

    def poll(self, transfer_id: str) -> torch.Tensor | None:
        """The buffer if it has fully arrived (it is handed over, not kept), else None."""
        with self._cond:
            self._expire(time.monotonic())
            entry = self._arrived.pop(transfer_id, None)
        return None if entry is None else entry[0]

    def recv(self, transfer_id: str, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire(time.monotonic())
                entry = self._arrived.pop(transfer_id, None)
                if entry is not None:
                    return entry[0]
                if self._closed:
                    raise RuntimeError(f"receiver closed while waiting for {transfer_id!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"KV buffer {transfer_id!r} did not arrive within "
                                       f"{timeout} s")
                self._cond.wait(left)

    def discard(self, transfer_id: str) -> None:
        """Drops the buffer now, or on arrival if it is still on its way (or never sent: the
        mark itself expires after ``ttl_s``)."""
        with self._cond:
            now = time.monotonic()
            self._expire(now)
            if self._arrived.pop(transfer_id, None) is None:
                self._discarded[transfer_id] = now

    def take_dropped(self, transfer_id: str) -> bool:
        """True (once) if a buffer sent under ``transfer_id`` was dropped because its bytes
        failed the checksum: its waiter can fail at once instead of at its timeout."""
        with self._cond:
            self._expire(time.monotonic())
            return self._dropped.pop(transfer_id, None) is not None

    def pending(self) -> int:
        """Buffers arrived and not yet taken."""
        with self._cond:
            self._expire(time.monotonic())
            return len(self._arrived)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._arrived.clear()
            self._discarded.clear()
            self._dropped.clear()
            self._cond.notify_all()
        self._stop_accepting()
        with self._cond:
            connections = list(self._connections.items())
        for conn, thread in connections:
            _shutdown(conn)  # wakes the thread blocked in recv_into
            thread.join(timeout=1.0)

    def __enter__(self) -> TcpKVReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _expire(self, now: float) -> None:
        """Drops buffers nobody took and discard marks nobody needed; caller holds _cond."""
        cutoff = now - self.ttl_s
        for transfer_id in [t for t, (_, at) in self._arrived.items() if at < cutoff]:
            del self._arrived[transfer_id]
            logger.warning("dropped KV buffer %r: not taken within %s s", transfer_id,
                           self.ttl_s)
        for marks in (self._discarded, self._dropped):
            for transfer_id in [t for t, at in marks.items() if at < cutoff]:
                del marks[transfer_id]

    def _stop_accepting(self) -> None:
        if self._listener is None:
            return
        assert self._wake_writer is not None and self._accept_thread is not None
        self._wake_writer.send(b"x")
        self._accept_thread.join()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            assert sock is not None
            sock.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake_reader is not None
        # A selector, not select.select: the engine process may hold fds above FD_SETSIZE.
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while not any(key.fileobj is self._wake_reader for key, _ in selector.select()):
                self._accept_one()

    def _accept_one(self) -> None:
        assert self._listener is not None
        try:
            conn, peer = self._listener.accept()
        except OSError as exc:
            logger.warning("KV receiver %s cannot accept: %s", self.address, exc)
            time.sleep(0.05)  # e.g. out of fds: the listener stays readable, don't spin
            return
        with self._cond:
            if self._closed:
                conn.close()
                return
            thread = threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                                      name=f"pdkv-conn-{peer}")
            self._connections[conn] = thread
        thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            if self.links is not None and self.links.takes_over(conn, self):
                return
            staging = _DeviceStaging(self.device) if self.device.type == "cuda" else None
            while self._read_message(conn, staging):
                pass
        except ProtocolError as exc:
            logger.warning("closing KV connection from %s: %s", peer, exc)
        except OSError as exc:
            if not self._closed:
                logger.warning("KV connection from %s broke: %s", peer, exc)
        except Exception:
            logger.exception("KV connection from %s failed", peer)
        finally:
            with self._cond:
                self._connections.pop(conn, None)
            conn.close()

    def _read_message(self, conn: socket.socket, staging: _DeviceStaging | None) -> bool:
        """Reads one buffer into place; False at a clean end of stream."""
        header = read_header(conn)
        if header is None:
            return False
        transfer_id, layout = header
        if staging is None:
            buffer = _allocate(layout)
            view = byte_view(buffer)
            recv_exactly(conn, view)  # one recv_into per burst the kernel has
            digest = xxhash.xxh3_64_intdigest(view)
        else:
            buffer, digest = staging.receive(conn, layout)
        sent = bytearray(DIGEST.size)
        recv_exactly(conn, memoryview(sent))
        if DIGEST.unpack(sent)[0] != digest:
            self.drop_corrupt(transfer_id)
        else:
            self.deliver(transfer_id, buffer)
        return True

    def drop_corrupt(self, transfer_id: str) -> None:
        """A buffer whose bytes failed their checksum: counted, reported, never handed on."""
        logger.error("dropped KV buffer %r: its bytes do not match the sender's checksum",
                     transfer_id)
        with self._cond:
            self.stats.num_corrupt += 1
            if not self._closed and self._discarded.pop(transfer_id, None) is None:
                self._dropped[transfer_id] = time.monotonic()
            self._cond.notify_all()

    def deliver(self, transfer_id: str, buffer: torch.Tensor) -> None:
        """Hands a complete buffer to whoever polls for ``transfer_id`` (any transport)."""
        now = time.monotonic()
        with self._cond:
            self._expire(now)
            self.stats.num_transfers += 1
            self.stats.num_bytes += buffer.numel() * buffer.element_size()
            if self._closed or self._discarded.pop(transfer_id, None) is not None:
                return
            if transfer_id in self._arrived:
                logger.warning("KV buffer %r arrived again before it was taken; keeping the "
                               "newer one", transfer_id)
            self._arrived[transfer_id] = (buffer, now)
            self._cond.notify_all()


def read_header(conn: socket.socket) -> tuple[str, KVLayout] | None:
    """The prefix and header of one message: (transfer id, layout); None at a clean end of
    stream before the message."""
    prefix = bytearray(PREFIX.size)
    if not recv_exactly(conn, memoryview(prefix), eof_ok=True):
        return None
    raw = bytearray(header_length(prefix))
    recv_exactly(conn, memoryview(raw))
    return decode_header(raw)


def _shape(layout: KVLayout) -> tuple[int, ...]:
    return (layout.num_layers, 2, layout.num_tokens, layout.kv_heads, layout.head_dim)


def _allocate(layout: KVLayout) -> torch.Tensor:
    try:
        return host_empty(_shape(layout), layout.dtype)
    except (RuntimeError, OSError) as exc:  # torch.empty raises the one, mmap the other
        raise ProtocolError(f"cannot allocate {layout.num_bytes} bytes: {exc}") from None


class _DeviceStaging:
    """A CUDA receiver's per-connection staging: two pinned chunks filled from the socket in
    turn; each is copied to the device on a side stream while the other one fills."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream()
            self.chunks = [torch.empty(STAGE_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                           for _ in range(2)]
            self.copied = [torch.cuda.Event() for _ in range(2)]

    def receive(self, conn: socket.socket, layout: KVLayout) -> tuple[torch.Tensor, int]:
        """The device buffer and the XXH3-64 digest of the bytes read into it."""
        hasher = xxhash.xxh3_64()
        with torch.cuda.device(self.device):
            try:
                buffer = torch.empty(_shape(layout), dtype=layout.dtype, device=self.device)
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError included
                raise ProtocolError(f"cannot allocate {layout.num_bytes} bytes on "
                                    f"{self.device}: {exc}") from None
            # The memory may have been freed by work still queued on the current stream;
            # and if the stream breaks mid-buffer, it must not be reused under our copies.
            self.stream.wait_stream(torch.cuda.current_stream())
            buffer.record_stream(self.stream)
            flat = buffer.view(-1).view(torch.uint8)
            for index, (start, end) in enumerate(_pieces(flat.numel())):
                chunk, copied = self.chunks[index % 2][: end - start], self.copied[index % 2]
                copied.synchronize()  # this chunk's previous copy to the device has finished
                recv_exactly(conn, byte_view(chunk))
                hasher.update(byte_view(chunk))
                with torch.cuda.stream(self.stream):
                    flat[start:end].copy_(chunk, non_blocking=True)
                copied.record(self.stream)
            self.stream.synchronize()  # handed over complete: any stream may read it
        return buffer, hasher.intdigest()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its own thread


# --- sender -------------------------------------------------------------------------------


@dataclass
class _Job:
    address: str
    transfer_id: str
    header: bytes
    host: torch.Tensor
    # For a device buffer still being copied: (end byte, torch.cuda.Event) per staged piece,
    # in order; the bytes before ``end`` are valid once its event has completed. Else empty.
    copied: list[tuple[int, Any]]
    on_done: OnDone | None


class TcpKVSender:
    """Sends buffers; one persistent connection per destination address, reconnects once on
    a broken connection; thread-safe (sends to one address are serialised on its
    connection, sends to different addresses run in parallel)."""

    def __init__(self, connect_timeout_s: float = 5.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.stats = TransferStats()
        self._lock = threading.Lock()  # guards the dicts below and stats
        self._connections: dict[str, socket.socket] = {}
        self._address_locks: dict[str, threading.Lock] = {}
        self._queue = SendQueue(self._drain_one, "pdkv-sender")

    def send(self, address: str, transfer_id: str, buffer: torch.Tensor) -> None:
        """Blocks until every byte is handed to the kernel. ConnectionError (naming the
        address) when it cannot be delivered; ValueError for a buffer it cannot carry."""
        self._deliver(self._job(address, transfer_id, buffer, None))

    def send_async(self, address: str, transfer_id: str, buffer: torch.Tensor,
                   on_done: OnDone | None = None) -> None:
        """Queues the send to one background thread (FIFO) and returns at once; ``on_done``
        gets None or the error, on that thread. A CPU buffer is sent in place: don't write
        to it before ``on_done``. A CUDA buffer's host copy is queued on the current stream,
        so the caller does not wait for it either. Bad arguments raise here."""
        self._queue.put(self._job(address, transfer_id, buffer, on_done))

    def close(self) -> None:
        """Finishes queued sends, then closes every connection; idempotent."""
        if not self._queue.close():
            return
        with self._lock:
            for sock in self._connections.values():
                sock.close()
            self._connections.clear()

    def __enter__(self) -> TcpKVSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _job(self, address: str, transfer_id: str, buffer: torch.Tensor,
             on_done: OnDone | None) -> _Job:
        split_address(address)  # a malformed address is the caller's bug: raise it now
        header = encode_header(transfer_id, layout_of(buffer))
        host, copied = _stage_on_host(buffer)
        return _Job(address, transfer_id, header, host, copied, on_done)

    def _drain_one(self, job: _Job) -> None:
        error: BaseException | None = None
        try:
            self._deliver(job)
        except Exception as exc:
            error = exc
        report_done(job.on_done, error, job.transfer_id)

    def _deliver(self, job: _Job) -> None:
        if self._queue.closed and not self._queue.on_own_thread():
            raise RuntimeError("sender is closed")
        payload = byte_view(job.host)
        with self._address_lock(job.address):
            try:
                self._write_with_retry(job.address, job.header, payload, job.copied)
            except OSError as exc:
                raise ConnectionError(f"cannot send KV buffer {job.transfer_id!r} to "
                                      f"{job.address}: {exc}") from exc
        with self._lock:
            self.stats.num_transfers += 1
            self.stats.num_bytes += len(payload)

    def _write_with_retry(self, address: str, header: bytes, payload: memoryview,
                          copied: list[tuple[int, Any]]) -> None:
        """Caller holds the address lock. A cached connection may have died since its last
        use (the receiver restarted): that failure earns one fresh connection."""
        for attempt in (0, 1):
            sock, reused = self._connection(address)
            try:
                sock.sendall(header)
                _send_payload(sock, payload, copied)
                return
            except BaseException as exc:
                # Whatever cut the message short (a socket error, a failed device copy
                # between pieces), the next one on this connection would be read as the
                # rest of its bytes: the connection goes. Only a cached one's socket error
                # earns a retry.
                self._forget(address)
                if not isinstance(exc, OSError) or not reused or attempt == 1:
                    raise

    def _connection(self, address: str) -> tuple[socket.socket, bool]:
        """(socket, whether it was cached); caller holds the address lock."""
        with self._lock:
            sock = self._connections.get(address)
        if sock is not None and not _peer_closed(sock):
            return sock, True
        if sock is not None:
            self._forget(address)
        sock = socket.create_connection(split_address(address), timeout=self.connect_timeout_s)
        sock.settimeout(None)
        # The header is a small write followed by the payload: Nagle would hold back the
        # payload's last partial segment for a delayed ACK (~40 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lock:
            self._connections[address] = sock
        return sock, False

    def _forget(self, address: str) -> None:
        with self._lock:
            sock = self._connections.pop(address, None)
        if sock is not None:
            sock.close()

    def _address_lock(self, address: str) -> threading.Lock:
        with self._lock:
            return self._address_locks.setdefault(address, threading.Lock())


def report_done(on_done: OnDone | None, error: BaseException | None, transfer_id: str) -> None:
    """Tells a send's caller how it ended (on the sending thread); a failure nobody asked
    about is logged."""
    if on_done is None:
        if error is not None:
            logger.warning("async KV send %r failed: %s", transfer_id, error)
        return
    try:
        on_done(error)
    except Exception:
        logger.exception("on_done of KV transfer %r raised", transfer_id)


def _pieces(num_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte ranges of ``STAGE_CHUNK_BYTES`` covering ``num_bytes``."""
    for start in range(0, num_bytes, STAGE_CHUNK_BYTES):
        yield start, min(start + STAGE_CHUNK_BYTES, num_bytes)


def _send_payload(sock: socket.socket, payload: memoryview,
                  copied: list[tuple[int, Any]]) -> None:
    """Writes the payload from its own memory (no copy in Python): a CPU buffer in one
    ``sendall``; a staged device buffer piece by piece, each once its copy has landed. Its
    digest follows."""
    hasher = xxhash.xxh3_64()
    start = 0
    for end, event in copied:
        event.synchronize()
        hasher.update(payload[start:end])
        sock.sendall(payload[start:end])
        start = end
    if start < len(payload):
        hasher.update(payload[start:])
        sock.sendall(payload[start:])
    sock.sendall(DIGEST.pack(hasher.intdigest()))


def _stage_on_host(buffer: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, Any]]]:
    """A contiguous CPU tensor with the buffer's bytes, plus (end byte, CUDA event) per
    piece still being copied into it (empty when the bytes are already valid)."""
    buffer = buffer.detach()
    if not buffer.is_cuda:
        return buffer.to("cpu").contiguous(), []
    with torch.cuda.device(buffer.device):
        # Pinned, the copies are queued behind the gather on the current stream and the
        # caller moves on; the sending thread waits on each piece's event and sends it
        # while the next piece is still being copied.
        source = buffer.contiguous().view(-1).view(torch.uint8)
        host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
        flat = host.view(-1).view(torch.uint8)
        copied = []
        for start, end in _pieces(flat.numel()):
            flat[start:end].copy_(source[start:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            copied.append((end, event))
    return host, copied


def _peer_closed(sock: socket.socket) -> bool:
    """True when a cached connection is dead. The receiver never writes, so anything
    readable (end of stream, an error, stray bytes) means the connection is unusable; a
    write to a peer that already closed could otherwise 'succeed' into the kernel buffer."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True
