"""What the gateway measures: per scenario, latencies and refusals as Prometheus series, and
a rolling window of the same that the ratio controller judges."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

WINDOW = 512  # latest requests per scenario the ratio controller looks at

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


@dataclass
class ScenarioWindow:
    """The latest answered requests of one scenario and the refusals seen meanwhile."""

    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    rejections: int = 0  # requests that every prefill instance refused at first
    requests: int = 0

    def ttft_share(self) -> float:
        total = sum(self.e2e_s)
        return sum(self.ttft_s) / total if total > 0 else 0.0

    def reject_rate(self) -> float:
        return self.rejections / self.requests if self.requests else 0.0

    def clear(self) -> None:
        self.ttft_s.clear()
        self.e2e_s.clear()
        self.rejections = self.requests = 0


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
        self.moves = Counter("pdserve_gateway_role_moves", "Instances the ratio controller "
                             "moved, by scenario and new role.", ["scenario", "role"],
                             registry=r)

    def window(self, scenario: str) -> ScenarioWindow:
        return self.windows.setdefault(scenario, ScenarioWindow())

    def prefilled(self, scenario: str, seconds: float) -> None:
        self.prefill.labels(scenario).observe(seconds)

    def answered(self, scenario: str, status: int, ttft_s: float, e2e_s: float) -> None:
        self.requests.labels(scenario, str(status)).inc()
        if status != 200:
            return
        self.ttft.labels(scenario).observe(ttft_s)
        self.e2e.labels(scenario).observe(e2e_s)
        window = self.window(scenario)
        window.ttft_s.append(ttft_s)
        window.e2e_s.append(e2e_s)
        window.requests += 1

    def count_rejection(self, instance_id: str) -> None:
        self.rejections.labels(instance_id).inc()

    def count_refused_request(self, scenario: str) -> None:
        """A request no prefill instance took at its first offer round (it had to wait)."""
        self.window(scenario).rejections += 1

    def count_unserved(self, scenario: str) -> None:
        self.unserved.labels(scenario).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
