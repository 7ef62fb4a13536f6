"""Dynamic P/D ratio (P/D-Serve): per scenario, watch the E2E latency and the share of it
spent before the first token, and move one instance between roles when one side is short.

- TTFT takes most of E2E, or prefill instances refuse many offers: prefill is short, so the
  least busy decode instance becomes a prefill instance (if the group keeps one decode).
- TTFT is a small share and few requests were refused: decode is the bottleneck (requests
  wait for decode room, or decode slowly), so the least busy prefill instance becomes a
  decode instance (if the group keeps one prefill).

Refusals are counted per request (refused by every instance at its first offer round), not
per offer: a request waiting in line is offered again and again, and per-offer counts would
read any backlog as a prefill shortage.

One move per scenario per cooldown: a moved instance first finishes the work it has, and the
window is judged afresh after it. A move is a request in the registry; the instance itself
re-registers under its new role (every instance serves both kinds of route).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from pdserve.cluster.config import RatioConfig
from pdserve.cluster.metrics import GatewayMetrics, ScenarioWindow
from pdserve.cluster.registry import Instance, Registry

log = logging.getLogger("pdserve.ratio")


@dataclass(frozen=True)
class Move:
    scenario: str
    instance_id: str
    role: str  # the new one
    why: str


def judge(window: ScenarioWindow, num_prefill: int, num_decode: int,
          config: RatioConfig) -> str | None:
    """The role one instance should move to, or None to leave the group as it is."""
    if window.requests < config.min_requests:
        return None
    share, rejects = window.ttft_share(), window.reject_rate()
    if (share > config.ttft_share_high or rejects > config.reject_rate_high) and num_decode > 1:
        return "prefill"
    if share < config.ttft_share_low and rejects < config.reject_rate_low and num_prefill > 1:
        return "decode"
    return None


class RatioController:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, load: dict[str, Counter],
                 config: RatioConfig | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.load = load  # role -> in-flight work by instance id, as the gateway counts it
        self.config = config or RatioConfig()
        self._last_move: dict[str, float] = {}

    def tick(self) -> list[Move]:
        """Looks at every scenario once; requests and returns the moves it decided."""
        moves = []
        for scenario in self.registry.scenarios():
            move = self._decide(scenario)
            if move is not None:
                self._apply(move)
                moves.append(move)
        return moves

    def _decide(self, scenario: str) -> Move | None:
        if time.monotonic() - self._last_move.get(scenario, -1e9) < self.config.cooldown_s:
            return None
        prefill = self.registry.instances(scenario, "prefill")
        decode = self.registry.instances(scenario, "decode")
        window = self.metrics.window(scenario)
        role = judge(window, len(prefill), len(decode), self.config)
        if role is None:
            return None
        donors = decode if role == "prefill" else prefill
        donor = min(donors, key=lambda i: (self._busy(i), i.instance_id))
        why = (f"TTFT share {window.ttft_share():.2f}, {window.reject_rate():.0%} of "
               f"{window.requests} requests refused at first")
        return Move(scenario, donor.instance_id, role, why)

    def _busy(self, instance: Instance) -> int:
        return self.load.get(instance.role, Counter())[instance.instance_id]

    def _apply(self, move: Move) -> None:
        log.info("moving %s to %s in scenario %s (%s)", move.instance_id, move.role,
                 move.scenario, move.why)
        self.registry.request_role(move.instance_id, move.role)
        self.metrics.moves.labels(move.scenario, move.role).inc()
        self.metrics.window(move.scenario).clear()
        self._last_move[move.scenario] = time.monotonic()

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a registry hiccup must not stop the loop
                log.exception("ratio controller tick failed")
