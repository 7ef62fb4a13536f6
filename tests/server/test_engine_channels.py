"""The engine loop with two channels on real OS pipes, in this process, around a core that
steps only when the test lets it: each channel gets its own requests' deltas and its own
answers, every channel the stats, and a channel's end aborts only its requests."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

from pdserve.messages import (
    AddRequest,
    DescribeQuery,
    DescribeReply,
    EngineStats,
    RequestUpdate,
    Shutdown,
    StepOutputs,
)
from pdserve.sampling_params import SamplingParams
from pdserve.server.channel import EngineChannels
from pdserve.server.client import channel_pipes
from pdserve.server.engine_process import EngineLoop

DEADLINE_S = 30


class GatedCore:
    """A request gives one token a step and never finishes; a step runs only when allowed."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps_allowed = threading.Semaphore(0)
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt: list[int], params: Any,
                    arrival_time: float) -> None:
        with self._lock:
            self.live[request_id] = 0

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
            self.live.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestUpdate]:
        if not self.steps_allowed.acquire(timeout=0.05):
            return []
        with self._lock:
            for request_id in self.live:
                self.live[request_id] += 1
            return [RequestUpdate(rid, [n], None, False, None, 1, 0)
                    for rid, n in self.live.items()]

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.live))

    def describe(self) -> dict:
        return {"schedule": "gated"}


class ServerEnd:
    """One HTTP process's end of a channel, read and written by the test."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.seen: list[Any] = []

    def send(self, message: Any) -> None:
        self.writer.send_bytes(pickle.dumps([message]))

    def next_of(self, kind: type) -> Any:
        while True:
            assert self.reader.poll(DEADLINE_S), f"no {kind.__name__} came"
            for message in pickle.loads(self.reader.recv_bytes()):
                self.seen.append(message)
                if isinstance(message, kind):
                    return message


def _channels(count: int) -> tuple[EngineChannels, list[ServerEnd]]:
    engine_ends, server_ends = channel_pipes(count)
    return EngineChannels(engine_ends), [ServerEnd(*ends) for ends in server_ends]


def _until(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _add(end: ServerEnd, request_id: str) -> None:
    end.send(AddRequest(request_id, [1, 2], SamplingParams(max_tokens=8), time.monotonic()))


def _ids(step: StepOutputs) -> list[str]:
    return sorted(update.request_id for update in step.deltas)


def test_each_channel_gets_its_own_and_a_closed_one_aborts_only_its_requests():
    core = GatedCore()
    channels, (first, second) = _channels(2)
    loop = EngineLoop(core, channels)
    runner = threading.Thread(target=loop.run)
    runner.start()
    _add(first, "a")
    _add(second, "b")
    _add(second, "c")
    _until(lambda: len(core.live) == 3)
    core.steps_allowed.release()
    assert _ids(first.next_of(StepOutputs)) == ["a"]
    assert _ids(second.next_of(StepOutputs)) == ["b", "c"]
    assert first.next_of(EngineStats) and second.next_of(EngineStats)  # stats go to both

    second.send(DescribeQuery(7))
    assert second.next_of(DescribeReply).info == {"schedule": "gated"}

    second.writer.close()  # the second HTTP process is gone
    _until(lambda: sorted(core.aborted) == ["b", "c"])
    assert list(core.live) == ["a"]
    core.steps_allowed.release()  # the engine goes on with the first process's request
    step = first.next_of(StepOutputs)
    assert _ids(step) == ["a"] and step.deltas[0].new_token_ids == [2]

    first.send(Shutdown())
    runner.join(DEADLINE_S)
    assert not runner.is_alive()
    channels.close()
    assert not any(isinstance(m, DescribeReply) for m in first.seen)  # the asker's alone
