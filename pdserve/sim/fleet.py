"""A fleet of P/D groups behind several gateways: the group simulator of ``cluster.py``
(one ``GroupSim`` per scenario, all on one event loop) fed by tidal traffic.

Each scenario's request rate rises and falls over ``period_s`` on its own phase, between
``trough`` and 1 times its peak; its prompts and answers are lengths drawn from a trace
(the Mooncake conversation trace's, say), scaled by the scenario's own factors. Each
request enters through a gateway picked at random. Arrivals are drawn a minute at a time,
vectorised, and only the next one sits in the event heap.

``pooled=True`` puts every instance in one group that serves all scenarios (the baseline
P/D-Serve compares per-scenario groups with); ``multiplexing`` makes every instance a
PD-multiplexing one (it prefills and decodes, ``cluster.Multiplexing``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.cluster.config import RatioConfig
from pdserve.sim.cluster import (
    EventLoop,
    GatewaySim,
    GroupSim,
    LatencyModel,
    Multiplexing,
    SimRequest,
)

CHUNK_S = 60.0  # arrivals are drawn this much simulated time at once
COUNT_S = 1.0  # the tally counts the requests that ended this often


@dataclass(frozen=True)
class Scenario:
    name: str
    num_prefill: int
    num_decode: int
    peak_rate: float  # requests/s at the top of the tide
    phase_s: float  # when in the period the tide peaks
    input_scale: float
    output_scale: float

    def rate(self, t: np.ndarray, period_s: float, trough: float) -> np.ndarray:
        tide = 0.5 * (1 + np.cos(2 * math.pi * (t - self.phase_s) / period_s))
        return self.peak_rate * (trough + (1 - trough) * tide)


@dataclass(frozen=True)
class Lengths:
    """Prompt and answer lengths to draw from (pairs kept together, as in the trace)."""

    inputs: np.ndarray
    outputs: np.ndarray

    @classmethod
    def from_trace(cls, path: str) -> Lengths:
        import json

        rows = [json.loads(line) for line in open(path)]
        return cls(np.array([r["input_length"] for r in rows]),
                   np.array([max(1, r["output_length"]) for r in rows]))

    def draw(self, rng: np.random.Generator, n: int, scenario: Scenario,
             max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        pick = rng.integers(0, len(self.inputs), n)
        inputs = np.maximum(1, (self.inputs[pick] * scenario.input_scale).astype(np.int64))
        outputs = np.maximum(1, (self.outputs[pick] * scenario.output_scale).astype(np.int64))
        # A request longer than a decode instance's KV pool could never be served.
        inputs = np.minimum(inputs, max_tokens // 2)
        return inputs, np.minimum(outputs, max_tokens - inputs)


@dataclass(frozen=True)
class FleetPlan:
    scenarios: list[Scenario]
    period_s: float = 3600.0
    trough: float = 0.3


def plan_fleet(model: LatencyModel, lengths: Lengths, num_instances: int, num_scenarios: int,
               peak_load: float = 0.8, prefill_share: float | None = None,
               period_s: float = 3600.0, seed: int = 0) -> FleetPlan:
    """Scenarios of random size, length scales and phase; each group sized so that at its
    peak its prefill side is ``peak_load`` busy. Its P/D split is what its lengths need
    (``ideal_prefill_share``), or ``prefill_share`` for every group (one fleet-wide ratio,
    as deployed without per-scenario knowledge: the dynamic ratio's starting point)."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 0.6, num_scenarios)
    sizes = np.maximum(4, np.floor(weights / weights.sum() * num_instances)).astype(int)
    sizes[np.argmax(sizes)] += num_instances - sizes.sum()
    scenarios = []
    for i, size in enumerate(sizes):
        draft = Scenario(f"s{i:03d}", 0, 0, 0.0, float(rng.uniform(0, period_s)),
                         float(rng.choice([0.25, 0.5, 1.0, 2.0])),
                         float(rng.choice([0.5, 1.0, 2.0])))
        scenarios.append(_size(draft, int(size), model, lengths, peak_load, prefill_share))
    return FleetPlan(scenarios, period_s)


def _size(draft: Scenario, size: int, model: LatencyModel, lengths: Lengths,
          peak_load: float, prefill_share: float | None) -> Scenario:
    sample = lengths.draw(np.random.default_rng(1), 2000, draft, model.decode_kv_tokens)
    prefill_s = float(np.mean([model.prefill_s(int(n)) for n in sample[0]]))
    ideal = _split(size, ideal_prefill_share(model, *sample))
    # The load follows the group's size alone: a fleet-wide split starts the same traffic
    # on other roles.
    num_prefill = ideal if prefill_share is None else _split(size, prefill_share)
    peak = peak_load * ideal / prefill_s
    return Scenario(draft.name, num_prefill, size - num_prefill, peak, draft.phase_s,
                    draft.input_scale, draft.output_scale)


def _split(size: int, prefill_share: float) -> int:
    return min(size - 1, max(1, round(size * prefill_share)))


def ideal_prefill_share(model: LatencyModel, inputs: np.ndarray, outputs: np.ndarray) -> float:
    """Share of instances prefill needs so both sides keep up at the same rate: prefill
    seconds per request against a full decode batch's requests per second."""
    prefill_s = float(np.mean([model.prefill_s(int(n)) for n in inputs]))
    per_request = float(np.mean(inputs + outputs))
    batch = max(1, min(256, int(model.decode_kv_tokens / per_request)))
    context = batch * float(np.mean(inputs + outputs / 2))
    step = model.decode_step_s(batch, int(context))
    decode_s = float(np.mean(outputs)) * step / batch  # instance-seconds per request
    return prefill_s / (prefill_s + decode_s)


class Tally:
    """What the fleet's requests came to, kept as counts and flat arrays (millions of
    requests: none is kept past the count after it ended). Groups append each request that
    ended to ``ended``; ``count`` takes them all at once with numpy (``FleetSim`` calls it
    every simulated second): a Python call per request cost more."""

    def __init__(self, num_scenarios: int, slo_s: float, bin_s: float = 60.0) -> None:
        self.slo_s, self.bin_s = slo_s, bin_s
        self.ended: list[SimRequest] = []
        self.requests = np.zeros(num_scenarios, np.int64)
        self.met = np.zeros(num_scenarios, np.int64)
        self.unserved = np.zeros(num_scenarios, np.int64)
        self._ttft_s: list[np.ndarray] = []  # float32 pieces, as answers came
        self._tpot_s: list[np.ndarray] = []
        self.minute_requests = np.zeros(0, np.int64)  # by minute of arrival
        self.minute_met = np.zeros(0, np.int64)

    def count(self) -> None:
        """Counts the requests in ``ended`` and empties it."""
        ended = self.ended
        if not ended:
            return
        # A list of each field, then an array of it: cheaper than an array of rows.
        gave_up = [r for r in ended if r.unserved]
        answered = [r for r in ended if not r.unserved] if gave_up else ended
        scenario = np.array([r.scenario for r in answered], np.int64)
        arrival = np.array([r.arrival for r in answered], np.float64)
        first = np.array([r.first_token for r in answered], np.float64)
        finished = np.array([r.finished for r in answered], np.float64)
        output_len = np.array([r.output_len for r in answered], np.int64)
        ttft = first - arrival
        self._ttft_s.append(ttft.astype(np.float32))
        long = output_len > 1
        self._tpot_s.append(((finished[long] - first[long]) / (output_len[long] - 1))
                            .astype(np.float32))
        met = ttft <= self.slo_s
        size = len(self.requests)
        self.met += np.bincount(scenario[met], minlength=size)
        given_up = np.array([r.scenario for r in gave_up], np.int64)
        self.unserved += np.bincount(given_up, minlength=size)
        self.requests += np.bincount(np.concatenate((scenario, given_up)), minlength=size)
        arrivals = np.concatenate((arrival, np.array([r.arrival for r in gave_up], np.float64)))
        minute = (arrivals // self.bin_s).astype(np.int64)
        size = max(len(self.minute_requests), int(minute.max()) + 1)
        self.minute_requests = _added(self.minute_requests, minute, size)
        self.minute_met = _added(self.minute_met, minute[:len(answered)][met], size)
        ended.clear()

    def summary(self) -> dict:
        self.count()
        ttft, tpot = _joined(self._ttft_s), _joined(self._tpot_s)
        requests, met = self.requests, self.met
        total = int(requests.sum())
        per_scenario = met / np.maximum(1, requests)
        by_minute = [[m, int(n), int(k)] for m, (n, k) in
                     enumerate(zip(self.minute_requests, self.minute_met, strict=True)) if n]
        return {"requests": total, "slo_attainment": float(met.sum() / max(1, total)),
                "unserved": int(self.unserved.sum()),
                "worst_scenario_attainment": float(per_scenario.min()),
                "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
                "tpot_p50_s": _percentile(tpot, 50), "tpot_p99_s": _percentile(tpot, 99),
                "by_minute": by_minute}


def _added(counts: np.ndarray, index: np.ndarray, size: int) -> np.ndarray:
    """``counts`` grown to ``size``, plus one at each of ``index``."""
    grown = np.zeros(size, np.int64)
    grown[:len(counts)] = counts
    return grown + np.bincount(index, minlength=size)


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


class FleetSim:
    """Every scenario's group (or one pool) on one event loop behind ``num_gateways``."""

    def __init__(self, plan: FleetPlan, model: LatencyModel, lengths: Lengths, *,
                 dispatch: str = "on-demand", ttft_slo_s: float = 5.0,
                 max_wait_s: float = 60.0, num_gateways: int = 4,
                 ratio: RatioConfig | None = None, pooled: bool = False,
                 multiplexing: Multiplexing | None = None, seed: int = 0) -> None:
        self.plan, self.model, self.lengths = plan, model, lengths
        self.multiplexing = multiplexing  # every instance's model, or None: pure P/D
        self.loop = EventLoop()
        self.gateways = [GatewaySim(f"g{i}") for i in range(num_gateways)]
        self.tally = Tally(len(plan.scenarios), ttft_slo_s)
        self.rng = np.random.default_rng(seed)
        options: dict[str, Any] = dict(
            dispatch=dispatch, ttft_slo_s=ttft_slo_s, max_wait_s=max_wait_s, ratio=ratio,
            loop=self.loop, gateways=self.gateways, ended=self.tally.ended,
            multiplexing=multiplexing)
        if pooled:
            pool = GroupSim(model, sum(s.num_prefill for s in plan.scenarios),
                            sum(s.num_decode for s in plan.scenarios), name="pool", **options)
            self.groups = [pool] * len(plan.scenarios)
        else:
            self.groups = [GroupSim(model, s.num_prefill, s.num_decode, name=s.name, **options)
                           for s in plan.scenarios]
        self._pending: list[tuple[float, int, int, int, int]] = []
        self._next = 0

    @property
    def num_instances(self) -> int:
        return sum(s.num_prefill + s.num_decode for s in self.plan.scenarios)

    def run(self, duration_s: float) -> dict:
        self.begin(duration_s)
        self.loop.run()
        return self.tally.summary()

    def begin(self, duration_s: float) -> None:
        """Before the loop runs: requests come for ``duration_s``."""
        for group in self.distinct_groups():
            group.start(duration_s)
        self._duration = duration_s
        self._draw(0.0)
        # Mid-second: a window of whole simulated seconds holds as many counts as seconds.
        self.loop.at(COUNT_S / 2, self._count)

    def _count(self) -> None:
        """Counts the requests ended meanwhile, again a second later while requests come
        (``Tally.summary`` counts the rest)."""
        self.tally.count()
        if self.loop.now + COUNT_S < self._duration:
            self.loop.at(self.loop.now + COUNT_S, self._count)

    def distinct_groups(self) -> list[GroupSim]:
        """Each group once (a pool stands for every scenario)."""
        return list({id(g): g for g in self.groups}.values())

    def arrived(self) -> int:
        """Requests that have come so far: those ended and those still in their groups."""
        return (int(self.tally.requests.sum()) + len(self.tally.ended)
                + sum(g.open for g in self.distinct_groups()))

    def _draw(self, start: float) -> None:
        """Arrivals of every scenario in [start, start + CHUNK_S), in time order."""
        end = min(start + CHUNK_S, self._duration)
        pieces: list[np.ndarray] = []
        scenarios, inputs, outputs = [], [], []
        for index, scenario in enumerate(self.plan.scenarios):
            t = self._poisson(scenario, start, end)
            ins, outs = self.lengths.draw(self.rng, len(t), scenario, self.model.decode_kv_tokens)
            pieces.append(t)
            inputs.append(ins)
            outputs.append(outs)
            scenarios.append(np.full(len(t), index))
        times = np.concatenate(pieces)
        order = np.argsort(times, kind="stable")
        gateways = self.rng.integers(0, len(self.gateways), len(times))
        columns: list[np.ndarray] = [times, np.concatenate(scenarios), np.concatenate(inputs),
                                     np.concatenate(outputs)]
        self._pending = list(zip(*(c[order].tolist() for c in columns), gateways.tolist(),
                                 strict=True))
        self._next = 0
        if end < self._duration:
            self.loop.at(end, self._draw, end)
        self._schedule_next()

    def _poisson(self, scenario: Scenario, start: float, end: float) -> np.ndarray:
        """A Poisson process of the scenario's tidal rate, by thinning one at its peak."""
        n = self.rng.poisson(scenario.peak_rate * (end - start))
        t = np.sort(self.rng.uniform(start, end, n))
        rate = scenario.rate(t, self.plan.period_s, self.plan.trough)
        return t[self.rng.random(n) * scenario.peak_rate < rate]

    def _schedule_next(self) -> None:
        if self._next < len(self._pending):
            self.loop.feed(self._pending[self._next][0], self._arrive)

    def _arrive(self) -> float:
        """The next arrival comes in; returns when the one after it comes (the loop's feed)."""
        pending, i = self._pending, self._next
        arrival, scenario, input_len, output_len, gateway = pending[i]
        self._next = i = i + 1
        # Every field by position: keywords would build a dict per request (a class's call
        # takes them through C).
        request = SimRequest(arrival, input_len, output_len, None, None, None, False, 0,
                             self.gateways[gateway], 0, scenario)
        self.groups[scenario].arrive(request)
        return pending[i][0] if i < len(pending) else math.inf
