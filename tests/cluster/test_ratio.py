"""The dynamic P/D ratio's decisions on hand-made latency windows, and a move carried out
through a registry."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pdserve.cluster.config import RatioConfig
from pdserve.cluster.metrics import GatewayMetrics, ScenarioWindow
from pdserve.cluster.ratio import RatioController, judge
from pdserve.cluster.registry import Instance, MemoryRegistry
from pdserve.server.pd import PrefillAdmission
from pdserve.server.protocol import APIError

CONFIG = RatioConfig(min_requests=10, cooldown_s=60)


def _window(ttft_s: float, e2e_s: float, requests: int = 20, rejections: int = 0):
    window = ScenarioWindow()
    for _ in range(requests):
        window.ttft_s.append(ttft_s)
        window.e2e_s.append(e2e_s)
    window.requests, window.rejections = requests, rejections
    return window


@pytest.mark.parametrize("window, prefill, decode, expected", [
    (_window(3.0, 4.0), 1, 2, "prefill"),  # TTFT is 75% of E2E
    (_window(3.0, 4.0), 1, 1, None),  # ... but the last decode instance stays
    (_window(0.2, 4.0, rejections=10), 1, 2, "prefill"),  # refusals: prefill is short
    (_window(0.2, 4.0), 2, 1, "decode"),  # TTFT is 5%: decode is the bottleneck
    (_window(0.2, 4.0), 1, 1, None),  # ... but the last prefill instance stays
    (_window(0.2, 4.0, rejections=1), 2, 1, None),  # 5% refused at first: prefill keeps them
    (_window(1.0, 4.0), 2, 2, None),  # balanced
    (_window(3.0, 4.0, requests=5), 1, 2, None),  # too few requests to judge
])
def test_judge(window, prefill, decode, expected):
    assert judge(window, prefill, decode, CONFIG) == expected


def _group(registry: MemoryRegistry, prefill: int, decode: int) -> None:
    for i in range(prefill + decode):
        role = "prefill" if i < prefill else "decode"
        registry.register(Instance(f"i{i}", "chat", role, f"h:{i}", f"h:{100 + i}"))


def test_controller_moves_the_least_busy_decode_instance_and_cools_down():
    registry, metrics = MemoryRegistry(), GatewayMetrics()
    _group(registry, 1, 3)
    for instance_id in ("i1", "i2", "i3"):  # an instance follows requests by re-registering
        registry.watch_role_requests(instance_id, _follower(registry, instance_id))
    decode_load = Counter({"i1": 4, "i2": 0, "i3": 2})
    controller = RatioController(registry, metrics, {"decode": decode_load}, CONFIG)
    for _ in range(20):
        metrics.answered("chat", 200, 3.0, 4.0)
    (move,) = controller.tick()
    assert (move.instance_id, move.role) == ("i2", "prefill")
    assert [i.instance_id for i in registry.instances("chat", "prefill")] == ["i0", "i2"]
    for _ in range(20):
        metrics.answered("chat", 200, 3.0, 4.0)
    assert controller.tick() == []  # cooling down
    assert metrics.window("chat").requests == 20  # the window restarted after the move


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
