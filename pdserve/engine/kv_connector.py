"""The worker side of every KV hand-off: gather a request's pages into one contiguous buffer,
carry it, scatter it into other pages (block-free transfer, as P/D-Serve does it).

- Between two pools of this engine (same-GPU disaggregation, ``KVMove``): gather on the
  prefill stream (after the prefill, by stream order), ``LocalTransport``, scatter on the
  decode stream. Pages a gather reads are reused only by later prefill work on the same
  stream, and pages a scatter writes were last used by completed decode launches.
- Across instances (``--kv-transfer-port``): export gathers the prompt's KV before the next
  launch can reuse its pages and ``KVSender.send_async`` ships it from its own thread over
  the transport agreed with that receiver (``--kv-transport``: CUDA IPC, torch.distributed
  p2p or TCP, ``transfer/links.py``); import polls the receiver for awaited transfer ids
  and scatters into fresh pages.

Work issued on the current stream returns an event the engine makes every later launch
wait on: launches may run on other streams (green-context partitions).

The scheduler side (which requests export, which wait for KV, when one may join) is the
policy's: ``Scheduler.reserve_received`` / ``join_received`` and ``EngineCore``'s book of
awaited transfers.
"""

from __future__ import annotations

import logging

import torch

from pdserve.config import TransferConfig
from pdserve.engine.streams import Event
from pdserve.sched.base import KVMove
from pdserve.transfer import LocalTransport, gather_blocks, scatter_blocks
from pdserve.transfer.links import KVSender, LinkServer, local_endpoint
from pdserve.transfer.tcp import TcpKVReceiver

log = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, runner, config: TransferConfig) -> None:
        self.runner, self.ops = runner, runner.ops
        self.local = LocalTransport()
        self.num_moves = 0
        self.moved_bytes = 0
        self.timeout_s = config.kv_transfer_timeout
        self.receiver: TcpKVReceiver | None = None
        self.sender: KVSender | None = None
        self.links: LinkServer | None = None
        self.failed_sends = 0
        self._waited: dict[str, torch.Tensor] = {}  # taken by wait_briefly, not yet claimed
        if config.kv_transfer_port is not None:
            self._start_links(config)

    def _start_links(self, config: TransferConfig) -> None:
        """The receiver (one TCP port; device transports agreed on per connection) and the
        sender. An explicit ``kv_transport`` this instance cannot run stops here."""
        endpoint = local_endpoint(config.kv_transport, self.runner.device)
        self.links = LinkServer(endpoint)
        # Unclaimed buffers outlive the wait by a margin, then go (an aborted request).
        self.receiver = TcpKVReceiver(config.kv_transfer_host, config.kv_transfer_port,
                                      ttl_s=2 * self.timeout_s + 60, links=self.links).start()
        self.sender = KVSender(endpoint)  # its ``stats`` count what was delivered
        log.info("KV receiver listening on %s (--kv-transport %s)", self.receiver.address,
                 config.kv_transport)

    @property
    def links_instances(self) -> bool:
        return self.receiver is not None

    @property
    def address(self) -> str | None:
        return self.receiver.address if self.receiver is not None else None

    # ---- between pools of this engine ----

    def move(self, move: KVMove) -> None:
        part, ops, rid = move.partition, self.ops, move.request.request_id
        source = self.runner.pools[move.source_pool]
        source_stream = part.prefill_stream if part is not None else None
        target_stream = part.decode_stream if part is not None else None
        with ops.on(source_stream):
            buffer = gather_blocks(source.kv_caches, move.source_blocks, move.num_tokens)
            self.local.send(rid, buffer, stream=source_stream)
        self.num_moves += 1
        self.moved_bytes += buffer.numel() * buffer.element_size()
        source.tables.drop(rid)
        with ops.on(target_stream):
            scatter_blocks(self.local.recv(rid, stream=target_stream),
                           self.runner.pools[move.target_pool].kv_caches, move.target_blocks)

    # ---- across instances: prefill side ----

    def export(self, transfer_id: str, target: str, pool: str, block_ids: list[int],
               num_tokens: int) -> Event:
        """Gathers the first ``num_tokens`` tokens' KV now and sends it in the background.
        Under tensor parallelism the buffer holds every rank's KV heads (``transfer/heads.py``)."""
        buffer = gather_blocks(self.runner.pools[pool].kv_caches, block_ids, num_tokens)
        if self.runner.tp is not None:
            buffer = self.runner.tp.gather_kv(pool, block_ids, num_tokens, buffer)

        def on_done(error: BaseException | None) -> None:
            if error is not None:  # the decode instance times out and fails the request
                self.failed_sends += 1
                log.warning("KV of %s not delivered to %s: %s", transfer_id, target, error)

        self.sender.send_async(target, transfer_id, buffer, on_done)
        return self.ops.record(None)

    # ---- across instances: decode side ----

    def arrived(self, transfer_id: str) -> torch.Tensor | None:
        """The buffer sent under ``transfer_id`` once it is all here (taken), else None."""
        buffer = self._waited.pop(transfer_id, None)
        return buffer if buffer is not None else self.receiver.poll(transfer_id)

    def dropped(self, transfer_id: str) -> bool:
        """True (once) when the receiver dropped this transfer's buffer as corrupt: no KV
        will come under this id, so its request can fail now, not at the timeout."""
        return self.receiver.take_dropped(transfer_id)

    def misfit(self, buffer: torch.Tensor, num_prompt_tokens: int) -> str | None:
        """Why a received buffer cannot be this model's KV of that prompt, or None. Checked
        before anything is written: a bad buffer fails its request, not the engine."""
        pages = self.runner.kv_caches[0][0]  # [pages, block, this rank's heads, dim]
        heads = self.runner.tp.kv_heads.total if self.runner.tp is not None else pages.shape[2]
        want = (len(self.runner.kv_caches), 2, num_prompt_tokens, heads, pages.shape[3])
        if tuple(buffer.shape) != want:
            return (f"received KV of shape {tuple(buffer.shape)}; this model's KV of the "
                    f"{num_prompt_tokens}-token prompt is {want}")
        return None

    def scatter(self, buffer: torch.Tensor, pool: str, block_ids: list[int]) -> Event:
        if self.runner.tp is not None:  # each rank writes its own heads
            buffer = self.runner.tp.scatter_kv(pool, block_ids, buffer)
        scatter_blocks(buffer, self.runner.pools[pool].kv_caches, block_ids)
        return self.ops.record(None)

    def discard(self, transfer_id: str) -> None:
        self._waited.pop(transfer_id, None)
        self.receiver.discard(transfer_id)

    def wait_briefly(self, transfer_id: str, timeout_s: float = 0.002) -> None:
        """Idles the engine loop a moment when it has nothing to do but wait for KV."""
        try:
            self._waited[transfer_id] = self.receiver.recv(transfer_id, timeout_s)
        except TimeoutError:
            pass

    def transfer_totals(self) -> tuple[int, int]:
        """(transfers, bytes): moves between pools plus buffers sent and received."""
        count, size = self.num_moves, self.moved_bytes
        if self.receiver is not None:
            sent, received = self.sender.stats, self.receiver.stats
            count += sent.num_transfers + received.num_transfers
            size += sent.num_bytes + received.num_bytes
        return count, size

    def fill_stats(self, stats) -> None:
        """Buffers sent to other instances, by the transport agreed with each receiver
        (``extra["kv_sent/<transport>"]``; the server's metric label)."""
        if self.sender is None:
            return
        for transport, sent in self.sender.stats_by_transport.items():
            stats.extra[f"kv_sent/{transport}"] = sent.num_transfers

    def describe(self) -> dict:
        """The transport asked for, what each receiver got from here, and what senders chose
        when they connected here: never a silent fallback."""
        if self.sender is None:
            return {}
        return {**self.sender.describe(), "kv_links_accepted": dict(self.links.accepted)}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()  # finishes the sends already queued
            self.receiver.close()
