"""The few stream and event operations the multiplex loop needs, behind one small interface.

``CudaStreamOps`` issues work asynchronously and tracks it with CUDA events; a stream of
``None`` means the current stream (emulated partitions on a GPU). ``SyncStreamOps`` is the
CPU: work runs when it is issued, so every event is already complete. Tests swap in fakes
that complete only when told, to check the ordering rules without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StreamOps(Protocol):
    def on(self, stream: Any) -> contextlib.AbstractContextManager: ...

    def record(self, stream: Any) -> Event: ...

    def wait(self, stream: Any, event: Event) -> None: ...

    def keep_alive(self, tensors: Iterable[torch.Tensor], stream: Any) -> None: ...

    def timed_record(self, stream: Any) -> Any | None: ...

    def host_buffer(self, size: int, dtype: torch.dtype) -> torch.Tensor: ...


class DoneEvent:
    """Work issued synchronously: complete the moment it is recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SyncStreamOps:
    """CPU: no streams, no events to wait for; the same calls, so the same code path runs."""

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Event:
        return DoneEvent()

    def timed_record(self, stream: Any) -> Any | None:
        return None  # no device clock: launches are timed on the host

    def wait(self, stream: Any, event: Event) -> None:
        return None

    def keep_alive(self, tensors: Iterable[torch.Tensor], stream: Any) -> None:
        return None

    def host_buffer(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype)


class CudaStreamOps:
    def __init__(self, device: torch.device):
        self.device = device

    def _stream(self, stream: Any) -> torch.cuda.Stream:
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, stream: Any) -> Event:
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return event

    def timed_record(self, stream: Any) -> torch.cuda.Event:
        """An event that can time the work between it and another such event."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream(stream))
        return event

    def wait(self, stream: Any, event: Event) -> None:
        if not isinstance(event, DoneEvent):
            self._stream(stream).wait_event(event)

    def keep_alive(self, tensors: Iterable[torch.Tensor], stream: Any) -> None:
        # The caching allocator is per stream: a tensor made on one stream and used on
        # another must be marked, or its memory is handed out again under a running kernel.
        target = self._stream(stream)
        for tensor in tensors:
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(target)

    def host_buffer(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, pin_memory=True)


def make_stream_ops(device: torch.device) -> StreamOps:
    return CudaStreamOps(device) if device.type == "cuda" else SyncStreamOps()


def same_stream(a: Any, b: Any) -> bool:
    return a is b or (a is not None and b is not None and a == b)
