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

import heapq
import itertools
import json
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.cluster.config import RatioConfig
from pdserve.cluster.gateway import DISPATCH, order_prefill
from pdserve.cluster.metrics import ScenarioWindow
from pdserve.cluster.ratio import decode_floor, judge
from pdserve.cluster.registry import Instance
from pdserve.server.pd import PrefillAdmission
from pdserve.server.protocol import APIError


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

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_per_token_s * tokens + self.prefill_per_token_sq_s * tokens ** 2

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (self.decode_base_s + self.decode_per_request_s * batch
                + self.decode_per_kv_token_s * context_tokens)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.link_gb_per_s * 1e9)

    @classmethod
    def from_engine_results(cls, path: str, kv_bytes_per_token: int,
                            **options: float) -> LatencyModel:
        """Least-squares fit to a ``bench_engine.py`` result's prefill and decode points."""
        with open(path) as f:
            measured = json.load(f)["models"][0]
        pre = measured["prefill"]
        a = np.array([[p["tokens"], p["tokens"] ** 2] for p in pre], dtype=float)
        prefill = np.linalg.lstsq(a, [p["seconds"] for p in pre], rcond=None)[0]
        dec = [d for d in measured["decode"] if "step_ms" in d]  # some points were skipped
        a = np.array([[1.0, d["batch"], d["batch"] * d["context"]] for d in dec])
        decode = np.linalg.lstsq(a, [d["step_ms"] / 1e3 for d in dec], rcond=None)[0]
        return cls(float(prefill[0]), float(max(prefill[1], 0.0)), *map(float, decode),
                   kv_bytes_per_token=kv_bytes_per_token,
                   decode_kv_tokens=int(measured.get("kv_pool_tokens", 290_000)), **options)


@dataclass
class SimRequest:
    arrival: float
    input_len: int
    output_len: int
    prefill_done: float | None = None
    first_token: float | None = None
    finished: float | None = None
    unserved: bool = False
    offers: int = 0


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


class PrefillSim:
    """One prefill instance: FCFS, one prompt at a time, with the real admission rule."""

    def __init__(self, name: str, loop: EventLoop, model: LatencyModel,
                 on_done: Callable[[PrefillSim, SimRequest], None]) -> None:
        self.instance = Instance(name, "sim", "prefill", name, name)
        self.loop, self.model, self.on_done = loop, model, on_done
        self.admission = PrefillAdmission(clock=lambda: loop.now)
        self.queue: deque[tuple[SimRequest, float]] = deque()
        self.busy = False

    def idle(self) -> bool:
        return not (self.busy or self.queue)

    def offer(self, request: SimRequest, ttft_budget_ms: float | None) -> bool:
        try:
            self.admission.admit(request.input_len, ttft_budget_ms)
        except APIError:  # the real rule refuses with a 429
            return False
        self.queue.append((request, self.loop.now))
        if not self.busy:
            self._start_next()
        return True

    def _start_next(self) -> None:
        request, arrived = self.queue.popleft()
        self.busy = True
        done = self.loop.now + self.model.prefill_s(request.input_len)
        self.loop.at(done, lambda: self._finish(request, arrived))

    def _finish(self, request: SimRequest, arrived: float) -> None:
        self.admission.done(request.input_len, request.input_len, arrived)
        # The gateway relays the first token as soon as the decode instance is asked, before
        # the KV has crossed the link (``pdserve/server/pd.py``).
        request.prefill_done = request.first_token = self.loop.now
        self.busy = False
        if self.queue:
            self._start_next()
        self.on_done(self, request)


class DecodeSim:
    """One decode instance: continuous batching within a KV pool of fixed size."""

    def __init__(self, name: str, loop: EventLoop, model: LatencyModel,
                 on_finish: Callable[[DecodeSim, SimRequest], None] | None = None,
                 max_batch: int = 256) -> None:
        self.name, self.loop, self.model, self.max_batch = name, loop, model, max_batch
        self.on_finish = on_finish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[SimRequest, int]] = []  # (request, tokens still to make)
        self.stepping = False

    def idle(self) -> bool:
        return not (self.running or self.waiting)

    def kv_in_use(self) -> int:
        return sum(r.input_len + r.output_len for r, _ in self.running)

    def receive(self, request: SimRequest) -> None:
        self.waiting.append(request)
        if not self.stepping:
            self._step()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if self.kv_in_use() + request.input_len + request.output_len > \
                    self.model.decode_kv_tokens and self.running:
                return
            self.running.append((self.waiting.popleft(), request.output_len - 1))

    def _step(self) -> None:
        self._admit()
        if not self.running:
            self.stepping = False
            return
        self.stepping = True
        context = sum(r.input_len + r.output_len - left for r, left in self.running)
        self.loop.at(self.loop.now + self.model.decode_step_s(len(self.running), context),
                     self._end_step)

    def _end_step(self) -> None:
        still, done = [], []
        for request, left in self.running:
            if left <= 1:
                request.finished = self.loop.now
                done.append(request)
            else:
                still.append((request, left - 1))
        self.running = still
        for request in done:  # after the batch shrank: the callback may find it idle
            if self.on_finish is not None:
                self.on_finish(self, request)
        self._step()


@dataclass
class GroupSim:
    """The gateway and one scenario's group, driven by a request list. Every instance can
    take either role (as a real one does); with ``ratio`` set, the real ratio controller's
    judgement (``judge``) moves one between roles every ``ratio_interval_s``, and a moved
    instance joins its new role once the work of its old one has drained."""

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

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH)}")
        names = [f"n{i}" for i in range(self.num_prefill + self.num_decode)]
        self.prefill = {n: PrefillSim(n, self.loop, self.model, self._prefilled) for n in names}
        self.decode = {n: DecodeSim(n, self.loop, self.model, self._finished) for n in names}
        self.roles = {n: "prefill" if i < self.num_prefill else "decode"
                      for i, n in enumerate(names)}
        self.draining: dict[str, str] = {}  # instance -> the role it moves to
        self.window = ScenarioWindow()
        self.moves: list[tuple[float, str, str]] = []
        self.load: Counter[str] = Counter()  # prefills in flight, by instance
        self.decode_load: Counter[str] = Counter()  # requests sent to decode, not finished
        self.line: deque[SimRequest] = deque()
        self._turn = 0
        self._open = 0  # requests not yet finished or given up on
        self._last_move = -1e9
        self._decode_short_at: tuple[int, float] | None = None  # as RatioController keeps

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        self._open = len(requests)
        for request in requests:
            self.loop.at(request.arrival, lambda r=request: self._arrive(r))
        if self.ratio is not None:
            self.loop.at(self.ratio_interval_s, self._tick)
        self.loop.run()
        return requests

    def active(self, role: str) -> list[str]:
        return [n for n, r in self.roles.items() if r == role and n not in self.draining]

    def _arrive(self, request: SimRequest) -> None:
        self.window.request_arrived()
        if self.line:  # a newcomer queues behind requests already waiting
            self._wait(request, first=False)
        else:
            self._try(request)

    def _try(self, request: SimRequest) -> None:
        self._turn += 1
        order = order_prefill([self.prefill[n].instance for n in self.active("prefill")],
                              self.dispatch, self.load, self._turn)
        first_round = request.offers == 0
        for instance in order:
            request.offers += 1
            if self.prefill[instance.instance_id].offer(request, self._budget_ms(request)):
                self.load[instance.instance_id] += 1
                return
        if first_round:
            self.window.refused_at_first()
        if self.loop.now - request.arrival + self.retry_poll_s > self.max_wait_s:
            request.unserved = True
            self._open -= 1
            return
        self._wait(request, first=True)

    def _budget_ms(self, request: SimRequest) -> float | None:
        if self.dispatch != "on-demand":
            return None
        return max(0.0, (self.ttft_slo_s - (self.loop.now - request.arrival)) * 1e3)

    def _wait(self, request: SimRequest, first: bool) -> None:
        (self.line.appendleft if first else self.line.append)(request)
        self.loop.at(self.loop.now + self.retry_poll_s, lambda: self._poll(request))

    def _poll(self, request: SimRequest) -> None:
        if request in self.line:
            self.line.remove(request)
            self._try(request)

    def _prefilled(self, prefill: PrefillSim, request: SimRequest) -> None:
        name = prefill.instance.instance_id
        self.load[name] -= 1
        self.window.prefill_ended()
        # Counted from the pick, as the gateway does: KV still on the link counts too.
        decode = self.decode[min(self.active("decode"), key=lambda n: (self.decode_load[n], n))]
        self.decode_load[decode.name] += 1
        arrive = self.loop.now + self.model.transfer_s(request.input_len)
        self.loop.at(arrive, lambda: decode.receive(request))
        self._settle(name)
        if self.line:  # room on that instance: the head of the line tries again
            self._try(self.line.popleft())

    def _finished(self, decode: DecodeSim, request: SimRequest) -> None:
        self._open -= 1
        self.decode_load[decode.name] -= 1
        self.window.answer_ended()
        self.window.latencies(request.arrival, request.first_token - request.arrival,
                              request.finished - request.arrival)
        self._settle(decode.name)

    # ---- dynamic P/D ratio ----

    def _tick(self) -> None:
        if self._open <= 0:
            return
        self.loop.at(self.loop.now + self.ratio_interval_s, self._tick)
        if self.draining or self.loop.now - self._last_move < self.ratio.cooldown_s:
            return
        num_decode = len(self.active("decode"))
        floor = decode_floor(self._decode_short_at, self.loop.now, self.ratio)
        role = judge(self.window, len(self.active("prefill")), num_decode, self.ratio,
                     self.loop.now, floor)
        if role == "decode":
            self._decode_short_at = (num_decode, self.loop.now)
        if role is not None:
            self._move(role)
        elif self.loop.now - self.window.opened >= self.ratio.window_s:
            self.window.clear(self.loop.now)  # as RatioController._decide does

    def _move(self, role: str) -> None:
        donors = self.active("decode" if role == "prefill" else "prefill")
        busy = (lambda n: self.decode_load[n]) if role == "prefill" else \
            (lambda n: self.load[n])
        name = min(donors, key=lambda n: (busy(n), n))
        self.draining[name] = role
        self.moves.append((self.loop.now, name, role))
        self._last_move = self.loop.now
        self.window.clear(self.loop.now)
        self._settle(name)

    def _settle(self, name: str) -> None:
        """A moving instance takes its new role once its old role's work is done."""
        role = self.draining.get(name)
        if role is None:
            return
        old = self.decode[name] if role == "prefill" else self.prefill[name]
        if old.idle():
            self.roles[name] = role
            del self.draining[name]


def summarize(requests: list[SimRequest], ttft_slo_s: float) -> dict:
    served = [r for r in requests if not r.unserved and r.first_token is not None]
    ttft = np.array([r.first_token - r.arrival for r in served]) if served else np.zeros(1)
    met = sum(1 for r in served if r.first_token - r.arrival <= ttft_slo_s)
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
