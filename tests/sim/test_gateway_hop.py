"""The gateway's hops on a prompt's way to its prefill instance (``gateway_hop_s``): a delay
that does not occupy the instance, so a prompt queued behind another waits only for the
other's prefill, not for its hops; fitted from prompts timed through the gateway and
straight at the instance."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.config import RatioConfig
from pdserve.sim.cluster import GroupSim, LatencyModel, SimRequest

# 1 ms per prompt token and 10 ms a prompt on the instance, decode 10 ms a step.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=0, decode_kv_tokens=100_000,
                     prefill_base_s=0.010)
HOPPED = dataclasses.replace(MODEL, prefill_base_s=0.002, gateway_hop_s=0.008)


def _first_tokens(model: LatencyModel, requests: list[SimRequest]) -> list[float]:
    return [r.first_token - r.arrival for r in GroupSim(model, 1, 1).run(requests)]


def test_a_prompt_alone_takes_the_same_either_way():
    assert _first_tokens(HOPPED, [SimRequest(1.0, 100, 2)]) == pytest.approx(
        _first_tokens(MODEL, [SimRequest(1.0, 100, 2)]))


def test_a_queued_prompt_waits_for_the_others_prefill_only():
    """Two 100-token prompts 5 ms apart: the second reaches the instance 8 ms after it
    arrived, waits for the first's 102 ms on the instance, then takes its own 102 ms; with
    the whole base on the instance it waited for the first's hop too."""
    requests = [SimRequest(1.0, 100, 2), SimRequest(1.005, 100, 2)]
    _, second = _first_tokens(HOPPED, [dataclasses.replace(r) for r in requests])
    assert second == pytest.approx(0.008 + 0.102 + 0.102 - 0.005)
    _, charged = _first_tokens(MODEL, requests)
    assert charged == pytest.approx(second + 0.008)


def test_fit_moves_the_median_difference_out_of_the_base():
    path = [{"tokens": n, "seconds": s} for n, s in ((64, 0.020), (256, 0.037), (1024, 0.178))]
    direct = [{"tokens": n, "seconds": s} for n, s in ((64, 0.012), (256, 0.028), (1024, 0.150))]
    fitted = MODEL.fit_gateway_hop(path, direct)
    assert fitted.gateway_hop_s == pytest.approx(0.009)  # the median of 8, 9 and 28 ms
    assert fitted.prefill_base_s == pytest.approx(0.001)
    assert fitted.prefill_s(500) + fitted.gateway_hop_s == pytest.approx(MODEL.prefill_s(500))
    assert fitted.without_gateway_hop() == MODEL


def test_fit_never_takes_more_than_the_base_nor_less_than_nothing():
    path = [{"tokens": 64, "seconds": 0.040}]
    assert MODEL.fit_gateway_hop(path, [{"tokens": 64, "seconds": 0.010}]).gateway_hop_s == 0.010
    assert MODEL.fit_gateway_hop(path, [{"tokens": 64, "seconds": 0.050}]).gateway_hop_s == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same prompt lengths"):
        MODEL.fit_gateway_hop([{"tokens": 64, "seconds": 0.02}],
                              [{"tokens": 128, "seconds": 0.01}])
    with pytest.raises(ValueError, match="gateway hop"):
        GroupSim(HOPPED, 1, 1, ratio=RatioConfig())


def test_no_hop_changes_nothing():
    requests = [SimRequest(0.3 * i, 50 + 20 * (i % 7), 3 + i % 5) for i in range(40)]
    plain = GroupSim(MODEL, 1, 1).run([dataclasses.replace(r) for r in requests])
    zero = GroupSim(dataclasses.replace(MODEL, gateway_hop_s=0.0), 1, 1).run(requests)
    assert [(r.first_token, r.finished) for r in zero] == [
        (r.first_token, r.finished) for r in plain]
