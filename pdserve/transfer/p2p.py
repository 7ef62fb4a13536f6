"""KV over torch.distributed point-to-point: NCCL between GPUs (hosts included), gloo between
CPUs (so CI runs this same code between two real processes).

Each (sender, receiver) pair of instances gets its own two-rank process group, built
without the global default group (instances start and stop on their own, so there is no
world to join): the sender hosts a ``TCPStore`` on an ephemeral port of the address its
hello connection leaves from (so the receiver can reach it back), names it in its choice
message on the hello connection (``links.py``), and both
sides construct the backend's group on it (sender rank 0, receiver rank 1).

Per buffer, the hello connection carries the ``tcp.py`` header (transfer id, layout) so the
receiver can allocate before posting its ``recv``; the buffer itself is ONE ``send`` /
``recv`` of the contiguous gathered tensor. Checksum: a CPU (gloo) buffer's XXH3-64 digest
follows on the connection, as on TCP, since gloo rides the same kernel TCP; a CUDA (NCCL)
buffer has none: hashing it would mean copying it to the host, and NVLink, PCIe and
InfiniBand check every packet with a link-level CRC and retry, unlike a routed TCP path.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from pdserve.transfer.kv_blocks import host_empty
from pdserve.transfer.links import Endpoint, LinkError, backend_for, write_frame
from pdserve.transfer.tcp import (
    DIGEST,
    byte_view,
    encode_header,
    join_address,
    layout_of,
    read_header,
    recv_exactly,
    split_address,
)
from pdserve.transfer.transport import KVLayout, TransferStats

log = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(seconds=60)
SENDER, RECEIVER = 0, 1


def pair_group(backend: str, store: Any, rank: int, device: torch.device) -> Any:
    """A two-rank group of ``backend`` on ``store``, outside any default group."""
    prefixed = dist.PrefixStore("pdkv", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, GROUP_TIMEOUT)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    with torch.cuda.device(device):
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)


class P2PLink:
    """The sender's side of one pair."""

    transport = "p2p"

    def __init__(self, sock: socket.socket, endpoint: Endpoint, stats: TransferStats) -> None:
        self.sock, self.stats = sock, stats
        self.backend = backend_for(endpoint.device)
        host = sock.getsockname()[0]  # the address the receiver's host sees this one at
        self.store = dist.TCPStore(host, 0, world_size=2, is_master=True,
                                   wait_for_workers=False, timeout=GROUP_TIMEOUT)
        write_frame(sock, {"transport": "p2p", "backend": self.backend,
                           "store": join_address(host, self.store.port)})
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        self.group = pair_group(self.backend, self.store, SENDER, device)

    def send(self, transfer_id: str, buffer: torch.Tensor) -> None:
        buffer = buffer.detach().contiguous()
        self.sock.sendall(encode_header(transfer_id, layout_of(buffer)))
        if buffer.is_cuda:
            with torch.cuda.device(buffer.device):
                self.group.send([buffer], RECEIVER, 0).wait()
                torch.cuda.current_stream().synchronize()  # the bytes have left
        else:
            self.group.send([buffer], RECEIVER, 0).wait()
            digest = xxhash.xxh3_64_intdigest(byte_view(buffer))
            self.sock.sendall(DIGEST.pack(digest))
        self.stats.num_transfers += 1
        self.stats.num_bytes += buffer.numel() * buffer.element_size()

    def close(self) -> None:
        self.sock.close()  # the receiver's loop ends; the group goes with this object


def serve_p2p(conn: socket.socket, choice: dict[str, Any], receiver: Any,
              endpoint: Endpoint) -> None:
    """The receiver's side of one pair: joins the sender's group, then receives buffers
    until the connection ends. Runs on the connection's own thread."""
    backend = choice.get("backend")
    if backend != backend_for(endpoint.device):
        raise LinkError(f"p2p backend {backend!r} does not fit KV on {endpoint.device}")
    host, port = split_address(str(choice.get("store")))
    store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=GROUP_TIMEOUT)
    device = _receive_device(endpoint)
    group = pair_group(backend, store, RECEIVER, device)
    while (header := read_header(conn)) is not None:
        transfer_id, layout = header
        buffer = _receive(group, layout, device)
        if device.type == "cpu" and not _digest_matches(conn, buffer):
            receiver.drop_corrupt(transfer_id)
        else:
            receiver.deliver(transfer_id, buffer)


def _receive_device(endpoint: Endpoint) -> torch.device:
    if endpoint.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", endpoint.visible_gpus.get(endpoint.gpu, 0))


def _receive(group: Any, layout: KVLayout, device: torch.device) -> torch.Tensor:
    shape = (layout.num_layers, 2, layout.num_tokens, layout.kv_heads, layout.head_dim)
    if device.type == "cpu":
        buffer = host_empty(shape, layout.dtype)
        group.recv([buffer], SENDER, 0).wait()
        return buffer
    with torch.cuda.device(device):
        buffer = torch.empty(shape, dtype=layout.dtype, device=device)
        group.recv([buffer], SENDER, 0).wait()
        torch.cuda.current_stream().synchronize()  # handed over complete
    return buffer


def _digest_matches(conn: socket.socket, buffer: torch.Tensor) -> bool:
    sent = bytearray(DIGEST.size)
    recv_exactly(conn, memoryview(sent))
    return DIGEST.unpack(sent)[0] == xxhash.xxh3_64_intdigest(byte_view(buffer))
