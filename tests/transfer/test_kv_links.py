"""Choosing the KV transport per pair of instances, and the device transports: p2p over
torch.distributed (gloo between two real processes here; NCCL and CUDA IPC on GPUs)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pdserve.transfer import tcp
from pdserve.transfer.links import (
    Endpoint,
    KVSender,
    LinkError,
    LinkServer,
    choose,
    local_endpoint,
    refusals,
)
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender

WAIT_S = 30.0
CPU = dict(device="cpu", host="h1", p2p=True)
GPU0 = dict(device="cuda", host="h1", gpu="GPU-a", visible_gpus={"GPU-a": 0, "GPU-b": 1},
            p2p=True)


def _random_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).reshape(shape)


def _hello(**fields) -> dict:
    """A sender's hello from another process (the receivers here are this one)."""
    return Endpoint(**{"want": "auto", "pid": -1, **fields}).hello()


# --- which transport ---------------------------------------------------------------------


def test_auto_between_gpus_of_one_host_picks_ipc():
    receiver = Endpoint("auto", **{**GPU0, "gpu": "GPU-b"})
    assert choose("auto", refusals(receiver, _hello(**GPU0)), "r") == "ipc"


def test_auto_between_hosts_picks_p2p_and_says_why_not_ipc():
    receiver = Endpoint("auto", **{**GPU0, "host": "h2"})
    refused = refusals(receiver, _hello(**GPU0))
    assert refused["ipc"] == "the instances are on different hosts"
    assert choose("auto", refused, "r") == "p2p"


def test_two_engines_of_one_process_fall_back_to_tcp():
    # CUDA IPC cannot open a handle in the process that exported it, and a process group
    # needs a rank per process: a pair inside one process must not pick either.
    receiver = Endpoint("auto", **GPU0)
    refused = refusals(receiver, receiver.hello())
    assert "one process" in refused["ipc"] and "one process" in refused["p2p"]
    assert choose("auto", refused, "r") == "tcp"
    with pytest.raises(LinkError, match="ipc: both instances run in one process"):
        choose("ipc", refused, "r")


def test_ipc_needs_the_senders_gpu_visible_to_the_receiver():
    receiver = Endpoint("auto", **{**GPU0, "visible_gpus": {"GPU-b": 0}})
    refused = refusals(receiver, _hello(**GPU0))
    assert "not visible" in refused["ipc"]
    assert choose("auto", refused, "r") == "p2p"


def test_auto_between_cpus_is_plain_tcp_but_p2p_when_asked():
    refused = refusals(Endpoint("auto", **CPU), _hello(**CPU))
    assert "p2p" not in refused and choose("auto", refused, "r", "cpu") == "tcp"
    both = refusals(Endpoint("p2p", **CPU), {**_hello(**CPU), "want": "p2p"})
    assert choose("p2p", both, "r") == "p2p"


def test_an_explicit_choice_the_peer_refuses_names_every_reason():
    refused = refusals(Endpoint("tcp", **CPU), _hello(**CPU))
    with pytest.raises(LinkError, match=r"p2p: the receiver runs --kv-transport tcp"):
        choose("p2p", refused, "10.0.0.2:7000")
    refused = refusals(Endpoint("auto", **CPU), _hello(**GPU0))
    with pytest.raises(LinkError, match=r"ipc: CUDA IPC needs KV on CUDA on both sides"):
        choose("ipc", refused, "10.0.0.2:7000")


def test_mixed_devices_never_get_p2p():
    refused = refusals(Endpoint("auto", **CPU), _hello(**GPU0))
    assert "one kind" in refused["p2p"] and choose("auto", refused, "r", "cuda") == "tcp"


def test_explicit_ipc_on_a_cpu_instance_stops_at_start_up():
    with pytest.raises(ValueError, match="ipc needs KV on a CUDA device"):
        local_endpoint("ipc", "cpu")
    with pytest.raises(ValueError, match="choose from auto, tcp, ipc, p2p"):
        local_endpoint("nvlink", "cpu")


# --- over real connections ----------------------------------------------------------------


@pytest.fixture
def p2p_receiver():
    with TcpKVReceiver(links=LinkServer(local_endpoint("p2p", "cpu"))) as rx:
        yield rx


def _send_from_another_process(address: str, want: str, count: int, prelude: str = "") -> str:
    """Sends ``count`` buffers from a fresh interpreter; returns what it printed."""
    script = prelude + textwrap.dedent(f"""
        import torch
        from pdserve.transfer.links import KVSender, local_endpoint
        from tests.transfer.test_kv_links import _random_kv
        sender = KVSender(local_endpoint({want!r}, "cpu"))
        for i in range({count}):
            sender.send({address!r}, f"req-{{i}}", _random_kv((3, 2, 5 + i, 2, 8),
                        torch.bfloat16, seed=i))
        print(sender.chosen[{address!r}], sender.stats.num_transfers)
        sender.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_p2p_gloo_between_two_processes(p2p_receiver):
    assert _send_from_another_process(p2p_receiver.address, "p2p", 4) == "p2p 4"
    for i in range(4):
        got = p2p_receiver.recv(f"req-{i}", timeout=WAIT_S)
        want = _random_kv((3, 2, 5 + i, 2, 8), torch.bfloat16, seed=i)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert p2p_receiver.links.accepted == {"p2p": 1}  # one group, four buffers
    assert p2p_receiver.stats.num_transfers == 4


def test_p2p_sender_to_an_auto_receiver_and_back_to_tcp():
    with TcpKVReceiver(links=LinkServer(local_endpoint("auto", "cpu"))) as rx:
        assert _send_from_another_process(rx.address, "p2p", 1) == "p2p 1"
        assert _send_from_another_process(rx.address, "auto", 1) == "tcp 1"
        assert rx.links.accepted == {"p2p": 1}  # tcp went over a plain connection
        assert rx.pending() == 1  # the second req-0 replaced the first: both arrived


def test_p2p_buffer_with_a_wrong_digest_is_dropped(p2p_receiver):
    # The sending process's digests are off by one bit: every buffer fails on arrival.
    corrupt = textwrap.dedent("""
        import xxhash
        real = xxhash.xxh3_64_intdigest
        xxhash.xxh3_64_intdigest = lambda data: real(data) ^ 1
    """)
    assert _send_from_another_process(p2p_receiver.address, "p2p", 2, corrupt) == "p2p 2"
    deadline = time.monotonic() + WAIT_S  # the last digest may still be in the reader
    while p2p_receiver.stats.num_corrupt < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p2p_receiver.take_dropped("req-0") and p2p_receiver.take_dropped("req-1")
    assert p2p_receiver.stats.num_corrupt == 2 and p2p_receiver.pending() == 0


def test_receiver_asked_for_p2p_refuses_a_plain_tcp_sender(p2p_receiver):
    with TcpKVSender() as plain:
        try:
            plain.send(p2p_receiver.address, "plain",
                       _random_kv((1, 2, 2, 1, 4), torch.float32, 0))
        except ConnectionError:  # closed on it while the buffer was still going out
            closed = True
        else:  # or once it was all written: the connection is closed, nothing taken
            closed = _closed_by_peer(plain._connections[p2p_receiver.address])
    assert closed and p2p_receiver.pending() == 0


def _closed_by_peer(sock) -> bool:
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_sender_whose_choice_the_receiver_refuses_fails_the_send_with_the_reason():
    with TcpKVReceiver(links=LinkServer(local_endpoint("tcp", "cpu"))) as rx:
        sender = KVSender(local_endpoint("p2p", "cpu"))
        with pytest.raises(LinkError, match="p2p: the receiver runs --kv-transport tcp"):
            sender.send(rx.address, "x", _random_kv((1, 2, 2, 1, 4), torch.float32, 0))
        sender.close()
        assert rx.pending() == 0 and rx.links.accepted == {}


def test_a_cpu_sender_on_auto_speaks_plain_tcp_without_a_hello():
    with TcpKVReceiver(links=LinkServer(local_endpoint("auto", "cpu"))) as rx:
        sender = KVSender(local_endpoint("auto", "cpu"))
        assert sender.plain_only
        sender.send(rx.address, "x", _random_kv((1, 2, 2, 1, 4), torch.float32, 0))
        assert rx.recv("x", timeout=WAIT_S) is not None
        assert sender.chosen == {rx.address: "tcp"} and sender.stats.num_transfers == 1
        sender.close()


def test_a_hello_that_is_not_json_closes_only_its_connection(p2p_receiver):
    with socket.create_connection(tcp.split_address(p2p_receiver.address)) as raw:
        raw.sendall(b"PDHI" + (5).to_bytes(4, "big") + b"\xff\xfe{{{")
        raw.settimeout(WAIT_S)
        assert raw.recv(1) == b""
    test_p2p_gloo_between_two_processes(p2p_receiver)


# --- GPUs ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("want", ["ipc", "p2p"])
def test_device_transport_between_two_processes_on_a_gpu(want):
    """Two processes on one GPU (or the first two): IPC maps the other process's memory,
    p2p runs NCCL; the bytes must arrive unchanged on the receiver's GPU."""
    if want == "p2p" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU: p2p needs two")
    device = f"cuda:{torch.cuda.device_count() - 1}"
    with TcpKVReceiver(links=LinkServer(local_endpoint(want, device))) as rx:
        script = textwrap.dedent(f"""
            import torch
            from pdserve.transfer.links import KVSender, local_endpoint
            from tests.transfer.test_kv_links import _random_kv
            sender = KVSender(local_endpoint({want!r}, "cuda:0"))
            for i in range(3):
                buffer = _random_kv((4, 2, 300, 8, 128), torch.bfloat16, seed=i).cuda()
                sender.send({rx.address!r}, f"g{{i}}", buffer)
            print(sender.chosen[{rx.address!r}])
            sender.close()
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == want
        for i in range(3):
            got = rx.recv(f"g{i}", timeout=WAIT_S)
            want_bits = _random_kv((4, 2, 300, 8, 128), torch.bfloat16, seed=i)
            assert got.device == torch.device(device)
            assert torch.equal(got.cpu().view(torch.uint8), want_bits.view(torch.uint8))
