"""A prompt that starts on a prefill instance idle a while (``IdleWake``): its extra over
the fitted time, a line in its tokens interpolated over the probe's pauses, only on the
first prompt after idleness; nothing changed without it."""

from __future__ import annotations

import pytest

from pdserve.sim.cluster import (
    GroupSim,
    IdleWake,
    LatencyModel,
    Multiplexing,
    PrefillSteps,
    SimRequest,
)

# 1 ms per prompt token, decode 10 ms a step, the KV handed over at once.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=0, decode_kv_tokens=100_000)
# After half a second idle 4 ms, after two seconds or more 6 ms plus 40 us per token.
WAKE = IdleWake(((0.5, 0.004, 0.0), (2.0, 0.006, 4e-5)))


def test_extra_interpolated_between_the_pauses_and_held_beyond():
    assert WAKE.extra_s(0.0, 100) == 0.0
    assert WAKE.extra_s(0.25, 100) == pytest.approx(0.002)
    assert WAKE.extra_s(1.0, 0) == pytest.approx(0.004 + 0.002 / 3)
    assert WAKE.extra_s(1.0, 100) == pytest.approx(0.004 + 0.002 / 3 + 100 * 4e-5 / 3)
    assert WAKE.extra_s(60.0, 100) == pytest.approx(0.010)


def test_only_a_prompt_starting_on_an_idle_instance_pays_it():
    first, queued, later = GroupSim(MODEL, 1, 1, idle_wake=WAKE).run(
        [SimRequest(1.0, 100, 2), SimRequest(1.05, 100, 2), SimRequest(5.0, 100, 2)])
    assert first.first_token == pytest.approx(1.0 + 0.1 + WAKE.extra_s(1.0, 100))  # idle from 0
    assert queued.first_token == pytest.approx(first.first_token + 0.1)  # started at once
    # idle from the queued prompt's end: 3.794 s, beyond the last pause
    assert later.first_token == pytest.approx(5.0 + 0.1 + 0.010)


def test_under_prefill_steps_the_first_step_pays_it():
    """Chunks of 60 tokens: the 100-token prompt's two steps, its whole extra in the
    first."""
    steps = PrefillSteps(60)
    (alone,) = GroupSim(MODEL, 1, 1, prefill_steps=steps).run([SimRequest(2.0, 100, 2)])
    (woken,) = GroupSim(MODEL, 1, 1, prefill_steps=steps, idle_wake=WAKE).run(
        [SimRequest(2.0, 100, 2)])
    assert alone.first_token == pytest.approx(2.1)
    assert woken.first_token == pytest.approx(2.1 + 0.010)


def _times(**options) -> list[float]:
    requests = [SimRequest(0.3 * i, 50 + 20 * (i % 7), 3 + i % 5) for i in range(40)]
    return [t for r in GroupSim(MODEL, 1, 1, **options).run(requests)
            for t in (r.first_token, r.finished)]


def test_off_by_default_and_nothing_added_by_a_zero_extra():
    assert GroupSim(MODEL, 1, 1).idle_wake is None
    plain = _times()
    assert _times(idle_wake=IdleWake(((1.0, 0.0, 0.0),))) == pytest.approx(plain, rel=1e-12)
    assert sum(_times(idle_wake=WAKE)) > sum(plain)


@pytest.mark.parametrize("points", [(), ((0.0, 0.001, 0.0),),
                                    ((1.0, 0.001, 0.0), (0.5, 0.002, 0.0)),
                                    ((1.0, -0.001, 0.0),), ((1.0, 0.0, -1e-6),)])
def test_bad_points_refused(points):
    with pytest.raises(ValueError, match="IdleWake.points"):
        IdleWake(points)


def test_not_inside_a_multiplexing_instance():
    with pytest.raises(ValueError, match="idle_wake"):
        GroupSim(MODEL, 1, 0, multiplexing=Multiplexing(2.0, 3.0), idle_wake=WAKE)
