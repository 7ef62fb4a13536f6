"""Block-free KV transfer between a prefill pool and a decode pool (P/D-Serve): in one
process, or between instances over CUDA IPC, torch.distributed p2p or TCP (``links.py``)."""

from pdserve.transfer.kv_blocks import flat_pool_view, gather_blocks, scatter_blocks
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.transfer.transport import (
    KVLayout,
    KVTransport,
    LocalTransport,
    TransferStats,
    make_transport,
)

__all__ = ["KVLayout", "KVTransport", "LocalTransport", "TcpKVReceiver", "TcpKVSender",
           "TransferStats", "flat_pool_view", "gather_blocks", "make_transport", "scatter_blocks"]
