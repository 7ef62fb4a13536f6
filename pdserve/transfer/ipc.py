"""KV between GPUs of one host by CUDA IPC: the receiver maps the sender's gathered buffer
and copies it into its own memory (one device-to-device copy, over NVLink or PCIe between
two GPUs, or within one GPU), then acknowledges so the sender may free it.

Per buffer, on the hello connection (``links.py``):

    sender   -> frame {"transfer_id", "layout", "gpu": UUID, "handle", "storage_bytes",
                       "storage_offset", "tensor_offset", "ref_counter", "ref_offset",
                       "event", "event_sync"}         (``UntypedStorage._share_cuda_()``)
    receiver -> frame {"ok": true} | {"ok": false, "error": "..."}

No pickle crosses the connection: the handle's fields travel as JSON (bytes as hex) and
the receiver rebuilds the storage with ``UntypedStorage._new_shared_cuda``, as
``torch.multiprocessing`` does. The GPU is named by UUID, since the two processes may
number their visible devices differently. No checksum: both ends are one machine's GPUs
and the copy never leaves its interconnect (which checks its own packets).
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from pdserve.transfer.links import Endpoint, LinkError, device_index, read_frame, write_frame
from pdserve.transfer.tcp import DTYPE_NAMES, layout_from_json, layout_of
from pdserve.transfer.transport import KVLayout, TransferStats


class IpcLink:
    """The sender's side: shares each buffer and waits for the receiver's copy."""

    transport = "ipc"

    def __init__(self, sock: socket.socket, endpoint: Endpoint, stats: TransferStats) -> None:
        self.sock, self.endpoint, self.stats = sock, endpoint, stats
        write_frame(sock, {"transport": "ipc"})

    def send(self, transfer_id: str, buffer: torch.Tensor) -> None:
        if not buffer.is_cuda:
            raise LinkError("CUDA IPC carries CUDA buffers only")
        buffer = buffer.detach().contiguous()
        write_frame(self.sock, share_message(transfer_id, buffer))
        answer = read_frame(self.sock)
        if not answer.get("ok"):
            raise LinkError(f"the receiver could not take {transfer_id!r} by CUDA IPC: "
                            f"{answer.get('error')}")
        self.stats.num_transfers += 1
        self.stats.num_bytes += buffer.numel() * buffer.element_size()

    def close(self) -> None:
        self.sock.close()


def share_message(transfer_id: str, buffer: torch.Tensor) -> dict[str, Any]:
    (_, handle, storage_bytes, storage_offset, ref_counter, ref_offset, event,
     event_sync) = buffer.untyped_storage()._share_cuda_()
    layout = layout_of(buffer)
    return {"transfer_id": transfer_id, "gpu": str(torch.cuda.get_device_properties(
                device_index(buffer.device)).uuid),
            "layout": {"num_layers": layout.num_layers, "num_tokens": layout.num_tokens,
                       "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
                       "dtype": DTYPE_NAMES[layout.dtype]},
            "handle": handle.hex(), "storage_bytes": storage_bytes,
            "storage_offset": storage_offset, "tensor_offset": buffer.storage_offset(),
            "ref_counter": ref_counter.hex(), "ref_offset": ref_offset,
            "event": event.hex() if event else None, "event_sync": bool(event_sync)}


def serve_ipc(conn: socket.socket, receiver: Any, endpoint: Endpoint) -> None:
    """The receiver's side: copies each shared buffer to its own GPU and acknowledges."""
    target = torch.device("cuda", endpoint.visible_gpus.get(endpoint.gpu, 0))
    while (message := read_frame(conn, eof_ok=True)) is not None:
        try:
            transfer_id, buffer = _copy_shared(message, endpoint, target)
        except Exception as exc:  # noqa: BLE001 - the sender gets the reason
            write_frame(conn, {"ok": False, "error": str(exc)})
            continue
        receiver.deliver(transfer_id, buffer)
        write_frame(conn, {"ok": True})


def _copy_shared(message: dict[str, Any], endpoint: Endpoint,
                 target: torch.device) -> tuple[str, torch.Tensor]:
    layout = layout_from_json(message.get("layout"))
    if not isinstance(message.get("transfer_id"), str):
        raise LinkError(f"transfer_id is not a string: {message.get('transfer_id')!r:.200}")
    source_index = endpoint.visible_gpus.get(message.get("gpu"))
    if source_index is None:
        raise LinkError("the sender's GPU is not visible to this process")
    # Opened on the sender's GPU (in this process's numbering), so the storage's device is
    # the one its memory is on; the copy then crosses to ours (peer access) if they differ.
    with torch.cuda.device(source_index):
        shared = _open(message, layout, source_index)
    copy = torch.empty(shared.shape, dtype=shared.dtype, device=target)
    with torch.cuda.device(target):
        copy.copy_(shared)
        torch.cuda.current_stream().synchronize()
    # Dropping ``shared`` here releases the sender's ref count before the acknowledgement.
    return str(message["transfer_id"]), copy


def _open(message: dict[str, Any], layout: KVLayout, device_index: int) -> torch.Tensor:
    event = message.get("event")
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index, bytes.fromhex(message["handle"]), int(message["storage_bytes"]),
        int(message["storage_offset"]), bytes.fromhex(message["ref_counter"]),
        int(message["ref_offset"]), bytes.fromhex(event) if event else b"",
        bool(message["event_sync"]))
    shape = (layout.num_layers, 2, layout.num_tokens, layout.kv_heads, layout.head_dim)
    tensor = torch.empty(0, dtype=layout.dtype, device=torch.device("cuda", device_index))
    return tensor.set_(storage, int(message["tensor_offset"]), shape)
