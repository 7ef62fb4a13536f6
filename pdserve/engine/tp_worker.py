"""A tensor-parallel worker process: rank ``r`` of the group, driven by rank 0's launches.

Started by ``TPLeader`` as ``python -m pdserve.engine.tp_worker`` with its spec pickled on
stdin. It loads its shard, sizes its KV pages as rank 0 does, then runs each command rank 0
broadcasts until "stop" or until rank 0 is gone (the control channel fails).
"""

from __future__ import annotations

import logging
import pickle
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig, TransferConfig
from pdserve.dist.comm import TPComm
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.launch import HostBuffers
from pdserve.engine.model_runner import ModelRunner, rank_device
from pdserve.engine.setup import build_disagg_partition, build_partitions
from pdserve.engine.tp import KEPT_EVENTS, MirrorRequest, PartKey, PlanDecoder, part_key
from pdserve.request import Request
from pdserve.sched.base import BatchCarry, KVMove, Work
from pdserve.signals import ignore_group_signals
from pdserve.transfer import gather_blocks, scatter_blocks
from pdserve.transfer.kv_blocks import host_empty

log = logging.getLogger("pdserve.tp_worker")


class TPFollower:
    """Replays rank 0's commands on this rank's runner."""

    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.runner, self.config = runner, config
        self.decoder = PlanDecoder()
        self.kv = KVConnector(runner, TransferConfig())  # moves between this rank's pools
        self.parts: dict[PartKey, object] = {}
        self.buffers: dict[str, HostBuffers] = {}
        self.carries: dict[int, BatchCarry] = {}
        self.events: dict[int, object] = {}

    def serve(self) -> None:
        while True:
            for command in self.runner.comm.broadcast_object():
                if command[0] == "stop":
                    return
                getattr(self, "_" + command[0])(*command[1:])

    def _configure(self, layout: dict, decode_pool: str, keys: list | None) -> None:
        self.parts = self._build_partitions()
        parts = None if keys is None else [self.parts[k] for k in keys]
        self.runner.configure(layout, decode_pool, parts)

    def _build_partitions(self) -> dict:
        schedule, device = self.config.scheduler.schedule, self.runner.device
        if schedule == "multiplex":
            pset = build_partitions(self.config, device)
            return {part_key(p): p for p in [*pset.choices(), pset.whole_gpu]}
        if schedule == "disagg":
            part = build_disagg_partition(self.config, device)
            return {part_key(part): part}
        return {}

    def _forget(self, request_id: str) -> None:
        self.decoder.forget(request_id)
        self.runner.forget(request_id)

    def _move(self, rid: str, source_pool: str, source_blocks: list, target_pool: str,
              target_blocks: list, num_tokens: int, key: PartKey | None) -> None:
        mirror = self.decoder.mirrors.get(rid, {}).get(source_pool) or MirrorRequest(rid)
        self.decoder.forget(rid, source_pool)
        move = KVMove(mirror, source_pool, source_blocks, target_pool, target_blocks,
                      num_tokens, self.parts.get(key) if key is not None else None)
        self.kv.move(move)

    def _gather_kv(self, pool: str, block_ids: list[int], num_tokens: int) -> None:
        """A request's KV on this rank's heads, to rank 0 (it exports to another instance)."""
        self._settle()
        own = gather_blocks(self.runner.pools[pool].kv_caches, block_ids, num_tokens)
        self.runner.comm.gather_to_first(own.cpu().contiguous())

    def _scatter_kv(self, pool: str, block_ids: list[int], layout: tuple) -> None:
        """This rank's heads of KV received from another instance, into its pages."""
        own = self.runner.comm.scatter_from_first(None, host_empty(*layout))
        scatter_blocks(own, self.runner.pools[pool].kv_caches, block_ids)
        self._settle()  # the next launch, on any stream, reads these pages

    def _settle(self) -> None:
        # Launches run on their lanes' streams; a transfer's copies are rare enough to wait
        # for all of them rather than track which launch touched which page.
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _launch(self, seq: int, encoded: tuple, waited: list[int]) -> None:
        plan, key, side, pool, layers, final, carry = encoded
        work = Work(self.decoder.decode(plan, pool), self.parts.get(key) if key else None,
                    side, pool, layers, final, self._carry(carry, final))
        # The gate a step checks before looking for prompts to score counts real requests,
        # which a worker has none of: it counts this launch's scoring mirrors instead.
        Request.num_scoring = self.decoder.num_scoring
        waits = [self.events[s] for s in waited if s in self.events]
        buffers = self.buffers.get(side)
        if buffers is None:
            buffers = self.buffers[side] = HostBuffers.make(
                self.runner.ops, self.config.scheduler.max_num_seqs)
        # A launch that fails here ends this process: rank 0 sees the worker gone at once,
        # rather than waiting in a collective this rank would never join.
        with self.runner.comm.on_lane(side):
            self.events[seq] = self.runner.launch(work, waits, buffers).event
        if len(self.events) > KEPT_EVENTS:
            del self.events[next(iter(self.events))]

    def _carry(self, token: int | None, final: bool) -> BatchCarry | None:
        if token is None:
            return None
        carry = self.carries.setdefault(token, BatchCarry())
        if final:
            del self.carries[token]
        return carry


def main() -> int:
    rank, size, port, config, arch, max_model_len = pickle.load(sys.stdin.buffer)
    ignore_group_signals()  # rank 0's process stops this one (its control channel closes)
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(message)s")
    device = rank_device(config.device.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # CPU ranks share the cores rather than each spinning on all of them
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    config = replace(config, device=replace(config.device, device=str(device)))
    store = dist.TCPStore("127.0.0.1", port, size, False)
    store.set(f"alive/{rank}", "1")
    comm = TPComm.connect(store, rank, size, device)
    runner = ModelRunner(config, arch, max_model_len, comm=comm)
    try:
        TPFollower(runner, config).serve()
    except RuntimeError as exc:  # rank 0 is gone: nothing left to serve
        log.warning("control channel closed (%s); exiting", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
