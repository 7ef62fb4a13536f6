"""``pdserve profile``: time the engine's own launches, fit the latency predictor, save it.

What is timed is exactly what the multiplex loop launches: decode steps (graph replay of
the partition's graphs, plus sampling) and prefill pieces (layer ranges of a prefill
batch), each alone and co-running with the other phase on the complementary SMs, and
whole-GPU mixed steps through ``ModelRunner.execute``. Rows become ``ProfileRecord``s; the
predictor is fitted on 80% of them and its error measured on the other 20% (targets:
median <= 5%, P95 <= 15%), then refitted on all rows and saved with that held-out error
and the raw rows, keyed by (GPU, model), where ``--schedule multiplex`` finds it.

The grid is sparse on purpose (the device budget is minutes): few SM counts (the
predictor interpolates in 1 / SMs), few batch / context / token points that span the
regimes (weight-bound, KV-bound, compute-bound), CUDA events, and few repeats.

Co-running rows: for each decode grid point, a queue of prefill pieces goes on the prefill
stream, long enough by the partition's alone rows to outlast the point's decode turn, and
the turn follows on the decode stream (a point whose steps were not all kept runs once
more beside a queue twice as long). A launch counts as co-running only if the other stream
was busy for its whole span (event timestamps), so the edges of each run are dropped
rather than mislabelled.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.engine.launch import HostBuffers
from pdserve.engine.setup import default_profile_dir, gpu_name, model_key
from pdserve.gpu.partitions import Partition
from pdserve.progress import progress as progress_bar
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.sched.base import BatchCarry, Plan, ScheduledRequest, Work
from pdserve.sched.predictor import (
    LatencyPredictor,
    ProfileRecord,
    predictor_path,
    stratified_split,
)

log = logging.getLogger(__name__)


# Decode steps per grid point beside its prefill queue (a turn).
STEPS_PER_TURN = 3
# How many times over a decode point's prefill queue is sized to outlast its turn as timed
# alone: beside prefill a decode step runs slower (the partitions share memory bandwidth),
# and the queue's time is estimated from other pieces than its own.
CO_COVER = 2.0


@dataclass(frozen=True)
class ProfileGrid:
    # The engine's default splits (``mux_decode_sms``): every split the planner may pick has
    # its own rows. The whole GPU is always profiled too.
    decode_sms: tuple[int, ...] = (16, 24, 32, 48, 64)
    # (batch, context per request); points whose KV does not fit the pool are skipped
    # The long-context points (16K of prefix or context) are where long-prompt serving runs
    # (LooGLE-like: 12-20K prompts beside a few decodes); without them those shapes are
    # extrapolated from 8K.
    # The last two are where ShareGPT-like serving decodes (50-180 requests of ~450
    # tokens): every other point past batch 16 holds 131K tokens, so the fit could not tell
    # batch from context there, and on the H200 (a11edb9 profile) decode alone at 32-190
    # requests ran 1.16-1.39x what it predicted.
    decode_points: tuple[tuple[int, int], ...] = (
        (1, 1024), (1, 8192), (8, 2048), (16, 1024), (16, 8192), (32, 4096), (64, 2048),
        (128, 1024), (2, 16384), (48, 512), (160, 384))
    # (new tokens, prefix tokens, layers); layers 0 means all of them. The 128-token points:
    # without a row under 256 tokens, held-out mixed steps of 128 prompt tokens beside 32
    # decodes were predicted 31-48% slow (the 3edb18c profile, 6 of 10 splits at target).
    # The last four are neighbours in the bend from reading the weights to computing
    # (~200 tokens on the H200): with one row per shape there, a split that held it out
    # missed P95 15% (the 20d5278 profile, 7 of 10: 128 tokens whole-model +25%, 256 over 6
    # layers +21-25%, 256 over a 16K prefix -16-19%).
    prefill_points: tuple[tuple[int, int, int], ...] = (
        (256, 0, 6), (256, 0, 0), (256, 8192, 24), (1024, 0, 6), (1024, 0, 24),
        (1024, 0, 0), (1024, 8192, 6), (1024, 8192, 0), (4096, 0, 6), (4096, 0, 24),
        (4096, 4096, 12), (4096, 0, 0), (2048, 2048, 0), (512, 0, 12), (512, 16384, 0),
        (256, 16384, 24), (2048, 12288, 6), (128, 0, 0), (128, 8192, 12),
        (192, 0, 0), (256, 0, 24), (384, 0, 6), (192, 16384, 24))
    # pieces queued on the prefill stream while decode runs beside them (layers > 0 only:
    # a piece that samples copies from pageable memory, which would stall the queueing).
    # The last ends inside a 128-row GEMM tile: without one, a group's tile count is its
    # tokens over 128 and the fit cannot price the steps (the 06d5640 profile's co-running
    # groups, all pieces multiples of 256).
    co_prefill_points: tuple[tuple[int, int, int], ...] = (
        (512, 0, 6), (1024, 0, 12), (2048, 0, 6), (2048, 4096, 12), (4096, 0, 6),
        (1024, 8192, 6), (256, 0, 24), (4096, 0, 3), (768, 2048, 12), (3072, 0, 4),
        (2048, 16384, 3), (192, 0, 24))
    # The most rounds (each co-running piece once) in one decode point's queue, its retry's
    # included, which bounds the phase. What the bound costs: a turn that outlasts this
    # many rounds keeps no rows (~2 s of prefill beside 16 decode SMs on the H200, where a
    # round takes ~0.35 s and a turn of 128 x 1K ~0.37 s alone); and a partition's phase
    # may take up to 11 points x 2 queues x 6 rounds, ~45 s there, where as sized it takes
    # ~5-6 s (1-4 rounds a point).
    co_rounds_max: int = 6
    # (chunk tokens, prefix, decode batch, decode context per request)
    mixed_points: tuple[tuple[int, int, int, int], ...] = (
        (256, 0, 16, 2048), (1024, 0, 16, 2048), (2048, 0, 32, 1024), (512, 4096, 8, 8192),
        (1024, 2048, 64, 1024), (128, 0, 32, 4096), (384, 16384, 2, 16384),
        (256, 12288, 1, 16384), (512, 8192, 3, 12288))
    repeats: int = 2
    warmup: int = 1

    @property
    def max_tokens(self) -> int:
        points = [t + p for t, p, _ in self.prefill_points + self.co_prefill_points]
        points += [c + p for c, p, _, _ in self.mixed_points]
        return max(points + [ctx + 1 for _, ctx in self.decode_points])

    @property
    def decode_batches(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self.decode_points}))

    def scaled(self, num_layers: int) -> ProfileGrid:
        """Layer counts written for 48 layers, scaled to the model (at least one)."""
        scale = lambda k: 0 if k == 0 else max(1, min(num_layers, round(k * num_layers / 48)))
        return replace(
            self,
            prefill_points=tuple((t, p, scale(k)) for t, p, k in self.prefill_points),
            co_prefill_points=tuple((t, p, scale(k)) for t, p, k in self.co_prefill_points))


QUICK_GRID = ProfileGrid(
    decode_sms=(16,), decode_points=((1, 64), (2, 32), (4, 64), (8, 16), (2, 128),
                                        (1, 200), (8, 100), (3, 50)),
    prefill_points=tuple((t, p, k) for t in (16, 64, 128) for p in (0, 64) for k in (12, 0)),
    co_prefill_points=tuple((t, p, k) for t in (16, 64, 128) for p in (0, 32) for k in (12, 24)),
    co_rounds_max=1, mixed_points=((32, 0, 2, 64), (64, 0, 4, 32), (16, 16, 1, 64)), repeats=1,
    warmup=0)


# ------------------------------------------------------------------- timing


class Clock:
    """Launch spans: CUDA events on the launch's stream, or wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self, stream: Any) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class Span:
    start: Any
    end: Any
    row: dict  # ProfileRecord fields but the latency


@dataclass(frozen=True)
class QueuedPiece:
    plan: Plan
    tokens: int
    prefix: int
    layers: int


class PrefillQueue:
    """The co-running pieces, handed out in a cycle: each decode point's queue starts where
    the last one stopped, so every piece gets co-running rows (those kept are the ones that
    ran beside the decode turn, near a queue's start)."""

    def __init__(self, pieces: list[QueuedPiece]):
        self.pieces, self._next = pieces, 0

    def upcoming(self, count: int) -> list[QueuedPiece]:
        return [self.pieces[(self._next + i) % len(self.pieces)] for i in range(count)]

    def take(self, count: int) -> list[QueuedPiece]:
        taken = self.upcoming(count)
        self._next = (self._next + count) % len(self.pieces)
        return taken


# ------------------------------------------------------------------ fixtures


class Fixtures:
    """Requests holding KV blocks at a given context, made without the scheduler."""

    def __init__(self, engine):
        self.engine = engine
        self.blocks, self.tables = engine.blocks, engine.runner.tables
        self.params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.vocab = engine.arch.vocab_size
        self._live: list[Request] = []
        self._ids = 0

    def request(self, context: int, new_tokens: int) -> Request | None:
        """A request with ``context`` tokens computed and ``new_tokens`` to compute."""
        self._ids += 1
        total = context + new_tokens
        tokens = [(i * 7919) % (self.vocab - 3) + 3 for i in range(total)]
        request = Request(f"profile-{self._ids}", tokens, self.params)
        if not self.blocks.grow(request, total):
            self.blocks.free(request)
            return None
        request.num_computed, request.status = context, RequestStatus.RUNNING
        self._live.append(request)
        return request

    def decode_plan(self, batch: int, context: int) -> Plan | None:
        plan = Plan()
        for _ in range(batch):
            request = self.request(context - 1, 1)
            if request is None:
                self.free(plan)
                return None
            plan.decodes.append(ScheduledRequest(request, 1))
        return plan

    def prefill_plan(self, tokens: int, prefix: int) -> Plan | None:
        request = self.request(prefix, tokens)
        return None if request is None else Plan(prefills=[ScheduledRequest(request, tokens)])

    def mixed_plan(self, tokens: int, prefix: int, batch: int, context: int) -> Plan | None:
        """A prompt chunk of ``tokens`` behind ``prefix`` cached ones, beside ``batch``
        decodes at ``context`` (none when ``batch`` is 0); None when the pool cannot hold it."""
        plan = self.decode_plan(batch, context) if batch else Plan()
        prefill = self.prefill_plan(tokens, prefix) if plan is not None else None
        if prefill is None:
            self.release()
            return None
        plan.prefills = prefill.prefills
        return plan

    def free(self, plan: Plan) -> None:
        for item in plan.scheduled:
            self._drop(item.request)
            self._live.remove(item.request)

    def release(self) -> None:
        for request in self._live:
            self._drop(request)
        self._live.clear()

    def _drop(self, request: Request) -> None:
        self.blocks.free(request)
        self.tables.drop(request.request_id)


# ------------------------------------------------------------------ profiler


class Profiler:
    def __init__(self, engine, grid: ProfileGrid, progress: Callable[[str], None] = log.info):
        self.engine, self.policy, self.runner = engine, engine.scheduler, engine.runner
        self.ops = self.runner.ops
        self.grid = grid.scaled(self.runner.model.num_layers)
        self.clock = Clock(self.runner.device)
        self.fixtures = Fixtures(engine)
        self.buffers = HostBuffers.make(self.ops, engine.config.scheduler.max_num_seqs)
        self.progress = progress
        self.rows: list[dict] = []
        self.launch_ms: list[float] = []  # host time to issue prefill pieces

    def run(self) -> list[dict]:
        phases = self._phases()
        bar = progress_bar(total=len(phases), desc="profiling", unit="phase")
        for name, fn, args in phases:
            bar.set_postfix_str(name)
            self._phase(name, fn, *args)
            bar.update(1)
        bar.close()
        return self.rows

    def _phases(self) -> list[tuple[str, Callable, tuple]]:
        phases: list[tuple[str, Callable, tuple]] = []
        for part in [*self.policy.partitions.choices(), self.policy.partitions.whole_gpu]:
            phases.append((f"decode alone on {part.decode_sms} SMs", self._decode_alone,
                           (part,)))
            phases.append((f"prefill alone on {part.prefill_sms} SMs", self._prefill_alone,
                           (part,)))
            if not part.whole_gpu:
                phases.append((f"co-running on {part.decode_sms}/{part.prefill_sms} SMs",
                               self._co_running, (part,)))
        phases.append(("mixed steps on the whole GPU", self._mixed, ()))
        return phases

    def _phase(self, name: str, fn, *args) -> None:
        started, before = time.perf_counter(), len(self.rows)
        try:
            fn(*args)
        finally:
            self.fixtures.release()
        self.progress(f"{name}: {len(self.rows) - before} rows in "
                      f"{time.perf_counter() - started:.1f} s")

    # ---- decode

    def _decode_alone(self, part: Partition) -> None:
        for batch, context in self.grid.decode_points:
            plan = self.fixtures.decode_plan(batch, context)
            if plan is None:
                continue
            ms = self._timed(part.decode_stream, lambda p=plan: self._decode(p, part))
            self._add("decode", batch, batch * context, batch, part.decode_sms, False, ms)
            self.fixtures.release()

    def _decode(self, plan: Plan, part: Partition) -> None:
        self.runner.launch(Work(plan, part), [], self.buffers)

    # ---- prefill

    def _prefill_alone(self, part: Partition) -> None:
        for tokens, prefix, layers in self.grid.prefill_points:
            plan = self.fixtures.prefill_plan(tokens, prefix)
            if plan is None:
                continue
            ms = self._timed(part.prefill_stream, lambda p=plan, k=layers:
                             self._piece(p, part, k))
            self._add("prefill", tokens, prefix, 1, part.prefill_sms, False, ms,
                      num_layers=layers or None)
            self.fixtures.release()

    def _piece(self, plan: Plan, part: Partition, layers: int) -> None:
        total = self.runner.model.num_layers
        end = min(total, layers or total)
        work = Work(plan, part, "prefill", layers=(0, end), final=end == total,
                    carry=BatchCarry())
        self.launch_ms.append(self.runner.launch(work, [], self.buffers).launch_ms)

    def _timed(self, stream: Any, fn: Callable[[], None]) -> float:
        """Median over repeats of one launch's span on ``stream`` (after warm-up)."""
        for _ in range(self.grid.warmup):
            fn()
        spans = []
        for _ in range(max(1, self.grid.repeats)):
            with self.ops.on(stream):
                start = self.clock.mark(stream)
                fn()
                spans.append((start, self.clock.mark(stream)))
        self.clock.sync()
        return statistics.median(self.clock.ms(a, b) for a, b in spans)

    # ---- co-running

    def _co_running(self, part: Partition) -> None:
        """Every decode grid point's turn beside a prefill queue of its own, sized from this
        partition's alone rows to outlast the turn; a point whose steps were not all kept
        runs once more beside a queue twice as long. One queue run until it drained gave the
        a11edb9 profile co-running decode only up to batch 16 on 16-32 decode SMs (never
        128) where ShareGPT-like splits ran 50-180: on a small decode partition a queue
        drained within a few turns, and a large batch's steps seldom fit inside one."""
        queue = self._co_queue()
        if not queue.pieces:
            return
        missed = []
        for batch, context in self.grid.decode_points:
            plan = self.fixtures.decode_plan(batch, context)
            if plan is None:  # its KV does not fit beside the queue's
                missed.append((batch, context))
                continue
            if not self._co_point(part, queue, plan, batch, context):
                missed.append((batch, context))
            self.fixtures.free(plan)  # the turn ran: nothing on the GPU reads it any more
        if missed:
            self.progress(f"co-running on {part.decode_sms} SMs: (batch, context) points "
                          f"with a step not kept beside prefill, or no KV room: {missed}")

    def _co_queue(self) -> PrefillQueue:
        """The co-running pieces' plans, made once: their KV is held for the phase, as every
        decode point's queue runs them again."""
        pieces = []
        for tokens, prefix, layers in self.grid.co_prefill_points:
            plan = self.fixtures.prefill_plan(tokens, prefix)
            if plan is not None:
                pieces.append(QueuedPiece(plan, tokens, prefix, layers))
        return PrefillQueue(pieces)

    def _co_point(self, part: Partition, queue: PrefillQueue, plan: Plan, batch: int,
                  context: int) -> bool:
        """One decode point's turn beside a queue sized to outlast it, and at most once
        more beside a queue twice as long; whether every step of a turn was kept."""
        turn_ms = self._turn_ms(part, batch, context)
        for times_as_long in (1, 2):
            cover_ms = None if turn_ms is None else times_as_long * CO_COVER * turn_ms
            pieces = queue.take(self._queue_length(part, queue, cover_ms))
            if self._co_turn(part, pieces, plan, batch, context):
                return True
        return False

    def _co_turn(self, part: Partition, pieces: list[QueuedPiece], plan: Plan, batch: int,
                 context: int) -> bool:
        """The queue, then one decode turn beside it on the other stream; the host waits
        for both before the next turn, so it is never more than one turn ahead of the GPU
        (the 1fcf915 profile's host, unchecked, ran hundreds of turns ahead and counted
        turns launched as turns run). Whether every step was kept."""
        spans = self._queue_pieces(part, pieces)
        decodes = [self._co_decode(plan, part, part.decode_stream, batch, context)
                   for _ in range(STEPS_PER_TURN)]
        self.clock.sync()
        return self._keep_overlapping(spans, decodes) == len(decodes)

    def _turn_ms(self, part: Partition, batch: int, context: int) -> float | None:
        """A decode turn's time alone on this partition, from its decode-alone row nearest in
        batch, then in context (None before any)."""
        rows = [r for r in self.rows if r["phase"] == "decode" and not r["co_running"]
                and r["sms"] == part.decode_sms]
        if not rows:
            return None
        kv = batch * context
        nearest = min(rows, key=lambda r: (abs(r["batch_size"] - batch),
                                           abs(r["context_tokens"] - kv)))
        return STEPS_PER_TURN * nearest["latency_ms"]

    def _queue_length(self, part: Partition, queue: PrefillQueue, cover_ms: float | None
                      ) -> int:
        """Pieces, from the queue's next one on, whose estimated time less the host's time
        to issue them is ``cover_ms`` (the GPU runs the queue while the host still issues
        it); the most the grid allows when nothing was timed to size it from."""
        most = self.grid.co_rounds_max * len(queue.pieces)
        rate = self._prefill_ms_per_token_layer(part)
        if cover_ms is None or rate is None:
            return most
        # On a CPU a launch has run when it returns: there is no queue to outrun.
        lag = statistics.median(self.launch_ms) if self.clock.cuda and self.launch_ms else 0.0
        covered, length = 0.0, 0
        for piece in queue.upcoming(most):
            if covered >= cover_ms:
                break
            covered += rate * piece.tokens * piece.layers - lag
            length += 1
        return max(1, length)

    def _prefill_ms_per_token_layer(self, part: Partition) -> float | None:
        """The fastest prefill-alone rate on this partition's prefill side: a queue estimated
        from it runs at least as long as estimated (prefixes and small, weight-bound pieces
        only make it slower)."""
        total = self.runner.model.num_layers
        rates = [r["latency_ms"] / (r["num_tokens"] * (r["num_layers"] or total))
                 for r in self.rows if r["phase"] == "prefill" and not r["co_running"]
                 and r["sms"] == part.prefill_sms]
        return min(rates) if rates else None

    def _queue_pieces(self, part: Partition, pieces: list[QueuedPiece]) -> list[Span]:
        spans, stream = [], part.prefill_stream
        with self.ops.on(stream):
            for piece in pieces:
                start = self.clock.mark(stream)
                self._piece(piece.plan, part, piece.layers)
                row = dict(phase="prefill", num_tokens=piece.tokens,
                           context_tokens=piece.prefix, batch_size=1, sms=part.prefill_sms,
                           co_running=True, num_layers=piece.layers or None)
                spans.append(Span(start, self.clock.mark(stream), row))
        return spans

    def _co_decode(self, plan: Plan, part: Partition, stream: Any, batch: int, context: int
                   ) -> Span:
        with self.ops.on(stream):
            start = self.clock.mark(stream)
            self._decode(plan, part)
            row = dict(phase="decode", num_tokens=batch, context_tokens=batch * context,
                       batch_size=batch, sms=part.decode_sms, co_running=True)
            return Span(start, self.clock.mark(stream), row)

    def _keep_overlapping(self, pieces: list[Span], decodes: list[Span]) -> int:
        """Rows whose whole span lies inside the other stream's busy span; returns how many
        decode rows were kept."""
        if not pieces or not decodes:
            return 0
        if not self.clock.cuda:  # the CPU runs them one after the other: plumbing only
            for span in pieces + decodes:
                self._add_row(span.row, self.clock.ms(span.start, span.end))
            return len(decodes)
        origin = pieces[0].start
        at = lambda event: origin.elapsed_time(event)
        busy = {"prefill": (at(pieces[0].start), at(pieces[-1].end)),
                "decode": (at(decodes[0].start), at(decodes[-1].end))}
        kept = 0
        for span in pieces + decodes:
            other = busy["decode" if span.row["phase"] == "prefill" else "prefill"]
            if other[0] <= at(span.start) and at(span.end) <= other[1]:
                self._add_row(span.row, self.clock.ms(span.start, span.end))
                kept += span.row["phase"] == "decode"
        return kept

    # ---- mixed

    def _mixed(self) -> None:
        total = self.policy.partitions.total_sms
        for chunk, prefix, batch, context in self.grid.mixed_points:
            plan = self.fixtures.mixed_plan(chunk, prefix, batch, context)
            if plan is None:
                continue
            ms = self._wall(lambda p=plan: self.runner.execute(p))
            self._add("mixed", chunk, prefix, 1, total, False, ms, decode_batch=batch,
                      decode_context=batch * context)
            self.fixtures.release()

    def _wall(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.grid.warmup):
            fn()
        times = []
        for _ in range(max(1, self.grid.repeats)):
            self.clock.sync()
            started = time.perf_counter()
            fn()  # ends with a host copy of the tokens: the step is done when it returns
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    # ---- rows

    def _add(self, phase: str, tokens: int, context: int, batch: int, sms: int, co: bool,
             ms: float, **extra) -> None:
        self._add_row(dict(phase=phase, num_tokens=tokens, context_tokens=context,
                           batch_size=batch, sms=sms, co_running=co, **extra), ms)

    def _add_row(self, row: dict, ms: float) -> None:
        self.rows.append(asdict(ProfileRecord(**row, latency_ms=float(ms))))


# ------------------------------------------------------------------ fitting


@dataclass
class ProfileResult:
    path: str
    gpu: str
    model: str
    num_rows: int
    held_out: dict
    by_phase: dict = field(default_factory=dict)
    seconds: float = 0.0
    prefill_launch_ms_p50: float = 0.0


def fit_and_save(rows: list[dict], path: Path, *, gpu: str, model: str, num_layers: int,
                 total_sms: int, extra: dict | None = None) -> tuple[LatencyPredictor, dict]:
    """Held-out error of a fit on 80% of the rows; the saved predictor uses all of them."""
    train, test = stratified_split(rows, test_fraction=0.2, seed=0)
    names = dict(gpu_name=gpu, model_name=model, num_layers=num_layers, total_sms=total_sms)
    held = LatencyPredictor.fit(train, **names)
    held_out = held.evaluate(test)
    by_phase = {phase: held.evaluate([r for r in test if r["phase"] == phase])
                for phase in ("decode", "prefill", "mixed")}
    predictor = LatencyPredictor.fit(rows, **names)
    data = {**predictor.to_json(), "held_out": held_out, "held_out_by_phase": by_phase,
            **(extra or {}), "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return predictor, {"all": held_out, **by_phase}


def profile_engine(engine, grid: ProfileGrid, out: Path | None = None) -> ProfileResult:
    """Profiles a multiplex ``EngineCore`` and saves its predictor; returns the summary."""
    started = time.perf_counter()
    profiler = Profiler(engine, grid)
    rows = profiler.run()
    device, total = engine.runner.device, engine.scheduler.partitions.total_sms
    gpu, model = gpu_name(device), model_key(engine.config)
    path = out if out is not None and out.suffix == ".json" else predictor_path(
        out or default_profile_dir(), gpu, model)
    launch = statistics.median(profiler.launch_ms) if profiler.launch_ms else 0.0
    seconds = time.perf_counter() - started
    _, errors = fit_and_save(rows, path, gpu=gpu, model=model,
                             num_layers=engine.runner.model.num_layers, total_sms=total,
                             extra={"profile_seconds": seconds, "prefill_launch_ms_p50": launch,
                                    "grid": asdict(profiler.grid)})
    return ProfileResult(str(path), gpu, model, len(rows), errors["all"], errors, seconds,
                         launch)


# ------------------------------------------- CLI (its parser: profile_args.py, without torch)


def engine_for_profile(model: str, grid: ProfileGrid, max_model_len: int = 0, **options
                       ) -> Any:
    """A multiplex engine whose partitions and decode graphs are the grid's."""
    from pdserve.engine.core import EngineCore

    config = EngineConfig.from_flat(
        model=model, schedule="multiplex", enable_prefix_caching=False,
        mux_predictor="roofline",  # what is being profiled is the model it replaces
        mux_decode_sms=",".join(map(str, grid.decode_sms)),
        mux_graph_batches=",".join(map(str, grid.decode_batches)),
        max_num_batched_tokens=max(t for t, _, _ in grid.prefill_points),
        max_num_seqs=max(256, max(grid.decode_batches)),
        max_model_len=max(grid.max_tokens + 16, max_model_len), **options)
    return EngineCore(config)


def grid_from_args(args: argparse.Namespace) -> ProfileGrid:
    grid = QUICK_GRID if args.quick else ProfileGrid()
    if args.decode_sms:
        grid = replace(grid, decode_sms=tuple(int(s) for s in args.decode_sms.split(",")))
    if args.repeats:
        grid = replace(grid, repeats=args.repeats)
    return grid


def run(args: argparse.Namespace) -> int:
    grid = grid_from_args(args)
    options = dict(load_format=args.load_format, dtype=args.dtype, device=args.device,
                   tensor_parallel_size=args.tensor_parallel_size)
    if args.device != "cpu":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    engine = engine_for_profile(args.model, grid, **options)
    result = profile_engine(engine, grid, Path(args.out) if args.out else None)
    print(json.dumps(asdict(result), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdserve.engine.profile_args import add_parser

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
