"""The engine's end of the channel on real OS pipes: ``send`` never waits on the server, and
what the pipe could not take at once still arrives whole and in order."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading

from pdserve.server.channel import EngineChannel


def _pipes():
    ctx = mp.get_context("spawn")
    to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
    from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
    return EngineChannel(to_engine_r, from_engine_w), to_engine_w, from_engine_r


def test_sends_past_a_full_pipe_return_and_arrive_in_order():
    channel, to_engine, from_engine = _pipes()
    payload = "x" * 10_000  # 40 of these are several times what a pipe buffers
    sent = threading.Thread(target=lambda: [channel.send((i, payload)) for i in range(40)])
    sent.start()
    sent.join(60)  # nobody reads yet: a send that waited on the reader would hang here
    assert not sent.is_alive()
    received = [pickle.loads(from_engine.recv_bytes()) for _ in range(40)]
    assert received == [[(i, payload)] for i in range(40)]
    channel.close()
    to_engine.close()


def test_close_sends_what_is_queued_then_ends_the_stream():
    channel, to_engine, from_engine = _pipes()
    for i in range(30):
        channel.send(("m", i, "y" * 5_000))
    closer = threading.Thread(target=channel.close)
    closer.start()
    received = []
    try:
        while True:
            received += pickle.loads(from_engine.recv_bytes())
    except EOFError:
        pass
    closer.join(60)
    assert [m[1] for m in received] == list(range(30))
    to_engine.close()


def test_a_gone_server_makes_sends_no_ops():
    channel, to_engine, from_engine = _pipes()
    from_engine.close()
    channel.send("lost")  # EPIPE is swallowed: nobody is left to tell
    channel.send("lost too")
    channel.close()
    to_engine.close()
