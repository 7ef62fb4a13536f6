"""One multiplexing instance as whole-GPU steps of the real planner, the queue kept.

Every step is what ``MuxPlanner`` plans for the waiting prompts (first come first served, or
with ``order`` in the engine's SLO-aware order: ``_arrange``) and the decode batch: a mixed
step (TEMPORAL), decode alone, prefill alone, or (with ``time_slice`` / ``spatial`` in the
planner's config) a time-slice cycle or a decode step on an SM split beside the batch's
pieces on the rest (``MuxStepSim._spatial``: a piece launched when the one before it
ended, decode kept on its split while one is in flight, switching splits free of the
engine's drain). With ``pinned_batches`` a batch that starts as the one before it on a
split ended is planned among that split's option alone, as the engine plans it beside the
decode step in flight there (without ``--mux-reweigh-spatial-batches``).

A time-slice cycle runs as ``pdserve/sched/multiplex.py`` runs it: on the whole GPU's one
stream, the decode step of the batch, then a piece (a layer range) of the prefill batch in
flight; a new batch takes the plan's chunks (whole prompts, the last perhaps cut), and
while it is in flight its requests are no candidates and the planner plans with it
(``InFlightPrefill``: no mixed step until its last layer). A prompt's first token comes
when the piece with its last layer ends (pieces are not overlapped: seen at once), and it
decodes from the cycle after the next (that cycle's decode step was issued before the
piece ended). At each cycle the planner may go on slicing; when it does not, the decode
step already issued runs alone and the next decision is made with both lanes drained. The
incumbent option is passed as the engine passes it, so a switch pays rule 4's margin.

How long a step runs (``StepTiming``):

- ``None``: the plan's own prediction, the planner's corrections fixed (the step replay
  as it was: ``benchmarks/mux_step_replay.py`` before engine timing).
- engine timing: on an SM split, a decode step and a piece each take the profile's time
  times a ratio drawn from ``spatial_decode_spread`` / ``spatial_piece_spread``, the
  co-running decode correction and the option's prefill correction learning from them.
  A mixed step takes the profile's time for its shape times the factor
  measured for its path (``graph_factor`` on the prefill-step graphs, ``eager_factor``
  otherwise: the corrections the engine learned on its probes), times a ratio drawn
  from a measured spread; decode alone takes its prediction times a drawn ratio. The
  planner's ``OnlineCalibration`` then learns from each mixed step as the engine's does.
  A time-slice cycle takes the profile's cycle (decode step alone plus the piece; the
  planner puts no correction in either) times a pair drawn from another run's
  time-slice pieces (``slice_spread``): the time from one piece's end to the next's over
  the predicted cycle (the cycle's wall time), and the piece's own issue to completion
  over it, which ``observe_prefill`` learns from, by the server's rule, as the engine's
  does (under ``--mux-prefill-correction delivery``, ``observe_delivery`` learns instead
  from each batch's prompt tokens over the time from its first cycle to its last). The
  option's correction only chooses: under the ``compounding`` rule it has no fixed
  point (7dad880 began its replay at 0.52 while pieces ran at 0.98 of the
  profile), so timing pieces by it would halve them.
  Why that matters (H200, 8ccd9ac): the planner weighs graph steps of ~250 prompt tokens
  (39 ms) against eager ones to the 54 ms budget (384 tokens, 52 ms), and whether the
  384 fit turns on a few percent of the eager correction; three slow eager steps in a
  row (1.07-1.41x) lifted it 11% and the engine ran graph steps from then on. The path
  no longer chosen never runs again to bring its correction back.

``first_token_lag``: the client sees a step's tokens at the end of the step after it
(overlap scheduling: the engine issues step k + 1 before it reads step k's output):
measured first tokens of 8ccd9ac's replay came 0.92 of a step (median) after the end of
the step that ran the prompt's last piece wherever another step followed, and with none
after it at its end. The engine itself has the token when its step ends: the request
decodes from the next step and the planner counts its tokens from then.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shlex
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig, add_cli_args, mux_sharing_options, ran_explicitly
from pdserve.sched.in_flight import decode_load_banked
from pdserve.sched.multiplex import mux_planner_config
from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlan,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
    piece_predicted_ms,
)
from pdserve.sched.prefill_order import PrefillOrder

WHOLE_GPU_MODES = (MuxMode.TEMPORAL, MuxMode.DECODE_ONLY, MuxMode.PREFILL_ONLY)
DECODE_NEIGHBOURS = 32  # the fewest measured steps a batch's draw comes from (whole batches)
MODELLED_MODES = (*WHOLE_GPU_MODES, MuxMode.TIME_SLICE)


@dataclass
class StepRequest:
    """One request as the model serves it (times in seconds from the first send)."""

    arrival: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    decoded: int = 0
    first_token: float | None = None  # as the client sees them
    finished: float | None = None
    sampled: float | None = None  # when the engine had the first token

    @property
    def num_tokens(self) -> int:
        """The context its next decode reads (``decode_load_over``)."""
        return self.prompt_len + self.decoded

    # What ``banked_slack_ms`` reads of a request: its first token counts as an output.
    @property
    def first_token_time(self) -> float | None:
        return self.sampled

    @property
    def num_output_tokens(self) -> int:
        return self.decoded + 1

    num_placeholders = 0  # the model samples each token within its step


@dataclass(frozen=True)
class StepTiming:
    """Engine timing of steps: measured over profile time per mixed-step path, and the
    spread of measured over predicted step time (``mixed_spread`` for mixed steps,
    ``decode_spread`` for decode alone, ``slice_spread``: (cycle, piece) pairs for
    time-slice cycles, ``slice_spread``'s), one drawn per step with ``seed``."""

    graph_factor: float
    eager_factor: float
    mixed_spread: tuple[float, ...] = (1.0,)
    decode_spread: tuple[float, ...] = (1.0,)
    seed: int = 0
    slice_spread: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    spatial_decode_spread: tuple[float, ...] = (1.0,)
    spatial_piece_spread: tuple[float, ...] = (1.0,)
    """Decode steps beside a piece on an SM split, and the pieces, over the profile's time."""
    decode_by_batch: tuple[tuple[int, float], ...] = ()
    """(batch, measured over profile time) of decode steps alone, by batch: a decode step
    draws from the steps of the batches nearest its own (``nearest_batch_ratios``; none:
    ``decode_spread``). On the H200 decode alone ran at the profile's time up to ~30
    requests and 1.1-1.35x it beyond (3fa127d), so one pooled spread would time large
    batches as small ones."""
    graph_mixed_by_batch: tuple[tuple[int, float], ...] = ()
    """(decode batch, measured over profile time) of mixed steps on the prefill-step
    graphs: such a step draws from the nearest to its decode batch instead of the graph
    path's factor times ``mixed_spread`` (none: that). On the H200 ShareGPT-like probes
    they ran ~1.0x the profile beside under 32 decodes and 1.09-1.12x beside 128-160, where
    the engine's one learned factor sits between (1.08 at 0162a0c)."""


@dataclass
class SliceBatch:
    """A prefill batch part-way through the layers in time-slice pieces: (request, tokens
    it prefills) in the order taken, its prefix before the batch, and layers launched."""

    chunks: list[tuple[StepRequest, int]]
    context_tokens: int
    layers_done: int = 0
    # The option and rate it was chosen by, and when: what ``observe_delivery`` compares
    # its wall time with (``--mux-prefill-correction delivery``), as the engine does.
    option: str | None = None
    committed_tokens_per_s: float = 0.0
    started: float = 0.0

    def view(self) -> InFlightPrefill:
        return InFlightPrefill(sum(t for _, t in self.chunks), self.context_tokens,
                               len(self.chunks), self.layers_done)


@dataclass
class StepLog:
    """Each step's seconds per kind (``graph``, ``eager``, decode or prefill alone), in
    order; the steps and seconds per kind are what a measured timeline is compared by."""

    durations: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.durations.setdefault(kind, []).append(seconds)

    @property
    def steps(self) -> dict[str, int]:
        return {kind: len(times) for kind, times in self.durations.items()}

    @property
    def seconds(self) -> dict[str, float]:
        return {kind: sum(times) for kind, times in self.durations.items()}


class MuxStepSim:
    """Runs ``requests`` (``StepRequest``) to completion; their times are filled in."""

    def __init__(self, planner: MuxPlanner, requests: Sequence[StepRequest],
                 timing: StepTiming | None = None, first_token_lag: bool = False,
                 pinned_batches: bool = False, order: PrefillOrder | None = None) -> None:
        self.planner, self.timing, self.lag = planner, timing, first_token_lag
        # --prefill-order slo: the waiting prompts kept in Moore-Hodgson order over the
        # prefill rate the steps delivered, as the engine's scheduler keeps its queue.
        self.order = order if order is not None and order.enabled else None
        # The engine without --mux-reweigh-spatial-batches: a batch that starts as the one
        # before it on a split ended (a decode step of that split always in flight) is
        # weighed among that split's spatial option alone (``_pinned_plan``).
        self.pinned_batches = pinned_batches
        self.pinned_split: int | None = None  # the split whose batch just ended
        self.requests = list(requests)
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.now, self.waiting, self.running = 0.0, [], []
        self.unseen: list[tuple[StepRequest, str]] = []  # outputs the client sees next
        self.modes: dict[str, int] = {}
        self.log = StepLog()
        self.busy_s = 0.0
        self.rng = random.Random(timing.seed if timing else 0)
        self._pools: dict[tuple[int, int], tuple[float, ...]] = {}  # by (spread, batch)
        self.batch: SliceBatch | None = None  # in flight in time-slice pieces
        self.slicing = False  # the lanes alternate on the whole GPU (TIME_SLICE)
        self.joining: list[StepRequest] = []  # prefilled by the last piece: not in the
        # decode step already issued behind it
        self.option: str | None = None  # the sharing option running (the incumbent)
        # A piece in flight on an SM split: when it ends, its layers, the split's decode SMs.
        self.piece_end: float | None = None
        self.piece_layers, self.split_sms = 0, 0

    def run(self) -> None:
        while self.pending or self.waiting or self.running or self.batch:
            self._admit()
            self._arrange()
            if not (self.waiting or self.running or self.batch):
                self._show()  # no step follows: the last one's output shows at its end
                self.now = self.pending[0].arrival
                continue
            self._step()
        self._show()

    def _admit(self) -> None:
        while self.pending and self.pending[0].arrival <= self.now:
            self.waiting.append(self.pending.popleft())

    def _arrange(self) -> None:
        """SLO order (``PrefillOrder``'s rule): prompts part-way through their prefill stay
        first, as the engine serves its running prefills first, and count, with the batch in
        flight, as backlog ahead of the rest, which are taken in Moore-Hodgson order."""
        order = self.order
        if order is None or len(self.waiting) < 2 or order.rate.tokens_per_s is None:
            return
        started = [r for r in self.waiting if r.prefilled]
        fresh = [r for r in self.waiting if not r.prefilled]
        backlog = sum(r.prompt_len - r.prefilled for r in started)
        if self.batch is not None:
            backlog += sum(tokens for _, tokens in self.batch.chunks)
        ranked, _ = order.rank([(r, r.arrival, r.prompt_len) for r in fresh],
                               self.now + order.rate.seconds(backlog), self.now)
        self.waiting[:] = started + ranked

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """A launch's (or a piecewise batch's) prompt tokens over its time: the sample the
        engine's ``PrefillRate`` takes."""
        if self.order is not None:
            self.order.rate.observe(tokens, 1e3 * seconds)

    def _step(self) -> None:
        pinned = self._pinned_plan()
        if pinned is not None:
            return self._spatial(pinned)
        in_flight = self.batch.view() if self.batch is not None else None
        plan = self.planner.plan(self._decode_load(), self._waiting_view(), in_flight,
                                 self.option)
        if self.piece_end is not None or plan.mode == MuxMode.SPATIAL:
            return self._spatial(plan)
        if self.slicing and plan.mode != MuxMode.TIME_SLICE:
            return self._end_slicing()
        if plan.mode not in MODELLED_MODES:
            raise ValueError(f"whole-GPU steps and time slices only, the planner chose "
                             f"{plan.mode}")
        self.modes[plan.mode] = self.modes.get(plan.mode, 0) + 1
        self.option = plan.option if plan.mode != MuxMode.PREFILL_ONLY else None
        if plan.mode == MuxMode.TIME_SLICE:
            return self._slice(plan)
        if self.batch is not None:  # prefill alone: every layer left in one piece
            return self._finish_alone(plan)
        kind = self._kind(plan)
        step_s = self._step_s(plan, kind)
        self.log.add(kind, step_s)
        if plan.mode == MuxMode.PREFILL_ONLY:
            self._show()  # planned once the lanes drained: the last step's tokens are out
        self.now += step_s
        self.busy_s += step_s
        self._show()
        self._decode(list(self.running) if plan.mode != MuxMode.PREFILL_ONLY else [])
        if plan.prefill is not None:
            self._observe_prefill(sum(t for _, t in plan.prefill.chunks), step_s)
            self._prefill(plan.prefill.chunks)

    def _slice(self, plan: MuxPlan) -> None:
        """One time-slice cycle: the decode step, then the batch's next piece."""
        self.slicing = True
        self._show()  # the lanes drained before slicing: the last step's output is out
        if self.batch is None:
            self._take_batch(plan)
        decoding, self.joining = self._decoding(), []
        cycle, piece = self._slice_ratios()
        if self.timing is not None:  # learned from each piece, as the engine learns
            predicted = piece_predicted_ms(plan)
            self.planner.calibration.observe_prefill(plan.option, predicted, predicted * piece)
        start, cycle_s = self.now, plan.cycle_ms * cycle / 1e3
        self.log.add(str(MuxMode.TIME_SLICE), cycle_s)
        self.now += cycle_s
        self.busy_s += cycle_s
        self._decode(decoding, at=start + plan.decode_ms * cycle / 1e3)
        batch = self.batch
        batch.layers_done = min(self.planner.num_layers,
                                batch.layers_done + max(1, plan.prefill.num_layers))
        if batch.layers_done >= self.planner.num_layers:
            if self.timing is not None and self.now > batch.started:
                tokens = sum(t for _, t in batch.chunks)
                self.planner.calibration.observe_delivery(
                    batch.option, batch.committed_tokens_per_s,
                    tokens / (self.now - batch.started))
            self.joining = self._batch_done()

    def _spatial(self, plan: MuxPlan) -> None:
        """One decode step on an SM split beside the batch's pieces on the rest, as the
        engine runs them: a piece is launched when the one before it has ended, and while
        one is in flight decode stays on its split whatever the planner would choose next.
        Switching splits costs nothing here (the engine drains first)."""
        self.slicing = False
        if self.piece_end is None and self.batch is None:
            self._take_batch(plan)
        if self.piece_end is None:
            self._launch_piece(plan)
        decoding = self._decoding()
        step_s = self._co_running_decode_ms(decoding) / 1e3
        self.modes[MuxMode.SPATIAL] = self.modes.get(MuxMode.SPATIAL, 0) + 1
        self.log.add(str(MuxMode.SPATIAL), step_s)
        self.now += step_s
        self.busy_s += step_s
        self._show()
        self._decode(decoding)
        if self.piece_end <= self.now:
            self._piece_ended()

    def _pinned_plan(self) -> MuxPlan | None:
        """With ``pinned_batches``, right after a batch on a split ended with prompts
        waiting and requests decoding: the next batch on that split, as the engine's
        ``_pinned_planner`` plans it (None where that plan is no split)."""
        split, self.pinned_split = self.pinned_split, None
        if split is None or not self.waiting or not self.running or self.batch is not None:
            return None
        planner = self.planner.pinned_to((split, dict(self.planner.partitions)[split]))
        plan = planner.plan(self._decode_load(), self._waiting_view(), None, self.option)
        return plan if plan.mode == MuxMode.SPATIAL else None

    def _take_batch(self, plan: MuxPlan) -> None:
        """The plan's chunks leave the queue as the batch its pieces will prefill."""
        taken = [(self.waiting[i], tokens) for i, tokens in plan.prefill.chunks]
        self.batch = SliceBatch(taken, sum(r.prefilled for r, _ in taken), 0,
                                plan.option, plan.committed_tokens_per_s, self.now)
        for request, _ in taken:
            self.waiting.remove(request)

    def _launch_piece(self, plan: MuxPlan) -> None:
        self.option, self.split_sms = plan.option, plan.decode_sms
        predicted = piece_predicted_ms(plan)  # the profile's: a piece carries no correction
        measured = predicted * self._ratio("spatial_piece_spread")
        self.planner.calibration.observe_prefill(plan.option, predicted, measured)
        self.piece_end, self.piece_layers = self.now + measured / 1e3, plan.prefill.num_layers

    def _co_running_decode_ms(self, decoding: list[StepRequest]) -> float:
        if not decoding:
            return max(0.0, 1e3 * (self.piece_end - self.now))  # nothing to decode: wait
        calibration = self.planner.calibration
        load = decode_load_banked(decoding, self.planner.config, self.now)
        predicted = calibration.predict("decode", load.batch_size, load.context_tokens,
                                        load.batch_size, self.split_sms, co_running=True)
        measured = (predicted / calibration.decode_correction
                    * self._ratio("spatial_decode_spread"))
        calibration.observe_decode(predicted, measured)
        return measured

    def _piece_ended(self) -> None:
        batch, self.piece_end = self.batch, None
        batch.layers_done = min(self.planner.num_layers, batch.layers_done + self.piece_layers)
        if batch.layers_done >= self.planner.num_layers:
            self._batch_done()
            self.pinned_split = self.split_sms if self.pinned_batches else None
            self.option = None

    def _ratio(self, spread: str) -> float:
        return self.rng.choice(getattr(self.timing, spread)) if self.timing else 1.0

    def _slice_ratios(self) -> tuple[float, float]:
        if self.timing is None:
            return 1.0, 1.0
        return self.rng.choice(self.timing.slice_spread)

    def _end_slicing(self) -> None:
        """The planner stops slicing: the decode step already issued runs alone, then the
        lanes are drained (the next decision chooses freely)."""
        self.slicing, decoding, self.joining = False, self._decoding(), []
        self.option = None
        if not decoding:
            return
        load = decode_load_banked(decoding, self.planner.config, self.now)
        sms = self.planner.total_sms
        ms = self.planner.predictor.predict("decode", load.batch_size, load.context_tokens,
                                            load.batch_size, sms)
        if self.timing is not None:
            ms = self._decode_alone_ms(ms, load.batch_size)
        self.log.add(str(MuxMode.DECODE_ONLY), ms / 1e3)
        self.now += ms / 1e3
        self.busy_s += ms / 1e3
        self._decode(decoding, at=self.now)

    def _finish_alone(self, plan: MuxPlan) -> None:
        """Prefill alone (no decode) runs the batch in flight through its layers left."""
        step_s = plan.prefill.predicted_ms / 1e3
        self.log.add(str(plan.mode), step_s)
        self._show()  # no decode beside it: the last step's tokens are out before it runs
        self.now += step_s
        self.busy_s += step_s
        self._batch_done()

    def _batch_done(self) -> list[StepRequest]:
        """The batch's last piece ended: prompts it completed have their first token (seen
        at once: no piece is overlapped); a prompt cut by it waits again, first."""
        completed, cut = [], []
        self._observe_prefill(sum(t for _, t in self.batch.chunks), self.now - self.batch.started)
        for request, tokens in self.batch.chunks:
            request.prefilled += tokens
            (completed if request.prefilled >= request.prompt_len else cut).append(request)
        self.batch = None
        self.waiting[:0] = cut
        for request in completed:
            request.sampled = request.first_token = self.now
            if request.output_len > 1:
                self.running.append(request)
            else:
                request.finished = self.now
        return [r for r in completed if r.output_len > 1]

    def _decoding(self) -> list[StepRequest]:
        """The decode batch: the running requests but those the last piece prefilled."""
        return [r for r in self.running if r not in self.joining]

    def _kind(self, plan: MuxPlan) -> str:
        if plan.mode != MuxMode.TEMPORAL:
            return str(plan.mode)
        graph = self.planner.on_graphs(plan.prefill.num_tokens, len(self.running))
        return "graph" if graph else "eager"

    def _step_s(self, plan: MuxPlan, kind: str) -> float:
        if plan.mode == MuxMode.PREFILL_ONLY:
            return plan.prefill.predicted_ms / 1e3
        if self.timing is None:
            return plan.cycle_ms / 1e3
        if plan.mode == MuxMode.DECODE_ONLY:
            return self._decode_alone_ms(plan.cycle_ms, len(self._decoding())) / 1e3
        return self._mixed_ms(plan, kind == "graph") / 1e3

    def _decode_alone_ms(self, predicted_ms: float, batch: int) -> float:
        """Decode alone on the whole GPU: the profile's time (``predicted_ms`` without the
        correction in force) times a ratio drawn for ``batch``; the decode-alone correction
        learns from it, as the engine's does."""
        calibration = self.planner.calibration
        measured = (predicted_ms / calibration.alone_decode_correction
                    * self._decode_ratio(batch))
        calibration.observe_decode(predicted_ms, measured, alone=True)
        return measured

    def _decode_ratio(self, batch: int) -> float:
        if not self.timing.decode_by_batch:
            return self.rng.choice(self.timing.decode_spread)
        return self._by_batch(self.timing.decode_by_batch, batch)

    def _by_batch(self, pairs: tuple[tuple[int, float], ...], batch: int) -> float:
        """A ratio drawn from the measured steps of the batches nearest ``batch``
        (``nearest_batch_ratios``)."""
        key = (id(pairs), batch)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = nearest_batch_ratios(pairs, batch, DECODE_NEIGHBOURS)
        return self.rng.choice(pool)

    def _mixed_ms(self, plan: MuxPlan, graph: bool) -> float:
        """The step's engine time; the planner's corrections learn from it, as the
        engine's do from the device's clock."""
        calibration, timing = self.planner.calibration, self.timing
        in_force = (calibration.graph_mixed_correction if graph
                    else calibration.mixed_correction)
        if graph and timing.graph_mixed_by_batch:
            ratio = self._by_batch(timing.graph_mixed_by_batch, len(self._decoding()))
        else:
            factor = timing.graph_factor if graph else timing.eager_factor
            ratio = factor * self.rng.choice(timing.mixed_spread)
        measured = plan.cycle_ms / in_force * ratio
        calibration.observe_mixed(plan.cycle_ms, measured, graph)
        return measured

    def _decode_load(self) -> DecodeLoad | None:
        return decode_load_banked(self._decoding(), self.planner.config, self.now)

    def _waiting_view(self) -> list[PrefillRequest]:
        return [PrefillRequest(r.prompt_len - r.prefilled, r.prefilled,
                               1e3 * (self.now - r.arrival)) for r in self.waiting]

    def _decode(self, decoding: list[StepRequest], at: float | None = None) -> None:
        """One token for each of ``decoding``; ``at``: seen then (a decode step that is not
        overlapped), else as ``_output`` says."""
        for request in decoding:
            request.decoded += 1
            if request.decoded + 1 >= request.output_len:
                if at is None:
                    self._output(request, "finished")
                else:
                    request.finished = at
                self.running.remove(request)

    def _prefill(self, chunks) -> None:
        finished = []
        for index, tokens in chunks:
            request = self.waiting[index]
            request.prefilled += tokens
            if request.prefilled >= request.prompt_len:
                finished.append(request)
        for request in finished:
            self.waiting.remove(request)
            request.sampled = self.now
            self._output(request, "first_token")
            if request.output_len > 1:
                self.running.append(request)
            else:
                self._output(request, "finished")

    def _output(self, request: StepRequest, event: str) -> None:
        """``event`` (``first_token`` or ``finished``) happened in the step that just
        ended: seen now, or with ``first_token_lag`` at the next step's end."""
        if self.lag:
            self.unseen.append((request, event))
        else:
            setattr(request, event, self.now)

    def _show(self) -> None:
        for request, event in self.unseen:
            setattr(request, event, self.now)
        self.unseen = []


def planner_config(server_args: str, variant: str = "", time_slice: bool = False,
                   spatial: bool = False) -> MuxPlannerConfig:
    """The planner a ``pdserve serve`` command line asks for, ``variant``'s flags over it,
    read as the server reads them (``SchedulerConfig``; graph steps left at ``auto`` count
    as off: the records name them). Time slices and SM splits off unless ``time_slice`` /
    ``spatial``, then as the command line's ``--mux-sharing`` says."""
    sched = scheduler_config(server_args, variant)
    options = mux_sharing_options(sched.mux_sharing)
    spatial, time_slice = spatial and "spatial" in options, time_slice and "time_slice" in options
    # Mixed steps as the flags say where another option is modelled, else always (the
    # whole-GPU model needs one way to prefill beside decode).
    temporal = "temporal" in options or not (spatial or time_slice)
    return mux_planner_config(sched, spatial=spatial, temporal=temporal, time_slice=time_slice)


def record_server_args(record: dict) -> str:
    """A probe record's server flags with the sharing options and the prefill correction
    rule it ran made explicit (``ran_explicitly``, from its engine info)."""
    return ran_explicitly(record["config"]["server_args"], record["config"].get("engine"))


def scheduler_config(server_args: str, variant: str = "") -> SchedulerConfig:
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser, SchedulerConfig)
    flags, _ = parser.parse_known_args(shlex.split(server_args) + shlex.split(variant))
    return SchedulerConfig(**{f.name: getattr(flags, f.name)
                              for f in dataclasses.fields(SchedulerConfig)})


def calibrated(predictor, corrections: dict | None, server_args: str = "") -> OnlineCalibration:
    """The predictor with the corrections an engine reported (``engine_calibration``'s
    ``mixed_steps``, ``graph_mixed_steps`` and each option's ``prefill_pieces``; none:
    1.0), learning by the rules ``server_args`` name (``--mux-prefill-correction``,
    ``--mux-correction-window``)."""
    sched = scheduler_config(server_args)
    model = OnlineCalibration.from_config(predictor, sched)
    corrections = corrections or {}
    model.mixed_correction = corrections.get("mixed_steps", 1.0)
    model.graph_mixed_correction = corrections.get("graph_mixed_steps", 1.0)
    for option, learned in (corrections.get("prefill_pieces") or {}).items():
        model.prefill_corrections[option] = learned["correction"]
        model.prefill_pieces[option] = learned["pieces"]
    return model


def path_factors(corrections: dict | None) -> tuple[float, float]:
    """Measured over profile time of graph and eager mixed steps: what the engine learned
    on its probes, before the replay (none reported: the profile's own)."""
    corrections = corrections or {}
    return corrections.get("graph_mixed_steps", 1.0), corrections.get("mixed_steps", 1.0)


def engine_timed(predictor, server_args: str, corrections: dict | None,
                 requests: Sequence[StepRequest], spread: StepSpread | None = None,
                 seed: int = 0, time_slice: bool = False) -> MuxStepSim:
    """``requests`` run on the step model as the engine of ``server_args`` with the
    ``corrections`` it learned on its probes times its steps (``StepTiming``), the client
    seeing tokens a step late; ``time_slice``: time slices as the server's flags allow."""
    timing = (spread or StepSpread()).timing(*path_factors(corrections), seed)
    planner = MuxPlanner(calibrated(predictor, corrections, server_args), [],
                         planner_config(server_args, time_slice=time_slice))
    sim = MuxStepSim(planner, requests, timing, first_token_lag=True)
    sim.run()
    return sim


@dataclass(frozen=True)
class StepSpread:
    """Measured over predicted time of an engine's steps (``step_spread``): mixed steps and
    decode alone; ``source`` names the timeline they came from. ``slices``: time-slice
    (cycle, piece) pairs (``slice_spread``), from ``slice_source``."""

    mixed: tuple[float, ...] = (1.0,)
    decode: tuple[float, ...] = (1.0,)
    source: str | None = None
    slices: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    slice_source: str | None = None
    decode_by_batch: tuple[tuple[int, float], ...] = ()
    spatial_decode: tuple[float, ...] = (1.0,)
    spatial_pieces: tuple[float, ...] = (1.0,)
    graph_mixed_by_batch: tuple[tuple[int, float], ...] = ()

    def timing(self, graph_factor: float, eager_factor: float, seed: int) -> StepTiming:
        """Steps timed by these spreads, mixed steps at the paths' factors (graph steps by
        their decode batch where ``graph_mixed_by_batch`` was measured)."""
        return StepTiming(graph_factor, eager_factor, self.mixed, self.decode, seed,
                          self.slices, spatial_decode_spread=self.spatial_decode,
                          spatial_piece_spread=self.spatial_pieces,
                          decode_by_batch=self.decode_by_batch,
                          graph_mixed_by_batch=self.graph_mixed_by_batch)


def step_spread(timeline: list[dict], source: str | None = None,
                predictor=None, graph_step_tokens: int = 0) -> StepSpread:
    """Each whole-GPU step's device time over the prediction it ran with, from a
    multiplexing engine's timeline (``MuxScheduler.timeline``): draw it from another run's
    timeline than the one a model is checked on. With the ``predictor`` the engine planned
    with and its ``graph_step_tokens``, the mixed steps on the prefill-step graphs over
    the profile's time, by decode batch (``graph_mixed_by_batch``)."""
    def timed(mode: str) -> list[dict]:
        return [e for e in timeline if e["mode"] == mode and e["measured_device_ms"] > 0
                and e["predicted_cycle_ms"] > 0]

    mixed = tuple(e["measured_device_ms"] / e["predicted_cycle_ms"]
                  for e in timed(MuxMode.TEMPORAL))
    # Decode alone over the profile's time: its prediction carried the decode-alone
    # correction in force (the entry's ``calibration``; 1.0 in timelines before it).
    decode = sorted((e["decode_batch"], e["measured_device_ms"] * e.get("calibration", 1.0)
                     / e["predicted_cycle_ms"]) for e in timed(MuxMode.DECODE_ONLY))
    # On an SM split: decode steps over the profile (their prediction carried the co-running
    # correction, the entry's ``calibration``), pieces over their (uncorrected) prediction.
    spatial = [e for e in timeline if e["mode"] == MuxMode.SPATIAL]
    split_decode = tuple(e["measured_device_ms"] * e.get("calibration", 1.0)
                         / e["predicted_decode_ms"] for e in spatial
                         if e["measured_device_ms"] > 0 and e["predicted_decode_ms"] > 0
                         and not e.get("switch_pending"))
    pieces = tuple(e["measured_piece_ms"] / e["predicted_piece_ms"] for e in spatial
                   if e.get("piece_launched") and e["measured_piece_ms"] > 0
                   and e["predicted_piece_ms"] > 0)
    graph_mixed = () if predictor is None or graph_step_tokens <= 0 else \
        graph_mixed_by_batch(timed(MuxMode.TEMPORAL), predictor, graph_step_tokens)
    return StepSpread(mixed, tuple(r for _, r in decode), source,
                      decode_by_batch=tuple(decode), spatial_decode=split_decode or (1.0,),
                      spatial_pieces=pieces or (1.0,), graph_mixed_by_batch=graph_mixed)


def graph_mixed_by_batch(steps: list[dict], predictor, graph_step_tokens: int
                         ) -> tuple[tuple[int, float], ...]:
    """(decode batch, measured over the profile's time) of the mixed steps on the
    prefill-step graphs among ``steps`` (timeline entries), sorted by batch; () where a
    timeline lacks what the profile needs (before the entries kept their contexts)."""
    pairs = []
    for entry in steps:
        if timeline_kind(entry, graph_step_tokens) != "graph" \
                or "decode_context_tokens" not in entry:
            continue
        # the prompts in the chunk: its pieces ([prefix, tokens] each) where recorded
        prompts = max(len(entry.get("prefill_pieces") or ()), 1)
        profile = predictor.predict_mixed(entry["prefill_tokens"],
                                          entry["prefill_context_tokens"], prompts,
                                          entry["decode_batch"],
                                          entry["decode_context_tokens"])
        if profile > 0:
            pairs.append((entry["decode_batch"], entry["measured_device_ms"] / profile))
    return tuple(sorted(pairs))


def slice_spread(timeline: list[dict]) -> tuple[tuple[float, float], ...]:
    """Each time-slice piece of a timeline over its predicted cycle (``predicted_piece_ms``:
    decode step plus piece, the profile's): (wall time from the previous piece's end to
    its own, where slicing ran on between them, else its issue to completion; its own
    issue to completion, what the engine's ``observe_prefill`` saw). The first is what
    the next cycle waits for: a piece is issued when the host sees the one before it end,
    behind the decode step already queued, so its own time misses that host lag."""
    pairs, previous_end = [], None
    for entry in timeline:
        if entry["mode"] != MuxMode.TIME_SLICE:
            previous_end = None
            continue
        predicted, measured = entry["predicted_piece_ms"], entry["measured_piece_ms"]
        if not entry["piece_launched"] or predicted <= 0 or measured <= 0:
            continue
        end = entry["time"] + measured / 1e3
        cycle = measured if previous_end is None else 1e3 * (end - previous_end)
        pairs.append((cycle / predicted, measured / predicted))
        previous_end = end
    return tuple(pairs)


def nearest_batch_ratios(pairs: tuple[tuple[int, float], ...], batch: int,
                         at_least: int) -> tuple[float, ...]:
    """The ratios of ``pairs`` ((batch, ratio), any order) whose batches are nearest
    ``batch``: every step of each batch taken, nearest first (the smaller batch first at
    equal distance), until ``at_least`` steps are in. Whole batches, because a slice of
    pairs sorted by ratio within a batch would draw one end of that batch's ratios: a batch
    past the largest measured drew only the slowest steps of that largest one."""
    by_batch: dict[int, list[float]] = {}
    for measured_batch, ratio in pairs:
        by_batch.setdefault(measured_batch, []).append(ratio)
    pool: list[float] = []
    for measured_batch in sorted(by_batch, key=lambda b: (abs(b - batch), b)):
        if len(pool) >= at_least:
            break
        pool.extend(by_batch[measured_batch])
    return tuple(pool)


def whole_gpu_only(timeline: list[dict]) -> bool:
    return all(e["mode"] in WHOLE_GPU_MODES for e in timeline)


def timeline_kind(entry: dict, graph_step_tokens: int) -> str:
    """``MuxStepSim``'s kind of a recorded decision (graph or eager for a mixed step)."""
    if entry["mode"] != MuxMode.TEMPORAL:
        return entry["mode"]
    tokens = entry["prefill_tokens"] + entry["decode_batch"]
    return "graph" if 0 < tokens <= graph_step_tokens else "eager"


def timeline_steps_by_kind(timeline: list[dict], graph_step_tokens: int) -> dict:
    """A timeline's steps and device seconds per kind, as ``StepLog`` counts them (a
    prefill alone is not timed on the device: its gap to the next decision; a time-slice
    cycle counts once, by its piece)."""
    log = StepLog()
    for entry, after in zip(timeline, timeline[1:] + [None], strict=True):
        seconds = entry["measured_device_ms"] / 1e3
        if entry["mode"] == MuxMode.TIME_SLICE:  # a cycle per piece, its issue to its end
            if entry.get("piece_launched"):
                log.add(entry["mode"], entry["measured_piece_ms"] / 1e3)
            continue
        if entry["mode"] == MuxMode.PREFILL_ONLY and after is not None:
            seconds = after["time"] - entry["time"]
        log.add(timeline_kind(entry, graph_step_tokens), seconds)
    return {"steps": log.steps, "seconds": log.seconds}


def median_log(logs: Sequence[StepLog]) -> dict:
    """Steps and seconds per kind, the median over several runs (0 where a run had none)."""
    kinds = sorted({kind for log in logs for kind in log.steps})
    median = lambda values: float(sorted(values)[len(values) // 2])
    return {"steps": {k: median([log.steps.get(k, 0) for log in logs]) for k in kinds},
            "seconds": {k: median([log.seconds.get(k, 0.0) for log in logs]) for k in kinds}}


def correction_trajectory(timeline: list[dict], start: tuple[float, float],
                          graph_step_tokens: int) -> list[tuple[float, float, float]]:
    """(seconds from the first decision, mixed-step correction, graph-step correction) in
    force at each decision of a timeline, from ``start`` (the engine's two after its
    probes). A mixed step records the mixed one in force (``calibration``; other
    decisions record 1.0, so it is carried over them); the graph one is not recorded and
    is rebuilt by ``OnlineCalibration``'s rule over the graph steps' device times (on
    8ccd9ac it lands on the value the engine reported after the replay)."""
    rebuilt = OnlineCalibration.learning_only()
    rebuilt.mixed_correction, rebuilt.graph_mixed_correction = start
    origin, trajectory = timeline[0]["time"], []
    for entry in timeline:
        if entry["mode"] == MuxMode.TEMPORAL:
            rebuilt.mixed_correction = entry["calibration"]
        trajectory.append((entry["time"] - origin, rebuilt.mixed_correction,
                           rebuilt.graph_mixed_correction))
        if timeline_kind(entry, graph_step_tokens) == "graph":
            rebuilt.observe_mixed(entry["predicted_cycle_ms"], entry["measured_device_ms"],
                                  graph=True)
    return trajectory


def timeline_accuracy(timeline: list[dict], trajectory: list[tuple[float, float, float]],
                      graph_step_tokens: int) -> dict:
    """Per kind of step, device time over the engine's corrected prediction and over the
    profile's own (the prediction over the correction in force: ``trajectory``), each as
    the median ratio and as total over total."""
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    for entry, (_, mixed, graph) in zip(timeline, trajectory, strict=True):
        kind = timeline_kind(entry, graph_step_tokens)
        if entry["measured_device_ms"] <= 0 or entry["predicted_cycle_ms"] <= 0:
            continue
        correction = {"graph": graph, "eager": mixed}.get(kind, 1.0)
        ratios.setdefault(kind, []).append((entry["measured_device_ms"],
                                            entry["predicted_cycle_ms"],
                                            entry["predicted_cycle_ms"] / correction))
    return {kind: _accuracy(rows) for kind, rows in ratios.items()}


def _accuracy(rows: list[tuple[float, float, float]]) -> dict:
    median = lambda values: float(sorted(values)[len(values) // 2])
    device = sum(m for m, _, _ in rows)
    return {"steps": len(rows),
            "over_corrected_p50": median([m / c for m, c, _ in rows]),
            "over_profile_p50": median([m / p for m, _, p in rows]),
            "over_profile_total": device / sum(p for _, _, p in rows)}


def timeline_stalls(timeline: list[dict], over: float) -> list[tuple[float, float]]:
    """(seconds from the first decision, device time beyond the prediction) of the steps
    that ran over ``over`` times their prediction."""
    start = timeline[0]["time"]
    return [(e["time"] - start, (e["measured_device_ms"] - e["predicted_cycle_ms"]) / 1e3)
            for e in timeline if e["predicted_cycle_ms"] > 0
            and e["measured_device_ms"] > over * e["predicted_cycle_ms"]]
