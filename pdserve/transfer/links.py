"""Which transport carries KV from one instance to another, and the sender that uses it.

Every instance's KV receiver listens on one TCP port (``--kv-transfer-port``); that address
is all a P/D group (registry, gateway) knows. A sender opens a connection to it and either
speaks plain TCP at once (``--kv-transport tcp``: ``tcp.py``, as before) or first says
hello, and the two sides agree on a transport:

    sender   -> b"PDHI" + length + JSON {"version": 1, "want": "auto", "host": ...,
                                         "device": "cuda", "gpu": "GPU-uuid", "p2p": true}
    receiver -> b"PDHI" + length + JSON {"host": ..., "refused": {"tcp": "why", ...}}
    sender   -> b"PDHI" + length + JSON {"transport": "p2p", ...}   (what it chose)

The receiver says which transports it refuses for this sender and why; the sender takes
the first one left of its own choice (``auto``: ipc, then p2p, then tcp) or fails the send
with every reason. The connection then carries that transport's control messages:

- ``ipc`` (``ipc.py``): both buffers on CUDA, same host, the sender's GPU visible to the
  receiver; the receiver opens the sender's buffer by its CUDA IPC handle and copies it.
- ``p2p`` (``p2p.py``): a two-rank ``torch.distributed`` group per pair of instances
  (NCCL between GPUs, gloo between CPUs); the buffer is one send / recv.
- ``tcp``: the hello connection closes and the buffers go over a plain TCP connection.

``auto`` never picks p2p between CPU instances: gloo runs over the same kernel TCP as the
plain transport, so it is there only when asked for (which is how CI runs the p2p code
between two real processes). What was asked and what each peer got is in ``describe()``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.transfer.tcp import (
    MAX_HEADER_BYTES,
    OnDone,
    ProtocolError,
    TcpKVSender,
    recv_exactly,
    report_done,
    split_address,
)
from pdserve.transfer.transport import SendQueue, TransferStats

log = logging.getLogger(__name__)

TRANSPORT_CHOICES = ("auto", "tcp", "ipc", "p2p")
AUTO_ORDER = ("ipc", "p2p", "tcp")
HELLO_MAGIC = b"PDHI"
PLAIN_MAGIC = b"PDKV"
FRAME = struct.Struct(">4sI")
HELLO_VERSION = 1
CONNECT_TIMEOUT_S = 10.0


class LinkError(ConnectionError):
    """No transport both sides accept, or a device transport broke."""


# --- what each side is --------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One side of a link: what it asked for and what it can do."""

    want: str
    """``--kv-transport``: auto, tcp, ipc or p2p."""
    device: str
    """Where its KV buffers live: cpu or cuda."""
    host: str
    """Same value on two processes of one machine (boot id and host name)."""
    gpu: str | None = None
    """UUID of the GPU its buffers are on (CUDA only)."""
    visible_gpus: dict[str, int] = field(default_factory=dict)
    """UUID -> index of every GPU this process sees (to open another process's buffer)."""
    p2p: bool = False
    """torch.distributed has the backend for its device (nccl on CUDA, gloo on CPU)."""
    pid: int = field(default_factory=os.getpid)
    """Two engines of one process (tests, one script running both roles) share neither a
    CUDA IPC handle nor a process group: such a pair falls back to TCP."""

    def hello(self) -> dict[str, Any]:
        return {"version": HELLO_VERSION, "want": self.want, "host": self.host,
                "device": self.device, "gpu": self.gpu, "p2p": self.p2p, "pid": self.pid}


def local_endpoint(want: str, device: torch.device | str) -> Endpoint:
    """This process's side; ValueError when ``want`` cannot work here at all."""
    device = torch.device(device)
    if want not in TRANSPORT_CHOICES:
        raise ValueError(f"--kv-transport {want!r}: choose from {', '.join(TRANSPORT_CHOICES)}")
    gpu, visible = (_gpu_uuid(device), _visible_gpus()) if device.type == "cuda" else (None, {})
    endpoint = Endpoint(want, device.type, host_identity(), gpu, visible,
                        backend_available(device.type))
    why = startup_refusal(endpoint)
    if why is not None:
        raise ValueError(why)
    return endpoint


def startup_refusal(endpoint: Endpoint) -> str | None:
    """Why an explicit ``--kv-transport`` cannot work on this instance, whatever its peers."""
    if endpoint.want == "ipc" and endpoint.device != "cuda":
        return (f"--kv-transport ipc needs KV on a CUDA device; this instance keeps it on "
                f"{endpoint.device} (use tcp, or p2p for gloo between CPU instances)")
    if endpoint.want == "p2p" and not endpoint.p2p:
        return (f"--kv-transport p2p needs torch.distributed with the "
                f"{backend_for(endpoint.device)} backend, which this torch build lacks")
    return None


def host_identity() -> str:
    """Two processes on one machine (one kernel boot) get the same string."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def backend_available(device: str) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    return dist.is_nccl_available() if device == "cuda" else dist.is_gloo_available()


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device_index(device)).uuid)


def device_index(device: torch.device) -> int:
    """``cuda`` without an index is the current device (device queries need the index)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _visible_gpus() -> dict[str, int]:
    return {str(torch.cuda.get_device_properties(i).uuid): i
            for i in range(torch.cuda.device_count())}


# --- agreeing on a transport ---------------------------------------------------------------


def refusals(receiver: Endpoint, sender: dict[str, Any]) -> dict[str, str]:
    """Transport -> why the receiver will not take it from this sender (its hello)."""
    why: dict[str, str] = {}
    for name in AUTO_ORDER:
        if receiver.want not in ("auto", name):
            why[name] = f"the receiver runs --kv-transport {receiver.want}"
    if sender.get("host") == receiver.host and sender.get("pid") == receiver.pid:
        why.update(_same_process_refusals(why))
    both_cuda = sender.get("device") == receiver.device == "cuda"
    if "ipc" not in why and not both_cuda:
        why["ipc"] = "CUDA IPC needs KV on CUDA on both sides"
    elif "ipc" not in why and sender.get("host") != receiver.host:
        why["ipc"] = "the instances are on different hosts"
    elif "ipc" not in why and sender.get("gpu") not in receiver.visible_gpus:
        why["ipc"] = "the sender's GPU is not visible to the receiver (CUDA_VISIBLE_DEVICES)"
    if "p2p" not in why:
        why.update(_p2p_refusal(receiver, sender))
    return why


def _same_process_refusals(refused: dict[str, str]) -> dict[str, str]:
    # CUDA IPC cannot open a handle in the process that exported it ("invalid device
    # context"), and a torch.distributed group needs one rank per process.
    reasons = {"ipc": "both instances run in one process (CUDA IPC opens another process's "
                      "memory only)",
               "p2p": "both instances run in one process (a process group needs one rank "
                      "per process)"}
    return {name: why for name, why in reasons.items() if name not in refused}


def _p2p_refusal(receiver: Endpoint, sender: dict[str, Any]) -> dict[str, str]:
    if sender.get("device") != receiver.device:
        return {"p2p": f"the sender's KV is on {sender.get('device')}, the receiver's on "
                       f"{receiver.device}; a p2p group needs one kind (nccl or gloo)"}
    if not (receiver.p2p and sender.get("p2p")):
        return {"p2p": f"torch.distributed {backend_for(receiver.device)} is missing on a side"}
    return {}


def choices(want: str, device: str) -> tuple[str, ...]:
    """What a sender may use, in its order of preference."""
    return (want,) if want != "auto" else AUTO_ORDER if device == "cuda" else ("tcp",)


def choose(want: str, refused: dict[str, str], address: str, device: str = "cuda") -> str:
    """The sender's pick given what the receiver refused; LinkError naming every reason.
    ``auto`` on a CPU sender skips p2p: gloo would ride the same kernel TCP as plain TCP."""
    order = choices(want, device)
    for name in order:
        if name not in refused:
            return name
    reasons = "; ".join(f"{name}: {refused[name]}" for name in order)
    raise LinkError(f"--kv-transport {want}: the receiver at {address} takes none of "
                    f"{', '.join(order)} ({reasons})")


# --- framing of the hello and of device transports' control messages ---------------------


def write_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(FRAME.pack(HELLO_MAGIC, len(body)) + body)


def read_frame(sock: socket.socket, eof_ok: bool = False) -> dict[str, Any] | None:
    """One control message; None at a clean end of stream when ``eof_ok``."""
    prefix = bytearray(FRAME.size)
    if not recv_exactly(sock, memoryview(prefix), eof_ok=eof_ok):
        return None
    magic, length = FRAME.unpack(prefix)
    if magic != HELLO_MAGIC or not 0 < length <= MAX_HEADER_BYTES:
        raise ProtocolError(f"bad control frame {bytes(magic)!r} of {length} bytes")
    body = bytearray(length)
    recv_exactly(sock, memoryview(body))
    try:
        message = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"control frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"control frame is not a JSON object: {message!r:.200}")
    return message


# --- receiver side -------------------------------------------------------------------------


class LinkServer:
    """The receiver's half of the hello: answers it and serves the chosen transport on the
    connection (``TcpKVReceiver`` hands each new connection here first)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.accepted: dict[str, int] = {}  # transport -> connections that chose it

    def takes_over(self, conn: socket.socket, receiver: Any) -> bool:
        """True when the connection was a hello and has been served to its end; False for
        a plain TCP stream the receiver reads itself. ProtocolError for one it refuses."""
        first = conn.recv(len(HELLO_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL)
        if first == PLAIN_MAGIC:
            if self.endpoint.want not in ("auto", "tcp"):
                raise ProtocolError(f"plain TCP refused: this receiver runs --kv-transport "
                                    f"{self.endpoint.want}")
            return False
        if first != HELLO_MAGIC:
            return False  # not ours: the plain reader reports the bad magic
        self._serve(conn, receiver)
        return True

    def _serve(self, conn: socket.socket, receiver: Any) -> None:
        hello = read_frame(conn)
        if hello.get("version") != HELLO_VERSION:
            raise ProtocolError(f"unsupported hello {hello!r:.200}")
        write_frame(conn, {"host": self.endpoint.host,
                           "refused": refusals(self.endpoint, hello)})
        choice = read_frame(conn, eof_ok=True)
        if choice is None:
            return  # the sender chose plain TCP, or none at all
        name = choice.get("transport")
        self.accepted[name] = self.accepted.get(name, 0) + 1
        if name == "p2p":
            from pdserve.transfer.p2p import serve_p2p

            serve_p2p(conn, choice, receiver, self.endpoint)
        elif name == "ipc":
            from pdserve.transfer.ipc import serve_ipc

            serve_ipc(conn, receiver, self.endpoint)
        else:
            raise ProtocolError(f"unknown transport {name!r}")


# --- sender side ---------------------------------------------------------------------------


class _TcpLink:
    """Plain TCP through the shared ``TcpKVSender`` (its own connection and checksum)."""

    transport = "tcp"

    def __init__(self, tcp: TcpKVSender, address: str) -> None:
        self.tcp, self.address = tcp, address

    def send(self, transfer_id: str, buffer: torch.Tensor) -> None:
        self.tcp.send(self.address, transfer_id, buffer)

    def close(self) -> None:
        pass  # the connection belongs to the shared sender


@dataclass
class _Job:
    address: str
    transfer_id: str
    buffer: torch.Tensor
    ready: Any  # a CUDA event recorded after the gather, or None
    on_done: OnDone | None


class KVSender:
    """Sends gathered KV buffers to receivers, each over the transport agreed with it.

    ``tcp``, and ``auto`` on a CPU sender, is the plain ``TcpKVSender`` path with no hello
    (a receiver asked for p2p or ipc refuses it, and logs why). Otherwise one background
    thread sends in FIFO order: the first buffer for an address opens its link (hello, and
    a p2p group or an IPC channel); a link that breaks is dropped, so the next buffer says
    hello again."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        # Plain TCP is its only choice: no hello (a CPU sender on auto never picks gloo).
        self.plain_only = choices(endpoint.want, endpoint.device) == ("tcp",)
        self.tcp = TcpKVSender()
        self.chosen: dict[str, str] = {}  # receiver address -> transport in use
        # Transports in use only; the plain TCP path counts in the TCP sender's own stats.
        self.stats_by_transport: dict[str, TransferStats] = {}
        self._links: dict[str, Any] = {}
        self._queue = SendQueue(self._drain_one, "pdkv-link-sender")

    @property
    def stats(self) -> TransferStats:
        """Every transport's transfers together."""
        total = TransferStats()
        for stats in self.stats_by_transport.values():
            total.num_transfers += stats.num_transfers
            total.num_bytes += stats.num_bytes
        return total

    def send_async(self, address: str, transfer_id: str, buffer: torch.Tensor,
                   on_done: OnDone | None = None) -> None:
        """As ``TcpKVSender.send_async``: queued, ``on_done`` gets None or the error."""
        if self.plain_only:
            self.tcp.send_async(address, transfer_id, buffer, on_done)
            self.chosen[address] = "tcp"
            self.stats_by_transport["tcp"] = self.tcp.stats
            return
        split_address(address)
        ready = None
        if buffer.is_cuda:  # the gather was queued on this thread's stream
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put(_Job(address, transfer_id, buffer, ready, on_done))

    def send(self, address: str, transfer_id: str, buffer: torch.Tensor) -> None:
        """Blocking send (tests, benchmarks); raises what the transport raised."""
        done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self.send_async(address, transfer_id, buffer, done.put)
        error = done.get()
        if error is not None:
            raise error

    def close(self) -> None:
        """Finishes queued sends, then closes every link."""
        if not self._queue.close():
            return
        for link in self._links.values():
            link.close()
        self.tcp.close()

    def _drain_one(self, job: _Job) -> None:
        report_done(job.on_done, self._run(job), job.transfer_id)

    def _run(self, job: _Job) -> BaseException | None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            link = self._link(job.address)
            try:
                link.send(job.transfer_id, job.buffer)
            except Exception:
                self._forget(job.address)
                raise
        except Exception as exc:
            return exc
        return None

    def _link(self, address: str) -> Any:
        link = self._links.get(address)
        if link is None:
            link = self._open(address)
            self._links[address] = link
            self.chosen[address] = link.transport
            log.info("KV to %s goes over %s", address, link.transport)
        return link

    def _open(self, address: str) -> Any:
        sock = socket.create_connection(split_address(address), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            write_frame(sock, self.endpoint.hello())
            answer = read_frame(sock)
            name = choose(self.endpoint.want, answer.get("refused", {}), address,
                          self.endpoint.device)
            sock.settimeout(None)
            return self._make_link(name, sock, address)
        except BaseException:
            sock.close()
            raise

    def _make_link(self, name: str, sock: socket.socket, address: str) -> Any:
        stats = self.stats_by_transport.setdefault(
            name, self.tcp.stats if name == "tcp" else TransferStats())
        if name == "tcp":
            sock.close()
            return _TcpLink(self.tcp, address)
        if name == "p2p":
            from pdserve.transfer.p2p import P2PLink

            return P2PLink(sock, self.endpoint, stats)
        from pdserve.transfer.ipc import IpcLink

        return IpcLink(sock, self.endpoint, stats)

    def _forget(self, address: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.close()

    def describe(self) -> dict[str, Any]:
        return {"kv_transport": self.endpoint.want, "kv_links": dict(self.chosen)}
