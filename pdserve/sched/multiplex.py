"""The PD-multiplexing policy: decode and prefill in flight at once, each on its own lane.

Lanes
- ``decode``: one decode step in flight (a replay of the chosen partition's own graphs, on
  its decode stream). Under overlap scheduling the next decode step follows it on the same
  split and stream before it completes, its tokens standing as placeholders (two in flight
  at most); the planner decides it with those tokens unknown. Beside a running piece it
  launches as any decode joining one; alone, only while the planner keeps decode alone on
  the whole GPU, else the lane drains and the next boundary with both lanes idle re-plans.
  A mixed (TEMPORAL) step is followed by the next one the same way, on the whole GPU's
  stream, while the planner keeps TEMPORAL. Time-slice decodes run synchronously
  (``overlap_lanes`` says why).
- ``prefill``: one prefill batch at a time, run as pieces (layer ranges) on the prefill
  stream, one piece in flight. Pieces are sized by the planner to last about one decode
  step, so the policy re-plans at every step; with no decode running, the batch takes the
  whole GPU and all its remaining layers in one piece.
- Hand-off: a batch's requests join decode only when its last piece has completed (they are
  in flight until then), and the engine makes every launch wait on the launches it has seen
  complete, so a decode step never reads KV a prefill is still writing.
- TEMPORAL: with both lanes drained, a whole-GPU mixed step (decodes plus a prefill chunk)
  runs on the decode lane, and nothing launches beside it; under overlap scheduling the
  next mixed step may follow it on the same stream (see the decode lane).
- TIME_SLICE: both lanes on the whole GPU's one ordinary stream, so stream order makes them
  alternate: a decode step, then a prefill piece sized to the rest of the ITL budget, then
  the next decode (launched as soon as the previous one completes, queued behind the
  piece), and so on. At each boundary the planner may keep slicing or end it (the other
  lane then drains before any split is taken).

Partition switching rule
The SM sets of two splits overlap, so the partition (the split both lanes use) changes only
when both lanes are drained. While one lane is busy under partition P, the other launches
under P too. When the planner, consulted at a decode boundary, prefers another split, the
switch is *pending*: prefill stops launching pieces under P, decode keeps running on P, and
the next boundary where the prefill lane is idle re-plans freely. A switch costs at most
about one decode step of idle prefill SMs, since pieces last about one step.

On the CPU (emulated partitions, no streams) the same code runs with every launch finishing
as it is issued.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from pdserve.config import MUX_SHARING, SchedulerConfig, mux_sharing_options
from pdserve.gpu.partitions import Partition, PartitionSet
from pdserve.sched.base import BatchCarry, LaneLaunches, Plan, StepOutput, Work
from pdserve.sched.in_flight import InFlightScheduler, decode_load_banked
from pdserve.sched.mux_planner import (
    MuxMode,
    MuxPlan,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    piece_predicted_ms,
)
from pdserve.sched.steps import step_entry

log = logging.getLogger(__name__)
TIMELINE_LENGTH = 20_000  # decisions kept for ``timeline()``; older ones are dropped
# Modes whose decode step runs alone on the whole GPU (its correction: ``decode_alone``).
WHOLE_GPU_DECODE = (MuxMode.DECODE_ONLY, MuxMode.TIME_SLICE)
DECODE_LANE, PREFILL_LANE = "decode", "prefill"


@dataclass
class TimelineEntry:
    """One planning decision that launched work."""

    time: float  # time.monotonic()
    mode: str
    decode_sms: int
    prefill_sms: int
    decode_batch: int
    prefill_tokens: int  # tokens of the prefill piece or chunk launched (0: none)
    prefill_layers: int  # layers of that piece
    predicted_decode_ms: float
    switch_pending: bool
    predicted_cycle_ms: float = 0.0  # the planner's time between two decode tokens
    measured_cycle_ms: float = 0.0  # the decode launch's issue to observed completion
    measured_device_ms: float = 0.0  # that launch on the GPU's clock (0: not timed there)
    # The online correction in the cycle's prediction (mixed steps in temporal, co-running
    # decode in spatial; 1.0 where none applies): how far serving moved the profile.
    calibration: float = 1.0
    # Prompt tokens already cached ahead of the piece or chunk (the planner's view): with
    # ``calibration`` and the cycles, how prediction error grows with the prefix.
    prefill_context_tokens: int = 0
    # The prefill rate the planner chose this option by: over the work it commits to.
    committed_tokens_per_s: float = 0.0
    # That rate as weighed: over what the option's pieces measured against their
    # predictions (``prefill_calibration``), less a switch's cost for a challenger.
    prefill_calibration: float = 1.0
    weighed_tokens_per_s: float = 0.0
    held_over: str = ""  # the option the switch margin kept this decision from ("": none)
    # The best option not chosen and the rate it was weighed by ("", 0: none feasible).
    runner_up: str = ""
    runner_up_tokens_per_s: float = 0.0
    # The prefill batch this decision ran a piece of (numbered from 1 per scheduler; 0:
    # none): pieces of one batch share it, however the planner's view of its context moves.
    prefill_batch: int = 0
    # This decision launched a prefill piece: its predicted time from issue to completion
    # (a time-slice piece queues behind its decode step: the whole cycle) and the host's
    # measured one, filled in when the piece completes.
    piece_launched: bool = False
    predicted_piece_ms: float = 0.0
    measured_piece_ms: float = 0.0
    # Segments the CUDA caching allocator took from the driver while this decision's
    # launches were issued: each a cudaMalloc inside a serving step (on the H200 the first
    # piece of a fresh server's first SM-split batch took 88 ms where 49 were predicted).
    cuda_mallocs: int = 0
    # KV tokens the decode launch's requests attend over, summed (0: no decode launch),
    # and, for a whole-GPU mixed step (TEMPORAL), its prompt pieces as [tokens cached
    # ahead, tokens]: the shape a step model prices (``pdserve.sched.steps``).
    decode_context_tokens: int = 0
    prefill_pieces: list[list[int]] = field(default_factory=list)
    path: str = ""  # how the decode launch ran (``Work.path``), once it completed


@dataclass
class PrefillProgress:
    """The prefill batch part-way through the model's layers."""

    plan: Plan
    num_tokens: int
    layers_done: int = 0  # layers launched (the last piece may still be running)
    carry: BatchCarry | None = None
    # The sharing option that started it and the rate it was chosen by, from when: what
    # the ``delivery`` correction rule compares the batch's wall time with.
    option: str | None = None
    committed_tokens_per_s: float = 0.0
    started: float = 0.0
    serial: int = 0  # ``TimelineEntry.prefill_batch``


@dataclass(frozen=True)
class MixedNote:
    """A TEMPORAL step: what the planner predicted, to calibrate against what it took."""

    plan: MuxPlan
    as_planned: bool  # the step carried every prefill token the prediction was for
    on_graphs: bool = False  # predicted as a step replayed from the prefill-step graphs


@dataclass
class PieceNote:
    """Carried by a prefill piece: what it was predicted to take, by which option's plan."""

    option: str | None  # ``MuxPlan.option``; None (prefill alone): timed, nothing learned
    predicted_ms: float
    entry: TimelineEntry | None = None


@dataclass
class DecodeNote:
    """Carried by a decode launch: the timeline entry that will get its measured time."""

    mixed: MixedNote | None = None
    entry: TimelineEntry | None = None


class MultiplexScheduler(InFlightScheduler):
    name = "multiplex"
    lanes = (DECODE_LANE, PREFILL_LANE)
    # Its pieces and co-running steps allocate on their partitions' own streams, whose
    # cached blocks no other stream reuses: the timeline says which decisions grew the pool.
    watches_allocations = True

    def __init__(self, config, block_manager, max_model_len, *, partitions: PartitionSet,
                 predictor, num_layers: int, predictor_source: dict | None = None):
        super().__init__(config, block_manager, max_model_len)
        self.predictor_source = predictor_source or {"kind": type(predictor).__name__}
        self.partitions, self.num_layers = partitions, num_layers
        self.set_predictor(predictor)
        self.current: Partition = partitions.whole_gpu
        self.decodes = LaneLaunches()  # the decode lane's
        self.piece_work: Work | None = None
        self.batch: PrefillProgress | None = None
        self.switch_pending = False
        self.option: str | None = None  # the sharing option running (``MuxPlan.option``)
        self.held_decisions = 0  # launching decisions the switch margin kept on ``option``
        self.batches_started = 0  # prefill batches numbered so far (``prefill_batch``)
        # Batches beside a split's decode not started because another option won
        # (``--mux-reweigh-spatial-batches``), and when the most recent were (monotonic
        # seconds, as the timeline's ``time``).
        self.spatial_batches_declined = 0
        self.spatial_batches_declined_at: deque[float] = deque(maxlen=TIMELINE_LENGTH)
        self.time_slicing = False  # lanes alternate on the whole GPU's stream (TIME_SLICE)
        self._timeline: deque[TimelineEntry] = deque(maxlen=TIMELINE_LENGTH)
        log.info("multiplex: %r, predictor %s", partitions, type(predictor).__name__)

    def set_predictor(self, predictor, **planner_overrides) -> None:
        """Re-plans with another latency model (e.g. one just profiled), keeping the graphs.

        The planners see it through an ``OnlineCalibration`` that mixed steps correct."""
        self.predictor = predictor
        self.model = OnlineCalibration.from_config(predictor, self.config)
        self._overrides = planner_overrides
        self.planner = MuxPlanner(self.model, self.partitions.decode_sm_choices(),
                                  self._planner_config(), self.partitions.total_sms)
        self._pinned: dict[int, MuxPlanner] = {}

    def _planner_config(self, **overrides) -> MuxPlannerConfig:
        return mux_planner_config(self.config, **{**self._overrides, **overrides})

    def describe(self) -> dict:
        sharing = sorted(mux_sharing_options(self.config.mux_sharing))
        planned = self.planner.config
        return {"partitions": self.partitions.describe(), "predictor": self.predictor_source,
                "sharing": sharing, "itl_slo_ms": self.config.itl_slo_ms,
                "itl_margin": self.config.mux_itl_margin,
                # As resolved (``auto`` graph steps: the runner's captured size, or 0).
                "graph_step_tokens": planned.graph_step_tokens,
                "token_align": planned.token_align,
                "align_step_tokens": planned.align_step_tokens,
                "mixed_floor_tokens": planned.mixed_floor_tokens,
                "mixed_floor_cap": planned.mixed_floor_cap,
                "tpot_bank_cap": planned.tpot_bank_cap,
                "tpot_bank_quantile": planned.tpot_bank_quantile,
                "ttft_pressed_margin": planned.ttft_pressed_margin,
                "reweigh_spatial_batches": self.config.mux_reweigh_spatial_batches,
                "calibration": self.describe_calibration()}

    def describe_calibration(self) -> dict:
        """How far serving has moved the profile, as of now: mixed steps, co-running decode
        and each option's prefill pieces; and how often the switch margin held an option."""
        return {"mixed_steps": round(self.model.mixed_correction, 4),
                "graph_mixed_steps": round(self.model.graph_mixed_correction, 4),
                "co_running_decode": round(self.model.decode_correction, 4),
                "decode_alone": round(self.model.alone_decode_correction, 4),
                "prefill_pieces": self.model.describe_prefill(),
                "co_running_start": self.model.co_running_start,
                "prefill_rule": self.model.prefill_rule,
                "correction_window": self.model.window,
                "guards": self.model.describe_guards(),
                "switch_margin": self.planner.config.switch_margin,
                "decisions_held_by_switch_margin": self.held_decisions,
                "spatial_batches_declined": self.spatial_batches_declined,
                "spatial_batches_declined_at": [round(t, 3)
                                                for t in self.spatial_batches_declined_at]}

    @property
    def decode_work(self) -> Work | None:
        """The newest decode-lane launch in flight (decode or mixed step), if any."""
        return self.decodes.newest

    def overlap_lanes(self) -> dict[str, str]:
        return {
            DECODE_LANE: (
                "decode steps (spatial, decode-only): the next one follows on the same split "
                "and stream. Mixed (temporal) steps: the next mixed step follows on the "
                "whole GPU's stream while the planner keeps TEMPORAL (mixed_steps counts "
                "those chained and those issued after the lane drained). Not time-slice "
                "decodes: the next one is already issued while the piece between them runs"),
            PREFILL_LANE: (
                "not overlapped: a piece feeds no sampled token to the next launch, and a "
                "batch's requests join decode only once its last piece completed")}

    def graph_partitions(self) -> list[Partition]:
        """Where decode graphs are replayed: every split and the whole GPU."""
        return [*self.partitions.choices(), self.partitions.whole_gpu]

    # ------------------------------------------------------------- scheduling

    def schedule(self, idle_lanes=(DECODE_LANE, PREFILL_LANE)) -> dict[str, Work]:
        works: dict[str, Work] = {}
        self.order_waiting()
        if self.decode_work is None and self.piece_work is None:
            self._schedule_drained(works)
        elif self.decode_work is None:
            self._decode_beside_piece(works)
        else:
            if self.piece_work is None:
                self._piece_beside_decode(works)
            if DECODE_LANE in idle_lanes:  # its one launch in flight is overlapped
                self._follow_decode(works)
        if works:
            self.last_work = next(iter(works.values()))
        return works

    def _schedule_drained(self, works: dict[str, Work]) -> None:
        """Both lanes idle: the planner may pick any split (the only place it changes)."""
        candidates = self.prefill_candidates()
        plan = self._plan(self.planner, candidates)
        self.switch_pending = False
        self.current = self.partitions.whole_gpu
        self.time_slicing = plan.mode == MuxMode.TIME_SLICE
        if plan.mode == MuxMode.TEMPORAL:
            self.option = plan.option
            return self._schedule_mixed(works, plan, candidates)
        if plan.mode == MuxMode.DECODE_ONLY:
            self._add_decode(works, self.plan_decode())
        elif plan.mode == MuxMode.PREFILL_ONLY:
            if self._ensure_batch(plan, candidates):
                self._add_piece(works, plan)
        elif plan.mode in (MuxMode.SPATIAL, MuxMode.TIME_SLICE):
            self._schedule_spatial(works, plan, candidates)
        if works:
            self.option = plan.option if PREFILL_LANE in works else None
            self._note(plan)

    def _schedule_spatial(self, works, plan: MuxPlan, candidates) -> None:
        # Decodes grow first (they may preempt); a split with nothing to prefill would
        # leave decode on a slice of the GPU for nothing, so it then takes the whole GPU.
        decode_plan = self.plan_decode()
        prefill = not decode_plan.preempted and self._ensure_batch(plan, candidates)
        if prefill:  # TIME_SLICE: decode_sms is the device's, so this is the whole GPU
            self.current = self.partitions.get(plan.decode_sms)
        self._add_decode(works, decode_plan)
        if prefill:
            self._add_piece(works, plan)

    def _schedule_mixed(self, works, plan: MuxPlan, candidates, chained: bool = False) -> None:
        step = self.plan_mixed(candidates, plan.prefill.chunks)
        if step.is_empty():
            return
        prefill_tokens = sum(s.num_new_tokens for s in step.prefills)
        self._note(plan, len(step.decodes), prefill_tokens, step)
        overlapped = self.overlap.allows(step)
        self.overlap.mixed_step(chained)
        self.launched(step, overlapped)
        graphs = self.planner.on_graphs(plan.prefill.num_tokens, len(step.decodes))
        note = DecodeNote(MixedNote(plan, prefill_tokens == plan.prefill.num_tokens, graphs))
        works[DECODE_LANE] = Work(step, self.current, note=note, overlapped=overlapped,
                                  timed=True)
        self.decodes.add(works[DECODE_LANE])
        note.entry = self._timeline[-1]

    def _decode_beside_piece(self, works) -> None:
        """A piece is in flight under ``current``: decode joins it there (see the rule)."""
        if self.time_slicing:
            return self._next_slice_decode(works)
        if self.current.whole_gpu or self.decode_load() is None:
            return  # a whole-GPU piece holds every SM: decode waits for it to drain
        plan = self._plan(self.planner, self.prefill_candidates())
        if plan.decode_sms != self.current.decode_sms:
            self.switch_pending = True
        self._add_decode(works, self.plan_decode())
        if works:
            self._note(replace(plan, mode=MuxMode.SPATIAL, decode_sms=self.current.decode_sms,
                               prefill_sms=self.current.prefill_sms))

    def _follow_decode(self, works) -> None:
        """An overlapped decode is in flight: the next one follows it under ``current``.
        Beside a piece, by the rule of a decode joining a running piece; alone, only while
        the planner keeps decode alone on the whole GPU (else the lane drains, and the next
        boundary with both lanes idle takes the planner's choice)."""
        if self.piece_work is not None:
            return self._decode_beside_piece(works)
        if self.decode_work.note.mixed is not None:
            return self._follow_mixed(works)
        if self.decode_load() is None:
            return
        plan = self._plan(self.planner, self.prefill_candidates())
        if plan.mode == MuxMode.DECODE_ONLY and self.current.whole_gpu:
            self._add_decode(works, self.plan_decode())
            if DECODE_LANE in works:
                self._note(plan)

    def _follow_mixed(self, works) -> None:
        """An overlapped mixed step is in flight on the whole GPU: the next one follows it on
        the same stream while the planner keeps TEMPORAL, its prompt chunks counted as done
        and the requests whose prompt ends in it decoding on placeholders. Anything else
        waits for the lane to drain, and the next boundary with both lanes idle re-plans."""
        if self.batch is not None or self.switch_pending:
            return
        candidates = self.prefill_candidates(same_stream=True)
        plan = self._plan(self.planner, candidates)
        if plan.mode == MuxMode.TEMPORAL:
            self._schedule_mixed(works, plan, candidates, chained=True)

    def _next_slice_decode(self, works) -> None:
        # Queued behind the piece on the same stream: it starts the moment the piece ends.
        if self.decode_load() is None:
            return
        plan = self._plan(self.planner, self.prefill_candidates())
        self._add_decode(works, self.plan_decode())
        if works:
            self._note(plan if plan.mode == MuxMode.TIME_SLICE else replace(
                plan, mode=MuxMode.TIME_SLICE, decode_sms=self.current.decode_sms,
                prefill_sms=self.current.prefill_sms))

    def _next_slice_piece(self, works) -> None:
        """Decode is in flight on the whole GPU: slice on, or let the lanes drain."""
        candidates = self.prefill_candidates()
        if self.batch is None and not candidates:
            return
        plan = self._plan(self.planner, candidates, self.decode_work.plan)
        if plan.mode != MuxMode.TIME_SLICE:
            self.time_slicing = False  # the next boundary with both lanes idle re-plans
            return
        if self._ensure_batch(plan, candidates):
            self._add_piece(works, plan)
            self._note(plan)

    def _piece_beside_decode(self, works) -> None:
        """Decode is in flight under ``current``: a piece may run on its other SMs."""
        if self.time_slicing:
            return self._next_slice_piece(works)
        if self.switch_pending or self.current.whole_gpu:
            return
        candidates = self.prefill_candidates()
        if self.batch is None and not candidates:
            return
        if self.batch is None and self._another_option_wins(candidates):
            self.spatial_batches_declined += 1
            self.spatial_batches_declined_at.append(time.monotonic())
            self.switch_pending = True  # the lanes drain; the next drained boundary re-plans
            return
        plan = self._plan(self._pinned_planner(self.current), candidates,
                          self.decode_work.plan)
        if plan.mode == MuxMode.SPATIAL and self._ensure_batch(plan, candidates):
            self._add_piece(works, plan)
            self._note(plan)

    def _another_option_wins(self, candidates) -> bool:
        """With ``--mux-reweigh-spatial-batches``: whether the whole planner, weighing every
        option against the running one (a challenger pays for the switch and must beat it by
        the switch margin), would run the next batch other than as a split of the GPU."""
        if not self.config.mux_reweigh_spatial_batches:
            return False
        plan = self._plan(self.planner, candidates, self.decode_work.plan)
        return plan.mode != MuxMode.SPATIAL

    def _pinned_planner(self, part: Partition) -> MuxPlanner:
        if part.decode_sms not in self._pinned:
            self._pinned[part.decode_sms] = self.planner.pinned_to(
                (part.decode_sms, part.prefill_sms))
        return self._pinned[part.decode_sms]

    def _plan(self, planner: MuxPlanner, candidates, decoding: Plan | None = None) -> MuxPlan:
        """``planner``'s plan beside the decode batch ``decoding`` holds (in flight), else
        beside the requests ready to decode."""
        requests = [s.request for s in decoding.decodes] if decoding is not None \
            else self.decode_ready()
        load = decode_load_banked(requests, planner.config, time.monotonic())
        in_flight = None
        if self.batch is not None:
            in_flight = self.in_flight_view(self.batch.plan, self.batch.layers_done)
        return planner.plan(load, self.planner_view(candidates), in_flight, self.option)

    def _add_decode(self, works, plan: Plan) -> None:
        if not plan.decodes:
            return
        overlapped = self._overlaps(plan)
        self.launched(plan, overlapped)
        works[DECODE_LANE] = Work(plan, self.current, note=DecodeNote(), overlapped=overlapped,
                                  timed=True)
        self.decodes.add(works[DECODE_LANE])

    def _overlaps(self, plan: Plan) -> bool:
        if self.time_slicing:  # see overlap_lanes
            self.overlap.synchronous("time_slice")
            return False
        return self.overlap.allows(plan)

    def _ensure_batch(self, plan: MuxPlan, candidates) -> bool:
        """The prefill batch to run ``plan``'s piece of: the one in flight, or a new one."""
        if self.batch is not None:
            return True
        piece = plan.prefill
        if piece is None or not piece.chunks:
            return False
        batch_plan = self.plan_prefill(candidates, piece.chunks)
        if not batch_plan.prefills:
            return False
        self.launched(batch_plan)
        tokens = sum(s.num_new_tokens for s in batch_plan.prefills)
        self.batch = PrefillProgress(batch_plan, tokens, carry=BatchCarry(),
                                     option=plan.option,
                                     committed_tokens_per_s=plan.committed_tokens_per_s,
                                     started=time.monotonic(), serial=self._next_batch())
        return True

    def _add_piece(self, works, plan: MuxPlan) -> None:
        batch = self.batch
        start = batch.layers_done
        end = min(self.num_layers, start + max(1, plan.prefill.num_layers))
        batch.layers_done = end
        note = PieceNote(plan.option, piece_predicted_ms(plan))
        works[PREFILL_LANE] = self.piece_work = Work(
            batch.plan, self.current, "prefill", layers=(start, end),
            final=end == self.num_layers, carry=batch.carry, note=note)

    # ------------------------------------------------------------- completion

    def update_work(self, work: Work, output: StepOutput) -> list:
        entry = getattr(work.note, "entry", None)
        if entry is not None:
            entry.cuda_mallocs += work.cuda_mallocs
        if self.decodes.pop_if_oldest(work):
            self._calibrate(work, output)
            return self.complete(work.plan, output, work.overlapped)
        self.piece_work = None
        self._observe_piece(work.note, output)
        if work.final:
            self._observe_delivery(self.batch)
            self.batch = None
            return self.complete(work.plan, output)
        return self._drop_aborted_batch()

    def _calibrate(self, work: Work, output: StepOutput) -> None:
        note = work.note
        if output.elapsed_ms is None:
            return
        entry, mixed = note.entry, note.mixed
        if entry is not None:
            entry.measured_cycle_ms = output.elapsed_ms
            entry.measured_device_ms = output.device_ms or 0.0
            entry.path = work.path
        # The profile timed the GPU: learn from the device's clock where there is one (the
        # host's view adds whatever kept it from looking at a finished step in time).
        measured = output.device_ms if output.device_ms is not None else output.elapsed_ms
        if mixed is not None and mixed.as_planned:
            self.model.observe_mixed(mixed.plan.decode_ms, measured, mixed.on_graphs)
        elif entry is not None and entry.mode == MuxMode.SPATIAL and not entry.switch_pending:
            # Its prediction was for this very partition (a pending switch planned another).
            self.model.observe_decode(entry.predicted_decode_ms, measured)
        elif entry is not None and entry.mode in WHOLE_GPU_DECODE:
            self.model.observe_decode(entry.predicted_decode_ms, measured, alone=True)

    def _observe_piece(self, note: object, output: StepOutput) -> None:
        """A piece completed: the timeline gets its time, its option's calibration learns.

        Timed on the host, from issue to the completion seen: no device clock runs around a
        piece, and what the next piece waits for is the host seeing this one done."""
        if not isinstance(note, PieceNote) or output.elapsed_ms is None:
            return
        if note.entry is not None:
            note.entry.measured_piece_ms = output.elapsed_ms
        if note.option is not None:
            self.model.observe_prefill(note.option, note.predicted_ms, output.elapsed_ms)

    def _next_batch(self) -> int:
        self.batches_started += 1
        return self.batches_started

    def _observe_delivery(self, batch: PrefillProgress | None) -> None:
        """A batch's last piece completed: its option learns what the batch delivered."""
        if batch is None or batch.option is None:
            return
        seconds = time.monotonic() - batch.started
        if seconds > 0:
            self.model.observe_delivery(batch.option, batch.committed_tokens_per_s,
                                        batch.num_tokens / seconds)

    def _drop_aborted_batch(self) -> list:
        aborted = self.drop_if_aborted(self.batch.plan)
        if aborted is None:
            return []
        self.batch = None
        return aborted

    def fail(self, work: Work) -> list:
        if not self.decodes.discard(work) and work is self.piece_work:
            self.piece_work = self.batch = None
        return super().fail(work)

    # --------------------------------------------------------------- reporting

    def _note(self, plan: MuxPlan, decode_batch: int | None = None,
              prefill_tokens: int | None = None, step: Plan | None = None) -> None:
        """Records what runs now: the split, the decode batch and the prefill piece
        (``step``: the whole-GPU mixed step launched, whose shape the entry keeps)."""
        decoding = step or (self.decode_work.plan if self.decode_work else None)
        shape = step_entry(decoding) if decoding is not None else None
        if decode_batch is None:
            decode_batch = len(self.decode_work.plan.decodes) if self.decode_work else 0
        layers = serial = 0
        if prefill_tokens is None:
            running = self.piece_work is not None and self.batch is not None
            prefill_tokens = self.batch.num_tokens if running else 0
            layers = plan.prefill.num_layers if running and plan.prefill else 0
            serial = self.batch.serial if running else 0
        entry = TimelineEntry(
            time.monotonic(), str(plan.mode), plan.decode_sms, plan.prefill_sms, decode_batch,
            prefill_tokens, layers, plan.decode_ms, self.switch_pending, plan.cycle_ms,
            calibration=self._calibration_of(plan.mode),
            prefill_context_tokens=plan.prefill.context_tokens if plan.prefill else 0,
            committed_tokens_per_s=plan.committed_tokens_per_s,
            prefill_calibration=plan.prefill_calibration,
            weighed_tokens_per_s=plan.weighed_tokens_per_s, held_over=plan.held_over or "",
            runner_up=plan.runner_up or "", runner_up_tokens_per_s=plan.runner_up_tokens_per_s,
            prefill_batch=serial,
            decode_context_tokens=shape.decode_context_tokens if shape else 0,
            prefill_pieces=shape.prefill_pieces if shape and step else [])
        self._timeline.append(entry)
        self.held_decisions += bool(plan.held_over)
        note = self.decode_work.note if self.decode_work is not None else None
        if isinstance(note, DecodeNote) and note.entry is None:
            note.entry = entry
        piece = self.piece_work.note if self.piece_work is not None else None
        if isinstance(piece, PieceNote) and piece.entry is None:
            piece.entry = entry
            entry.piece_launched, entry.predicted_piece_ms = True, piece.predicted_ms

    def _calibration_of(self, mode: MuxMode) -> float:
        if mode == MuxMode.TEMPORAL:
            return self.model.mixed_correction
        if mode in WHOLE_GPU_DECODE:
            return self.model.alone_decode_correction
        return self.model.decode_correction if mode == MuxMode.SPATIAL else 1.0

    def timeline(self, since: float | None = None) -> list[dict]:
        """SM split over time: one dict per launching decision (``TimelineEntry`` fields)."""
        return [asdict(e) for e in self._timeline if since is None or e.time >= since]

    def fill_stats(self, stats) -> None:
        last = self._timeline[-1] if self._timeline else None
        if last is not None:
            stats.mux_mode, stats.decode_sms, stats.prefill_sms = (
                last.mode, last.decode_sms, last.prefill_sms)
            stats.last_batch_decode = last.decode_batch
            stats.last_batch_prefill_tokens = last.prefill_tokens


def mux_planner_config(sched: SchedulerConfig, **overrides) -> MuxPlannerConfig:
    """The planner settings a ``SchedulerConfig`` asks for (graph steps as resolved: ``auto``
    unresolved counts as off), ``overrides`` over them."""
    sharing = mux_sharing_options(sched.mux_sharing)
    fields = dict(itl_slo_ms=sched.itl_slo_ms, ttft_slo_ms=sched.ttft_slo_ms,
                  max_prefill_tokens=sched.max_num_batched_tokens,
                  safety_margin=sched.mux_itl_margin,
                  token_align=sched.mux_token_align,
                  align_step_tokens=sched.mux_align_step_tokens,
                  switch_margin=sched.mux_switch_margin,
                  graph_step_tokens=sched.mux_graph_step_tokens or 0,
                  mixed_floor_tokens=sched.mux_mixed_floor_tokens,
                  mixed_floor_cap=sched.mux_mixed_floor_cap,
                  floor_off_graphs=sched.mux_floor_off_graphs,
                  tpot_bank_cap=sched.mux_tpot_bank_cap,
                  tpot_bank_quantile=sched.tpot_bank_quantile(),
                  ttft_pressed_margin=sched.ttft_pressed_margin(),
                  **{name: name in sharing for name in MUX_SHARING})
    return MuxPlannerConfig(**{**fields, **overrides})
