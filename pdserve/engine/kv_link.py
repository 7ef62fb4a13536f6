"""This instance's end of P/D across instances: ship a prefilled prompt's KV, take one in.

- Export (prefill instance): right after the step that sampled a request's first token, its
  prompt pages are gathered into one contiguous buffer (one kernel for all layers) and sent
  to the decode instance's receiver as one stream. The gather is issued before the next
  step can reuse the pages (same stream, and freed pages are only handed out by the next
  ``schedule()``). The network send runs on a thread of its own, so the engine loop never
  waits on it; on a GPU that thread first waits for the device-to-host copy's event.
- Import (decode instance): the receiver's thread collects arriving buffers; the engine
  loop polls for the ids it waits on, gives each request fresh pages and scatters the
  buffer into them (``RecvScatter``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pdserve.config import TransferConfig
from pdserve.transfer import TransferStats, gather_blocks, scatter_blocks
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender

log = logging.getLogger(__name__)


class KVLink:
    def __init__(self, config: TransferConfig, kv_caches: Any) -> None:
        self.kv_caches = kv_caches
        self.timeout_s = config.kv_transfer_timeout
        # Unclaimed buffers outlive the wait by a margin, then go (an aborted request).
        self.receiver = TcpKVReceiver(config.kv_transfer_host, config.kv_transfer_port,
                                      ttl_s=2 * self.timeout_s + 60).start()
        self.sender = TcpKVSender()
        self._send_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-send")
        self.sent = TransferStats()
        self.failed_sends = 0
        self._waited: dict[str, torch.Tensor] = {}  # taken by wait_briefly, not yet claimed

    @property
    def address(self) -> str:
        return self.receiver.address

    # ---- prefill side -------------------------------------------------------------------

    def export(self, transfer_id: str, target: str, block_ids: list[int],
               num_tokens: int) -> None:
        """Gathers the first ``num_tokens`` tokens' KV now and sends it in the background."""
        buffer = gather_blocks(self.kv_caches, block_ids, num_tokens)
        ready = None
        if buffer.is_cuda:
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
            host.copy_(buffer, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            buffer = host
        self._send_thread.submit(self._send, transfer_id, target, buffer, ready)

    def _send(self, transfer_id: str, target: str, buffer: torch.Tensor,
              ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()
        try:
            self.sender.send(target, transfer_id, buffer)
        except OSError as exc:
            # The decode instance times out waiting and fails the request there.
            self.failed_sends += 1
            log.warning("KV of %s not delivered to %s: %s", transfer_id, target, exc)
            return
        self.sent.num_transfers += 1
        self.sent.num_bytes += buffer.numel() * buffer.element_size()

    # ---- decode side --------------------------------------------------------------------

    def arrived(self, transfer_id: str) -> torch.Tensor | None:
        """The buffer sent under ``transfer_id`` once it is all here (taken), else None."""
        buffer = self._waited.pop(transfer_id, None)
        return buffer if buffer is not None else self.receiver.poll(transfer_id)

    def scatter(self, buffer: torch.Tensor, block_ids: list[int]) -> None:
        scatter_blocks(buffer, self.kv_caches, block_ids)

    def discard(self, transfer_id: str) -> None:
        self._waited.pop(transfer_id, None)
        self.receiver.discard(transfer_id)

    def wait_briefly(self, transfer_id: str, timeout_s: float = 0.002) -> None:
        """Idles the engine loop a moment when it has nothing to do but wait for KV."""
        try:
            self._waited[transfer_id] = self.receiver.recv(transfer_id, timeout_s)
        except TimeoutError:
            pass

    def close(self) -> None:
        self._send_thread.shutdown(wait=True)
        self.sender.close()
        self.receiver.close()
