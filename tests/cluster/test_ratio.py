"""The dynamic P/D ratio's decisions on hand-made windows (current pressure, not the lagging
latencies of requests answered late), and moves carried out through a registry."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pdserve.cluster.config import RatioConfig
from pdserve.cluster.metrics import GatewayMetrics, ScenarioWindow
from pdserve.cluster.ratio import RatioController, decode_floor, judge
from pdserve.cluster.registry import Instance, MemoryRegistry
from pdserve.server.admission import PrefillAdmission
from pdserve.server.protocol import APIError

CONFIG = RatioConfig(min_requests=10, cooldown_s=20, decode_window_s=60)
NOW = 90.0  # the windows below opened at 0: old enough to judge both sides


def _window(arrived: int = 100, refused: int = 0, prefilled: int | None = None,
            answered: int | None = None, ttft_s: float = 1.0, e2e_s: float = 10.0,
            latencies: int = 20) -> ScenarioWindow:
    """A window opened at 0; by default prefill and decode keep up exactly."""
    window = ScenarioWindow(opened=0.0)
    window.arrived, window.rejections = arrived, refused
    window.prefilled = arrived if prefilled is None else prefilled
    window.answered = window.prefilled if answered is None else answered
    for _ in range(latencies):
        window.latencies(arrived_at=1.0, ttft_s=ttft_s, e2e_s=e2e_s)
    return window


@pytest.mark.parametrize("window, prefill, decode, expected", [
    # prefill: new requests refused, and its backlog is not draining
    (_window(refused=30), 1, 2, "prefill"),
    (_window(refused=30), 1, 1, None),  # ... but the last decode instance stays
    (_window(refused=30, prefilled=80), 1, 2, "prefill"),  # its backlog grows
    # A backlog from before drains (prefill got through 30% more than arrived): requests
    # are refused only because they queue behind it. The old judge moved on here.
    (_window(refused=30, prefilled=130), 1, 2, None),
    # TTFT share high (requests that queued in a shortage), no refusals, backlog draining:
    # the old judge read this as a prefill shortage (TTFT 75% of E2E) and overshot.
    (_window(ttft_s=3.0, e2e_s=4.0, prefilled=120), 1, 2, None),
    # ... while it is not draining, a high TTFT share is prefill's signal (blind dispatch
    # refuses nothing)
    (_window(ttft_s=3.0, e2e_s=4.0), 1, 2, "prefill"),
    # decode: its backlog grows (answered 60 of the 100 handed to it)
    (_window(answered=60), 2, 1, "decode"),
    (_window(answered=60), 1, 1, None),  # ... but the last prefill instance stays
    (_window(answered=60, refused=30), 2, 2, None),  # both short: no move helps
    # decode is draining a backlog of its own: it gives nothing to prefill
    (_window(refused=30, answered=130), 1, 3, None),
    # a low TTFT share alone is no decode shortage (the old judge moved to decode here)
    (_window(ttft_s=0.2, e2e_s=4.0), 2, 1, None),
    (_window(refused=4), 2, 2, None),  # balanced
    (_window(arrived=5, refused=5), 1, 2, None),  # too few requests to judge
])
def test_judge(window, prefill, decode, expected):
    assert judge(window, prefill, decode, CONFIG, NOW) == expected


def test_judge_waits_for_a_window_old_enough():
    assert judge(_window(refused=30), 1, 2, CONFIG, now=10.0) is None  # < cooldown_s
    # Decode's backlog fills for about a request's decode time after any change: growth over
    # a young window is no shortage.
    assert judge(_window(answered=60), 2, 1, CONFIG, now=30.0) is None
    assert judge(_window(answered=60), 2, 1, CONFIG, now=60.0) == "decode"


def test_decode_floor_keeps_decode_above_the_size_found_short():
    window = _window(refused=30)
    assert judge(window, 7, 2, CONFIG, NOW, min_decode=2) is None
    assert judge(window, 6, 3, CONFIG, NOW, min_decode=2) == "prefill"
    config = RatioConfig(memory_s=600)
    assert decode_floor(None, 100.0, config) == 1
    assert decode_floor((1, 100.0), 650.0, config) == 2  # found short with 1, 550 s ago
    assert decode_floor((1, 100.0), 700.0, config) == 1  # forgotten


def test_window_counts_per_request_and_keeps_only_new_latencies():
    window = ScenarioWindow(opened=0.0)
    window.clear(now=100.0)
    for _ in range(4):
        window.request_arrived()
    window.refused_at_first()
    window.prefill_ended()
    window.answer_ended()
    window.latencies(arrived_at=90.0, ttft_s=30.0, e2e_s=31.0)  # queued before the window
    window.latencies(arrived_at=101.0, ttft_s=1.0, e2e_s=4.0)
    assert window.reject_rate() == 0.25
    assert (window.prefill_shortfall(), window.decode_shortfall()) == (3, 0)
    assert window.ttft_share() == 0.25
    window.clear(now=200.0)
    assert (window.arrived, window.rejections, window.prefilled, window.answered) == (0,) * 4
    assert window.opened == 200.0 and not window.e2e_s


def _group(registry: MemoryRegistry, prefill: int, decode: int) -> None:
    for i in range(prefill + decode):
        role = "prefill" if i < prefill else "decode"
        registry.register(Instance(f"i{i}", "chat", role, f"h:{i}", f"h:{100 + i}"))


def _traffic(metrics: GatewayMetrics, requests: int, refused: int = 0, answered: int | None = None,
             age_s: float = 100.0) -> None:
    """What the gateway records for ``requests`` requests, into a window ``age_s`` old."""
    window = metrics.window("chat")
    window.clear(time.monotonic() - age_s)
    for i in range(requests):
        metrics.arrived("chat")
        if i < refused:
            metrics.count_refused_request("chat")
        metrics.prefilled("chat", 1.0)
    for _ in range(requests if answered is None else answered):
        metrics.decode_ended("chat")
        metrics.answered("chat", 200, 1.0, 10.0, arrived_at=time.monotonic())


def test_controller_moves_the_least_busy_decode_instance_and_cools_down():
    registry, metrics = MemoryRegistry(), GatewayMetrics()
    _group(registry, 1, 3)
    for instance_id in ("i1", "i2", "i3"):  # an instance follows requests by re-registering
        registry.watch_role_requests(instance_id, _follower(registry, instance_id))
    decode_load = Counter({"i1": 4, "i2": 0, "i3": 2})
    controller = RatioController(registry, metrics, {"decode": decode_load}, CONFIG)
    _traffic(metrics, 40, refused=20)
    (move,) = controller.tick()
    assert (move.instance_id, move.role) == ("i2", "prefill")
    assert "50% refused at first" in move.why
    assert [i.instance_id for i in registry.instances("chat", "prefill")] == ["i0", "i2"]
    assert metrics.window("chat").arrived == 0  # the window restarted after the move
    for _ in range(40):
        metrics.arrived("chat")
        metrics.count_refused_request("chat")
    assert controller.tick() == []  # cooling down: the new window is too young


def test_controller_keeps_decode_it_found_short():
    registry, metrics = MemoryRegistry(), GatewayMetrics()
    _group(registry, 2, 2)
    for instance_id in ("i0", "i1", "i2", "i3"):
        registry.watch_role_requests(instance_id, _follower(registry, instance_id))
    config = RatioConfig(min_requests=10, cooldown_s=0, decode_window_s=0)
    controller = RatioController(registry, metrics, {}, config)
    _traffic(metrics, 40, answered=20)  # decode answers half of what it gets
    (move,) = controller.tick()
    assert move.role == "decode" and len(registry.instances("chat", "decode")) == 3
    _traffic(metrics, 40, refused=20)  # then a burst of refusals
    assert controller.tick() == []  # not back to the 2 decode instances that were short
    assert metrics.window("chat").arrived == 40  # nothing moved: the window goes on


def _follower(registry: MemoryRegistry, instance_id: str):
    def follow(role: str) -> None:
        (instance,) = [i for r in ("prefill", "decode")
                       for i in registry.instances("chat", r) if i.instance_id == instance_id]
        registry.register(Instance(instance_id, "chat", role, instance.http, instance.kv))

    return follow


def test_prefill_admission_predicts_the_first_token_from_measured_throughput():
    admission = PrefillAdmission()
    admission.admit(1000, ttft_budget_ms=0)  # nothing measured yet: taken
    admission.tokens_per_s = 10_000.0
    assert admission.predicted_ttft_ms(500) == pytest.approx(150.0)  # 1000 ahead, 500 own
    admission.admit(500, ttft_budget_ms=160)
    with pytest.raises(APIError) as refused:
        admission.admit(500, ttft_budget_ms=190)  # 1500 ahead + 500 own: 200 ms
    assert refused.value.status == 429 and refused.value.code == "prefill_busy"
    assert (admission.accepted, admission.rejected, admission.queued_tokens) == (2, 1, 1500)
    idle = PrefillAdmission()
    idle.tokens_per_s = 10_000.0
    idle.admit(50_000, ttft_budget_ms=100)  # 5 s on its own, but nobody could do better


def test_prefill_admission_learns_only_from_prefills_that_finished():
    admission = PrefillAdmission()
    admission.admit(1000, ttft_budget_ms=None)
    admission.done(1000, None, arrival=0.0)  # failed at once: says nothing about speed
    assert admission.tokens_per_s is None and admission.queued_tokens == 0
    admission.admit(800, ttft_budget_ms=None)
    admission.done(800, 600, arrival=time.monotonic() - 0.5)  # 200 prompt tokens were cached
    assert admission.tokens_per_s == pytest.approx(1200, rel=0.2)
