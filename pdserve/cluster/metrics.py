"""What the gateway measures: per scenario, latencies and refusals as Prometheus series, and
a window of the same since the ratio controller's last move (or restart), which it judges."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

WINDOW = 512  # latest requests per scenario the ratio controller looks at

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


@dataclass
class ScenarioWindow:
    """What one scenario's group did since the window opened (the last move, or the last
    restart): the ratio controller judges current pressure from it, not history.

    Counts follow requests through the two sides: how many arrived, how many of those every
    prefill instance refused at their first offer round, how many prefills ended and were
    handed to decode, how many answers ended. Latencies are kept only for requests that
    arrived after the window opened: requests that queued before a move would still show
    the shortage the move relieved."""

    opened: float = 0.0  # when the window opened, on the recorder's clock
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    arrived: int = 0  # requests that came in (each is offered to the prefill instances)
    rejections: int = 0  # requests that every prefill instance refused at their first round
    prefilled: int = 0  # prefills that ended and went on to decode
    answered: int = 0  # answers that ended (any status)

    def ttft_share(self) -> float:
        total = sum(self.e2e_s)
        return sum(self.ttft_s) / total if total > 0 else 0.0

    def reject_rate(self) -> float:
        """Share of the window's requests that no prefill instance took at their first offer
        round. Per request, not per offer: a waiting request is offered again and again."""
        return self.rejections / self.arrived if self.arrived else 0.0

    def prefill_shortfall(self) -> int:
        """Requests that arrived but did not get through prefill in the window: the prefill
        backlog's growth plus the requests given up on. Negative while a backlog drains."""
        return self.arrived - self.prefilled

    def decode_shortfall(self) -> int:
        """Requests handed to decode but not answered in the window: the decode backlog's
        growth (negative while it drains)."""
        return self.prefilled - self.answered

    # ---- what the gateway (or the simulator) records ----

    def request_arrived(self) -> None:
        self.arrived += 1

    def refused_at_first(self) -> None:
        """A request no prefill instance took at its first offer round (it had to wait)."""
        self.rejections += 1

    def prefill_ended(self) -> None:
        """A request's prefill ended and it goes on to decode."""
        self.prefilled += 1

    def request_withdrawn(self) -> None:
        """A request that came in turned out malformed (an instance answered 400): it says
        nothing about load."""
        self.arrived = max(0, self.arrived - 1)

    def answer_ended(self) -> None:
        """An answer ended, whatever its status."""
        self.answered += 1

    def latencies(self, arrived_at: float, ttft_s: float, e2e_s: float) -> None:
        """A successful answer's latencies, kept if it arrived after the window opened."""
        if arrived_at >= self.opened:
            self.ttft_s.append(ttft_s)
            self.e2e_s.append(e2e_s)

    def clear(self, now: float) -> None:
        """Opens a fresh window at ``now``."""
        self.opened = now
        self.ttft_s.clear()
        self.e2e_s.clear()
        self.arrived = self.rejections = self.prefilled = self.answered = 0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.windows: dict[str, ScenarioWindow] = {}
        self.ttft = Histogram("pdserve_gateway_time_to_first_token_seconds",
                              "Gateway arrival to the first byte of the answer.", ["scenario"],
                              buckets=_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve_gateway_prefill_seconds",
                                 "Gateway arrival to a prefill instance's first token "
                                 "(refusals and retries included).", ["scenario"],
                                 buckets=_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_gateway_e2e_request_latency_seconds",
                             "Gateway arrival to the answer's last byte.", ["scenario"],
                             buckets=_BUCKETS, registry=r)
        self.requests = Counter("pdserve_gateway_requests", "Answered requests by status.",
                                ["scenario", "status"], registry=r)
        self.rejections = Counter("pdserve_gateway_prefill_rejections", "Offers a prefill "
                                  "instance refused (it could not start them in time).",
                                  ["instance"], registry=r)
        self.unserved = Counter("pdserve_gateway_unserved", "Requests every prefill instance "
                                "refused until max_wait_s (answered 503).", ["scenario"],
                                registry=r)
        self.retries = Counter("pdserve_gateway_retries", "Attempts that failed on an "
                               "instance and went to another one, by what was retried.",
                               ["scenario", "stage"], registry=r)
        self.local_prefills = Counter(
            "pdserve_gateway_local_prefills", "Requests every prefill instance refused that a "
            "multiplexing decode instance prefilled itself (no KV transfer).", ["scenario"],
            registry=r)
        self.moves = Counter("pdserve_gateway_role_moves", "Instances the ratio controller "
                             "moved, by scenario and new role.", ["scenario", "role"],
                             registry=r)

    def window(self, scenario: str) -> ScenarioWindow:
        window = self.windows.get(scenario)
        if window is None:
            window = self.windows[scenario] = ScenarioWindow(opened=time.monotonic())
        return window

    def arrived(self, scenario: str) -> None:
        self.window(scenario).request_arrived()

    def withdrawn(self, scenario: str) -> None:
        self.window(scenario).request_withdrawn()

    def prefilled(self, scenario: str, seconds: float) -> None:
        """A request's prefill ended, ``seconds`` after its arrival; it goes on to decode."""
        self.prefill.labels(scenario).observe(seconds)
        self.window(scenario).prefill_ended()

    def decode_ended(self, scenario: str) -> None:
        """The answer of a request handed to decode ended (relayed, or failed)."""
        self.window(scenario).answer_ended()

    def answered(self, scenario: str, status: int, ttft_s: float, e2e_s: float,
                 arrived_at: float) -> None:
        """An answer relayed to its end; ``arrived_at`` is the request's arrival on the clock
        the ratio windows open on (``time.monotonic``)."""
        self.requests.labels(scenario, str(status)).inc()
        if status != 200:
            return
        self.ttft.labels(scenario).observe(ttft_s)
        self.e2e.labels(scenario).observe(e2e_s)
        self.window(scenario).latencies(arrived_at, ttft_s, e2e_s)

    def count_rejection(self, instance_id: str) -> None:
        self.rejections.labels(instance_id).inc()

    def count_refused_request(self, scenario: str) -> None:
        """A request no prefill instance took at its first offer round (it had to wait)."""
        self.window(scenario).refused_at_first()

    def count_local_prefill(self, scenario: str) -> None:
        self.local_prefills.labels(scenario).inc()

    def count_retry(self, scenario: str, stage: str) -> None:
        """An instance failed a request: ``stage`` is "prefill" (nothing sent yet, offered
        afresh) or "resume" (part of the answer was out; it resumes elsewhere)."""
        self.retries.labels(scenario, stage).inc()

    def count_unserved(self, scenario: str) -> None:
        self.unserved.labels(scenario).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
