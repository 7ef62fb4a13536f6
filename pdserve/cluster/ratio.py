"""Dynamic P/D ratio (P/D-Serve): per scenario, judge current pressure on each side and move
one instance between roles when exactly one side is short.

The controller judges a window that opens at every move (and restarts every ``window_s``):
how many requests arrived, how many of those every prefill instance refused at their first
offer round, how many went through prefill, how many answers ended.

- Prefill is short when more than ``reject_rate_high`` of the window's requests were refused
  at their first offer round (or, with blind dispatch, TTFT takes most of E2E for requests
  that arrived in the window) and its backlog is not draining: prefill got through no more
  than about as many requests as arrived. The least busy decode instance becomes a prefill
  instance, if decode is neither short nor still draining a backlog of its own, and keeps
  ``decode_floor`` instances.
- Decode is short when its backlog grows: it answered clearly fewer requests than were handed
  to it (judged over at least ``decode_window_s``). The least busy prefill instance becomes a
  decode instance, if prefill is not short.

Why not the TTFT share of answered requests, as before: it lags. Requests that queued during
a prefill shortage keep it high for minutes after prefill has enough instances, so the
controller went on moving decode instances to prefill until decode starved (in the
simulation, from 1P8D to 8P1D and a median E2E of ~250 s). Refusals of new requests and the
two backlogs' growth answer for now. Refusals are counted per request, not per offer: a
request waiting in line is offered again and again.

A move is a request in the registry; the instance itself re-registers under its new role
(every instance serves both kinds of route) and first finishes the work it has.
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


def judge(window: ScenarioWindow, num_prefill: int, num_decode: int, config: RatioConfig,
          now: float, min_decode: int = 1) -> str | None:
    """The role one instance should move to, or None to leave the group as it is: a pure
    function of the window (since the last move or restart), its age, the group and the
    fewest decode instances a move may leave (``decode_floor``)."""
    age = now - window.opened
    if window.arrived < config.min_requests or age < config.cooldown_s:
        return None
    prefill_short = prefill_is_short(window, config)
    decode_short = age >= config.decode_window_s and decode_is_short(window, config)
    decode_draining = window.decode_shortfall() < -config.drain * window.prefilled
    if (prefill_short and not decode_short and not decode_draining
            and num_decode > max(1, min_decode)):
        return "prefill"
    if decode_short and not prefill_short and num_prefill > 1:
        return "decode"
    return None


def prefill_is_short(window: ScenarioWindow, config: RatioConfig) -> bool:
    """Requests arriving now are refused (or wait long for their first token), and prefill
    did not get through as many requests as arrived: its backlog is not draining."""
    if window.prefill_shortfall() < -config.drain * window.prefilled:
        return False  # its backlog drains: it has the instances it needs
    return (window.reject_rate() > config.reject_rate_high
            or (len(window.e2e_s) >= config.min_requests
                and window.ttft_share() > config.ttft_share_high))


def decode_is_short(window: ScenarioWindow, config: RatioConfig) -> bool:
    """Decode answered clearly fewer requests than were handed to it: its backlog grows."""
    return window.decode_shortfall() > config.decode_growth_high * window.prefilled


def decode_floor(decode_short_at: tuple[int, float] | None, now: float,
                 config: RatioConfig) -> int:
    """Fewest decode instances a move to prefill may leave: one more than decode had when it
    was last found short, for ``memory_s`` after that. A decode side too small starves (its
    backlog grows without bound) and a burst of prefill refusals cannot tell that."""
    if decode_short_at is None or now - decode_short_at[1] >= config.memory_s:
        return 1
    return decode_short_at[0] + 1


def explain(window: ScenarioWindow, now: float) -> str:
    return (f"over {now - window.opened:.0f} s: {window.arrived} requests, "
            f"{window.reject_rate():.0%} refused at first, prefill shortfall "
            f"{window.prefill_shortfall()}, decode shortfall {window.decode_shortfall()} of "
            f"{window.prefilled}, TTFT share {window.ttft_share():.2f}")


class RatioController:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, load: dict[str, Counter],
                 config: RatioConfig | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.load = load  # role -> in-flight work by instance id, as the gateway counts it
        self.config = config or RatioConfig()
        self._last_move: dict[str, float] = {}
        self._decode_short_at: dict[str, tuple[int, float]] = {}  # decode size, when

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
        now = time.monotonic()
        if now - self._last_move.get(scenario, -1e9) < self.config.cooldown_s:
            return None
        prefill = self.registry.instances(scenario, "prefill")
        decode = self.registry.instances(scenario, "decode")
        window = self.metrics.window(scenario)
        floor = decode_floor(self._decode_short_at.get(scenario), now, self.config)
        role = judge(window, len(prefill), len(decode), self.config, now, floor)
        if role is None:
            if now - window.opened >= self.config.window_s:
                window.clear(now)  # stays current: judges the latest window_s at most
            return None
        if role == "decode":
            self._decode_short_at[scenario] = (len(decode), now)
        donors = decode if role == "prefill" else prefill
        donor = min(donors, key=lambda i: (self._busy(i), i.instance_id))
        return Move(scenario, donor.instance_id, role, explain(window, now))

    def _busy(self, instance: Instance) -> int:
        return self.load.get(instance.role, Counter())[instance.instance_id]

    def _apply(self, move: Move) -> None:
        log.info("moving %s to %s in scenario %s (%s)", move.instance_id, move.role,
                 move.scenario, move.why)
        self.registry.request_role(move.instance_id, move.role)
        self.metrics.moves.labels(move.scenario, move.role).inc()
        now = time.monotonic()
        self.metrics.window(move.scenario).clear(now)
        self._last_move[move.scenario] = now

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a registry hiccup must not stop the loop
                log.exception("ratio controller tick failed")
