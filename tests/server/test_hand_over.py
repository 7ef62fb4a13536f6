"""The engine client hands a step's deltas to the streams' writers a few streams per
event-loop callback: every stream still gets its deltas in order (merged when it fell
behind), and a socket that became readable is served between two such callbacks, not after
the whole step's writes."""

from __future__ import annotations

import asyncio
import socket

from pdserve.messages import RequestUpdate, StepOutputs
from pdserve.server.client import STREAMS_PER_CALLBACK, EngineClient, RequestStream

STREAMS = 3 * STREAMS_PER_CALLBACK + 5


def _client_with_listeners(log: list) -> EngineClient:
    client = EngineClient(None)
    for i in range(STREAMS):
        stream = RequestStream(f"r{i}", 0.0)
        stream.listener = lambda items, i=i: log.append(
            (i, [token for delta, _ in items for token in delta.new_token_ids]))
        client._streams[stream.request_id] = stream
    return client


def _step(token: int, streams: range = range(STREAMS)) -> StepOutputs:
    return StepOutputs([RequestUpdate(f"r{i}", [token], None, False, None, 1, 0)
                        for i in streams], float(token))


async def _until_handed(client: EngineClient) -> None:
    while client._handing_scheduled:
        await asyncio.sleep(0)


def test_each_stream_gets_its_deltas_in_order_and_merged():
    async def main() -> tuple[list, int]:
        log: list = []
        client = _client_with_listeners(log)
        client._on_batch([_step(1)])
        client._on_batch([_step(2)])  # before any hand-over ran: one chunk with both
        await _until_handed(client)
        client._on_batch([_step(3)])
        await asyncio.sleep(0)  # only the first few streams have their token 3 ...
        handed = len(log)
        # ... when the next step comes, its streams in another order
        client._on_batch([_step(4, range(STREAMS - 1, -1, -1))])
        await _until_handed(client)
        return log, handed

    log, handed_before_step_4 = asyncio.run(main())
    assert handed_before_step_4 == STREAMS + STREAMS_PER_CALLBACK
    per_stream: dict[int, list[list[int]]] = {}
    for stream, tokens in log:
        per_stream.setdefault(stream, []).append(tokens)
    assert per_stream == {i: [[1, 2], [3], [4]] for i in range(STREAMS)}


def test_a_readable_socket_is_served_between_hand_over_callbacks():
    async def main() -> tuple[list, int]:
        log: list = []
        client = _client_with_listeners(log)
        reader, writer = socket.socketpair()
        read_at: list[int] = []
        loop = asyncio.get_running_loop()
        loop.add_reader(reader, lambda: (read_at.append(len(log)), reader.recv(1)))
        writer.send(b"x")  # a new request's bytes, readable before the step is handed over
        try:
            client._on_batch([_step(1)])
            await _until_handed(client)
            await asyncio.sleep(0)
        finally:
            loop.remove_reader(reader)
            reader.close()
            writer.close()
        return log, read_at[0]

    log, read_after = asyncio.run(main())
    assert len(log) == STREAMS
    assert read_after <= STREAMS_PER_CALLBACK  # not behind all the step's writes
