"""The PD-multiplexing engine loop: decode and prefill in flight at once, one host thread.

``EngineCore`` hands its ``step()`` to a ``MultiplexLoop`` when ``schedule == "multiplex"``.
Each step (1) collects launches whose event reports done, applying their sampled tokens;
(2) launches work on whichever lane is free; (3) if it has nothing to return, waits a
little for the next completion. It never blocks on one lane while the other could launch.

Lanes and events
- Decode lane: one decode step in flight (a graph replay of the partition's own graphs, on
  its decode stream). The next step needs this step's tokens, so it launches only after
  this one's event is done.
- Prefill lane: one prefill batch at a time, run as pieces (layer ranges) on the prefill
  stream, one piece in flight. Pieces are sized by the planner to last about one decode
  step, so the scheduler re-plans at every step; with no decode running, the batch takes
  the whole GPU and all its remaining layers in one piece.
- Hand-off: a batch's requests join decode only when its last piece's event is done (the
  scheduler marks them in flight until then), and the next decode launch makes the decode
  stream wait on that event first (DESIGN.md §3a). A new prefill batch likewise waits on
  the last decode event, since prefix-cache hits may read KV a decode step wrote.
- TEMPORAL: with both lanes drained, a whole-GPU mixed step (decodes plus a prefill
  chunk) runs through ``ModelRunner.execute`` and completes before ``step`` returns.

Partition switching rule
The SM sets of two splits overlap, so the partition (the split both lanes use) changes only
when both lanes are drained. While one lane is busy under partition P, the other launches
under P too. When the planner, consulted at a decode boundary, prefers another split,
the switch is *pending*: prefill stops launching pieces under P, decode keeps running on
P, and the next boundary where the prefill lane is idle re-plans freely. A switch costs at
most about one decode step of idle prefill SMs, since pieces last about one step.

On the CPU (emulated partitions, no streams) the same code runs with every launch
finishing as it is issued.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

from pdserve.engine.mux_exec import DecodeLane, HostBuffers, Launch, PrefillBatch, decode_load_of
from pdserve.engine.mux_setup import build_partitions, graph_buckets, load_predictor
from pdserve.engine.streams import Event, StreamOps, make_stream_ops
from pdserve.gpu.partitions import Partition, PartitionSet
from pdserve.sched.base import Plan, StepOutput
from pdserve.sched.multiplex import MultiplexScheduler
from pdserve.sched.mux_planner import (
    MuxMode,
    MuxPlan,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
)

log = logging.getLogger(__name__)
TIMELINE_LENGTH = 20_000  # decisions kept for ``timeline()``; older ones are dropped
WAIT_FOR_COMPLETION_S = 0.002  # longest a step spins on events before returning empty


@dataclass(frozen=True)
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


class MultiplexLoop:
    def __init__(self, core, partitions: PartitionSet | None = None, predictor=None,
                 ops: StreamOps | None = None):
        self.core, self.runner = core, core.runner
        self.scheduler: MultiplexScheduler = core.scheduler
        self.config = core.config
        self.ops = ops or make_stream_ops(self.runner.device)
        self.partitions = partitions or build_partitions(self.config, self.runner.device)
        self.set_predictor(predictor or load_predictor(self.config, self.runner,
                                                       self.partitions.total_sms))
        self.num_layers = self.runner.model.num_layers
        max_seqs = self.config.scheduler.max_num_seqs
        self.decode_lane = DecodeLane(self.runner, self.ops, max_seqs)
        self.prefill_buffers = HostBuffers.make(self.ops, max_seqs)
        self.decode_lane.capture(self._graph_partitions(), graph_buckets(self.config))
        self.current: Partition = self.partitions.whole_gpu
        self.decode: Launch | None = None
        self.piece: Launch | None = None
        self.batch: PrefillBatch | None = None
        self.switch_pending = False
        self._handoff: list[Event] = []  # finished prefill events the decode stream must wait on
        self._last_decode_event: Event | None = None
        self._failed: list = []  # updates of requests whose launch raised
        self._timeline: deque[TimelineEntry] = deque(maxlen=TIMELINE_LENGTH)
        log.info("multiplex: %r, predictor %s", self.partitions, type(self.predictor).__name__)

    def set_predictor(self, predictor, **planner_overrides) -> None:
        """Re-plans with another latency model (e.g. one just profiled), keeping the graphs.

        The planners see it through an ``OnlineCalibration`` that mixed steps correct."""
        self.predictor = predictor
        self.model = OnlineCalibration(predictor)
        self._overrides = planner_overrides
        self.planner = MuxPlanner(self.model, self.partitions.decode_sm_choices(),
                                  self._planner_config(), self.partitions.total_sms)
        self._pinned: dict[int, MuxPlanner] = {}

    def _planner_config(self, **overrides) -> MuxPlannerConfig:
        sched = self.config.scheduler
        fields = dict(itl_slo_ms=sched.itl_slo_ms, ttft_slo_ms=sched.ttft_slo_ms,
                      max_prefill_tokens=sched.max_num_batched_tokens)
        return MuxPlannerConfig(**{**fields, **self._overrides, **overrides})

    def _graph_partitions(self) -> list[Partition]:
        return [*self.partitions.choices(), self.partitions.whole_gpu]

    # ------------------------------------------------------------------ step

    def step(self) -> list:
        updates = self._collect()
        updates += self._launch()
        updates += self._failed
        self._failed = []
        if not updates and (self.decode or self.piece):
            self._wait_any()
            updates += self._collect()
        return updates

    def _wait_any(self) -> None:
        wait_for_any((self.decode, self.piece))

    def busy(self) -> bool:
        return self.decode is not None or self.piece is not None

    # ------------------------------------------------------------- collecting

    def _collect(self) -> list:
        updates = []
        if self.decode is not None and self.decode.event.query():
            launch, self.decode = self.decode, None
            self._last_decode_event = launch.event
            updates += self._complete(launch)
        if self.piece is not None and self.piece.event.query():
            launch, self.piece = self.piece, None
            if launch.final:
                self.batch = None
                self._handoff.append(launch.event)
                updates += self._complete(launch)
            else:
                updates += self._drop_aborted_batch()
        return updates

    def _drop_aborted_batch(self) -> list:
        aborted = self.scheduler.drop_if_aborted(self.batch.plan)
        if aborted is None:
            return []
        self.batch = None
        core = self.core
        updates = [core._update(r, [], None) for r in aborted]
        for request in aborted:
            core._forget(request)
        return updates

    def _complete(self, launch: Launch) -> list:
        try:
            output = launch.output()
        except Exception:
            log.exception("%s launch failed; aborting its requests", launch.kind)
            return self._fail(launch.plan)
        return self._apply(launch.plan, output)

    def _apply(self, plan: Plan, output: StepOutput) -> list:
        core = self.core
        finished, aborted = self.scheduler.complete(plan, output)
        core._counters["steps"] += 1
        core._counters["generation"] += len(output.token_ids)
        updates = core._collect(plan, output)
        updates += [core._update(r, [], None) for r in aborted]
        for request in finished + aborted:
            core._forget(request)
        return updates

    def _fail(self, plan: Plan) -> list:
        for item in plan.scheduled:
            self.scheduler.in_flight.discard(item.request.request_id)
        return self.core._fail(plan)

    # -------------------------------------------------------------- launching

    def _launch(self) -> list:
        if self.decode is None and self.piece is None:
            return self._launch_drained()
        if self.decode is None:
            self._launch_decode_beside_piece()
        elif self.piece is None:
            self._launch_piece_beside_decode()
        return []

    def _launch_drained(self) -> list:
        """Both lanes idle: the planner may pick any split (the only place it changes)."""
        candidates = self.scheduler.prefill_candidates()
        plan = self._plan(self.planner, candidates)
        self.switch_pending = False
        whole = self.partitions.whole_gpu
        if plan.mode == MuxMode.TEMPORAL:
            self.current = whole
            return self._run_mixed(plan, candidates)
        if plan.mode == MuxMode.DECODE_ONLY:
            self.current = whole
            self._launch_decode(self.scheduler.plan_decode())
        elif plan.mode == MuxMode.PREFILL_ONLY:
            self.current = whole
            if self._ensure_batch(plan, candidates):
                self._launch_piece(plan)
        elif plan.mode == MuxMode.SPATIAL:
            self._launch_spatial(plan, candidates)
        if self.busy():
            self._note(plan)
        return []

    def _launch_spatial(self, plan: MuxPlan, candidates) -> None:
        # Decodes grow first (they may preempt); a split with nothing to prefill would
        # leave decode on a slice of the GPU for nothing, so it then takes the whole GPU.
        decode_plan = self.scheduler.plan_decode()
        prefill = not decode_plan.preempted and self._ensure_batch(plan, candidates)
        whole = self.partitions.whole_gpu
        self.current = self.partitions.get(plan.decode_sms) if prefill else whole
        self._launch_decode(decode_plan)
        if prefill:
            self._launch_piece(plan)

    def _launch_decode_beside_piece(self) -> None:
        """A piece is in flight under ``current``: decode joins it there (see the rule)."""
        if self.current.whole_gpu or self.scheduler.decode_load() is None:
            return  # a whole-GPU piece holds every SM: decode waits for it to drain
        plan = self._plan(self.planner, self.scheduler.prefill_candidates())
        if plan.decode_sms != self.current.decode_sms:
            self.switch_pending = True
        self._launch_decode(self.scheduler.plan_decode())
        if self.decode is not None:
            self._note(replace(plan, mode=MuxMode.SPATIAL, decode_sms=self.current.decode_sms,
                               prefill_sms=self.current.prefill_sms))

    def _launch_piece_beside_decode(self) -> None:
        """Decode is in flight under ``current``: a piece may run on its other SMs."""
        if self.switch_pending or self.current.whole_gpu:
            return
        candidates = self.scheduler.prefill_candidates()
        if self.batch is None and not candidates:
            return
        plan = self._plan(self._pinned_planner(self.current), candidates,
                          decode_load_of(self.decode.plan))
        if plan.mode == MuxMode.SPATIAL and self._ensure_batch(plan, candidates):
            self._launch_piece(plan)
            self._note(plan)

    def _pinned_planner(self, part: Partition) -> MuxPlanner:
        if part.decode_sms not in self._pinned:
            self._pinned[part.decode_sms] = MuxPlanner(
                self.model, [(part.decode_sms, part.prefill_sms)],
                self._planner_config(temporal=False), self.partitions.total_sms)
        return self._pinned[part.decode_sms]

    def _plan(self, planner: MuxPlanner, candidates, load=None) -> MuxPlan:
        load = load or self.scheduler.decode_load()
        in_flight = None
        if self.batch is not None:
            in_flight = self.scheduler.in_flight_view(self.batch.plan, self.batch.layers_done)
        return planner.plan(load, self.scheduler.planner_view(candidates), in_flight)

    def _launch_decode(self, plan: Plan) -> None:
        if not plan.decodes:
            return
        self.scheduler.launched(plan)
        waits, self._handoff = self._handoff, []
        if self._last_decode_event is not None:
            waits.append(self._last_decode_event)  # the previous step may be on another stream
        try:
            self.decode = self.decode_lane.launch(plan, self.current, waits, decode_load_of(plan))
        except Exception:
            log.exception("decode launch failed; aborting its %d requests", len(plan.decodes))
            self._failed += self._fail(plan)

    def _ensure_batch(self, plan: MuxPlan, candidates) -> bool:
        """The prefill batch to run ``plan``'s piece of: the one in flight, or a new one."""
        if self.batch is not None:
            return True
        piece = plan.prefill
        if piece is None or not piece.chunks:
            return False
        batch_plan = self.scheduler.plan_prefill(candidates, piece.chunks)
        if not batch_plan.prefills:
            return False
        self.scheduler.launched(batch_plan)
        self.batch = PrefillBatch(batch_plan, self.runner, self.ops, self.prefill_buffers)
        return True

    def _launch_piece(self, plan: MuxPlan) -> None:
        batch = self.batch
        waits = []
        if not batch.started and self._last_decode_event is not None:
            waits.append(self._last_decode_event)  # prefix hits may read KV decode wrote
        try:
            self.piece = batch.launch_piece(self.current, plan.prefill.num_layers, waits)
        except Exception:
            log.exception("prefill launch failed; aborting its %d requests",
                          len(batch.plan.prefills))
            self.batch = None
            self._failed += self._fail(batch.plan)

    def _run_mixed(self, plan: MuxPlan, candidates) -> list:
        step = self.scheduler.plan_mixed(candidates, plan.prefill.chunks)
        prefill_tokens = sum(s.num_new_tokens for s in step.prefills)
        self._note(plan, len(step.decodes), prefill_tokens)
        if step.is_empty():
            return []
        self.scheduler.launched(step)
        started = time.perf_counter()
        try:
            output = self.runner.execute(step)  # returns once the tokens are on the host
        except Exception:
            log.exception("mixed step failed; aborting its %d requests", len(step.scheduled))
            return self._fail(step)
        if prefill_tokens == plan.prefill.num_tokens:  # the step the prediction was for
            self.model.observe_mixed(plan.decode_ms, (time.perf_counter() - started) * 1e3)
        return self._apply(step, output)

    # ------------------------------------------------------------- reporting

    def _note(self, plan: MuxPlan, decode_batch: int | None = None,
              prefill_tokens: int | None = None) -> None:
        """Records what runs now: the split, the decode batch and the prefill piece."""
        if decode_batch is None:
            decode_batch = len(self.decode.plan.decodes) if self.decode is not None else 0
        layers = 0
        if prefill_tokens is None:
            running = self.piece is not None and self.batch is not None
            prefill_tokens = self.batch.num_tokens if running else 0
            layers = plan.prefill.num_layers if running and plan.prefill else 0
        self._timeline.append(TimelineEntry(
            time.monotonic(), str(plan.mode), plan.decode_sms, plan.prefill_sms, decode_batch,
            prefill_tokens, layers, plan.decode_ms, self.switch_pending))

    def timeline(self, since: float | None = None) -> list[dict]:
        """SM split over time: one dict per launching decision (``TimelineEntry`` fields)."""
        return [asdict(e) for e in self._timeline if since is None or e.time >= since]

    def last(self) -> TimelineEntry | None:
        return self._timeline[-1] if self._timeline else None


def wait_for_any(launches) -> None:
    """Spins (yielding the GIL) until one in-flight launch completes, or a short deadline."""
    deadline = time.monotonic() + WAIT_FOR_COMPLETION_S
    while time.monotonic() < deadline:
        if any(launch.event.query() for launch in launches if launch):
            return
        time.sleep(0)
