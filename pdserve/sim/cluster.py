"""Discrete-event simulation of one P/D group behind the gateway, at a scale one machine
cannot run: how on-demand forwarding and blind dispatch hold the TTFT SLO as load rises.

What is the real code and what is modelled:

- Real: each prefill instance's admission rule (``PrefillAdmission``, on simulated time),
  the gateway's offer order (``order_prefill``) for each dispatch policy, and the gateway's
  first-come line of refused requests, woken when a prefill the gateway placed ends.
- Modelled: service times. A prefill instance runs prompts one at a time, first come first
  served, for ``LatencyModel.prefill_s(tokens)``; the KV then crosses the link for
  ``transfer_s``; a decode instance batches continuously, one token per running request per
  step of ``decode_step_s(batch, context)``, and admits a request only while its KV pool has
  room (``decode_kv_tokens``). ``LatencyModel.from_engine_results`` fits the model to a
  measured ``benchmarks/bench_engine.py`` result.

A request is met when its TTFT is within the SLO; one the gateway gave up on after
``max_wait_s`` (503) is a miss and counts as unserved.
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import json
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush
from typing import Any, Generic, TypeVar

import numpy as np

from pdserve.cluster.config import RatioConfig
from pdserve.cluster.dispatch import DISPATCH, order_prefill
from pdserve.cluster.metrics import ScenarioWindow
from pdserve.cluster.ratio import decode_floor, judge
from pdserve.cluster.registry import Instance
from pdserve.server.admission import PrefillAdmission

T = TypeVar("T")


@dataclass(frozen=True)
class LatencyModel:
    prefill_per_token_s: float
    prefill_per_token_sq_s: float  # attention: grows with the square of the prompt
    decode_base_s: float
    decode_per_request_s: float
    decode_per_kv_token_s: float  # KV read each step
    kv_bytes_per_token: int
    link_gb_per_s: float = 25.0
    decode_kv_tokens: int = 290_000
    prefill_base_s: float = 0.0  # per prefill whatever its length: a step, an HTTP hop
    # From the prefill's end until the request joins the decode batch, beyond the link's
    # transfer: the gateway's call to the decode instance, its engine taking the KV in
    # (``fit_handoff``). Zero: the KV joins as it lands, the fleet figures' model.
    handoff_base_s: float = 0.0
    handoff_per_token_s: float = 0.0
    # Seconds on each request's way to its prefill instance that do not occupy the instance:
    # the gateway's hops (``fit_gateway_hop``). ``GroupSim`` adds them before the prompt
    # joins the instance's queue, so two prompts' hops overlap where their prefills queue.
    # Zero: the prefill instance's time is the whole, the fleet figures' model.
    gateway_hop_s: float = 0.0
    # A chunked instance's mixed step beyond the roofline (``pdserve.sim.instance``: what a
    # measured grid of mixed steps says, ``fit_mixed_step_grid``). All zero: the roofline
    # form the validations at 8ccd9ac and efbfdd5 were fitted with.
    # Attention over a prefix is latency-bound for a small piece: at least this per prefix
    # token whatever the piece's size (H200, codellama-34b: ~1.3 us).
    mixed_prefix_floor_per_token_s: float = 0.0
    # Past the floor it grows with (piece tokens x prefix tokens); 0: the prefill fit's
    # square instead (2 * ``prefill_per_token_sq_s``, the roofline form, floor unused).
    mixed_prefix_per_pair_s: float = 0.0
    # Steps of at most this many tokens replay the piecewise CUDA graphs (the engine's
    # ``--piecewise-graph-max-tokens``), each at its kernels plus ``mixed_graph_extra_s``;
    # larger ones run eagerly: their kernels plus ``mixed_eager_extra_s``, and never less
    # than ``mixed_eager_floor_s`` (the host launching every kernel of the step).
    mixed_graph_max_tokens: int = 0
    mixed_graph_extra_s: float = 0.0
    mixed_eager_extra_s: float = 0.0
    mixed_eager_floor_s: float = 0.0

    def prefill_s(self, tokens: int) -> float:
        return (self.prefill_base_s + self.prefill_per_token_s * tokens
                + self.prefill_per_token_sq_s * tokens ** 2)

    def prefill_piece_s(self, start: int, end: int) -> float:
        """Tokens ``start`` to ``end`` of one prompt, in a step of their own: ``prefill_s``'s
        terms for those tokens (the square term's share ``end**2 - start**2``: each attends
        to those before it; the base with the first piece), so a prompt's pieces add up to
        its ``prefill_s``."""
        return ((self.prefill_base_s if start == 0 else 0.0)
                + self.prefill_per_token_s * (end - start)
                + self.prefill_per_token_sq_s * (end * end - start * start))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (self.decode_base_s + self.decode_per_request_s * batch
                + self.decode_per_kv_token_s * context_tokens)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.link_gb_per_s * 1e9)

    def handoff_s(self, tokens: int) -> float:
        """From the prefill's end until a prompt of ``tokens`` joins the decode batch."""
        return self.transfer_s(tokens) + self.handoff_base_s + self.handoff_per_token_s * tokens

    def fit_handoff(self, points: list[dict]) -> LatencyModel:
        """This model with the handoff fitted (least squares, nothing negative) to measured
        ``{"tokens", "seconds"}``: the time from the prefill's end until the request joins
        the decode batch, the link's transfer included (it is taken off before the fit)."""
        a = np.array([[1.0, p["tokens"]] for p in points])
        base, per_token = fit_nonnegative(
            a, [p["seconds"] - self.transfer_s(p["tokens"]) for p in points])
        return replace(self, handoff_base_s=base, handoff_per_token_s=per_token)

    def fit_gateway_hop(self, path: list[dict], direct: list[dict]) -> LatencyModel:
        """This model, its prefill fitted to ``path`` (each prompt length's first token
        through the gateway, ``{"tokens", "seconds"}``), with the gateway's share moved
        out of the prefill base into ``gateway_hop_s``: the median over the lengths of how
        much longer a prompt took through the gateway than straight at the prefill
        instance (``direct``, the same lengths), at least 0 and at most the whole base.
        The median, not a line in the tokens: the hops are HTTP calls of a few kilobytes
        whatever the length, and where the difference grew with the prompt (the 1,024-token
        point in some CPU runs) nothing says that part is off the instance."""
        lengths = sorted(p["tokens"] for p in path)
        if not path or lengths != sorted(p["tokens"] for p in direct):
            raise ValueError(f"fit_gateway_hop needs the same prompt lengths both ways, not "
                             f"{lengths} and {sorted(p['tokens'] for p in direct)}")
        straight = {p["tokens"]: p["seconds"] for p in direct}
        hop = float(np.median([p["seconds"] - straight[p["tokens"]] for p in path]))
        hop = min(max(hop, 0.0), self.prefill_base_s)
        return replace(self, prefill_base_s=self.prefill_base_s - hop,
                       gateway_hop_s=self.gateway_hop_s + hop)

    def at_speed(self, prefill: float, decode: float) -> LatencyModel:
        """This model on a host that runs its prefill instances' work ``prefill`` times
        and its decode instances' ``decode`` times as long as when it was fitted (a host
        meter's reading over its calibration's); hops and handoffs as they are."""
        return replace(self, prefill_per_token_s=self.prefill_per_token_s * prefill,
                       prefill_per_token_sq_s=self.prefill_per_token_sq_s * prefill,
                       prefill_base_s=self.prefill_base_s * prefill,
                       decode_base_s=self.decode_base_s * decode,
                       decode_per_request_s=self.decode_per_request_s * decode,
                       decode_per_kv_token_s=self.decode_per_kv_token_s * decode)

    def without_gateway_hop(self) -> LatencyModel:
        """The hop charged to the prefill instance again, as before ``gateway_hop_s``."""
        return replace(self, prefill_base_s=self.prefill_base_s + self.gateway_hop_s,
                       gateway_hop_s=0.0)

    @classmethod
    def from_engine_results(cls, path: str, kv_bytes_per_token: int,
                            **options: Any) -> LatencyModel:
        """``fit`` to a ``bench_engine.py`` result's prefill and decode points."""
        with open(path) as f:
            measured = json.load(f)["models"][0]
        decode = [d for d in measured["decode"] if "step_ms" in d]  # some points were skipped
        return cls.fit(measured["prefill"], decode, kv_bytes_per_token,
                       decode_kv_tokens=int(measured.get("kv_pool_tokens", 290_000)), **options)

    @classmethod
    def fit(cls, prefill: list[dict], decode: list[dict], kv_bytes_per_token: int,
            **options: Any) -> LatencyModel:
        """Least squares of the relative error, no coefficient negative, over measured
        points: prefill ``{"tokens", "seconds"}``, decode ``{"batch", "context", "step_ms"}``
        (``context`` per request)."""
        a = np.array([[1.0, p["tokens"], p["tokens"] ** 2] for p in prefill])
        base, per_token, per_token_sq = fit_nonnegative(a, [p["seconds"] for p in prefill],
                                                        relative=True)
        return cls(per_token, per_token_sq, 0.0, 0.0, 0.0, kv_bytes_per_token=kv_bytes_per_token,
                   prefill_base_s=base, **options).fit_decode(decode)

    def fit_decode(self, decode: list[dict]) -> LatencyModel:
        """This model with the decode step refitted (least squares of the relative error,
        nothing negative) to measured ``{"batch", "context", "step_ms"}`` (``context`` per
        request)."""
        a = np.array([[1.0, d["batch"], d["batch"] * d["context"]] for d in decode])
        base, per_request, per_kv_token = fit_nonnegative(
            a, [d["step_ms"] / 1e3 for d in decode], relative=True)
        return replace(self, decode_base_s=base, decode_per_request_s=per_request,
                       decode_per_kv_token_s=per_kv_token)


def fit_nonnegative(a: np.ndarray, b: list[float], relative: bool = False) -> list[float]:
    """Least squares; a coefficient that comes out negative (noise: no cost shrinks as the
    work grows) is fixed at zero and the rest refitted.

    ``relative``: each point's error counted as a share of its measured time (every ``b``
    above 0). Service times span ten times and more between the smallest and the largest
    point, and what is judged of a simulation is percent errors: a plain fit lets the
    largest points decide, and one slow calibration point there (a CPU instance's batch of
    4 at 1K context timed at 26 ms where the rest of the grid said about 12) took a
    third off the fitted batch-1 step, where nearly every replayed step ran."""
    if relative:
        times = np.asarray(b, dtype=float)
        if not (times > 0).all():
            raise ValueError("fit_nonnegative(relative=True) needs every time above 0")
        a, b = a / times[:, None], list(np.ones_like(times))
    free, coefficients = list(range(a.shape[1])), np.zeros(0)
    while free:
        coefficients = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (coefficients >= 0).all():
            break
        free = [f for f, c in zip(free, coefficients, strict=True) if c >= 0]
        coefficients = np.zeros(0)  # every coefficient negative: nothing is left to fit
    result = [0.0] * a.shape[1]
    for f, c in zip(free, coefficients, strict=True):
        result[f] = float(c)
    return result


@dataclass(frozen=True)
class PlannerShare:
    """What a prompt gets beside a decode batch on a multiplexing instance, tabulated from
    the planner itself: the real ``MuxPlanner`` over the instance's own fitted predictor,
    walking a prompt through its prefill beside a decode batch (``benchmarks/mux_whatif.py``,
    ``share_table``). Per grid point (decode batch, decode context per request, prompt
    tokens): the prompt's time beside the batch over its time alone on the whole GPU
    (``prefill``), the time between two decode tokens meanwhile over the batch's step
    alone (``decode``) and the prefill batches the planner splits the prompt into
    (``prefill_batches``); each flattened batch-major, then context, then prompt.

    Spatial splits overlap a weight-bound decode step with a compute-bound prefill, mixed
    steps carry both in one step, time slices take turns: the planner picks among them by
    the predictor, so the table follows what the instance would run rather than one rule
    for all. Two measured corrections turn the plan into what is delivered: a prompt takes
    ``delivered`` times its planned time plus ``per_batch_s`` per prefill batch (what a
    batch costs beyond its pieces: the switch into it, the wait for its last piece).
    Between grid points the tables interpolate linearly in the logarithms of the
    coordinates; beyond the grid they hold the edge's values (``covers`` says whether a
    load stays inside)."""

    batches: tuple[float, ...]
    contexts: tuple[float, ...]
    prompts: tuple[float, ...]
    prefill: tuple[float, ...]
    decode: tuple[float, ...]
    delivered: float = 1.0
    prefill_batches: tuple[float, ...] = ()  # needed only with a per-batch cost
    per_batch_s: float = 0.0

    def __post_init__(self) -> None:
        size = len(self.batches) * len(self.contexts) * len(self.prompts)
        for name in ("batches", "contexts", "prompts"):
            axis = getattr(self, name)
            if len(axis) < 2 or any(b <= a for a, b in zip(axis, axis[1:], strict=False)) \
                    or axis[0] <= 0:
                raise ValueError(f"PlannerShare.{name}: at least two rising positive points")
        counts = len(self.prefill_batches) if self.prefill_batches or self.per_batch_s else size
        if len(self.prefill) != size or len(self.decode) != size or counts != size:
            raise ValueError(f"PlannerShare: {size} grid points, {len(self.prefill)} prefill, "
                             f"{len(self.decode)} decode and {counts} prefill batch figures")
        if min(self.prefill + self.decode) <= 0 or self.delivered <= 0 or self.per_batch_s < 0:
            raise ValueError("PlannerShare: factors must be positive, the per-batch cost not "
                             "negative")

    def prefill_s(self, alone_s: float, batch: int, context: float, tokens: int) -> float:
        """A prompt of ``tokens`` that takes ``alone_s`` alone, beside ``batch`` decodes of
        ``context`` tokens in all; never less than alone (the batch takes, never gives)."""
        beside = alone_s * self.prefill_factor(batch, context, tokens)
        if self.per_batch_s > 0.0:
            beside += self.per_batch_s * self._at(self.prefill_batches, batch, context, tokens)
        return beside if beside > alone_s else alone_s

    def prefill_factor(self, batch: int, context: float, tokens: int) -> float:
        """The part of ``prefill_s`` that grows with the prompt's time: delivered over
        planned times the planner's factor."""
        return self.delivered * self._at(self.prefill, batch, context, tokens)

    def planned_prefill(self, batch: int, context: float, tokens: int) -> float:
        """The planner's own factor there, before the corrections: what a measured one is
        fitted against."""
        return self._at(self.prefill, batch, context, tokens)

    def planned_batches(self, batch: int, context: float, tokens: int) -> float:
        """The prefill batches the planner splits such a prompt into (0: none tabulated)."""
        return self._at(self.prefill_batches, batch, context, tokens) \
            if self.prefill_batches else 0.0

    def decode_factor(self, batch: int, context: float, tokens: int) -> float:
        """The batch's time per token beside that prompt over its step alone (at least 1)."""
        factor = self._at(self.decode, batch, context, tokens)
        return factor if factor > 1.0 else 1.0

    def covers(self, batch: int, context: float) -> bool:
        """Whether ``batch`` decodes of ``context`` tokens in all lie inside the grid."""
        per_request = context / batch if batch > 0 else 0.0
        return (batch <= self.batches[-1] and self.contexts[0] <= per_request
                <= self.contexts[-1])

    def _at(self, values: tuple[float, ...], batch: int, context: float, tokens: int) -> float:
        i, wi = _bracket(self.batches, float(batch))
        j, wj = _bracket(self.contexts, context / batch if batch > 0 else 0.0)
        k, wk = _bracket(self.prompts, float(tokens))
        nc, np_ = len(self.contexts), len(self.prompts)
        total = 0.0
        for di, fi in ((0, 1.0 - wi), (1, wi)):
            for dj, fj in ((0, 1.0 - wj), (1, wj)):
                row = ((i + di) * nc + j + dj) * np_ + k
                total += fi * fj * ((1.0 - wk) * values[row] + wk * values[row + 1])
        return total


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """Where ``x`` falls on ``axis``: the point below it and its weight towards the next,
    in logarithms, held at the ends."""
    if x <= axis[0]:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 2, 1.0
    i = bisect.bisect_right(axis, x) - 1
    return i, math.log(x / axis[i]) / math.log(axis[i + 1] / axis[i])


@dataclass(frozen=True)
class Multiplexing:
    """How the two sides of a PD-multiplexing instance (prefill and decode on one GPU's SM
    partitions) slow each other. Three models, the first one set wins (``model`` names it):

    - ``share`` (``PlannerShare``): the planner's own choice among its options for this
      decode batch and prompt, from the instance's fitted predictor, corrected by what
      measured runs delivered (of the plan, and a cost per prefill batch); a prompt's time
      is fixed when it starts (from the batch then), the decode side's factor at each
      change of its stretch.
    - ``cycle_s`` (the measured decode step while a prompt prefills beside it): beside a
      prompt a decode step lasts the cycle and the prompt gets the rest of each cycle,
      ``1 - decode step / cycle`` of the GPU, so its prefill takes ``cycle / (cycle -
      decode step)`` times its time alone: the sides take turns, as mixed steps and time
      slices do (spatial splits run them at once, and on the H200 delivered more:
      docs/cluster.md, validation). A batch whose step alone is the cycle or longer leaves
      the planner no option within its budget; such a batch and a prompt beside it take the
      fixed factors (``covers`` says whether a load can reach it).
    - fixed factors: a decode step takes ``decode_slowdown`` times as long while a prompt
      prefills beside it, and a prompt ``prefill_slowdown`` times as long while a batch
      decodes beside it, whatever either's size.

    Each side's factor is fixed when its stretch of work starts: a prompt's for the whole
    prompt, decode's until its batch next changes or the prefill side starts or ends a
    prompt (the decode side is then resynced at its next step)."""

    decode_slowdown: float
    prefill_slowdown: float
    cycle_s: float | None = None
    share: PlannerShare | None = None

    @property
    def model(self) -> str:
        """Which model runs: ``planner``, ``cycle`` or ``fixed``."""
        if self.share is not None:
            return "planner"
        return "fixed" if self.cycle_s is None else "cycle"

    def covers(self, longest_step_s: float, batch: int = 0, context: float = 0.0) -> bool:
        """Whether a decode step alone of up to ``longest_step_s`` stays within the cycle
        (always, with fixed factors); with ``share``, whether ``batch`` decodes of
        ``context`` tokens in all stay inside its grid."""
        if self.share is not None:
            return self.share.covers(batch, context)
        return self.cycle_s is None or longest_step_s < self.cycle_s

    def prefill_beside_s(self, alone_s: float, decode_step_s: float, batch: int,
                         context: float, tokens: int) -> float:
        """A prompt of ``tokens`` that takes ``alone_s`` alone, beside a decode batch of
        ``batch`` requests, ``context`` tokens in all, whose step alone lasts
        ``decode_step_s``."""
        if self.share is not None:
            return self.share.prefill_s(alone_s, batch, context, tokens)
        return alone_s * self.prefill_factor(decode_step_s)

    def prefill_factor(self, decode_step_s: float) -> float:
        """How much longer a prompt takes beside a decode batch whose step alone lasts
        ``decode_step_s`` (the cycle model or the fixed factors)."""
        if self.cycle_s is None or decode_step_s >= self.cycle_s:
            return self.prefill_slowdown
        return self.cycle_s / (self.cycle_s - decode_step_s)

    def decode_stretch(self, a: float, b: float, batch: int = 0, context: float = 0.0,
                       tokens: int = 0) -> tuple[float, float]:
        """Step ``k`` of a stretch beside a prompt of ``tokens``, from its time alone
        ``a + b*k`` (the batch: ``batch`` requests, ``context`` tokens in all)."""
        if self.share is not None:
            factor = self.share.decode_factor(batch, context, tokens)
            return a * factor, b * factor
        if self.cycle_s is None or a >= self.cycle_s:
            return a * self.decode_slowdown, b * self.decode_slowdown
        return self.cycle_s, 0.0

    @classmethod
    def from_multiplex_results(cls, path: str, model: LatencyModel,
                               itl_slo_ms: float = 40.0) -> Multiplexing:
        """From a ``bench_multiplex.py`` result's multiplex run at ``itl_slo_ms``: decode's
        P50 step while prefilling over alone, and the prompt's time at the measured
        multiplexed rate over ``model``'s time for it alone."""
        with open(path) as f:
            runs = json.load(f)["runs"]
        run = next(r["multiplex"] for r in runs if r["itl_slo_ms"] == itl_slo_ms)
        decode = (run["decode_step_ms_while_prefilling"]["p50"]
                  / run["decode_step_ms_alone"]["p50"])
        tokens = run["prompt_tokens"]
        prefill = tokens / run["prefill_tokens_per_s"] / model.prefill_s(tokens)
        return cls(decode, prefill)


@dataclass(frozen=True)
class PrefillSteps:
    """How a prefill instance's engine steps through its prompts, where it matters: steps
    of at most ``chunk_tokens`` prompt tokens (the chunked policy: the oldest prompt's next
    piece first, later prompts' first pieces in what is left of the budget, first come
    first served), each piece costing ``LatencyModel.prefill_piece_s``, so a prompt alone
    takes ``prefill_s`` as before. With ``tokens_one_step_late`` a step's first tokens are
    handed back only once the next step has run, if there is work for one: overlap
    scheduling on a CPU, where issuing a step runs it (``pdserve/engine/core.py``: a
    synchronous policy collects an overlapped launch after issuing the next). A prompt
    that ends while another waits thus hands back its first token after the other's first
    piece. Each step is planned as it starts, as on a CPU; on a GPU the issue returns at
    once, the tokens come with their own step and the next step is planned a step ahead,
    which ``ChunkedInstanceSim(overlap=True)`` models and this does not. ``GroupSim``'s
    default, None, runs whole prompts one after another, each handed back as it ends: the
    fleet's figures."""

    chunk_tokens: int
    tokens_one_step_late: bool = False

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"PrefillSteps.chunk_tokens must be at least 1, not "
                             f"{self.chunk_tokens}")


@dataclass(frozen=True)
class SharedCores:
    """How the P/D instances of one group slow each other where they share a host's cores
    (the CPU validation: both instances, the gateway and the client on two cores): a decode
    step takes ``decode_slowdown`` times its time while a prefill instance of the group is
    busy, and a prompt runs ``prefill_slowdown`` times slower while a decode batch of the
    group runs: a batch that starts or ends while a prompt (or a prefill step) runs slows
    only the part beside it. Until 156c086 the whole prompt or step took the factor when a
    batch ran as it started; a 1,024-token prompt (about 0.2 s) then paid it in full beside
    a batch that ended a few steps in, and those prompts, the CPU runs' TTFT P99, came out
    5-12% slower than measured. Fitted from a probe that times each side with and without
    the other working (``benchmarks/validate_sim.py``: prompts beside an answer that
    outlasts them), never from a replay. Instances on devices of their own (the fleet)
    share nothing: ``GroupSim``'s default is None."""

    decode_slowdown: float = 1.0
    prefill_slowdown: float = 1.0

    @classmethod
    def from_probe(cls, probe: dict) -> SharedCores:
        """From a probe's medians (``validate_sim.measure_sharing``'s result): decode steps
        beside prompts over alone, and prompts beside a decode batch over alone - those
        sent on the replay's path (through the gateway, each joining the decode batch as
        the next starts) where the probe timed them
        (``prefill_on_path_beside_decode_over_alone``): prompts sent straight to the
        prefill instance missed most of the slowdown the replay's prompts met (1.03-1.20
        against 1.33-2.34 in the CPU runs before it was timed)."""
        beside, alone = probe["decode_step_ms_beside_prefill"], probe["decode_step_ms_alone"]
        prompts = probe.get("prefill_on_path_beside_decode_over_alone",
                            probe["prefill_beside_decode_over_alone"])
        return cls(decode_slowdown=beside["p50"] / alone["p50"],
                   prefill_slowdown=prompts["p50"])


@dataclass(frozen=True)
class IdleWake:
    """What a prompt costs beyond its fitted time when its prefill instance has been idle
    a while (the CPU validation: the calibration sends prompts back to back, the replay's
    come after idle cores; a process that slept runs its first work slower). ``points``:
    measured ``(idle_s, extra_base_s, extra_per_token_s)``, idle seconds rising: after
    ``idle_s`` a prompt of ``n`` tokens takes ``extra_base_s + extra_per_token_s * n``
    more. Between points both terms are interpolated (from none after no idle time),
    beyond the last held. Added to a prompt (under ``PrefillSteps``, to its first step)
    that starts on an idle instance, after any shared-cores factor. Fitted from a probe
    that sends prompts through the gateway back to back and after pauses
    (``benchmarks/validate_sim.py``), never from a replay. ``GroupSim``'s default, None,
    adds nothing: the fleet's figures."""

    points: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        idle = [p[0] for p in self.points]
        if not self.points or idle[0] <= 0 or sorted(set(idle)) != idle:
            raise ValueError(f"IdleWake.points needs idle seconds above 0, rising: "
                             f"{self.points}")
        if any(p[1] < 0 or p[2] < 0 for p in self.points):
            raise ValueError(f"IdleWake.points: an extra below 0 in {self.points}")

    def extra_s(self, idle_s: float, tokens: int) -> float:
        """The extra seconds of a prompt of ``tokens`` starting after ``idle_s`` idle."""
        idle = [0.0] + [p[0] for p in self.points]
        base = float(np.interp(idle_s, idle, [0.0] + [p[1] for p in self.points]))
        per_token = float(np.interp(idle_s, idle, [0.0] + [p[2] for p in self.points]))
        return base + per_token * tokens


class _CoreSharing:
    """A group's instances on shared cores: which prefill instances are busy and which
    decode instances run a batch. A decode instance starts a stretch at its next step
    boundary when the first prefill instance gets busy or the last one goes idle."""

    def __init__(self, factors: SharedCores, decodes: list[DecodeSim],
                 prefills: list[PrefillSim]) -> None:
        self.factors = factors
        self.decodes = decodes
        self.prefills = prefills
        self.busy_prefills: set[str] = set()
        self.running_decodes: set[str] = set()

    def prefill_starts(self, name: str) -> None:
        """A prompt (or step) of prefill instance ``name`` starts."""
        if name not in self.busy_prefills:
            self.busy_prefills.add(name)
            if len(self.busy_prefills) == 1:
                self._resync_decodes()

    def prefill_factor(self) -> float:
        """How much slower a prompt runs now: beside a decode batch or not."""
        return self.factors.prefill_slowdown if self.running_decodes else 1.0

    def prefill_idle(self, name: str) -> None:
        self.busy_prefills.discard(name)
        if not self.busy_prefills:
            self._resync_decodes()

    def decode_running(self, name: str, running: bool) -> None:
        before = bool(self.running_decodes)
        (self.running_decodes.add if running else self.running_decodes.discard)(name)
        if bool(self.running_decodes) != before:
            for prefill in self.prefills:
                prefill.cores_changed()

    def slowdown(self) -> float:
        """A decode stretch starting now: its steps' factor."""
        return self.factors.decode_slowdown if self.busy_prefills else 1.0

    def _resync_decodes(self) -> None:
        for decode in self.decodes:
            decode.cores_changed()


class ServiceNoise:
    """The measured spread of service times, as ratios of each measured time to the median
    of its own point (prefill: one prompt length; decode: one batch and context). A prompt
    takes the model's time times a ratio drawn at random. Step ``n`` of a decode
    instance's busy period takes the model's step times the ``n``-th of a sequence of
    ratios drawn once; their running sums keep ``DecodeSim``'s jumps exact. With
    ``first_step`` set, every busy period starts there in the sequence (a reference run
    can then replay its steps). With ``steps_per_ratio`` above 1, each drawn ratio holds
    for that many steps in a row: where each measured ratio is the mean of as many steps
    (a slow stretch of the host slows them all), drawing one per step would average the
    spread away over an answer. With ``hold_probability`` above 0, each block of steps keeps
    the previous block's ratio with that probability (drawn afresh otherwise): slow
    stretches of the host that outlast a block, consecutive blocks' ratios correlating by
    that much (the correlation of consecutive measured block means)."""

    def __init__(self, prefill_ratios: list[float], decode_ratios: list[float],
                 seed: int = 0, steps: int = 1 << 20, first_step: int | None = None,
                 steps_per_ratio: int = 1, hold_probability: float = 0.0) -> None:
        self._first_step = first_step
        self._rng = np.random.default_rng(seed)
        self._prefill = np.asarray(prefill_ratios, dtype=float)
        blocks = -(-steps // steps_per_ratio)
        factors = self._rng.choice(np.asarray(decode_ratios, dtype=float), blocks)
        if hold_probability > 0.0:
            fresh = self._rng.random(blocks) >= hold_probability
            fresh[0] = True
            factors = factors[np.maximum.accumulate(np.where(fresh, np.arange(blocks), 0))]
        if steps_per_ratio > 1:
            factors = np.repeat(factors, steps_per_ratio)[:steps]
        self._sum = np.concatenate(([0.0], np.cumsum(factors)))
        self._weighted = np.concatenate(([0.0], np.cumsum(np.arange(steps) * factors)))

    def prefill_factor(self) -> float:
        return float(self._rng.choice(self._prefill))


    def start(self) -> int:
        """Where a busy period starts in the drawn sequence: anywhere in its first half."""
        if self._first_step is not None:
            return self._first_step
        return int(self._rng.integers(0, (len(self._sum) - 1) // 2))

    def span(self, first: int, end: int) -> tuple[float, float]:
        """Over steps ``first <= n < end``: the sum of their ratios and of ``(n - first)``
        times their ratios (a stretch's ``a`` and ``b`` multiply these)."""
        if end >= len(self._sum):
            raise ValueError("a decode busy period outran the drawn step ratios")
        total = float(self._sum[end] - self._sum[first])
        return total, float(self._weighted[end] - self._weighted[first]) - first * total


@dataclass(slots=True)
class SimRequest:
    arrival: float
    input_len: int
    output_len: int
    prefill_done: float | None = None
    first_token: float | None = None
    finished: float | None = None
    unserved: bool = False
    offers: int = 0
    gateway: GatewaySim | None = None  # the gateway that took it in
    wait_token: int = 0  # which entry of its gateway's wait line is live
    scenario: int = 0  # its index in a fleet's scenarios


class EventLoop:
    """Timed actions, run in time order, those due at one time in the order scheduled. An
    action is a callable and one argument, so that the hot paths schedule bound methods
    instead of building a closure per event.

    The heap holds only the distinct times (floats, compared directly), each time's actions
    sit in a list under it: a heap of (time, sequence, action, argument) tuples paid a tuple
    comparison, several calls deep, at each of the heap's levels. Besides the heap, one
    feed: a source of events already in time order (a fleet's arrivals, a fifth of its
    events) hands the loop only its next time (``feed``), which the loop compares with the
    heap's head instead of pushing and popping it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._times: list[float] = []  # heap of the times actions are due at, each once
        self._due: dict[float, list] = {}  # time -> [action, argument, action, ...]
        self._feed_at = math.inf
        self._feed: Callable[[], float] = _dry  # runs only at _feed_at: never while dry

    def at(self, when: float, action: Callable[..., None], arg: object = None) -> None:
        due = self._due.get(when)
        if due is None:
            self._due[when] = [action, arg]
            heappush(self._times, when)
        else:  # after those already due then (once they run, it opens a new entry)
            due.append(action)
            due.append(arg)

    def feed(self, when: float, action: Callable[[], float]) -> None:
        """``action`` runs at ``when`` (after heap events of that very time) and returns when
        it runs next: the source's next event, or ``math.inf`` when the source is dry (until
        ``feed`` is called again). A return value spares a call back per event."""
        self._feed_at, self._feed = when, action

    def run(self, until: float = math.inf) -> None:
        """Runs every event due before ``until`` (a later ``run`` goes on from there), with
        Python's cycle collector paused: the simulator's events, requests and batches form
        no reference cycles (reference counting frees each as it ends; a test checks none is
        left), and the collector's passes over the fleet's live objects, set off by its
        allocations, took about a tenth of the run."""
        paused = gc.isenabled()
        gc.disable()
        try:
            self._run(until)
        finally:
            if paused:
                gc.enable()

    def _run(self, until: float) -> None:
        times, due, pop, inf = self._times, self._due, heappop, math.inf
        while True:
            head = times[0] if times else inf
            feed_at = self._feed_at
            if feed_at < head:
                if feed_at >= until:
                    return
                self.now = feed_at
                self._feed_at = self._feed()
                continue
            if head >= until:  # (with nothing left, inf >= until)
                return
            pop(times)
            self.now = head
            # Taken out before they run: one due at this time from them opens a new entry,
            # which the heap hands back at once (after these, before the feed: as before).
            actions = due.pop(head)
            if len(actions) == 2:  # most times have one action
                action, arg = actions
                if arg is None:
                    action()
                else:
                    action(arg)
                continue
            for i in range(0, len(actions), 2):
                action, arg = actions[i], actions[i + 1]
                if arg is None:
                    action()
                else:
                    action(arg)


def _dry() -> float:
    """A source with no events (``EventLoop``'s feed until one is given)."""
    return math.inf


class LoadOrder(Generic[T]):
    """One gateway's instances of one role in a group, in its order - fewest in flight from
    that gateway first, ties by name: the order ``order_prefill`` offers prefills in, and
    whose first is the decode instance ``_pick_decode`` picks - kept as a load moves by one
    instead of sorted again per request: per load, a sorted list of the instances' ranks by
    name. Sorting every request's candidates was the fleet's largest cost.
    ``GroupSim(verify_order=True)`` checks it against ``order_prefill`` on every request."""

    def __init__(self, counts: dict[str, int], names: list[str], items: dict[str, T]) -> None:
        """The order of ``names`` by ``counts`` (a gateway's, which ``shift`` keeps too)."""
        self.counts = counts
        loads = {n: counts[n] for n in names}
        names = sorted(names)
        self._items = [items[n] for n in names]  # by rank
        self._entries = {n: [rank, loads[n]] for rank, n in enumerate(names)}  # [rank, load]
        self._levels: list[list[int]] = [[] for _ in range(max(loads.values(), default=0) + 1)]
        for rank, name in enumerate(names):
            self._levels[loads[name]].append(rank)
        self._low = 0  # no instance has a lower load

    def shift(self, name: str, delta: int) -> None:
        """``name``'s count moved by ``delta``."""
        self.counts[name] += delta
        entry = self._entries.get(name)
        if entry is None:
            return  # it is leaving this role: no longer in the order
        rank, load = entry
        levels = self._levels
        level = levels[load]
        del level[bisect.bisect_left(level, rank)]  # sorted: not list.remove's scan
        load += delta
        entry[1] = load
        if load == len(levels):
            levels.append([])
        bisect.insort(levels[load], rank)
        if load < self._low:
            self._low = load

    def _lowest(self) -> int:
        levels, low = self._levels, self._low
        while low < len(levels) - 1 and not levels[low]:  # moved up: the next in use
            low += 1
        self._low = low
        return low

    def in_order(self) -> Iterator[T]:
        """The instances in order (a plain method: ``iter()`` would reach ``__iter__`` through
        a C slot, a heavier call from the offer path than a method call)."""
        levels = self._levels
        low = self._low if levels[self._low] else self._lowest()
        return map(self._items.__getitem__, itertools.chain.from_iterable(levels[low:]))

    def __iter__(self) -> Iterator[T]:
        return self.in_order()

    def first(self) -> T:
        levels = self._levels
        low = self._low if levels[self._low] else self._lowest()
        return self._items[levels[low][0]]


class GatewaySim:
    """What one gateway knows on its own: the prefills it placed that are still in flight
    and the answers it relays, by instance, its round-robin turn, and its line of refused
    requests per group. Several gateways in front of one group do not see each other's
    counts, as real ones do not."""

    def __init__(self, name: str = "g0") -> None:
        self.name = name
        # Plain dicts, every instance of its groups entered at 0: a Counter's item access
        # is not specialised for a dict subclass, and these change four times a request.
        self.load: dict[str, int] = {}
        self.decode_load: dict[str, int] = {}
        self.turn = 0
        self.lines: dict[int, WaitLine] = {}

    def line(self, group: GroupSim) -> WaitLine:
        line = self.lines.get(id(group))
        if line is None:
            line = self.lines[id(group)] = WaitLine()
        return line


class WaitLine:
    """A gateway's first-come line of refused requests for one group. A request that leaves
    it by its own poll stays in the deque as a dead entry (its ``wait_token`` moved on):
    removing it from the middle would cost a scan of the line per poll."""

    def __init__(self) -> None:
        self._entries: deque[tuple[int, SimRequest]] = deque()
        self.live = 0

    def __bool__(self) -> bool:
        return self.live > 0

    def put(self, request: SimRequest, first: bool) -> None:
        request.wait_token += 1
        entry = (request.wait_token, request)
        (self._entries.appendleft if first else self._entries.append)(entry)
        self.live += 1

    def take(self, request: SimRequest, token: int) -> bool:
        """Takes ``request`` out if its entry ``token`` is still live."""
        if request.wait_token != token:
            return False
        request.wait_token += 1
        self.live -= 1
        return True

    def pop(self) -> SimRequest | None:
        while self._entries:
            token, request = self._entries.popleft()
            if self.take(request, token):
                return request
        return None


class PrefillSim:
    """One prefill instance: FCFS, one prompt at a time, with the real admission rule."""

    def __init__(self, name: str, loop: EventLoop, model: LatencyModel,
                 on_done: Callable[[PrefillSim, SimRequest], None]) -> None:
        self.name = name
        self.instance = Instance(name, "sim", "prefill", name, name)
        self.loop, self.model, self.on_done = loop, model, on_done
        # The clock reads the loop's time without a Python frame per reading.
        self.admission = PrefillAdmission(clock=functools.partial(getattr, loop, "now"))
        self.queue: deque[tuple[SimRequest, float]] = deque()
        self.busy = False
        self.partner: DecodeSim | None = None  # the decode side of a multiplexing instance
        self.multiplexing: Multiplexing | None = None
        self.noise: ServiceNoise | None = None
        self.tokens = 0  # the prompt prefilling now, or last (multiplexing only)
        self.cores: _CoreSharing | None = None  # shares a host's cores with the group
        self.steps: PrefillSteps | None = None  # None: whole prompts, one at a time
        self._head_done = 0  # tokens of the oldest queued prompt already prefilled (steps)
        self._head_factor = 1.0  # its drawn ratio of the spread (steps)
        self._late: list[tuple[SimRequest, float]] = []  # ended, handed back after a step
        self.wake: IdleWake | None = None  # None: a prompt after idleness costs no more
        self._idle_since: float | None = 0.0  # None while busy
        # The work in flight on shared cores (``_run_shared``): its end action, the seconds
        # left at ``_mark`` (a fixed part first, then work alone that runs ``_factor`` times
        # slower), and a generation that retires an end rescheduled since.
        self._end: Callable[[Any], None] | None = None
        self._end_arg: object = None
        self._fixed_left = 0.0
        self._alone_left = 0.0
        self._mark = 0.0
        self._factor = 1.0
        self._generation = 0

    def idle(self) -> bool:
        return not (self.busy or self.queue)

    def reach(self, job: tuple[SimRequest, float]) -> None:
        """A prompt admitted at ``job[1]`` reaches the instance: it queues, and starts if
        the instance is free."""
        self.queue.append(job)
        if not self.busy:
            self._start_next()

    def _start_next(self) -> None:
        if self.steps is not None:
            self._start_step(self.steps.chunk_tokens)
            return
        job = self.queue.popleft()
        self.busy = True
        m, tokens = self.model, job[0].input_len
        service = (m.prefill_base_s + m.prefill_per_token_s * tokens  # m.prefill_s, in place
                   + m.prefill_per_token_sq_s * (tokens * tokens))  # (** is a slower C call)
        if self.noise is not None:
            service *= self.noise.prefill_factor()
        partner = self.partner
        if partner is not None:
            self.tokens = tokens
            if partner.running:
                assert self.multiplexing is not None  # set with the partner (GroupSim._pair)
                service = self.multiplexing.prefill_beside_s(
                    service, partner.step_alone_s(), len(partner.running), partner.context(),
                    tokens)
            partner.resync()
        woken = self._woken_s(tokens)
        if self.cores is not None:
            self._run_shared(woken, service, self._finish, job)
            return
        self.loop.at(self.loop.now + service + woken, self._finish, job)

    def _run_shared(self, fixed_s: float, alone_s: float, end: Callable[[Any], None],
                    arg: object) -> None:
        """Work on shared cores: ``fixed_s`` (the wake after idleness), then ``alone_s`` of
        work that runs slower while a decode batch runs (``cores_changed`` stretches what
        is left); ``end(arg)`` when it is done."""
        assert self.cores is not None
        self.cores.prefill_starts(self.name)
        self._end, self._end_arg = end, arg
        self._fixed_left, self._alone_left = fixed_s, alone_s
        self._reschedule()

    def _reschedule(self) -> None:
        assert self.cores is not None
        now = self.loop.now
        self._mark, self._factor = now, self.cores.prefill_factor()
        self._generation += 1
        self.loop.at(now + self._fixed_left + self._alone_left * self._factor,
                     self._shared_done, self._generation)

    def cores_changed(self) -> None:
        """A decode batch of the group started or ended: the work in flight runs at the new
        speed from now."""
        if self._end is None:
            return
        elapsed = self.loop.now - self._mark
        fixed_done = min(elapsed, self._fixed_left)
        self._fixed_left -= fixed_done
        self._alone_left = max(self._alone_left - (elapsed - fixed_done) / self._factor, 0.0)
        self._reschedule()

    def _shared_done(self, generation: object) -> None:
        if generation != self._generation or self._end is None:
            return  # rescheduled since
        end, arg = self._end, self._end_arg
        self._end, self._end_arg = None, None
        end(arg)

    def _woken_s(self, tokens: int) -> float:
        """A prompt of ``tokens`` starts now: its extra seconds after idleness
        (``IdleWake``; none where the instance was busy)."""
        idle_since, self._idle_since = self._idle_since, None
        if self.wake is None or idle_since is None:
            return 0.0
        return self.wake.extra_s(self.loop.now - idle_since, tokens)

    def _finish(self, job: tuple[SimRequest, float]) -> None:
        request, arrived = job
        self.admission.done(request.input_len, request.input_len, arrived)
        # The gateway relays the first token as soon as the decode instance is asked, before
        # the KV has crossed the link (``pdserve/server/pd.py``).
        request.prefill_done = request.first_token = self.loop.now
        self.busy = False
        if self.queue:
            self._start_next()
        else:
            self._idle_since = self.loop.now
            if self.partner is not None:
                self.partner.resync()
        if self.cores is not None and not self.busy:
            self.cores.prefill_idle(self.name)
        self.on_done(self, request)

    def _start_step(self, budget: int) -> None:
        """One engine step (``PrefillSteps``): pieces of the queued prompts, oldest first,
        up to ``budget`` tokens; the prompts it ends go to ``_step_done``."""
        self.busy = True
        queue, seconds, ended = self.queue, 0.0, []
        oldest_tokens = queue[0][0].input_len
        while budget > 0 and queue:
            tokens, start = queue[0][0].input_len, self._head_done
            if start == 0:  # a prompt's first piece: its draw of the spread, for all pieces
                self._head_factor = 1.0 if self.noise is None else self.noise.prefill_factor()
            end = min(tokens, start + budget)
            seconds += self._head_factor * self.model.prefill_piece_s(start, end)
            budget -= end - start
            self._head_done = end if end < tokens else 0
            if end == tokens:
                ended.append(queue.popleft())
        woken = self._woken_s(oldest_tokens)
        if self.cores is not None:
            self._run_shared(woken, seconds, self._step_done, ended)
            return
        self.loop.at(self.loop.now + seconds + woken, self._step_done, ended)

    def _step_done(self, ended: list[tuple[SimRequest, float]]) -> None:
        """Hands back the previous step's held prompts, and this step's unless they wait for
        the next step (``tokens_one_step_late`` with work queued), then starts that step."""
        steps = self.steps
        assert steps is not None  # only stepped instances schedule steps
        ready, self._late = self._late, []
        if self.queue and steps.tokens_one_step_late:
            self._late = ended
        else:
            ready += ended
        now = self.loop.now
        for request, arrived in ready:
            self.admission.done(request.input_len, request.input_len, arrived)
            request.prefill_done = request.first_token = now
        if self.queue:
            self._start_step(steps.chunk_tokens)
        else:
            self.busy = False
            self._idle_since = now
            if self.cores is not None:
                self.cores.prefill_idle(self.name)
        for request, _ in ready:  # after the instance's state is settled, as ``_finish``
            self.on_done(self, request)


class DecodeSim:
    """One decode instance: continuous batching within a KV pool of fixed size.

    Simulated step by step it would cost one event per step (tens a second per instance);
    instead it jumps from one change of the batch to the next. Between changes the batch is
    fixed and each step's context grows by one token per request, so step ``k`` of the
    stretch takes ``a + b*k`` and ``k`` steps take ``k*a + b*k*(k-1)/2``: the time of any
    later step boundary is exact. The batch changes only when a request ends (a step
    boundary counted in advance) or a newcomer is admitted (at the boundary after it came).
    """

    def __init__(self, name: str, loop: EventLoop, model: LatencyModel,
                 on_finish: Callable[[DecodeSim, SimRequest], None] | None = None,
                 max_batch: int = 256) -> None:
        self.name, self.loop, self.model, self.max_batch = name, loop, model, max_batch
        self.on_finish = on_finish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[int, int, SimRequest]] = []  # heap: (last step, seq, request)
        self.kv_in_use = 0  # tokens reserved: prompt plus whole answer of each running one
        self._context_base = 0  # context at step s is _context_base + len(running) * s
        self._seq = itertools.count()
        self._step = 0  # steps done at _since
        self._since = 0.0
        self._sync_step: int | None = None  # the step at which a sync is scheduled
        self._version = 0  # a sync scheduled before the latest change is stale
        self.partner: PrefillSim | None = None  # the prefill side of a multiplexing instance
        self.multiplexing: Multiplexing | None = None
        self._beside = False  # the current stretch runs beside a prompt's prefill
        self._a = self._b = 0.0  # step k of the current stretch takes _a + _b*k seconds
        self.noise: ServiceNoise | None = None
        self._noise_at = 0  # the busy period's step 0 in the noise's drawn sequence
        self.cores: _CoreSharing | None = None  # shares a host's cores with the group
        self._slowdown = 1.0  # the current stretch's factor from the group's shared cores

    def idle(self) -> bool:
        return not (self.running or self.waiting)

    def receive(self, request: SimRequest) -> None:
        self.waiting.append(request)
        if not self.running:
            if self.noise is not None:
                self._noise_at = self.noise.start()
            self._begin_stretch(0)
            self._admit()
            self._schedule(self.running[0][0] if self.running else None)
            if self.cores is not None and self.running:
                self.cores.decode_running(self.name, True)
        elif len(self.waiting) == 1 and len(self.running) < self.max_batch and (
                self.kv_in_use + request.input_len + request.output_len
                <= self.model.decode_kv_tokens):  # it fits (as in ``_admit``; running is not empty)
            now = self.loop.now
            # the next step boundary and its time; one still ahead when a newcomer joins
            # there already
            boundary, at = ((self._step, self._since) if now < self._since
                            else self._boundary_after(now))
            sync = self._sync_step
            # Nothing changes the batch before that boundary (no request ends by then, no
            # prefill beside it resyncs it): the newcomer is admitted now, from there.
            if (self.partner is None and self.running[0][0] > boundary
                    and (sync is None or sync > boundary)):
                self._join_at(boundary, at)
            else:
                self._schedule(boundary)

    def _join_at(self, step: int, at: float) -> None:
        """Admits the waiting newcomer from step boundary ``step`` without an event there:
        the boundary's time is exact. The next finish now comes later (a larger batch steps
        slower); if it is still the scheduled one, its event stays and, firing early, moves
        itself (``_sync``): one move for however many newcomers joined before it. ``at``:
        the boundary's time, with the batch before the newcomer."""
        self._since = at
        self._step = step
        self._admit()
        if self.running[0][0] != self._sync_step:  # the newcomer ends first
            self._version += 1
            self._sync_step = None
            self._schedule(self.running[0][0] if self.running else None)

    def _admit(self) -> None:
        """Admits the waiting requests that fit, then sets the stretch from this batch (every
        change of the batch or of the stretch's start ends here): step k (from 0) takes
        _a + _b*k seconds, computed once per change, not per step time asked for."""
        waiting, running = self.waiting, self.running
        if waiting:  # (locals: each field read and written once, not per request)
            step, kv, base = self._step, self.kv_in_use, self._context_base
            max_batch, pool = self.max_batch, self.model.decode_kv_tokens
            # One fits while the batch has room and its whole prompt and answer fit in the
            # pool (any one does in an empty batch).
            while waiting:
                request = waiting[0]
                size = request.input_len + request.output_len
                if len(running) >= max_batch or (kv + size > pool and running):
                    break
                waiting.popleft()
                steps = request.output_len - 1  # at least 1 (CPython 3.11's max() is slow)
                last = step + (steps if steps > 1 else 1)
                heappush(running, (last, next(self._seq), request))
                kv += size
                base += size - last
            self.kv_in_use, self._context_base = kv, base
        m, batch = self.model, len(running)
        context = self._context_base + batch * self._step
        self._a = (m.decode_base_s + m.decode_per_request_s * batch
                   + m.decode_per_kv_token_s * context)
        self._b = m.decode_per_kv_token_s * batch
        if self._beside:
            assert self.multiplexing is not None and self.partner is not None  # _beside
            self._a, self._b = self.multiplexing.decode_stretch(self._a, self._b, batch, context,
                                                                self.partner.tokens)
        if self._slowdown != 1.0:
            self._a *= self._slowdown
            self._b *= self._slowdown

    def _begin_stretch(self, step: int) -> None:
        self._step, self._since = step, self.loop.now
        # The multiplexing factors are set with the partner (GroupSim._pair).
        self._beside = (self.partner is not None and self.partner.busy
                        and self.multiplexing is not None)
        if self.cores is not None:
            self._slowdown = self.cores.slowdown()

    def step_alone_s(self) -> float:
        """The current step's time with nothing beside it."""
        m, batch = self.model, len(self.running)
        return (m.decode_base_s + m.decode_per_request_s * batch
                + m.decode_per_kv_token_s * self.context())

    def context(self) -> int:
        """The running requests' context at the current step, in all."""
        return self._context_base + len(self.running) * self._step

    def resync(self) -> None:
        """The prefill side beside it started or ended a prompt: a new stretch at the next
        step boundary."""
        if self.running:
            self._schedule(self._boundary_after(self.loop.now)[0])

    def cores_changed(self) -> None:
        """A prefill instance of the group got busy or went idle: a new stretch at the
        next step boundary (at the current stretch's start where that is still ahead: a
        newcomer joined there, ``_join_at``)."""
        if self.running:
            now = self.loop.now
            self._schedule(self._step if now < self._since else self._boundary_after(now)[0])

    def _time_of(self, step: int) -> float:
        a, b = self._a, self._b
        k = step - self._step
        if self.noise is not None:
            total, weighted = self.noise.span(self._noise_at + self._step,
                                              self._noise_at + step)
            return self._since + a * total + b * weighted
        return self._since + k * a + b * k * (k - 1) / 2

    def _boundary_after(self, now: float) -> tuple[int, float]:
        """The first step boundary after ``now`` (counted from the busy period's start, as
        ``_step``) and its time (``_time_of``'s, which the search computes on its way)."""
        if self.noise is not None:
            step = self._noisy_steps_done(now) + 1
            return step, self._time_of(step)
        a, b = self._a, self._b
        elapsed = now - self._since
        if b > 0:
            c = a - b / 2
            k = int((math.sqrt(c * c + 2 * b * elapsed) - c) / b)
        else:
            k = int(elapsed / a)
        # Float rounding; the step times are ``_time_of``'s, written out: the loops ask a
        # few each, for most requests.
        since = self._since
        while k > 0 and since + k * a + b * k * (k - 1) / 2 > now:
            k -= 1
        while True:
            at = since + (k + 1) * a + b * (k + 1) * k / 2
            if at > now:
                return self._step + k + 1, at
            k += 1

    def _noisy_steps_done(self, now: float) -> int:
        """Whole steps of the current stretch done by ``now`` (plus the steps before it), by
        bisection: no closed form inverts the noisy sums."""
        low, high = 0, 1
        while self._time_of(self._step + high) <= now:
            low, high = high, high * 2
        while high - low > 1:  # time_of(step + low) <= now < time_of(step + high)
            middle = (low + high) // 2
            if self._time_of(self._step + middle) <= now:
                low = middle
            else:
                high = middle
        return self._step + low

    def _schedule(self, step: int | None) -> None:
        if step is None or (self._sync_step is not None and self._sync_step <= step):
            return
        self._version += 1
        self._sync_step = step
        if self.noise is None:  # _time_of, in place: once a request or more
            k = step - self._step
            when = self._since + k * self._a + self._b * k * (k - 1) / 2
        else:
            when = self._time_of(step)
        self.loop.at(when, self._sync, (self._version, step))

    def _sync(self, event: tuple[int, int]) -> None:
        version, step = event
        if version != self._version:
            return
        now = self.loop.now
        if self.noise is None:  # _time_of, in place: once a request or more
            k = step - self._step
            when = self._since + k * self._a + self._b * k * (k - 1) / 2
        else:
            when = self._time_of(step)
        if when > now:  # newcomers joined since it was scheduled (``_join_at``)
            self.loop.at(when, self._sync, event)
            return
        self._begin_stretch(step)
        self._sync_step = None
        running, done = self.running, []
        while running and running[0][0] <= step:  # most often one ends
            last, _, request = heappop(running)
            size = request.input_len + request.output_len
            self.kv_in_use -= size
            self._context_base -= size - last
            request.finished = now
            done.append(request)
        self._admit()
        self._schedule(running[0][0] if running else None)
        if self.cores is not None and not running:
            self.cores.decode_running(self.name, False)
        if self.on_finish is not None:
            for request in done:  # after the batch shrank: the callback may find it idle
                self.on_finish(self, request)


@dataclass
class GroupSim:
    """One scenario's group behind its gateways, driven by a request list (``run``) or by a
    fleet (``FleetSim`` calls ``arrive``). Every instance can take either role (as a real
    one does); with ``ratio`` set, the real ratio controller's judgement (``judge``) moves
    one between roles every ``ratio_interval_s``, and a moved instance joins its new role
    once the work of its old one has drained. Each request that ended, answered or given up
    on (``unserved``), is appended to ``ended`` if set (a list its reader empties: a
    callback per request cost a Python call each)."""

    model: LatencyModel
    num_prefill: int
    num_decode: int
    dispatch: str = "on-demand"
    ttft_slo_s: float = 2.0
    max_wait_s: float = 30.0
    retry_poll_s: float = 0.05
    ratio: RatioConfig | None = None
    ratio_interval_s: float = 10.0
    loop: EventLoop = field(default_factory=EventLoop)
    gateways: list[GatewaySim] = field(default_factory=lambda: [GatewaySim()])
    name: str = "sim"
    ended: list[SimRequest] | None = None
    multiplexing: Multiplexing | None = None  # every instance prefills and decodes itself
    verify_order: bool = False  # check each offer order against the gateway's own
    noise: ServiceNoise | None = None  # measured spread of service times; None: medians
    shared_cores: SharedCores | None = None  # the instances share a host's cores
    prefill_steps: PrefillSteps | None = None  # None: whole prompts one after another
    idle_wake: IdleWake | None = None  # None: a prompt after idleness costs no more

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH)}")
        if self.multiplexing is not None and self.ratio is not None:
            raise ValueError("multiplexing instances have no P/D ratio to move")
        if self.model.gateway_hop_s > 0.0 and self.ratio is not None:
            raise ValueError("a gateway hop (LatencyModel.gateway_hop_s) with a moving P/D "
                             "ratio is not modelled: an instance could change roles while "
                             "a prompt is on its way to it")
        names = [f"{self.name}-n{i}" if self.name != "sim" else f"n{i}"
                 for i in range(self.num_prefill + self.num_decode)]
        self.prefill = {n: PrefillSim(n, self.loop, self.model, self._prefilled) for n in names}
        self.decode = {n: DecodeSim(n, self.loop, self.model, self._finished) for n in names}
        self.roles = {n: "prefill" if i < self.num_prefill else "decode"
                      for i, n in enumerate(names)}
        if self.prefill_steps is not None and self.multiplexing is not None:
            raise ValueError("prefill_steps models a prefill instance's steps, not a "
                             "multiplexing instance's")
        if self.idle_wake is not None and self.multiplexing is not None:
            raise ValueError("idle_wake models a prefill instance's idleness, not a "
                             "multiplexing instance's")
        for prefill in self.prefill.values():
            prefill.noise = self.noise
            prefill.steps = self.prefill_steps
            prefill.wake = self.idle_wake
        for decode in self.decode.values():
            decode.noise = self.noise
        if self.multiplexing is not None:
            self._pair(names)
        if self.shared_cores is not None:
            self._share_cores(self.shared_cores)
        for gateway in self.gateways:
            for counts in (gateway.load, gateway.decode_load):
                counts.update(dict.fromkeys(names, 0))
        self.draining: dict[str, str] = {}  # instance -> the role it moves to
        self._lines = {gateway: gateway.line(self) for gateway in self.gateways}
        self.window = ScenarioWindow()
        self.moves: list[tuple[float, str, str]] = []
        self._active: dict[str, list] = {}  # role -> its active instances, rebuilt on a move
        self._orders: dict[GatewaySim, LoadOrder[PrefillSim]] = {}  # rebuilt as _active
        self._decode_orders: dict[GatewaySim, LoadOrder[DecodeSim]] = {}  # the same, decode
        self.open = 0  # requests in the group, not yet finished or given up on
        self.until = 0.0  # the ratio controller looks at least until then
        self._last_move = -1e9
        self._decode_short_at: tuple[int, float] | None = None  # as RatioController keeps

    def _pair(self, names: list[str]) -> None:
        """Each instance offers prefills and decodes what it prefilled, on one GPU."""
        for name in names:
            prefill, decode = self.prefill[name], self.decode[name]
            prefill.partner, decode.partner = decode, prefill
            prefill.multiplexing = decode.multiplexing = self.multiplexing
            self.roles[name] = "prefill"

    def _share_cores(self, factors: SharedCores) -> None:
        """Every instance slows the other role's while it works (``SharedCores``)."""
        if self.multiplexing is not None:
            raise ValueError("shared cores are between P/D instances, not inside a "
                             "multiplexing one")
        sharing = _CoreSharing(factors, list(self.decode.values()), list(self.prefill.values()))
        for prefill in self.prefill.values():
            prefill.cores = sharing
        for decode in self.decode.values():
            decode.cores = sharing

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        gateway = self.gateways[0]
        for request in requests:
            request.gateway = gateway
            self.loop.at(request.arrival, self.arrive, request)
        self.start(max((r.arrival for r in requests), default=0.0))
        self.loop.run()
        return requests

    def start(self, until: float) -> None:
        """Before the loop runs: requests come until ``until``; the ratio controller looks
        until then and on while requests are still in the group."""
        self.until = until
        if self.ratio is not None:
            self.loop.at(self.ratio_interval_s, self._tick)

    def active(self, role: str) -> list[str]:
        return [n for n, r in self.roles.items() if r == role and n not in self.draining]

    def _prefill_instances(self) -> list[Instance]:
        instances = self._active.get("prefill")
        if instances is None:
            instances = self._active["prefill"] = [self.prefill[n].instance
                                                   for n in self.active("prefill")]
        return instances

    def _order(self, gateway: GatewaySim) -> LoadOrder[PrefillSim]:
        """``gateway``'s prefill order; its ``shift`` counts a prefill placed or ended."""
        return self._orders.get(gateway) or self._new_order(gateway, "prefill")

    def _decode_order(self, gateway: GatewaySim) -> LoadOrder[DecodeSim]:
        """``gateway``'s decode order; its ``shift`` counts an answer placed or ended."""
        return self._decode_orders.get(gateway) or self._new_order(gateway, "decode")

    def _new_order(self, gateway: GatewaySim, role: str) -> LoadOrder[Any]:
        """``gateway``'s order of ``role``'s active instances, kept until the roles change."""
        order: LoadOrder[Any]
        if role == "prefill":
            order = self._orders[gateway] = LoadOrder(gateway.load, self.active(role),
                                                      self.prefill)
        else:
            order = self._decode_orders[gateway] = LoadOrder(gateway.decode_load,
                                                             self.active(role), self.decode)
        return order

    def _offer_order(self, gateway: GatewaySim, order: LoadOrder) -> Iterator[PrefillSim]:
        if self.dispatch == "round-robin":
            return (self.prefill[i.instance_id] for i in order_prefill(
                self._prefill_instances(), self.dispatch, gateway.load, gateway.turn))
        if self.verify_order:
            expected = order_prefill(self._prefill_instances(), self.dispatch, gateway.load,
                                     gateway.turn)
            assert [p.instance for p in order] == expected, "offer order differs"
        return iter(order)

    # The per-request paths below count on the window's fields and read the kept orders
    # in place rather than through the small methods beside them (``ScenarioWindow``'s
    # recorders and ``latencies``, ``_order``, a TTFT budget function): a Python call per
    # request each, at millions of requests.

    def arrive(self, request: SimRequest) -> None:
        self.open += 1
        self.window.arrived += 1  # ScenarioWindow.request_arrived
        gateway = request.gateway
        assert gateway is not None  # set before it arrives (GroupSim.run, FleetSim)
        if self._lines[gateway].live:  # a newcomer queues behind those waiting
            self._wait(request, first=False)
        else:
            self._try(request)

    def _try(self, request: SimRequest) -> None:
        gateway = request.gateway
        assert gateway is not None
        gateway.turn += 1
        first_round = request.offers == 0
        budget = None
        if self.dispatch == "on-demand":  # what is left of the SLO, at least 0 (not max())
            budget = (self.ttft_slo_s - (self.loop.now - request.arrival)) * 1e3
            budget = budget if budget > 0.0 else 0.0
        order = self._orders.get(gateway) or self._new_order(gateway, "prefill")
        offers = (order.in_order() if self.dispatch != "round-robin" and not self.verify_order
                  else self._offer_order(gateway, order))
        for prefill in offers:
            request.offers += 1
            # The real rule (a real instance answers its refusal with a 429).
            if prefill.admission.try_admit(request.input_len, budget) is None:
                hop = self.model.gateway_hop_s
                if hop > 0.0:  # on its way: the instance serves others meanwhile
                    self.loop.at(self.loop.now + hop, prefill.reach, (request, self.loop.now))
                else:  # ``reach``, in place (a Python call per request at fleet scale)
                    prefill.queue.append((request, self.loop.now))
                    if not prefill.busy:
                        prefill._start_next()
                order.shift(prefill.name, 1)  # ends the order's iteration
                return
        if first_round:
            self.window.refused_at_first()
        if self.loop.now - request.arrival + self.retry_poll_s > self.max_wait_s:
            request.unserved = True
            self._ended(request)
            return
        self._wait(request, first=True)

    def _wait(self, request: SimRequest, first: bool) -> None:
        gateway = request.gateway
        assert gateway is not None
        self._lines[gateway].put(request, first)
        self.loop.at(self.loop.now + self.retry_poll_s, self._poll,
                     (request, request.wait_token))

    def _poll(self, entry: tuple[SimRequest, int]) -> None:
        request, token = entry
        gateway = request.gateway
        assert gateway is not None
        if self._lines[gateway].take(request, token):
            self._try(request)

    def _prefilled(self, prefill: PrefillSim, request: SimRequest) -> None:
        name = prefill.name
        gateway = request.gateway
        assert gateway is not None
        (self._orders.get(gateway) or self._order(gateway)).shift(name, -1)
        self.window.prefilled += 1  # ScenarioWindow.prefill_ended
        order = self._decode_orders.get(gateway) or self._decode_order(gateway)
        if self.multiplexing is not None:  # its KV is already where it decodes
            order.shift(name, 1)
            self.decode[name].receive(request)
        else:
            # The fewest placed on it, ties by name, as the gateway's ``_pick_decode``;
            # counted from the pick: KV still on the link counts too.
            decode = order.first()
            order.shift(decode.name, 1)
            m, tokens = self.model, request.input_len  # m.handoff_s, in place
            self.loop.at(self.loop.now + tokens * m.kv_bytes_per_token / (m.link_gb_per_s * 1e9)
                         + m.handoff_base_s + m.handoff_per_token_s * tokens,
                         decode.receive, request)
        if self.draining:
            self._settle(name)
        line = self._lines[gateway]
        if line.live:  # room on that instance: the head of the line tries again
            waiting = line.pop()
            if waiting is not None:
                self._try(waiting)

    def _finished(self, decode: DecodeSim, request: SimRequest) -> None:
        gateway = request.gateway
        assert gateway is not None
        (self._decode_orders.get(gateway) or self._decode_order(gateway)).shift(decode.name, -1)
        window = self.window
        window.answered += 1  # ScenarioWindow.answer_ended
        arrival, first_token, finished = request.arrival, request.first_token, request.finished
        assert first_token is not None and finished is not None  # it was answered
        if arrival >= window.opened:  # ScenarioWindow.latencies, in place
            window.ttft_s.append(first_token - arrival)
            window.e2e_s.append(finished - arrival)
        self.open -= 1  # _ended
        if self.ended is not None:
            self.ended.append(request)
        if self.draining:
            self._settle(decode.name)

    def _ended(self, request: SimRequest) -> None:
        self.open -= 1
        if self.ended is not None:
            self.ended.append(request)

    # ---- dynamic P/D ratio ----

    def _tick(self) -> None:
        ratio = self.ratio
        assert ratio is not None  # ticks only with a ratio (start)
        if self.open <= 0 and self.loop.now >= self.until:
            return
        self.loop.at(self.loop.now + self.ratio_interval_s, self._tick)
        if self.draining or self.loop.now - self._last_move < ratio.cooldown_s:
            return
        num_decode = len(self.active("decode"))
        floor = decode_floor(self._decode_short_at, self.loop.now, ratio)
        role = judge(self.window, len(self.active("prefill")), num_decode, ratio,
                     self.loop.now, floor)
        if role == "decode":
            self._decode_short_at = (num_decode, self.loop.now)
        if role is not None:
            self._move(role)
        elif self.loop.now - self.window.opened >= ratio.window_s:
            self.window.clear(self.loop.now)  # as RatioController._decide does

    def _move(self, role: str) -> None:
        donors = self.active("decode" if role == "prefill" else "prefill")
        name = min(donors, key=lambda n: (self._busy(n, role), n))
        self.draining[name] = role
        self._active.clear()
        self._orders.clear()
        self._decode_orders.clear()
        self.moves.append((self.loop.now, name, role))
        self._last_move = self.loop.now
        self.window.clear(self.loop.now)
        self._settle(name)

    def _busy(self, name: str, role: str) -> int:
        """In-flight work on ``name`` in the role it leaves, summed over the gateways."""
        counts = [g.decode_load if role == "prefill" else g.load for g in self.gateways]
        return sum(c[name] for c in counts)

    def _settle(self, name: str) -> None:
        """A moving instance takes its new role once its old role's work is done."""
        role = self.draining.get(name)
        if role is None:
            return
        old = self.decode[name] if role == "prefill" else self.prefill[name]
        if old.idle():  # the roles change: every kept order is rebuilt on its next use
            self.roles[name] = role
            del self.draining[name]
            self._active.clear()
            self._orders.clear()
            self._decode_orders.clear()


def summarize(requests: list[SimRequest], ttft_slo_s: float) -> dict:
    served = [r.first_token - r.arrival for r in requests
              if not r.unserved and r.first_token is not None]  # their TTFTs
    ttft = np.array(served) if served else np.zeros(1)
    met = len([t for t in served if t <= ttft_slo_s])
    return {"requests": len(requests), "served": len(served),
            "success_rate": len(served) / len(requests),
            "slo_attainment": met / len(requests),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "mean_offers": float(np.mean([r.offers for r in requests]))}


def load_trace(path: str, rate_scale: float = 1.0, limit: int | None = None,
               start_s: float = 0.0) -> list[SimRequest]:
    """Requests of a Mooncake-format trace, arrivals compressed by ``rate_scale``."""
    requests = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            arrival = row["timestamp"] / 1e3
            if arrival < start_s:
                continue
            requests.append(SimRequest((arrival - start_s) / rate_scale, row["input_length"],
                                       max(1, row["output_length"])))
            if limit is not None and len(requests) >= limit:
                break
    return requests
