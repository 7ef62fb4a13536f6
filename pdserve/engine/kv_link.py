"""This instance's end of P/D across instances: ship a prefilled prompt's KV, take one in.

- Export (prefill instance): right after the step that sampled a request's first token, its
  prompt pages are gathered into one contiguous buffer (one kernel for all layers) and sent
  to the decode instance's receiver as one stream. The gather is issued before the next
  step can reuse the pages (same stream, and freed pages are only handed out by the next
  ``schedule()``). ``TcpKVSender.send_async`` stages a device buffer on the host on the
  current stream and sends from its own thread, so the engine loop never waits on either.
- Import (decode instance): the receiver's thread collects arriving buffers; the engine
  loop polls for the ids it waits on, gives each request fresh pages and scatters the
  buffer into them (``RecvScatter``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdserve.config import TransferConfig
from pdserve.transfer import gather_blocks, scatter_blocks
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender

log = logging.getLogger(__name__)


class KVLink:
    def __init__(self, config: TransferConfig, kv_caches: Any) -> None:
        self.kv_caches = kv_caches
        self.timeout_s = config.kv_transfer_timeout
        # Unclaimed buffers outlive the wait by a margin, then go (an aborted request).
        self.receiver = TcpKVReceiver(config.kv_transfer_host, config.kv_transfer_port,
                                      ttl_s=2 * self.timeout_s + 60).start()
        self.sender = TcpKVSender()  # its ``stats`` count what was delivered
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

        def on_done(error: BaseException | None) -> None:
            if error is not None:  # the decode instance times out and fails the request
                self.failed_sends += 1
                log.warning("KV of %s not delivered to %s: %s", transfer_id, target, error)

        self.sender.send_async(target, transfer_id, buffer, on_done)

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
        self.sender.close()  # finishes the sends already queued
        self.receiver.close()
