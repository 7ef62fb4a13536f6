"""Tensor parallelism around ``ModelRunner``: rank 0 (the engine process) drives the others.

The one scheduler runs on rank 0. Every launch is broadcast once, as a compact plan (pickled,
over the gloo control group), before rank 0 issues it; each worker rebuilds the ``Work`` and
runs the same ``ModelRunner.launch`` on its shard, so the collectives inside the model meet
in the same order on every rank. What else changes the workers' state travels with the next
launch: requests forgotten, KV moved between pools (disagg).

Only rank 0's sampled tokens are used: a request's sampling state (seeded generators,
penalties over its output) lives on rank 0 alone. Workers mirror only what the forward
needs (the step's new tokens, positions, page ids) and pick greedily from the same
gathered logits, a result nobody reads, so that every rank runs one launch path.

A worker that dies stops the engine (``TPGroupBroken``): the model cannot run without its
shard. So does a launch that fails on one rank only: the others are then inside collectives
the failed rank never joins, and every later collective would pair with the wrong one.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.dist.comm import TPComm
from pdserve.dist.shard import TPShard, tp_refusal
from pdserve.gpu.partitions import Partition
from pdserve.model.arch import ModelArch
from pdserve.sampling_params import SamplingParams
from pdserve.sched.base import BatchCarry, KVMove, Plan, ScheduledRequest, Work
from pdserve.transfer.heads import HEAD_DIM, head_shard, join_head_shards
from pdserve.transfer.kv_blocks import host_empty

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a worker imports torch and connects before this
KEPT_EVENTS = 1024  # launch events a later launch may still name as a wait
PartKey = tuple[int, int, bool]


class TPGroupBroken(BaseException):
    """The ranks can no longer run in step (a worker died, or a launch failed on rank 0
    after the workers were sent it). A BaseException so that no per-launch handler takes it
    for one bad batch: the engine must stop (the server then starts a fresh one)."""


def part_key(part: Partition | None) -> PartKey | None:
    return None if part is None else (part.decode_sms, part.prefill_sms, part.whole_gpu)


def check_tp_config(config: EngineConfig, arch: ModelArch) -> None:
    """Refuses, in one line and before any weight loads, what cannot run split."""
    size = config.device.tensor_parallel_size
    why = tp_refusal(arch, size)
    first = _first_gpu(config)
    if why is None and size > 1 and first is not None and \
            torch.cuda.device_count() < first + size:
        why = (f"--tensor-parallel-size {size} from GPU {first} needs GPUs {first}.."
               f"{first + size - 1}, {torch.cuda.device_count()} visible")
    if why is not None:
        raise ValueError(why)


def _first_gpu(config: EngineConfig) -> int | None:
    """Rank 0's GPU index (the others follow it), or None on the CPU."""
    name = config.device.device
    if name.startswith("cuda"):
        return torch.device(name).index or 0
    return 0 if name == "auto" and torch.cuda.is_available() else None


# ---- the plan as it travels ----


@dataclass
class PlanEncoder:
    """Rank 0: each scheduled request as (id, position, its new tokens, samples, preemptions,
    page ids the worker lacks). Page ids follow the rule ``BlockTables`` applies: only the
    ones added since last sent, all of them after a preemption or on another pool."""

    sent: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  # id, pool

    def encode(self, plan: Plan, pool: str) -> tuple[list, list]:
        return ([self._one(s, pool) for s in plan.decodes],
                [self._one(s, pool) for s in plan.prefills])

    def _one(self, item: ScheduledRequest, pool: str) -> tuple:
        request = item.request
        sent, blocks = self.sent.setdefault(request.request_id, {}), request.block_ids
        filled, preemptions = sent.get(pool, (0, -1))
        if preemptions != request.num_preemptions or len(blocks) < filled:
            filled = -1  # the worker replaces its list
        sent[pool] = (len(blocks), request.num_preemptions)
        start = request.num_computed
        tokens = request.token_ids[start:start + item.num_new_tokens]
        return (request.request_id, start, tokens, item.samples, request.num_preemptions,
                filled, blocks[max(filled, 0):], _scoring(request, start, len(tokens)))

    def forget(self, request_id: str, pool: str | None = None) -> None:
        forget_request(self.sent, request_id, pool)


def _scoring(request, start: int, num_new: int) -> tuple | None:
    """What a worker needs to score the prompt as rank 0 does (its LM head's all-gathers
    must meet rank 0's): the width asked for, the prompt's length and the prompt tokens the
    step's positions score (position p scores token p + 1)."""
    if not request.scores_prompt:
        return None
    targets = request.prompt_token_ids[start + 1:start + 1 + num_new]
    return request.params.prompt_logprobs, request.num_prompt_tokens, targets


def forget_request(by_request: dict[str, dict], request_id: str, pool: str | None) -> None:
    """Drops what is kept of ``request_id`` on ``pool``, or on every pool when None."""
    if pool is None:
        by_request.pop(request_id, None)
    else:
        by_request.get(request_id, {}).pop(pool, None)


class TokenWindow:
    """The tokens of a request that a step reads, indexed by their position in the request."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        """The request's length up to the window's end: every token before it is known."""
        return self.start + len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.tokens[index.start - self.start:index.stop - self.start]
        return self.tokens[index - self.start]


class MirrorRequest:
    """What a worker's forward reads of a request; greedy, with no sampling state."""

    __slots__ = ("request_id", "num_computed", "token_ids", "block_ids", "num_preemptions",
                 "params", "generator", "scores_prompt", "num_prompt_tokens",
                 "prompt_token_ids")
    PARAMS = SamplingParams(temperature=0)
    # What the step's batch building and sampling read of a real request, at the values a
    # worker needs: no grammar nor bad words, no placeholder ids (overlap is off under TP).
    grammar = allowed_ids = None
    bad_words = ()
    num_placeholders = placeholder_row = 0

    def __init__(self, request_id: str) -> None:
        self.request_id, self.block_ids, self.num_preemptions = request_id, [], 0
        self.params, self.generator = self.PARAMS, None
        self.score(None, 0)

    def score(self, scoring: tuple | None, start: int) -> None:
        """Scores the prompt in this step as rank 0's request does, or not at all."""
        self.scores_prompt = scoring is not None
        if scoring is None:
            self.params, self.num_prompt_tokens, self.prompt_token_ids = self.PARAMS, 0, ()
            return
        width, self.num_prompt_tokens, targets = scoring
        if self.params.prompt_logprobs != width:
            self.params = SamplingParams(temperature=0, prompt_logprobs=width)
        self.prompt_token_ids = TokenWindow(start + 1, targets)


@dataclass
class PlanDecoder:
    """A worker: the mirrored requests, by (pool, id), kept between launches."""

    mirrors: dict[str, dict[str, MirrorRequest]] = field(default_factory=dict)  # id, pool
    num_scoring: int = 0  # requests of the plan last decoded that score their prompt

    def decode(self, encoded: tuple[list, list], pool: str) -> Plan:
        decodes, prefills = encoded
        self.num_scoring = 0
        return Plan(decodes=[self._one(e, pool) for e in decodes],
                    prefills=[self._one(e, pool) for e in prefills])

    def _one(self, entry: tuple, pool: str) -> ScheduledRequest:
        request_id, start, tokens, samples, preemptions, filled, blocks, scoring = entry
        by_pool = self.mirrors.setdefault(request_id, {})
        mirror = by_pool.get(pool)
        if mirror is None:
            mirror = by_pool[pool] = MirrorRequest(request_id)
        if filled < 0:
            mirror.block_ids = blocks
        else:
            mirror.block_ids.extend(blocks)
        mirror.num_computed, mirror.num_preemptions = start, preemptions
        mirror.token_ids = TokenWindow(start, tokens)
        mirror.score(scoring, start)
        self.num_scoring += scoring is not None
        return _scheduled(mirror, len(tokens), samples)

    def forget(self, request_id: str, pool: str | None = None) -> None:
        forget_request(self.mirrors, request_id, pool)


def _scheduled(mirror: MirrorRequest, num_new_tokens: int, samples: bool) -> ScheduledRequest:
    # Built field by field: ``ScheduledRequest`` would derive ``samples`` from the whole
    # token list, which a mirror does not hold.
    item = ScheduledRequest.__new__(ScheduledRequest)
    item.request, item.num_new_tokens, item.samples = mirror, num_new_tokens, samples
    return item


@dataclass(frozen=True)
class KVHeadSplit:
    """Which KV heads each rank holds (``transfer/heads.py``): rank r the ``count`` from
    ``starts[r]``, of the model's ``total``."""

    starts: list[int]
    count: int
    total: int

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return join_head_shards(shards, self.starts, self.total)

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        if whole.shape[HEAD_DIM] != self.total:
            raise ValueError(f"a KV buffer of {whole.shape[HEAD_DIM]} heads for a model with "
                             f"{self.total} KV heads")
        return [head_shard(whole, start, self.count) for start in self.starts]


# ---- rank 0 ----


class TPLeader:
    """Rank 0's side: starts one worker process per other rank and sends them the launches."""

    def __init__(self, config: EngineConfig, arch: ModelArch, max_model_len: int,
                 device: torch.device) -> None:
        self.size = config.device.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False)
        self.workers = [_spawn(rank, self.size, store.port, config, arch, max_model_len)
                        for rank in range(1, self.size)]
        # Dropped without ``close``: the workers are killed rather than left waiting.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.workers), 0.0)
        self._wait_alive(store)
        self.comm = TPComm.connect(store, 0, self.size, device)
        self._store = store  # the workers' rendezvous; kept while the group lives
        self.encoder = PlanEncoder()
        shards = [TPShard(arch, rank, self.size) for rank in range(self.size)]
        self.kv_heads = KVHeadSplit([s.kv_head_start for s in shards], shards[0].num_kv_heads,
                                    arch.num_kv_heads)
        self._pending: list[tuple] = []
        self._carries: dict[int, tuple[int, BatchCarry]] = {}
        self._event_seq: dict[int, int] = {}
        self._seq = 0
        self.broken = False  # out of step: workers are killed, not told to stop
        log.info("tensor parallel: %d ranks (workers %s)", self.size,
                 [p.pid for p in self.workers])

    def _wait_alive(self, store: dist.TCPStore) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.size):
            while not store.check([f"alive/{rank}"]):
                self.check_workers()
                if time.monotonic() > deadline:
                    raise TPGroupBroken(f"tensor-parallel rank {rank} did not start within "
                                     f"{START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)

    def check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                self.broken = True
                raise TPGroupBroken(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                 f"code {code}; the engine cannot run without its shard")

    def _name_dead_worker(self, wait_s: float = 2.0) -> None:
        """After a collective failed: raises naming the worker that died, once its exit is
        seen (its sockets close a moment before its exit status can be read)."""
        deadline = time.monotonic() + wait_s
        while True:
            self.check_workers()
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _send(self, commands: list[tuple]) -> None:
        self.check_workers()
        with self._control_channel():
            self.comm.broadcast_object(commands)

    @contextmanager
    def _control_channel(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo: a peer's connection closed
            self.broken = True
            self._name_dead_worker()
            raise TPGroupBroken(f"tensor-parallel control channel failed: {exc}") from exc

    # ---- KV across instances (P/D roles) ----

    def gather_kv(self, pool: str, block_ids: list[int], num_tokens: int,
                  own: torch.Tensor) -> torch.Tensor:
        """The whole model's KV of a request from ``own`` (rank 0's gathered shard) and the
        workers' shards, which they gather from their pages on this command."""
        self._send(self._take_pending() + [("gather_kv", pool, list(block_ids), num_tokens)])
        with self._control_channel():
            shards = self.comm.gather_to_first(own.cpu().contiguous(), host_empty)
        return self.kv_heads.join(shards).to(own.device)

    def scatter_kv(self, pool: str, block_ids: list[int], whole: torch.Tensor) -> torch.Tensor:
        """Sends each worker its heads of a received buffer to write into its pages
        ``block_ids``; returns rank 0's heads."""
        pieces = self.kv_heads.split(whole.cpu())
        layout = (tuple(pieces[0].shape), pieces[0].dtype)  # the sender's dtype, maybe not ours
        self._send(self._take_pending() + [("scatter_kv", pool, list(block_ids), layout)])
        with self._control_channel():
            return self.comm.scatter_from_first(pieces, pieces[0])

    # ---- what the runner reports ----

    def configure(self, layout: dict, decode_pool: str, partitions: list | None) -> None:
        keys = None if partitions is None else [part_key(p) for p in partitions]
        self._send(self._take_pending() + [("configure", layout, decode_pool, keys)])

    def forget(self, request_id: str) -> None:
        self.encoder.forget(request_id)
        self._pending.append(("forget", request_id))

    def note_move(self, move: KVMove) -> None:
        rid = move.request.request_id
        self.encoder.forget(rid, move.source_pool)
        self._pending.append(("move", rid, move.source_pool, list(move.source_blocks),
                              move.target_pool, list(move.target_blocks), move.num_tokens,
                              part_key(move.partition)))

    def send_launch(self, work: Work, waits: list) -> None:
        waited = [self._event_seq[id(e)] for e in waits if id(e) in self._event_seq]
        encoded = (self.encoder.encode(work.plan, work.pool), part_key(work.partition),
                   work.side, work.pool, work.layers, work.final, self._carry_token(work))
        self._send(self._take_pending() + [("launch", self._seq, encoded, waited)])

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """Around rank 0's part of a launch the workers were sent: a failure there leaves
        the group out of step."""
        try:
            yield
        except Exception as exc:
            self.broken = True
            self._name_dead_worker()  # the likeliest cause
            raise TPGroupBroken(f"a launch failed on rank 0 after the workers began it "
                                f"({type(exc).__name__}: {exc}); the tensor-parallel group "
                                "is out of step") from exc

    def launched(self, event: Any) -> None:
        """The event of the launch just sent: later launches may name it as a wait."""
        self._event_seq[id(event)] = self._seq
        self._seq += 1
        if len(self._event_seq) > KEPT_EVENTS:
            del self._event_seq[next(iter(self._event_seq))]

    def _carry_token(self, work: Work) -> int | None:
        """The same number for every piece of one prefill batch (its ``BatchCarry``)."""
        if work.carry is None:
            return None
        token, _ = self._carries.setdefault(id(work.carry), (self._seq, work.carry))
        if work.final:
            del self._carries[id(work.carry)]
        return token

    def _take_pending(self) -> list[tuple]:
        pending, self._pending = self._pending, []
        return pending

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        if not self.broken:  # a worker inside a collective would never read "stop"
            try:
                self._send(self._take_pending() + [("stop",)])
            except TPGroupBroken:
                pass
        _stop_processes(self.workers, grace_s=0.0 if self.broken else 10.0)


def _spawn(rank: int, size: int, port: int, config: EngineConfig, arch: ModelArch,
           max_model_len: int) -> subprocess.Popen:
    # A plain subprocess: the server's engine process is a daemon, which multiprocessing
    # forbids to have children.
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.tp_worker"],
                            stdin=subprocess.PIPE, env=os.environ.copy())
    proc.stdin.write(pickle.dumps((rank, size, port, config, arch, max_model_len)))
    proc.stdin.close()
    return proc


def _stop_processes(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Waits ``grace_s`` for each worker to exit (it does on "stop"), then kills it."""
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
