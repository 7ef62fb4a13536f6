"""Moving a gathered KV buffer from the prefill side to the decode side.

``KVTransport`` is the seam within one process: the engine gathers, calls ``send``, and the
receiver calls ``recv`` and scatters. ``LocalTransport`` hands the tensor over (the one-GPU
disaggregation baseline). Between instances, ``links.KVSender`` sends each buffer over the
transport agreed with its receiver, whose one TCP port (``tcp.TcpKVReceiver``) serves them
all:

- CUDA IPC (same host, ``ipc.py``): the receiver maps the sender's buffer by its IPC handle,
  copies it to its own GPU and acknowledges, after which the sender frees the buffer.
- torch.distributed point-to-point (``p2p.py``): NCCL between GPUs, gloo between CPUs; the
  buffer is one contiguous tensor, so one send on the link.
- TCP (``tcp.py``): pinned host copy, the layout header, the raw bytes, their digest.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class KVLayout:
    """What a receiver needs to allocate a buffer before the bytes arrive."""

    num_layers: int
    num_tokens: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, buffer: torch.Tensor) -> KVLayout:
        layers, _, tokens, heads, dim = buffer.shape
        return cls(layers, tokens, heads, dim, buffer.dtype)

    @property
    def num_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_tokens * self.kv_heads * self.head_dim * element


class KVTransport(Protocol):
    def send(self, request_id: str, buffer: torch.Tensor, stream: Any = None) -> None:
        """Ships ``buffer``; work that wrote it was issued on ``stream`` (None: current)."""

    def recv(self, request_id: str, stream: Any = None) -> torch.Tensor:
        """The buffer sent for ``request_id``, safe to read on ``stream`` (None: current)."""


@dataclass
class TransferStats:
    num_transfers: int = 0
    num_bytes: int = 0
    num_corrupt: int = 0
    """Buffers dropped on receipt because their checksum did not match (TCP only)."""


class LocalTransport:
    """Same process: the tensor itself changes hands.

    On CUDA, ``send`` records an event on the sender's stream and ``recv`` makes the
    receiver's stream wait on it, so the scatter never reads a buffer the gather is still
    writing; the buffer is also marked for the receiver's stream, since the caching
    allocator would otherwise reuse its memory once the sender's stream moves on.
    """

    def __init__(self) -> None:
        self._boxes: dict[str, tuple[torch.Tensor, Any]] = {}
        self.stats = TransferStats()

    def send(self, request_id: str, buffer: torch.Tensor, stream: Any = None) -> None:
        if request_id in self._boxes:
            raise KeyError(f"a KV buffer for {request_id!r} is already in transit")
        event = None
        if buffer.is_cuda:
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream())
        self._boxes[request_id] = (buffer, event)
        self.stats.num_transfers += 1
        self.stats.num_bytes += buffer.numel() * buffer.element_size()

    def recv(self, request_id: str, stream: Any = None) -> torch.Tensor:
        buffer, event = self._boxes.pop(request_id)
        if event is not None:
            target = stream if stream is not None else torch.cuda.current_stream()
            target.wait_event(event)
            buffer.record_stream(target)
        return buffer

    def discard(self, request_id: str) -> None:
        """Drops a buffer nobody will receive (the request was aborted in transit)."""
        self._boxes.pop(request_id, None)

    def pending(self) -> int:
        return len(self._boxes)


class SendQueue:
    """One background thread that runs queued jobs in FIFO order (a sender's sends);
    started by the first job, and ``close`` lets it finish what was queued."""

    _STOP = object()

    def __init__(self, run: Callable[[Any], None], name: str) -> None:
        self._run, self._name = run, name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closed = False

    def put(self, job: Any) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("sender is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=self._name)
                self._thread.start()
        self._jobs.put(job)

    def close(self) -> bool:
        """Waits for the queued jobs (unless called from one); False if already closed."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(self._STOP)
            if thread is not threading.current_thread():  # close() from an on_done
                thread.join()
        return True

    def on_own_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not self._STOP:
            self._run(job)


TRANSPORTS: dict[str, Callable[[], KVTransport]] = {"local": LocalTransport}


def make_transport(name: str = "local") -> KVTransport:
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; choose from "
                         f"{', '.join(TRANSPORTS)}") from None
