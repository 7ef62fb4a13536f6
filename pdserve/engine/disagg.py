"""PD-disaggregation on one GPU: prefill and decode on two *static* SM partitions, each with
its own KV pool, KV handed over by block-free transfer (P/D-Serve), one host thread.

``EngineCore`` hands its ``step()`` to a ``DisaggLoop`` when ``schedule == "disagg"``.
It reuses the multiplex launch machinery (``DecodeLane``, ``PrefillBatch``, events, pinned
buffers) with a fixed partition: no planner, no temporal mode, no partition switch.

- Pools: the engine's KV tensor is cut by page range into a prefill pool (the first
  ``disagg_prefill_kv_fraction`` of the pages, with the prefix cache) and a decode pool;
  each has its own block manager and block tables, and page ids start at 0 in each.
- Prefill lane: one batch (whole prompts or ``max_num_batched_tokens`` chunks) at a time,
  all layers in one launch on the prefill partition, into the prefill pool.
- Hand-off: a prefilled request is gathered from its prefill pages into one contiguous
  buffer (on the prefill stream, so after its prefill), sent through the ``KVTransport``,
  scattered into fresh decode pages (on the decode stream, which waits on the send's
  event), and its prefill pages are freed. Requests wait in the hand-off queue, holding
  their prefill pages, while the decode pool is full.
- Decode lane: decode steps on the decode partition, replaying graphs captured on its own
  stream over the decode pool. Preemption sends a request back to prefill (recompute).

Stream order keeps pages safe without host waits: pages a gather reads are reused only by
later prefill work on the same stream, and pages a scatter writes were last used by
completed decode launches on the decode stream.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

import torch

from pdserve.engine.batch import BlockTables
from pdserve.engine.multiplex import TIMELINE_LENGTH, TimelineEntry, wait_for_any
from pdserve.engine.mux_exec import DecodeLane, HostBuffers, Launch, PrefillBatch
from pdserve.engine.mux_setup import build_partitions, graph_buckets
from pdserve.engine.streams import StreamOps, make_stream_ops
from pdserve.gpu.driver import EmulatedDriver
from pdserve.gpu.partitions import Partition
from pdserve.request import Request
from pdserve.sched.base import Plan
from pdserve.sched.disagg import DisaggScheduler
from pdserve.sched.multiplex import MultiplexScheduler
from pdserve.transfer import KVTransport, LocalTransport, gather_blocks, scatter_blocks

log = logging.getLogger(__name__)
DEFAULT_DECODE_SHARE = 0.4  # of the SMs; decode is bandwidth-bound and needs fewer


@dataclass
class PoolView:
    """The runner as one pool's lane sees it: the shared model, its own pages and tables
    (what ``DecodeLane`` and ``PrefillBatch`` read from a runner)."""

    model: object
    arch: object
    device: torch.device
    dtype: torch.dtype
    block_size: int
    kv_caches: list
    tables: BlockTables


@dataclass(frozen=True)
class DisaggTimelineEntry(TimelineEntry):
    kv_transfers: int = 0  # since start
    kv_transfer_bytes: int = 0


def split_kv_caches(kv_caches: list, num_prefill: int) -> tuple[list, list]:
    """Page ranges [0, n) and [n, end) of every layer: views, no new memory."""
    prefill = [(k[:num_prefill], v[:num_prefill]) for k, v in kv_caches]
    decode = [(k[num_prefill:], v[num_prefill:]) for k, v in kv_caches]
    return prefill, decode


def build_disagg_partition(config, device: torch.device) -> Partition:
    """The one fixed split, at the driver's granularity (emulated on the CPU)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        total = EmulatedDriver.num_sms
    decode = config.scheduler.disagg_decode_sms or max(1, round(DEFAULT_DECODE_SHARE * total))
    sched = replace(config.scheduler, mux_decode_sms=str(decode))
    choices = build_partitions(replace(config, scheduler=sched), device).choices()
    if not choices:
        raise ValueError(f"cannot split {total} SMs with {decode} for decode")
    return choices[0]


class DisaggLoop:
    def __init__(self, core, partition: Partition | None = None, ops: StreamOps | None = None,
                 transport: KVTransport | None = None):
        self.core, runner = core, core.runner
        self.scheduler: DisaggScheduler = core.scheduler
        self.config = core.config
        self.ops = ops or make_stream_ops(runner.device)
        self.partition = partition or build_disagg_partition(self.config, runner.device)
        self.transport = transport or LocalTransport()
        self.num_layers = runner.model.num_layers
        prefill_kv, decode_kv = split_kv_caches(runner.kv_caches,
                                                self.scheduler.prefill.blocks.num_blocks)
        self.prefill_view, self.decode_view = (
            PoolView(runner.model, runner.arch, runner.device, runner.dtype, runner.block_size,
                     kv, BlockTables(runner.tables.width)) for kv in (prefill_kv, decode_kv))
        max_seqs = self.config.scheduler.max_num_seqs
        self.decode_lane = DecodeLane(self.decode_view, self.ops, max_seqs)
        self.decode_lane.capture([self.partition], graph_buckets(self.config))
        self.prefill_buffers = HostBuffers.make(self.ops, max_seqs)
        self.num_transfers = 0
        self.transfer_bytes = 0
        self.decode: Launch | None = None
        self.piece: Launch | None = None
        self._failed: list = []
        self._timeline: deque[DisaggTimelineEntry] = deque(maxlen=TIMELINE_LENGTH)
        log.info("disagg: %d decode SMs / %d prefill SMs, %d prefill pages / %d decode pages",
                 self.partition.decode_sms, self.partition.prefill_sms,
                 self.scheduler.prefill.blocks.num_blocks,
                 self.scheduler.decode.blocks.num_blocks)

    # ------------------------------------------------------------------ step

    def step(self) -> list:
        updates = self._collect()
        self._hand_off()
        self._launch()
        updates += self._failed
        self._failed = []
        if not updates and self.busy():
            self._wait_any()
            updates += self._collect()
        return updates

    def busy(self) -> bool:
        return self.decode is not None or self.piece is not None

    def _wait_any(self) -> None:
        wait_for_any((self.decode, self.piece))

    # ------------------------------------------------------------- collecting

    def _collect(self) -> list:
        updates = []
        if self.decode is not None and self.decode.event.query():
            launch, self.decode = self.decode, None
            updates += self._complete(self.scheduler.decode, launch)
        if self.piece is not None and self.piece.event.query():
            launch, self.piece = self.piece, None
            updates += self._complete(self.scheduler.prefill, launch)
            self.scheduler.take_prefilled()
        return updates

    def _complete(self, side: MultiplexScheduler, launch: Launch) -> list:
        core = self.core
        try:
            output = launch.output()
        except Exception:
            log.exception("%s launch failed; aborting its requests", launch.kind)
            return self._fail(side, launch.plan)
        finished, aborted = side.complete(launch.plan, output)
        core._counters["steps"] += 1
        core._counters["generation"] += len(output.token_ids)
        updates = core._collect(launch.plan, output)
        updates += [core._update(r, [], None) for r in aborted]
        for request in finished + aborted:
            self._forget(request)
        return updates

    def _fail(self, side: MultiplexScheduler, plan: Plan) -> list:
        for item in plan.scheduled:
            side.in_flight.discard(item.request.request_id)
        updates = self.core._fail(plan)
        for item in plan.scheduled:
            self._forget(item.request)
        return updates

    def _forget(self, request: Request) -> None:
        self.core._forget(request)
        self.prefill_view.tables.drop(request.request_id)
        self.decode_view.tables.drop(request.request_id)

    # -------------------------------------------------------------- hand-off

    def _hand_off(self) -> None:
        while (request := self.scheduler.next_handoff()) is not None:
            self._transfer(request)

    def _transfer(self, request: Request) -> None:
        """Gather on the prefill stream, send, receive on the decode stream, scatter."""
        part, ops, rid = self.partition, self.ops, request.request_id
        with ops.on(part.prefill_stream):
            buffer = gather_blocks(self.prefill_view.kv_caches, request.block_ids,
                                   request.num_computed)
            self.transport.send(rid, buffer, stream=part.prefill_stream)
        self.num_transfers += 1
        self.transfer_bytes += buffer.numel() * buffer.element_size()
        _, target = self.scheduler.move_to_decode(request)
        self.prefill_view.tables.drop(rid)
        with ops.on(part.decode_stream):
            scatter_blocks(self.transport.recv(rid, stream=part.decode_stream),
                           self.decode_view.kv_caches, target)

    # -------------------------------------------------------------- launching

    def _launch(self) -> None:
        launched = False
        if self.decode is None:
            launched |= self._launch_decode()
        if self.piece is None:
            launched |= self._launch_prefill()
        if launched:
            self._note()

    def _launch_decode(self) -> bool:
        plan = self.scheduler.plan_decode()
        for request in plan.preempted:
            self.decode_view.tables.drop(request.request_id)
        if not plan.decodes:
            return False
        self.scheduler.decode.launched(plan)
        try:
            self.decode = self.decode_lane.launch(plan, self.partition, [])
        except Exception:
            log.exception("decode launch failed; aborting its %d requests", len(plan.decodes))
            self._failed += self._fail(self.scheduler.decode, plan)
        return self.decode is not None

    def _launch_prefill(self) -> bool:
        plan = self.scheduler.plan_prefill()
        if plan.is_empty():
            return False
        self.scheduler.prefill.launched(plan)
        try:
            batch = PrefillBatch(plan, self.prefill_view, self.ops, self.prefill_buffers)
            # A dedicated partition has nobody to re-plan for: all layers in one launch.
            self.piece = batch.launch_piece(self.partition, self.num_layers, [])
        except Exception:
            log.exception("prefill launch failed; aborting its %d requests", len(plan.prefills))
            self._failed += self._fail(self.scheduler.prefill, plan)
        return self.piece is not None

    # ------------------------------------------------------------- reporting

    def _note(self) -> None:
        part = self.partition
        decode_batch = len(self.decode.plan.decodes) if self.decode is not None else 0
        tokens = sum(s.num_new_tokens for s in self.piece.plan.prefills) if self.piece else 0
        self._timeline.append(DisaggTimelineEntry(
            time.monotonic(), "disagg", part.decode_sms, part.prefill_sms, decode_batch, tokens,
            self.num_layers if tokens else 0, 0.0, False, self.num_transfers, self.transfer_bytes))

    def timeline(self, since: float | None = None) -> list[dict]:
        """The fixed split and transfer totals at each launching step."""
        return [asdict(e) for e in self._timeline if since is None or e.time >= since]

    def last(self) -> DisaggTimelineEntry | None:
        return self._timeline[-1] if self._timeline else None
