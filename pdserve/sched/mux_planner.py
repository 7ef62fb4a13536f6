"""Per-step planning for PD-multiplexing: how to share the GPU between decode and prefill.

Pure logic over a latency predictor (no torch). At every decode step the engine asks
``MuxPlanner.plan`` and gets a ``MuxPlan``:

- SPATIAL: decode on its own green-context partition, prefill on the rest, at the same
  time. Decode gets the *smallest* partition whose predicted co-running step fits the
  ITL budget; prefill gets a piece (tokens x layers) predicted to last about one decode
  step, so the scheduler can re-plan at every step and neither stream idles.
- TEMPORAL: one whole-GPU mixed step; decode tokens ride along in a prefill chunk's GEMMs
  (chunked prefill), with the largest chunk whose predicted step fits the ITL budget. With
  ``MuxPlannerConfig.graph_step_tokens`` the largest chunk whose step stays on the
  prefill-step graphs is weighed beside it, at its own learned cost; the higher rate wins.
- TIME_SLICE: whole-GPU time slicing at layer boundaries. A decode step runs alone on the
  whole GPU (graph replay), then a whole-GPU prefill piece (a layer range) sized so that
  decode step + piece fit the ITL budget; the next decode step starts after the piece.
  With a small decode batch prefill gets about (1 - decode step / ITL) of the whole GPU,
  where SPATIAL leaves it 55-75% of its speed and slows decode by 25-40% (H200). Offered
  only with ``MuxPlannerConfig.time_slice`` (the loop must know how to run it).
- PREFILL_ONLY: no decode running; prefill takes the whole GPU and runs every remaining
  layer of its batch in one piece (no layer-by-layer crawl when nobody needs the SMs).
- DECODE_ONLY: nothing to prefill, or prefill paused because no option meets the SLO.
- IDLE: nothing to do.

Decision rule, with budget = ITL SLO x safety margin, and a plan's *cycle* the predicted
time between two decode tokens (``MuxPlan.cycle_ms``: the co-running decode step in
SPATIAL, the mixed step in TEMPORAL, decode step + piece in TIME_SLICE):
1. SPATIAL, TEMPORAL and TIME_SLICE are each feasible when their cycle is within the
   budget.
2. Among feasible options, pick the highest predicted prefill progress, in prompt tokens
   per second of wall time (a piece of T tokens through k of L layers counts T x k / L),
   over the work the option commits to (``MuxPlan.committed_tokens_per_s``):
   - a SPATIAL or TIME_SLICE piece commits its batch to every layer it has left (no mixed
     step until then), so it counts the batch's whole run: its pieces, the decode steps
     they wait for, and a short last piece paid as a whole cycle;
   - a mixed step commits to nothing beyond itself, but the next ones take smaller chunks
     as the prefix they attend to grows, so it counts the mixed steps through the same
     prompt tokens as the best batch another option would start: both end in one state.
   Judged by the next cycle alone, the planner took mixed steps that look fastest at a
   short prefix and so gave up the large batch a split runs at one rate throughout.
   Each option's rate is divided by what serving measured of its prefill pieces against
   their predictions (``OnlineCalibration.prefill_correction``, per option and per split;
   mixed steps are corrected in their prediction already), so an option whose pieces run
   slower than profiled stops being chosen for a rate it does not deliver.
   Ties go to TEMPORAL (one stream, no partition switch), then TIME_SLICE (no partition).
3. If none is feasible, pick the shortest cycle among SPATIAL on the largest decode
   partition and DECODE_ONLY on the whole GPU (prefill waits a step).
   Prefill waits at most ``max_prefill_stall_ms``: once the oldest waiting request has
   waited that long (or a batch is part-way through its layers), DECODE_ONLY is off the
   list and the smallest mixed step and the smallest time slice join it, so a load whose
   decode alone breaks the SLO slows decode down instead of starving new prompts.

4. Hysteresis, given the option running now (``plan``'s ``incumbent``): a switch drains
   both lanes first (``multiplex.py``), about one of the incumbent's cycles with prefill
   idle, so a challenger's rate counts that time over the work it commits to and must then
   beat the incumbent's by ``switch_margin``; the incumbent's split is weighed beside the
   smallest one that fits, and a split smaller than the incumbent's must fit the budget
   less ``switch_margin``. A plan kept this way names the option it was kept over
   (``MuxPlan.held_over``).

A prefill batch that is part-way through its layers (started in spatial pieces) must
finish its layers before a mixed step can take new prompt tokens, so while one is in
flight TEMPORAL is not offered.

With a TTFT SLO, a new prefill batch is capped so that its predicted time through all
layers fits the oldest waiting request's remaining TTFT (never below that request's own
tokens): batching more prompts behind it would only delay its first token.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from pdserve.config import PREFILL_RULES


class LatencyModel(Protocol):
    """What the planner needs from a predictor (``LatencyPredictor``, ``RooflinePredictor``)."""

    num_layers: int
    total_sms: int

    def predict(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                sms: int, co_running: bool = False, num_layers: int | None = None) -> float: ...

    def predict_mixed(self, prefill_tokens: int, prefill_context: int, prefill_batch: int,
                      decode_batch: int, decode_context: int, sms: int | None = None
                      ) -> float: ...


@dataclass(frozen=True)
class _NoModel:
    """What ``OnlineCalibration`` reads of a model, where it only learns."""

    num_layers: int = 0
    total_sms: int = 0


_NO_MODEL = _NoModel()


class OnlineCalibration:
    """A latency model whose mixed-step and co-running decode predictions follow what the
    engine measures.

    The profile times a handful of mixed steps; the serving loop runs many more shapes, and
    on the H200 a mixed step's wall time (host batch building, eager launches, sampling)
    ran 10-20% over the fitted composition for small chunks. A planner working to 90% of
    the ITL SLO then misses it on every step. Co-running decode steps erred the other way
    (measured 0.91 of predicted at the median), which kept decode on a larger partition than
    it needed and left a third of the ITL budget unused. After each such step the engine
    reports (predicted, measured); the step's correction factor (one for mixed steps, one
    for co-running decode steps: shared by every partition, so a split the planner has not
    used yet is judged by what the others showed) moves a ``weight`` of the way (in log
    space) towards their ratio, within ``bounds``. One step's ratio counts as at most
    ``step_limit`` (or its inverse), so one odd step moves a factor by a few percent only:
    on the H200 a fresh server's first eager mixed step (kernels compiled on first use) ran
    16x its prediction and, counted at 2x, raised the correction 15%; with the planner no
    longer choosing mixed steps, no later step could bring it back. A real, lasting error
    is still learned, over a few steps.

    Each sharing option's prefill correction (``observe_prefill``) learns from its pieces
    by ``prefill_rule``: ``"converging"`` (the default) as above; ``"compounding"`` moves by
    every piece's ratio to the *uncorrected* prediction, so it drifts to a bound while pieces
    run a few percent off the profile: on the H200 at e1f3fe3 time slices' pieces at 0.95 of
    their prediction walked its factor to 0.5 and the planner weighed them at twice what
    their batches delivered (ShareGPT-like 16 req/s: 60% against converging's 83%, one call).

    With a ``window`` (``--mux-correction-window``) every factor is instead the median of
    its last ``window`` measured over *uncorrected* ratios (the moving rule above until
    ``MIN_WINDOW`` are in). A short run of slow steps then moves nothing: on the H200
    (8ccd9ac) three eager mixed steps at 1.07-1.41x their prediction, after ~300 as
    predicted, raised the eager correction from 1.00 to 1.11; the planner stopped choosing
    eager steps, so no later step could bring it back.

    Two guards against that lock-out (``--mux-stall-ratio``, ``--mux-correction-half-life``).
    A step or piece over ``stall_ratio`` times its corrected prediction is a stall, not a
    rate, and teaches nothing: at 6f2d50e a fresh server's first eager mixed steps took
    796 and 645 ms where 51-54 ms were predicted, and even at 1.25x a step they lifted the
    eager correction 1.05 -> 1.20 for the rest of the run. With a ``half_life`` every
    factor not observed relaxes towards the profile (in log space, its deviation halving
    over ``half_life`` observations of the others), so a path priced out is tried again
    and relearned if it really is slower: at 6f2d50e (ShareGPT-like, 18 req/s) four eager
    steps at 1.4-1.5x kept 256-token eager steps over the budget for 48 s; the planner ran
    graph steps of 115 prompt tokens at ~35 ms each (3.3K tokens/s against 5.5K).
    """

    MIN_WINDOW = 3  # ratios a window needs before its median is trusted

    def __init__(self, model: LatencyModel, weight: float = 0.2,
                 bounds: tuple[float, float] = (0.5, 2.0), step_limit: float = 1.25,
                 prefill_rule: str = "converging", window: int = 0, half_life: int = 0,
                 stall_ratio: float = 0.0, co_running_start: float = 1.0):
        if prefill_rule not in PREFILL_RULES:
            raise ValueError(f"prefill correction rule {prefill_rule!r}: expected one of "
                             f"{', '.join(PREFILL_RULES)}")
        if window < 0 or half_life < 0:
            raise ValueError(f"correction window {window}, half-life {half_life}: must be "
                             ">= 0 (0: off)")
        if stall_ratio and stall_ratio <= 1.0:
            raise ValueError(f"stall ratio {stall_ratio}: must be > 1 (0: off)")
        self.model, self.weight, self.bounds = model, weight, bounds
        self.step_limit, self.prefill_rule, self.window = step_limit, prefill_rule, window
        self.half_life, self.stall_ratio = half_life, stall_ratio
        # Where SM splits' and time slices' prefill corrections start (and relax back to).
        self.co_running_start = co_running_start
        self.stalls_ignored: dict[str, int] = {}  # by factor
        self._ratios: dict[str, deque[float]] = {}  # by factor, with a window
        self.num_layers, self.total_sms = model.num_layers, model.total_sms
        self.mixed_correction = 1.0
        # Mixed steps small enough for the prefill-step graphs learn their own factor: the
        # profile's mixed rows are all eager, and graph steps measured cheaper must not pull
        # the eager steps' predictions down with them (nor eager ones keep graph steps dear).
        self.graph_mixed_correction = 1.0
        self.decode_correction = 1.0  # co-running decode steps
        # Decode alone on the whole GPU (decode-only steps, time slices' decodes): on the
        # H200 (ShareGPT-like, 3fa127d) such steps of 33-128 requests ran 1.11-1.18x the
        # profile, so time slices sized their pieces to a budget the decode had already used.
        self.alone_decode_correction = 1.0
        self.prefill_corrections: dict[str, float] = {}  # by ``option_key``
        self.prefill_pieces: dict[str, int] = {}
        self.delivered_batches: dict[str, int] = {}  # the ``delivery`` rule's lessons

    @classmethod
    def from_config(cls, model: LatencyModel, config) -> OnlineCalibration:
        """The calibration a ``SchedulerConfig``'s correction flags ask for."""
        return cls(model, prefill_rule=config.mux_prefill_correction,
                   window=config.mux_correction_window,
                   half_life=config.mux_correction_half_life,
                   stall_ratio=config.mux_stall_ratio,
                   co_running_start=config.mux_co_running_correction)

    @classmethod
    def learning_only(cls, **kwargs) -> OnlineCalibration:
        """A calibration that learns from (predicted, measured) pairs with no profile to
        predict from: the offline replays of a run's corrections."""
        return cls(_NO_MODEL, **kwargs)

    def predict(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                sms: int, co_running: bool = False, num_layers: int | None = None) -> float:
        ms = self.model.predict(phase, num_tokens, context_tokens, batch_size, sms,
                                co_running, num_layers)
        if phase == "decode" and co_running:
            ms *= self.decode_correction
        elif phase == "decode" and sms == self.total_sms:
            ms *= self.alone_decode_correction
        return ms

    def predict_mixed(self, *args, **kwargs) -> float:
        return self.mixed_correction * self.model.predict_mixed(*args, **kwargs)

    def predict_graph_mixed(self, *args, **kwargs) -> float:
        """A mixed step replayed from the prefill-step graphs (``predict_mixed``'s arguments)."""
        return self.graph_mixed_correction * self.model.predict_mixed(*args, **kwargs)

    def observe_mixed(self, predicted_ms: float, measured_ms: float, graph: bool = False
                      ) -> None:
        """``predicted_ms``: what ``predict_mixed`` (``graph``: ``predict_graph_mixed``) said
        for the step that ran."""
        key = "graph_mixed" if graph else "mixed"
        if not self._teaches(key, predicted_ms, measured_ms):
            return
        if graph:
            self.graph_mixed_correction = self._learned(
                key, self.graph_mixed_correction, predicted_ms, measured_ms)
        else:
            self.mixed_correction = self._learned(key, self.mixed_correction, predicted_ms,
                                                  measured_ms)

    def observe_decode(self, predicted_ms: float, measured_ms: float, alone: bool = False
                       ) -> None:
        """A co-running decode step (``alone``: a decode step alone on the whole GPU);
        ``predicted_ms``: what ``predict`` said for it."""
        if alone:
            if self._teaches("alone_decode", predicted_ms, measured_ms):
                self.alone_decode_correction = self._learned(
                    "alone_decode", self.alone_decode_correction, predicted_ms, measured_ms)
        elif self._teaches("decode", predicted_ms, measured_ms):
            self.decode_correction = self._learned("decode", self.decode_correction,
                                                   predicted_ms, measured_ms)

    def prefill_correction(self, option: str | None) -> float:
        """Measured over predicted time of ``option``'s prefill pieces (none seen: where
        the option starts, ``prefill_start``)."""
        if option is None:
            return 1.0
        return self.prefill_corrections.get(option, self.prefill_start(option))

    def prefill_start(self, option: str) -> float:
        """The correction ``option`` starts from: ``co_running_start`` for an SM split or
        time slices (their batches deliver less than their pieces' profile says: decode
        steps alone and switches between the pieces), 1.0 for mixed steps."""
        return 1.0 if option == str(MuxMode.TEMPORAL) else self.co_running_start

    def observe_prefill(self, option: str, predicted_ms: float, measured_ms: float) -> None:
        """A prefill piece of ``option`` (``option_key``) completed: it took ``measured_ms``
        where the plan it was launched by said ``predicted_ms``.

        The profile times a piece on its partition beside a decode step; serving runs it
        beside other decode batches, with host gaps, eager launches and the lanes' hand-offs
        in between, and nothing else checks the prefill side of a co-running option: on the
        H200 the decode side of every option was predicted right while batches run in
        pieces beside a 16-SM decode partition advanced prompts well below the rate the
        planner chose them by. The planner divides an option's committed rate by this
        correction. Every spatial split learns on its own (unlike co-running decode, whose
        error the splits share): a split not run yet keeps its prediction.

        ``predicted_ms`` is the profile's (a plan's piece carries no correction: the planner
        divides rates by it). The ``"compounding"`` rule moves the factor by that
        ratio, so it keeps moving while pieces run off the profile at all: on the H200 pieces
        that took 0.97-0.98 of their prediction walked their option's factor to its 0.5
        bound, and ones at 1.19 to 2.0, doubling or halving the rate the planner weighs the
        option by. ``"converging"`` (the default) compares the corrected
        prediction, as mixed steps and decode steps do, so the factor settles on the
        pieces' measured over predicted time."""
        if self.prefill_rule == "delivery":
            return
        factor = self.prefill_correction(option)
        if not self._teaches(f"prefill:{option}", predicted_ms * factor, measured_ms):
            return
        if self.window:
            learned = self._learned(f"prefill:{option}", factor, predicted_ms * factor,
                                    measured_ms)
        else:
            if self.prefill_rule == "converging":
                predicted_ms *= factor
            learned = self._moved(factor, predicted_ms, measured_ms)
        self.prefill_corrections[option] = learned
        self.prefill_pieces[option] = self.prefill_pieces.get(option, 0) + 1

    def observe_delivery(self, option: str, committed_tokens_per_s: float,
                         delivered_tokens_per_s: float) -> None:
        """A prefill batch of ``option`` completed, delivering its prompt tokens at
        ``delivered_tokens_per_s`` (from its first piece's decision to its last piece seen
        done) where it was chosen at ``committed_tokens_per_s`` (uncorrected). The
        ``delivery`` rule learns only from these, converging on committed over delivered.

        On the H200 (``mux_calibration_audit.py --delivery`` over the committed timelines)
        time-slice pieces ran at 0.99-1.04 of their prediction (median over runs) while
        their batches delivered 0.82-0.95 of the committed rate (ShareGPT-like, LooGLE-like,
        Mooncake), spatial batches 0.80-0.84, mixed steps 1.00-1.01: the loss lies between
        the pieces (decode steps run alone, switches), where no piece correction looks."""
        if self.prefill_rule != "delivery" or committed_tokens_per_s <= 0 \
                or delivered_tokens_per_s <= 0:
            return
        factor = self.prefill_correction(option)
        predicted_ms, measured_ms = 1e3 / committed_tokens_per_s, 1e3 / delivered_tokens_per_s
        if not self._teaches(f"prefill:{option}", predicted_ms * factor, measured_ms):
            return
        self.prefill_corrections[option] = self._learned(
            f"prefill:{option}", factor, predicted_ms * factor, measured_ms)
        self.delivered_batches[option] = self.delivered_batches.get(option, 0) + 1

    def describe_prefill(self) -> dict[str, dict[str, float]]:
        """Each option's prefill correction and the pieces (or, by the ``delivery`` rule,
        the batches) it learned from."""
        return {option: {"correction": round(factor, 4),
                         "pieces": self.prefill_pieces.get(option, 0),
                         **({"batches": self.delivered_batches[option]}
                            if option in self.delivered_batches else {})}
                for option, factor in sorted(self.prefill_corrections.items())}

    def describe_guards(self) -> dict:
        """The lock-out guards in force and the stalls they kept out, by factor."""
        return {"half_life": self.half_life, "stall_ratio": self.stall_ratio,
                "stalls_ignored": dict(sorted(self.stalls_ignored.items()))}

    def _teaches(self, key: str, corrected_ms: float, measured_ms: float) -> bool:
        """Whether factor ``key`` learns from this observation (not a stall); every other
        factor relaxes one observation's worth towards the profile."""
        if self.stall_ratio and corrected_ms > 0 and measured_ms > self.stall_ratio * corrected_ms:
            self.stalls_ignored[key] = self.stalls_ignored.get(key, 0) + 1
            return False
        if self.half_life:
            self._relax_all_but(key, 0.5 ** (1.0 / self.half_life))
        return True

    def _relax_all_but(self, key: str, keep: float) -> None:
        """Every factor but ``key`` with its log deviation from 1 times ``keep``."""
        if key != "mixed":
            self.mixed_correction **= keep
        if key != "graph_mixed":
            self.graph_mixed_correction **= keep
        if key != "decode":
            self.decode_correction **= keep
        if key != "alone_decode":
            self.alone_decode_correction **= keep
        for option, factor in self.prefill_corrections.items():
            if key != f"prefill:{option}":
                start = self.prefill_start(option)
                self.prefill_corrections[option] = start * (factor / start) ** keep

    def _learned(self, key: str, factor: float, corrected_ms: float, measured_ms: float
                 ) -> float:
        """``factor`` after a step predicted ``corrected_ms`` (``factor`` included) took
        ``measured_ms``: the window's median where there is a window, else moved."""
        if not self.window or corrected_ms <= 0 or measured_ms <= 0:
            return self._moved(factor, corrected_ms, measured_ms)
        ratios = self._ratios.setdefault(key, deque(maxlen=self.window))
        ratios.append(measured_ms * factor / corrected_ms)
        if len(ratios) < self.MIN_WINDOW:
            return self._moved(factor, corrected_ms, measured_ms)
        low, high = self.bounds
        return min(max(statistics.median(ratios), low), high)

    def _moved(self, factor: float, predicted_ms: float, measured_ms: float) -> float:
        if predicted_ms <= 0 or measured_ms <= 0:
            return factor
        low, high = self.bounds
        ratio = min(max(measured_ms / predicted_ms, 1.0 / self.step_limit), self.step_limit)
        return min(max(factor * ratio ** self.weight, low), high)


class MuxMode(StrEnum):
    SPATIAL = "spatial"
    TEMPORAL = "temporal"
    TIME_SLICE = "time_slice"
    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"
    IDLE = "idle"


@dataclass(frozen=True)
class DecodeLoad:
    batch_size: int
    context_tokens: int  # sum over the batch of each request's context
    # What the tightest request of the batch has banked against its TPOT target
    # (``banked_slack_ms``): the longest the next planned step may take. None: not
    # tracked (``MuxPlannerConfig.tpot_bank_cap`` off), every step within the budget.
    slack_ms: float | None = None
    # A waiting prompt is predicted to miss its TTFT SLO at the budget's prefill rate
    # (``MuxPlanner.ttft_pressed``): this step is planned to ``ttft_pressed_margin`` of the
    # ITL SLO instead of ``safety_margin``.
    ttft_pressed: bool = False


@dataclass(frozen=True)
class PrefillRequest:
    """A request waiting for (more) prefill."""

    tokens_remaining: int
    prefix_tokens: int = 0  # already in the KV cache: prefix hit plus earlier chunks
    waited_ms: float = 0.0


@dataclass(frozen=True)
class InFlightPrefill:
    """A prefill batch part-way through the model's layers."""

    num_tokens: int
    context_tokens: int  # sum of the batch's prefixes
    batch_size: int
    layers_done: int


@dataclass(frozen=True)
class PrefillPiece:
    """Prefill work to launch: ``num_tokens`` tokens through layers [start, start + n).

    ``chunks`` lists (index into the waiting list, tokens taken) when this piece starts a
    new batch; it is empty when the piece continues the batch in flight.
    """

    chunks: tuple[tuple[int, int], ...]
    num_tokens: int
    context_tokens: int
    batch_size: int
    start_layer: int
    num_layers: int
    predicted_ms: float


@dataclass(frozen=True)
class MuxPlan:
    """What to launch until the next decode boundary, and what it is predicted to cost.

    TIME_SLICE: ``decode_sms == prefill_sms ==`` the device's SMs; the decode step
    (``decode_ms``) runs first, then the piece (``prefill.predicted_ms``, layers
    ``prefill.start_layer`` for ``prefill.num_layers`` layers), never overlapping;
    ``cycle_ms`` is their sum.
    """

    mode: MuxMode
    decode_sms: int  # both counts are the device's SMs in the whole-GPU modes, so
    prefill_sms: int  # ``PartitionSet.get(plan.decode_sms)`` is the partition to run on
    prefill: PrefillPiece | None
    decode_ms: float  # predicted decode step (the mixed step in TEMPORAL; 0 without decode)
    prefill_tokens_per_s: float  # predicted prefill progress (see the module's rule 2)
    meets_slo: bool
    reason: str
    # Predicted time between two decode tokens, what the ITL SLO bounds (0 without decode).
    cycle_ms: float = 0.0
    prefill_waiting: bool = False  # decode ran while prefill work was waiting or in flight
    # Predicted prefill progress over the work the plan commits to (the module's rule 2):
    # what ``plan`` picks by; ``prefill_tokens_per_s`` is the rate of this one cycle. An
    # estimate, not part of what to launch, so plans that launch the same compare equal.
    committed_tokens_per_s: float = field(default=0.0, compare=False)
    # What serving measured of this option's pieces against their predictions
    # (``OnlineCalibration.prefill_correction``; 1.0 where nothing was learned) and the
    # rate the plan was weighed by: the committed rate over that correction, less a
    # switch's cost for a challenger (rule 4).
    prefill_calibration: float = field(default=1.0, compare=False)
    weighed_tokens_per_s: float = field(default=0.0, compare=False)
    # The option rule 4 kept this plan over (the one the rates alone would pick), if any.
    held_over: str | None = field(default=None, compare=False)
    # The best feasible option not chosen and the rate it was weighed by (None, 0: none):
    # why an option won is read from the timeline against what it beat.
    runner_up: str | None = field(default=None, compare=False)
    runner_up_tokens_per_s: float = field(default=0.0, compare=False)

    @property
    def option(self) -> str | None:
        """The sharing option this plan runs (``option_key``)."""
        return option_key(self.mode, self.decode_sms)


@dataclass(frozen=True)
class MuxPlannerConfig:
    itl_slo_ms: float
    ttft_slo_ms: float | None = None
    safety_margin: float = 0.9  # plan to this share of the ITL SLO: predictor error, jitter
    max_prefill_tokens: int = 8192  # most prompt tokens in one prefill batch
    min_chunk_tokens: int = 64  # smallest mixed-step chunk or spatial batch worth launching
    token_align: int = 64  # chunk sizes are multiples of this (GEMM tiles, graph buckets)
    # Align the whole mixed step (the chunk and the decode batch's tokens) instead of the
    # chunk alone, as chunked prefill's token budget does: a 256-token chunk beside 2
    # decodes is a 258-token step the prefill-step graphs pad to 272 tokens. The mixed-step
    # floor's chunk is then rounded down to an aligned step (256 beside 2 decodes: 254).
    align_step_tokens: bool = False
    spatial: bool = True
    temporal: bool = True
    # Off by default: a loop that cannot run TIME_SLICE plans must never be handed one.
    time_slice: bool = False
    # Longest a waiting prompt is held back when no option meets the ITL SLO (rule 3).
    max_prefill_stall_ms: float = 2000.0
    # Hysteresis (rule 4): how much more a challenger must deliver than the running option,
    # and how far under the budget a smaller decode partition's step must be to be re-entered.
    switch_margin: float = 0.03
    # Largest whole-GPU step (prompt and decode tokens) the engine replays from its prefill
    # step graphs; 0: mixed steps are all predicted as eager ones. When set, a mixed step
    # also weighs the largest chunk that keeps the step on the graphs, at the graph steps'
    # own learned cost (``OnlineCalibration.predict_graph_mixed``): on the H200 the planner's
    # 64-token chunks plus the decode batch left almost every mixed step one token over.
    graph_step_tokens: int = 0
    # Smallest chunk a mixed step takes (while that many prompt tokens wait) even where the
    # largest chunk fitting the budget is smaller, as long as the step stays within
    # ``mixed_floor_cap`` of the ITL SLO (else the largest chunk under it that does); kept on
    # the prefill-step graphs when they are weighed. 0: off, a chunk shrinks to whatever fits.
    # The budget is per step, the SLO a mean over a request's tokens: on the H200 (Mooncake
    # trace) chunks cut to 64-128 tokens over 14-22K-token prefixes prefilled 1.2-2.5K
    # tokens/s and took a third of the mixed steps' time, where chunked prefill kept 256-token
    # steps and met TPOT 60 ms.
    mixed_floor_tokens: int = 0
    mixed_floor_cap: float = 1.25
    # Where the floor is cut to the graphs' room beside the decode batch, take the whole
    # floor eagerly instead when that step (within the cap) is predicted to prefill faster.
    # On the H200 (ShareGPT-like, 16 req/s) an eager correction of 1.2 beside ~140 decodes
    # left graph steps of 116 prompt tokens (~40 ms, half the prefill rate) for whole runs.
    floor_off_graphs: bool = False
    # A mixed step or a time slice may run past the budget by what every request of the
    # decode batch has banked against its TPOT target (``DecodeLoad.slack_ms``), up to
    # this multiple of the ITL SLO; 0: off. The SLO is a mean per request: on the H200
    # (Mooncake trace) chunked 1024's ~150 ms mixed steps kept TPOT p50 at 29 ms while the
    # planner's steps held 0.69 of a 60 ms target and its prompts waited.
    tpot_bank_cap: float = 0.0
    # Whose bank is spent: the request at this quantile of the batch's banks (0: the
    # tightest). A request that just joined has banked nothing, so at 0 a steady stream of
    # arrivals keeps every step at the budget however much the others banked.
    tpot_bank_quantile: float = 0.0
    # While a waiting prompt is predicted to miss ``ttft_slo_ms`` at the prefill rate of
    # mixed steps planned to ``safety_margin``, plan mixed steps and time slices to this
    # share of the ITL SLO instead; 0: off. On the H200 (ShareGPT-like, 16 req/s) the
    # planner's 52 ms steps (0.87 of the target) prefilled 4.9K tokens/s against 5.2K
    # arriving, TTFT P50 1.8 s against a 2 s SLO, while chunked 512's ~60 ms steps kept
    # every TTFT under it.
    ttft_pressed_margin: float = 0.0

    @property
    def budget_ms(self) -> float:
        return self.itl_slo_ms * self.safety_margin

    def step_budget_ms(self, decode: DecodeLoad) -> float:
        """The longest a mixed step or a time slice beside ``decode`` may be planned to
        take: the budget (the pressed one while prompts miss their TTFT), or what the batch
        banked (``tpot_bank_cap``), whichever is more, at most the cap."""
        budget = self.budget_ms
        if decode.ttft_pressed and self.ttft_pressed_margin > 0:
            budget = max(budget, self.itl_slo_ms * self.ttft_pressed_margin)
        if self.tpot_bank_cap <= 0 or decode.slack_ms is None:
            return budget
        return min(max(budget, decode.slack_ms), self.itl_slo_ms * self.tpot_bank_cap)


class MuxPlanner:
    """``partitions``: (decode SMs, prefill SMs) of each spatial split, any order."""

    def __init__(self, predictor: LatencyModel, partitions: Sequence[tuple[int, int]],
                 config: MuxPlannerConfig, total_sms: int | None = None,
                 calibration: OnlineCalibration | None = None):
        self.predictor = predictor
        # Where each option's prefill correction comes from (rule 2): the predictor itself
        # when it is an ``OnlineCalibration``; none (1.0 everywhere) otherwise.
        if calibration is None and isinstance(predictor, OnlineCalibration):
            calibration = predictor
        self.calibration = calibration
        self.partitions = sorted(partitions)
        self.config = config
        self.total_sms = total_sms or predictor.total_sms
        self.num_layers = predictor.num_layers

    def pinned_to(self, split: tuple[int, int]) -> MuxPlanner:
        """This planner's settings with ``split`` (decode SMs, prefill SMs) as the only SM
        split and no whole-GPU mixed step: how a prefill batch that starts beside a decode
        step in flight on that split is weighed (the split holds until both lanes drain)."""
        return MuxPlanner(self.predictor, [split], replace(self.config, temporal=False),
                          self.total_sms, self.calibration)

    def plan(self, decode: DecodeLoad | None, waiting: Sequence[PrefillRequest] = (),
             in_flight: InFlightPrefill | None = None, incumbent: str | None = None
             ) -> MuxPlan:
        """``incumbent``: the sharing option running now (``MuxPlan.option``), if any: a
        challenger pays for the switch (rule 4)."""
        solo = self._solo(decode, waiting, in_flight)
        if solo is not None:
            return solo
        decode = self._pressed(decode, waiting)
        feasible = self._weighed(decode, waiting, in_flight, incumbent)
        if feasible:  # max() keeps the first of equals: the incumbent, then _sharing's order
            chosen = max(feasible, key=lambda p: p.weighed_tokens_per_s)
            free = max(feasible, key=_delivered)
            held = chosen.option == incumbent != free.option and chosen.held_over is None
            return _with_runner_up(replace(chosen, held_over=free.option) if held else chosen,
                                   feasible)
        return min(self._fallbacks(decode, waiting, in_flight), key=lambda p: p.cycle_ms)

    def options(self, decode: DecodeLoad | None, waiting: Sequence[PrefillRequest] = (),
                in_flight: InFlightPrefill | None = None, incumbent: str | None = None
                ) -> list[MuxPlan]:
        """Every plan ``plan`` weighs for this load: the feasible sharing options first,
        then what it falls back to when none is."""
        solo = self._solo(decode, waiting, in_flight)
        if solo is not None:
            return [solo]
        decode = self._pressed(decode, waiting)
        weighed = self._weighed(decode, waiting, in_flight, incumbent)
        for plan in self._fallbacks(decode, waiting, in_flight):
            weighed += [plan] if plan not in weighed else []
        return weighed

    def itl_use(self, plan: MuxPlan) -> float | None:
        """``plan``'s predicted time between decode tokens over the ITL SLO."""
        return itl_use(plan, self.config.itl_slo_ms)

    def profile_groups(self) -> list[tuple[str, int, bool]]:
        """Every (phase, SMs, co-running) this planner can ask its predictor about."""
        partitions = self.partitions if self.config.spatial else []
        return profile_groups(partitions, self.total_sms)

    def _solo(self, decode: DecodeLoad | None, waiting: Sequence[PrefillRequest],
              in_flight: InFlightPrefill | None) -> MuxPlan | None:
        """The plan when at most one phase has work; None when both have."""
        has_decode = decode is not None and decode.batch_size > 0
        has_prefill = in_flight is not None or any(r.tokens_remaining > 0 for r in waiting)
        if not has_decode:
            return self._prefill_only(waiting, in_flight) if has_prefill else self._idle()
        if not has_prefill:
            return self._decode_only(decode, "no prefill work", prefill_waiting=False)
        return None

    def _pressed(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest]) -> DecodeLoad:
        """``decode`` marked ``ttft_pressed`` where ``ttft_pressed`` holds."""
        if self.config.ttft_pressed_margin <= 0 or not self.ttft_pressed(decode, waiting):
            return decode
        return replace(decode, ttft_pressed=True)

    def ttft_pressed(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest]) -> bool:
        """Whether some waiting prompt is predicted to miss ``ttft_slo_ms`` (within the
        safety margin) if the queue ahead of it, itself included, is prefilled by mixed
        steps of the largest chunk that fits the unpressed budget: its wait so far plus
        the tokens up to its last over that rate. A lower bound on what the planner can
        deliver (another option may be faster), so the pressure errs towards on."""
        cfg = self.config
        live = [r for r in waiting if r.tokens_remaining > 0]
        if cfg.ttft_slo_ms is None or not live:
            return False
        rate = self._unpressed_mixed_rate(replace(decode, ttft_pressed=False), waiting)
        deadline, ahead = cfg.ttft_slo_ms * cfg.safety_margin, 0
        for request in live:
            ahead += request.tokens_remaining
            if rate <= 0 or request.waited_ms + ahead / rate > deadline:
                return True
        return False

    def _unpressed_mixed_rate(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest]
                              ) -> float:
        """Prompt tokens per ms of mixed steps of the largest chunk within the step budget
        (the smallest chunk where none fits)."""
        step = lambda tokens: self._mixed_ms(decode, waiting, tokens)
        smallest, largest = self._chunk_range(waiting, decode)
        chunk = self._largest_step(step, smallest, largest, None,
                                   self.config.step_budget_ms(decode), self._offset(decode))
        chunk = chunk or smallest
        return chunk / step(chunk)

    def _chunk_range(self, waiting: Sequence[PrefillRequest], decode: DecodeLoad
                     ) -> tuple[int, int]:
        """The smallest and largest chunk a mixed step may take of the waiting prompts. A
        step that ``max_prefill_tokens`` cuts is aligned as one the budget cuts (only what
        is left of the prompts may end off the alignment)."""
        available = sum(r.tokens_remaining for r in waiting)
        return min(available, self.config.min_chunk_tokens), self._capped(available, decode)

    def _capped(self, tokens: int, decode: DecodeLoad) -> int:
        """``tokens``, or where ``max_prefill_tokens`` cuts them the cap aligned as the
        budget's cuts are (the decodes counted with ``align_step_tokens``)."""
        cfg = self.config
        if tokens <= cfg.max_prefill_tokens:
            return tokens
        return self._aligned_down(cfg.max_prefill_tokens, decode,
                                  least=min(tokens, cfg.min_chunk_tokens))

    def _aligned_down(self, chunk: int, decode: DecodeLoad, least: int) -> int:
        """``chunk`` cut so that it (with ``align_step_tokens`` the decodes beside it too)
        ends on the alignment, but not under ``least``."""
        offset, align = self._offset(decode), self.config.token_align
        return max((chunk + offset) // align * align - offset, least)

    def _sharing(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                 in_flight: InFlightPrefill | None, incumbent: str | None = None
                 ) -> list[MuxPlan]:
        """The options that run both phases, in the order that breaks ties (rule 2)."""
        made = (self._temporal(decode, waiting, in_flight),
                self._time_slice(decode, waiting, in_flight))
        spatial = self._spatial_options(decode, waiting, in_flight, incumbent)
        return [p for p in made if p is not None] + spatial

    def _weighed(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                 in_flight: InFlightPrefill | None, incumbent: str | None = None
                 ) -> list[MuxPlan]:
        """The sharing options that meet the budget, each with the rate it is weighed by
        (rules 2 and 4), the incumbent first: a mixed step's over the prompt tokens of the
        best batch another option would start."""
        feasible = [self._calibrated(p) for p in
                    self._sharing(decode, waiting, in_flight, incumbent) if p.meets_slo]
        batches = [p for p in feasible if p.mode != MuxMode.TEMPORAL and p.prefill.chunks]
        work = max(batches, key=_delivered).prefill.num_tokens if batches else None
        if work is not None:
            feasible = [self._mixed_over(p, decode, waiting, work)
                        if p.mode == MuxMode.TEMPORAL else p for p in feasible]
        held = next((p for p in feasible if p.option == incumbent), None)
        weighed = [self._challenging(p, held, work) for p in feasible]
        return sorted(weighed, key=lambda p: p.option != incumbent)  # stable: rule 2's order

    def _calibrated(self, plan: MuxPlan) -> MuxPlan:
        if self.calibration is None:
            return plan
        return replace(plan, prefill_calibration=self.calibration.prefill_correction(plan.option))

    def _challenging(self, plan: MuxPlan, held: MuxPlan | None, work: int | None) -> MuxPlan:
        """Rule 4: a plan other than the running option ``held`` delivers its committed work
        only after a switch (about one of ``held``'s cycles with prefill idle, while the
        lanes drain), and must beat ``held`` by the switch margin."""
        rate = _delivered(plan)
        if held is None or plan is held:
            return replace(plan, weighed_tokens_per_s=rate)
        tokens = self._committed_work(plan, work)
        if rate > 0 and tokens > 0:
            rate = tokens / (tokens / rate + held.cycle_ms / 1e3)
        return replace(plan, weighed_tokens_per_s=rate / (1 + self.config.switch_margin))

    def _committed_work(self, plan: MuxPlan, work: int | None) -> float:
        """Prompt tokens (a share of the layers counting pro rata) the plan's rate runs
        over: a batch's layers left; mixed steps, the best batch's tokens (rule 2)."""
        piece = plan.prefill
        if plan.mode == MuxMode.TEMPORAL:
            return work if work is not None else piece.num_tokens
        return piece.num_tokens * (self.num_layers - piece.start_layer) / self.num_layers

    def _mixed_over(self, plan: MuxPlan, decode: DecodeLoad,
                    waiting: Sequence[PrefillRequest], work: int) -> MuxPlan:
        """``plan`` (a mixed step) with the rate of mixed steps through the next ``work``
        prompt tokens, each step with the largest chunk that fits (the last one no more than
        is left): chunks shrink as the prefix they attend to grows, so the first step's rate
        overstates the run. 0 when mixed steps stop fitting the budget on the way."""
        cfg = self.config
        ms, done, chunk = 0.0, 0, plan.prefill.num_tokens
        while done < work and chunk is not None:
            window, left = _window(waiting, done, work - done), work - done
            chunk = self._mixed_chunk(decode, window, min(left, cfg.min_chunk_tokens),
                                      self._capped(left, decode), guess=chunk)
            if chunk is not None:
                ms, done = ms + self._mixed_ms(decode, window, chunk), done + chunk
        rate = 1e3 * work / ms if chunk is not None else 0.0
        return replace(plan, committed_tokens_per_s=rate)

    def _fallbacks(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                   in_flight: InFlightPrefill | None) -> list[MuxPlan]:
        """Rule 3: what runs when no option meets the budget."""
        spatial = self._spatial(decode, waiting, in_flight)
        fallback = [spatial] if spatial is not None else []
        if self._stalled(waiting, in_flight):
            forced = (self._temporal(decode, waiting, in_flight, forced=True),
                      self._time_slice(decode, waiting, in_flight, forced=True))
            fallback += [p for p in forced if p is not None]
            if fallback:
                return fallback
        return fallback + [self._decode_only(decode, "no option meets the ITL SLO")]

    def _stalled(self, waiting: Sequence[PrefillRequest],
                 in_flight: InFlightPrefill | None) -> bool:
        """Prefill has waited its longest; a batch in flight always moves on."""
        if in_flight is not None:
            return True
        waited = [r.waited_ms for r in waiting if r.tokens_remaining > 0]
        return bool(waited) and max(waited) >= self.config.max_prefill_stall_ms

    # ------------------------------------------------------------------ options

    def _idle(self) -> MuxPlan:
        return MuxPlan(MuxMode.IDLE, self.total_sms, self.total_sms, None, 0.0, 0.0, True,
                       "nothing to run")

    def _decode_only(self, decode: DecodeLoad, reason: str, prefill_waiting: bool = True
                     ) -> MuxPlan:
        ms = self._decode_ms(decode, self.total_sms, co_running=False)
        return MuxPlan(MuxMode.DECODE_ONLY, self.total_sms, self.total_sms, None, ms, 0.0,
                       ms <= self.config.itl_slo_ms, reason, ms, prefill_waiting)

    def _prefill_only(self, waiting: Sequence[PrefillRequest],
                      in_flight: InFlightPrefill | None) -> MuxPlan:
        sms = self.total_sms
        if in_flight is not None:
            piece = self._continue(in_flight, sms, co_running=False,
                                   layers=self.num_layers - in_flight.layers_done)
        else:
            chunks = self._gather(waiting, self._token_budget(waiting, sms, False))
            piece = self._piece(waiting, chunks, 0, self.num_layers, sms, False)
        rate = self._rate(piece)
        return MuxPlan(MuxMode.PREFILL_ONLY, sms, sms, piece, 0.0, rate, True,
                       "no decode running: whole GPU, all remaining layers",
                       committed_tokens_per_s=rate)

    def _spatial(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                 in_flight: InFlightPrefill | None) -> MuxPlan | None:
        plans = self._spatial_options(decode, waiting, in_flight)
        return plans[0] if plans else None

    def _spatial_options(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                         in_flight: InFlightPrefill | None, incumbent: str | None = None
                         ) -> list[MuxPlan]:
        """SPATIAL on the smallest decode partition that fits, and on the incumbent's split
        when that is another one and still fits (rule 4 weighs the two)."""
        if not (self.config.spatial and self.partitions):
            return []
        held = self._split_of(incumbent)
        smallest, free = self._smallest_fitting(decode, held), self._smallest_fitting(decode)
        plans = [self._spatial_on(smallest, decode, waiting, in_flight)]
        if free != smallest:  # the margin kept decode off a smaller split: say so
            plans[0] = replace(plans[0], held_over=option_key(MuxMode.SPATIAL,
                                                               self.partitions[free][0]))
        if held is not None and held != smallest:
            kept = self._spatial_on(held, decode, waiting, in_flight)
            plans += [kept] if kept.meets_slo else []
        return plans

    def _split_of(self, option: str | None) -> int | None:
        """Index into ``partitions`` of a spatial option's split (None: not spatial)."""
        for i, (decode_sms, _) in enumerate(self.partitions):
            if option == option_key(MuxMode.SPATIAL, decode_sms):
                return i
        return None

    def _smallest_fitting(self, decode: DecodeLoad, held: int | None = None) -> int:
        """The smallest decode partition whose co-running step fits the budget (the largest
        when none does). Below the incumbent's split ``held`` a step must fit the budget
        less the switch margin: on the H200 a 16-SM decode step predicted right at the
        budget flipped the split 16 -> 24 -> 16 SMs every ~10 cycles, as its online
        correction moved by a percent or two, each switch draining both lanes."""
        budget = self.config.budget_ms
        step = lambda i: self._decode_ms(decode, self.partitions[i][0], co_running=True)
        limit = lambda i: budget * (1 - self.config.switch_margin) if held is not None \
            and i < held else budget
        lo, hi = 0, len(self.partitions) - 1
        while lo < hi:  # decode time falls as its SMs grow: bisect for the smallest that fits
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if step(mid) <= limit(mid) else (mid + 1, hi)
        return lo

    def _spatial_on(self, index: int, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                    in_flight: InFlightPrefill | None) -> MuxPlan:
        decode_sms, prefill_sms = self.partitions[index]
        decode_ms = self._decode_ms(decode, decode_sms, co_running=True)
        fits = decode_ms <= self.config.budget_ms
        # A piece starts at a decode boundary, so it holds a whole number of decode steps.
        run_rate = lambda p: self._run_rate(p, prefill_sms, True,
                                            cycle=lambda ms: _period(ms, decode_ms))
        piece = self._piece_within(waiting, in_flight, prefill_sms, True, decode_ms, run_rate)
        reason = (f"smallest decode partition meeting the ITL budget: {decode_sms} SMs"
                  if fits else "no partition meets the ITL budget: largest decode partition")
        return MuxPlan(MuxMode.SPATIAL, decode_sms, prefill_sms, piece, decode_ms,
                       self._rate(piece, decode_ms), fits, reason, decode_ms, True,
                       run_rate(piece))

    def _temporal(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                  in_flight: InFlightPrefill | None, forced: bool = False) -> MuxPlan | None:
        """The largest chunk that fits the budget; ``forced``: the smallest one, over it."""
        if not self.config.temporal or in_flight is not None:
            return None
        cfg = self.config
        step = lambda tokens: self._mixed_ms(decode, waiting, tokens)
        smallest, largest = self._chunk_range(waiting, decode)
        budget = cfg.step_budget_ms(decode)
        if step(smallest) <= budget:
            chunk = self._mixed_chunk(decode, waiting, smallest, largest)
        else:
            chunk = self._floored(None, decode, step, largest)
        fits = chunk is not None
        if not fits and not forced:
            return None
        chunk = chunk if fits else smallest
        chunks = self._gather(waiting, chunk)
        ms = step(chunk)
        piece = PrefillPiece(tuple(chunks), chunk, _prefix_sum(waiting, chunks), len(chunks), 0,
                             self.num_layers, ms)
        graphs = " on the prefill-step graphs" if self.on_graphs(chunk, decode.batch_size) else ""
        floor = " (the floor, over the budget)" if ms > budget and fits else ""
        over = _over_budget_label(cfg, decode, ms) if fits and cfg.budget_ms < ms <= budget \
            else ""
        reason = (f"mixed step with a {chunk}-token chunk{graphs}{floor}{over}" if fits else
                  f"prefill waited {cfg.max_prefill_stall_ms:.0f} ms: smallest mixed step")
        rate = 1e3 * chunk / ms
        return MuxPlan(MuxMode.TEMPORAL, self.total_sms, self.total_sms, piece, ms, rate, fits,
                       reason, ms, True, rate)

    def on_graphs(self, prefill_tokens: int, decode_batch: int) -> bool:
        """Whether a mixed step of this many prompt tokens beside ``decode_batch`` decodes is
        predicted as one replayed from the prefill-step graphs (``graph_step_tokens``)."""
        return 0 < prefill_tokens + decode_batch <= self.config.graph_step_tokens

    def _mixed_chunk(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest], lo: int,
                     hi: int, guess: int | None = None) -> int | None:
        """The chunk in [lo, hi] of the highest predicted rate among the largest mixed steps
        that fit the budget on the prefill-step graphs and eagerly (None: none fits); a
        ``guess`` (the last step's chunk) is searched from."""
        step = lambda tokens: self._mixed_ms(decode, waiting, tokens)
        budget = self.config.step_budget_ms(decode)
        found = [self._largest_step(step, a, b, guess, budget, self._offset(decode))
                 for a, b in self._graph_ranges(decode, lo, hi)]
        best = max((n for n in found if n is not None), key=lambda n: n / step(n), default=None)
        return self._floored(best, decode, step, hi)

    def _floored(self, chunk: int | None, decode: DecodeLoad, step: Callable[[int], float],
                 hi: int) -> int | None:
        """``chunk`` raised towards the floor (``_raised``), then taken off the graphs where
        that is asked for and prefills faster (``_off_graphs``)."""
        return self._off_graphs(self._raised(chunk, decode, step, hi), decode, step, hi)

    def _raised(self, chunk: int | None, decode: DecodeLoad, step: Callable[[int], float],
                hi: int) -> int | None:
        """``chunk`` raised towards the floor (``mixed_floor_tokens``, cut to the graphs'
        room): the floor where its step stays within the floor's cap, else the largest chunk
        under it that does; unchanged where the floor is off or reached, or not even
        ``chunk`` fits the cap."""
        cfg = self.config
        floor = self._floor_chunk(decode, hi)
        if floor == 0 or (chunk is not None and chunk >= floor):
            return chunk
        cap_ms = cfg.itl_slo_ms * cfg.mixed_floor_cap
        start = chunk if chunk is not None else min(floor, cfg.min_chunk_tokens)
        if step(start) > cap_ms:
            return chunk
        offset = self._offset(decode)
        return _largest_fitting(lambda total: step(total - offset), start + offset,
                                floor + offset, cfg.token_align, cap_ms) - offset

    def _off_graphs(self, chunk: int | None, decode: DecodeLoad,
                    step: Callable[[int], float], hi: int) -> int | None:
        """``chunk``, or the whole floor as an eager step where ``floor_off_graphs`` is on,
        the floor was cut to the graphs' room, and the eager step within the cap is predicted
        to prefill faster than ``chunk``."""
        cfg = self.config
        whole = min(cfg.mixed_floor_tokens, hi)
        if not cfg.floor_off_graphs or self._floor_chunk(decode, hi) >= whole \
                or (chunk is not None and chunk >= whole):
            return chunk
        if step(whole) > cfg.itl_slo_ms * cfg.mixed_floor_cap:
            return chunk
        if chunk is not None and chunk / step(chunk) >= whole / step(whole):
            return chunk
        return whole

    def _floor_chunk(self, decode: DecodeLoad, hi: int) -> int:
        """The floor's chunk: ``mixed_floor_tokens`` (at most ``hi``), cut to stay on the
        prefill-step graphs when they are weighed, as chunked prefill's steps do."""
        floor = self.config.mixed_floor_tokens
        if floor <= 0:
            return 0
        if self._offset(decode):  # the floor's step aligned: its chunk rounded down to it
            floor = self._aligned_down(floor, decode,
                                       least=min(floor, self.config.min_chunk_tokens))
        graph_room = self.config.graph_step_tokens - decode.batch_size
        if 0 < graph_room < floor:
            floor = graph_room
        return min(floor, hi)

    def _largest_step(self, step: Callable[[int], float], lo: int, hi: int,
                      guess: int | None, budget_ms: float, offset: int = 0) -> int | None:
        """The largest chunk in [lo, hi] whose ``step`` fits ``budget_ms`` (None: none
        does), searched from ``guess`` when there is one; the chunk plus ``offset`` (the
        decode tokens beside it, ``_offset``) aligned."""
        align = self.config.token_align
        total = lambda tokens: step(tokens - offset)
        if guess is not None:
            found = _fitting_near(total, guess + offset, lo + offset, hi + offset, align,
                                  budget_ms)
            return None if found is None else found - offset
        if step(lo) > budget_ms:
            return None
        return _largest_fitting(total, lo + offset, hi + offset, align, budget_ms) - offset

    def _offset(self, decode: DecodeLoad) -> int:
        """The tokens beside a mixed step's chunk that its alignment counts: the decode
        batch's with ``align_step_tokens``, else none."""
        return decode.batch_size if self.config.align_step_tokens else 0

    def _graph_ranges(self, decode: DecodeLoad, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi] cut where a mixed step outgrows the prefill-step graphs: a step's
        predicted cost grows with its chunk on each side, not across the cut."""
        graph_hi = self.config.graph_step_tokens - decode.batch_size
        if self.config.graph_step_tokens <= 0 or not lo <= graph_hi < hi:
            return [(lo, hi)]
        return [(lo, graph_hi), (graph_hi + 1, hi)]

    def _time_slice(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest],
                    in_flight: InFlightPrefill | None, forced: bool = False
                    ) -> MuxPlan | None:
        """Decode alone on the whole GPU, then the whole-GPU piece that advances prefill
        fastest within what the budget leaves; ``forced``: the smallest piece, over it."""
        if not self.config.time_slice:
            return None
        sms = self.total_sms
        decode_ms = self._decode_ms(decode, sms, co_running=False)
        room = self.config.step_budget_ms(decode) - decode_ms
        cycle = lambda p: decode_ms + p.predicted_ms
        run_rate = lambda p: self._run_rate(p, sms, False, cycle=lambda ms: decode_ms + ms)
        piece = self._piece_within(waiting, in_flight, sms, False, room, run_rate)
        fits = piece.predicted_ms <= room
        if not fits and not forced:
            return None
        reason = (f"decode alone, then {piece.num_layers} layers of {piece.num_tokens} tokens"
                  if fits else
                  f"prefill waited {self.config.max_prefill_stall_ms:.0f} ms: smallest slice")
        return MuxPlan(MuxMode.TIME_SLICE, sms, sms, piece, decode_ms,
                       _progress(piece, self.num_layers, cycle(piece)), fits, reason,
                       cycle(piece), True, run_rate(piece))

    # ------------------------------------------------------------------- pieces

    def _piece_within(self, waiting: Sequence[PrefillRequest],
                      in_flight: InFlightPrefill | None, sms: int, co_running: bool,
                      limit_ms: float, rate: Callable[[PrefillPiece], float]) -> PrefillPiece:
        """The piece with the highest ``rate`` (of its batch's whole run) among those
        predicted within ``limit_ms``; the smallest piece (one layer, the fewest tokens) when
        none is.

        A piece continuing the batch in flight keeps its tokens and takes as many layers as
        fit. A new batch weighs a few layer counts around the most that fit with every
        token, each with the most tokens that fit. In SPATIAL the limit is one decode step:
        a piece that is too short leaves the prefill SMs idle until the next step, one that
        is too long delays the next re-plan.
        """
        if in_flight is not None:
            left = self.num_layers - in_flight.layers_done
            layers = self._layers_fitting(in_flight.num_tokens, in_flight.context_tokens,
                                          in_flight.batch_size, sms, co_running, limit_ms,
                                          left)
            return self._continue(in_flight, sms, co_running, layers=layers)
        chunks = self._gather(waiting, self._token_budget(waiting, sms, co_running))
        most = sum(t for _, t in chunks)
        fit_all = self._layers_fitting(most, _prefix_sum(waiting, chunks), len(chunks), sms,
                                       co_running, limit_ms, self.num_layers)
        pieces = []
        for layers in range(fit_all, min(fit_all + 3, self.num_layers + 1)):
            cost = lambda tokens, k=layers: self._piece(waiting, self._gather(waiting, tokens),
                                                        0, k, sms, co_running).predicted_ms
            floor = min(most, self.config.min_chunk_tokens)
            if cost(floor) > limit_ms and layers > 1:
                break
            tokens = _largest_fitting(cost, floor, most, self.config.token_align, limit_ms)
            pieces.append(self._piece(waiting, self._gather(waiting, tokens), 0, layers, sms,
                                      co_running))
        if not pieces:
            # Fewer tokens can be priced above all of them (pairs are per request of the
            # batch: the first 64 of a prompt over a long prefix, alone, against those
            # beside a short one), so the batch's every token over the layers that fit.
            pieces.append(self._piece(waiting, chunks, 0, fit_all, sms, co_running))
        return max(pieces, key=rate)

    def _layers_fitting(self, tokens: int, context: int, batch: int, sms: int,
                        co_running: bool, limit_ms: float, most: int) -> int:
        fits = lambda k: self._prefill_ms(tokens, context, batch, sms, co_running, k) <= limit_ms
        lo, hi = 1, most
        while lo < hi:  # largest k in [1, most] that fits; 1 if none does
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _continue(self, flight: InFlightPrefill, sms: int, co_running: bool, layers: int
                  ) -> PrefillPiece:
        ms = self._prefill_ms(flight.num_tokens, flight.context_tokens, flight.batch_size, sms,
                              co_running, layers)
        return PrefillPiece((), flight.num_tokens, flight.context_tokens, flight.batch_size,
                            flight.layers_done, layers, ms)

    def _piece(self, waiting: Sequence[PrefillRequest], chunks: list[tuple[int, int]],
               start: int, layers: int, sms: int, co_running: bool) -> PrefillPiece:
        tokens, context = sum(t for _, t in chunks), _prefix_sum(waiting, chunks)
        ms = self._prefill_ms(tokens, context, len(chunks), sms, co_running, layers)
        return PrefillPiece(tuple(chunks), tokens, context, len(chunks), start, layers, ms)

    def _token_budget(self, waiting: Sequence[PrefillRequest], sms: int, co_running: bool
                      ) -> int:
        """Tokens for a new batch: the configured maximum, capped by the TTFT SLO of the
        request the batch serves first. Under first come, first served that is the oldest;
        under ``--prefill-order slo`` a prompt that can no longer meet its deadline waits at
        the back, and its negative slack must not shrink the batches served before it."""
        cfg = self.config
        budget = cfg.max_prefill_tokens
        live = [r for r in waiting if r.tokens_remaining > 0]
        if cfg.ttft_slo_ms is None or not live:
            return budget
        first = live[0]
        floor = min(budget, first.tokens_remaining)
        slack = cfg.ttft_slo_ms - first.waited_ms

        def whole_batch_ms(tokens: int) -> float:
            chunks = self._gather(waiting, tokens)
            return self._prefill_ms(sum(t for _, t in chunks), _prefix_sum(waiting, chunks),
                                    len(chunks), sms, co_running, self.num_layers)

        if whole_batch_ms(budget) <= slack:
            return budget
        if whole_batch_ms(floor) > slack:
            return floor
        return _largest_fitting(whole_batch_ms, floor, budget, cfg.token_align, slack)

    @staticmethod
    def _gather(waiting: Sequence[PrefillRequest], tokens: int) -> list[tuple[int, int]]:
        """In the candidates' order (the admission order, ``--prefill-order``): (index,
        tokens) until ``tokens`` are taken."""
        chunks, left = [], tokens
        for i, request in enumerate(waiting):
            if left <= 0:
                break
            take = min(request.tokens_remaining, left)
            if take > 0:
                chunks.append((i, take))
                left -= take
        return chunks

    # -------------------------------------------------------------- predictions

    def _decode_ms(self, decode: DecodeLoad, sms: int, co_running: bool) -> float:
        return self.predictor.predict("decode", decode.batch_size, decode.context_tokens,
                                      decode.batch_size, sms, co_running)

    def _prefill_ms(self, tokens: int, context: int, batch: int, sms: int, co_running: bool,
                    layers: int) -> float:
        return self.predictor.predict("prefill", tokens, context, max(batch, 1), sms,
                                      co_running, layers)

    def _mixed_ms(self, decode: DecodeLoad, waiting: Sequence[PrefillRequest], tokens: int
                  ) -> float:
        chunks = self._gather(waiting, tokens)
        predict = self.predictor.predict_mixed
        if self.calibration is not None and self.on_graphs(tokens, decode.batch_size):
            predict = self.calibration.predict_graph_mixed
        return predict(sum(t for _, t in chunks), _prefix_sum(waiting, chunks), len(chunks),
                       decode.batch_size, decode.context_tokens, self.total_sms)

    def _rate(self, piece: PrefillPiece | None, step_ms: float = 0.0) -> float:
        """Prompt tokens per second a stream of such pieces advances (a share of the layers
        counts pro rata). Pieces start at decode-step boundaries (every ``step_ms``), so a
        piece occupies a whole number of steps."""
        if piece is None or piece.predicted_ms <= 0:
            return 0.0
        period = _period(piece.predicted_ms, step_ms) if step_ms > 0 else piece.predicted_ms
        return _progress(piece, self.num_layers, period)

    def _run_rate(self, piece: PrefillPiece, sms: int, co_running: bool,
                  cycle: Callable[[float], float]) -> float:
        """Prompt tokens per second over the run ``piece`` commits its batch to: through
        every layer it has left, ``piece`` and then pieces of as many layers (the last one
        shorter), each taking ``cycle(its predicted ms)`` of wall time. A batch that splits
        its layers unevenly pays for a short last piece as for a whole cycle."""
        left = self.num_layers - piece.start_layer
        whole, rest = divmod(left, piece.num_layers)
        ms = whole * cycle(piece.predicted_ms)
        if rest:
            ms += cycle(self._prefill_ms(piece.num_tokens, piece.context_tokens,
                                         piece.batch_size, sms, co_running, rest))
        return 1e3 * piece.num_tokens * left / self.num_layers / ms if ms > 0 else 0.0


def option_key(mode: MuxMode, decode_sms: int) -> str | None:
    """The name a sharing option is calibrated and kept by: ``spatial:<decode SMs>`` (every
    split its own), ``temporal``, ``time_slice``; None for the solo modes."""
    if mode == MuxMode.SPATIAL:
        return f"spatial:{decode_sms}"
    return str(mode) if mode in (MuxMode.TEMPORAL, MuxMode.TIME_SLICE) else None


def piece_predicted_ms(plan: MuxPlan) -> float:
    """What a piece of ``plan`` should take from its issue to its completion: a time-slice
    piece queues behind its decode step on the same stream, so its whole cycle."""
    if plan.mode == MuxMode.TIME_SLICE:
        return plan.cycle_ms
    return plan.prefill.predicted_ms if plan.prefill is not None else 0.0


def _with_runner_up(chosen: MuxPlan, weighed: Sequence[MuxPlan]) -> MuxPlan:
    """``chosen`` with the best other option of ``weighed`` named as its runner-up."""
    others = [p for p in weighed if p.option != chosen.option]
    if not others:
        return chosen
    best = max(others, key=lambda p: p.weighed_tokens_per_s)
    return replace(chosen, runner_up=best.option,
                   runner_up_tokens_per_s=best.weighed_tokens_per_s)


def _delivered(plan: MuxPlan) -> float:
    """The committed rate serving is expected to deliver: over the option's calibration."""
    return plan.committed_tokens_per_s / plan.prefill_calibration


def profile_groups(partitions: Sequence[tuple[int, int]], total_sms: int
                   ) -> list[tuple[str, int, bool]]:
    """The (phase, SMs, co-running) groups a profile must time for a planner over these
    spatial splits, so that no choice rests on an interpolated or borrowed fit.

    The whole GPU alone, both phases, always: DECODE_ONLY, PREFILL_ONLY, TIME_SLICE's
    decode step and pieces, and the mixed step's parts. Each split (decode SMs, prefill
    SMs) adds decode on its decode SMs and prefill on the rest, both co-running."""
    groups = {("decode", total_sms, False), ("prefill", total_sms, False)}
    for decode_sms, prefill_sms in partitions:
        groups |= {("decode", decode_sms, True), ("prefill", prefill_sms, True)}
    return sorted(groups)


def itl_use(plan: MuxPlan, itl_slo_ms: float) -> float | None:
    """Predicted time between decode tokens over the ITL SLO (None without decode): how
    much of the budget a plan uses; near the safety margin while prefill waits."""
    return plan.cycle_ms / itl_slo_ms if plan.cycle_ms > 0 else None


@dataclass
class ItlUseLog:
    """The distribution of ``itl_use`` over one run's plans made while prefill waited: the
    engine adds every plan it launches and logs ``summary()`` at the end of a run."""

    itl_slo_ms: float
    values: list[float] = field(default_factory=list)

    def add(self, plan: MuxPlan) -> None:
        use = itl_use(plan, self.itl_slo_ms)
        if plan.prefill_waiting and use is not None:
            self.values.append(use)

    def summary(self) -> dict[str, float]:
        """Count, mean and nearest-rank quantiles (p10, p50, p90) and max; {"n": 0} if empty."""
        if not self.values:
            return {"n": 0}
        ordered = sorted(self.values)
        rank = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
        return {"n": len(ordered), "mean": sum(ordered) / len(ordered), "p10": rank(0.1),
                "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


def _progress(piece: PrefillPiece, num_layers: int, period_ms: float) -> float:
    """Prompt tokens per second of a stream of such pieces, one every ``period_ms``."""
    return 1e3 * piece.num_tokens * piece.num_layers / num_layers / period_ms


def _period(piece_ms: float, step_ms: float) -> float:
    """Wall time of a piece launched at a decode boundary: whole decode steps."""
    return max(1, math.ceil(piece_ms / step_ms - 1e-6)) * step_ms


def _window(waiting: Sequence[PrefillRequest], start: int, tokens: int
            ) -> list[PrefillRequest]:
    """``waiting`` once its first ``start`` prompt tokens (first come, first served) are
    prefilled, holding only the ``tokens`` after them."""
    window, skip, keep = [], start, tokens
    for request in waiting:
        skipped = min(request.tokens_remaining, skip)
        kept = min(request.tokens_remaining - skipped, keep)
        skip, keep = skip - skipped, keep - kept
        window.append(replace(request, tokens_remaining=kept,
                              prefix_tokens=request.prefix_tokens + skipped))
    return window


def _over_budget_label(cfg: MuxPlannerConfig, decode: DecodeLoad, ms: float) -> str:
    """What let a step planned to ``ms`` run past the budget."""
    if decode.ttft_pressed and ms <= cfg.itl_slo_ms * cfg.ttft_pressed_margin:
        return " (TTFT pressed)"
    return " (banked TPOT slack)"


def _prefix_sum(waiting: Sequence[PrefillRequest], chunks: Sequence[tuple[int, int]]) -> int:
    return sum(waiting[i].prefix_tokens for i, _ in chunks)


def banked_slack_ms(requests: Sequence, budget_ms: float, now: float,
                    quantile: float = 0.0) -> float | None:
    """The longest the next planned step may take with every request's mean time per
    output token so far still within ``budget_ms`` when that step's token lands: per
    request, ``budget_ms`` times its output tokens (those being sampled included: the
    intervals once the planned step's token is in) less the time since its first token,
    less one budget for a step of its still in flight; the tightest request's, or with
    ``quantile`` q the bank that at most a share q of the requests have less than. None
    where a request has no first token yet (a P/D decode side's hand-off): nothing banked."""
    banks = []
    for request in requests:
        if request.first_token_time is None:
            return None
        tokens = request.num_output_tokens + request.num_placeholders
        banks.append(budget_ms * tokens - 1e3 * (now - request.first_token_time)
                     - (budget_ms if request.num_placeholders else 0.0))
    if not banks:
        return None
    if quantile <= 0.0:
        return min(banks)
    return sorted(banks)[int(quantile * len(banks))]


def _fitting_near(cost, guess: int, lo: int, hi: int, align: int, limit: float) -> int | None:
    """What ``_largest_fitting`` finds (None when not even ``lo`` fits), searched in ``align``
    steps from ``guess``: a few calls when the answer is near it, as from one mixed step to
    the next."""
    up = lambda n: min(hi, (n // align + 1) * align)
    down = lambda n: max(lo, (-(-n // align) - 1) * align)
    n = min(max(guess, lo), hi)
    if cost(n) <= limit:
        while n < hi and cost(up(n)) <= limit:
            n = up(n)
        return n
    while n > lo:
        n = down(n)
        if cost(n) <= limit:
            return n
    return None


def _largest_fitting(cost, lo: int, hi: int, align: int, limit: float) -> int:
    """Largest n in [lo, hi] (``hi`` itself or a multiple of ``align``) with cost(n) <= limit,
    assuming cost grows with n and cost(lo) <= limit."""
    if cost(hi) <= limit:
        return hi
    best, a, b = lo, -(-lo // align), hi // align
    while a <= b:
        mid = (a + b) // 2
        if mid * align >= lo and cost(mid * align) <= limit:
            best, a = mid * align, mid + 1
        else:
            b = mid - 1
    return best
