"""The multiplexing instance's planner model (``PlannerShare``) from given numbers: the
curve between and beyond its grid, its limits, and the simulated instance running it."""

from __future__ import annotations

import itertools

import pytest

from pdserve.sim.cluster import GroupSim, LatencyModel, Multiplexing, PlannerShare, SimRequest

# 1 ms per prompt token; decode 10 ms a step whatever the batch.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=1_000_000)
AXES = {"batches": (1.0, 4.0), "contexts": (1000.0, 4000.0), "prompts": (1000.0, 4000.0)}


def _share(prefill, decode=None, delivered: float = 1.0) -> PlannerShare:
    """A table whose factor at each grid point is ``prefill(batch, context, prompt)``."""
    points = list(itertools.product(*AXES.values()))
    decode = decode or (lambda b, c, p: 2.0)
    return PlannerShare(**AXES, prefill=tuple(prefill(*x) for x in points),
                        decode=tuple(decode(*x) for x in points), delivered=delivered)


def _rising(b: float, c: float, p: float) -> float:
    return 1.0 + 0.5 * b / 4 + 0.25 * c / 4000 + 0.1 * p / 4000


def test_the_grid_points_come_back_and_between_them_the_logarithms_interpolate():
    share = _share(_rising)
    for b, c, p in itertools.product(*AXES.values()):
        assert share.prefill_factor(int(b), b * c, int(p)) == pytest.approx(_rising(b, c, p))
    # Batch 2 is halfway from 1 to 4 in logarithms: the factor is halfway too.
    half = (_rising(1, 1000, 1000) + _rising(4, 1000, 1000)) / 2
    assert share.prefill_factor(2, 2 * 1000, 1000) == pytest.approx(half)
    # The decode side from its own table; context per request is context over batch.
    assert share.decode_factor(2, 2 * 2000, 2000) == pytest.approx(2.0)


def test_beyond_the_grid_the_edge_holds_and_covers_says_so():
    share = _share(_rising)
    edge = share.prefill_factor(4, 4 * 4000, 4000)
    assert share.prefill_factor(64, 64 * 50_000, 100_000) == pytest.approx(edge)
    assert share.prefill_factor(1, 10, 10) == pytest.approx(_rising(1, 1000, 1000))
    assert share.covers(4, 4 * 4000) and share.covers(2, 2 * 1000)
    assert not share.covers(5, 5 * 2000)  # a larger batch than the grid's
    assert not share.covers(2, 2 * 500) and not share.covers(2, 2 * 5000)


def test_a_rising_table_gives_a_rising_curve_and_the_delivered_correction_scales_it():
    share = _share(_rising)
    sweep = [share.prefill_factor(b, b * 2500, 3000) for b in range(1, 9)]
    assert all(b >= a for a, b in itertools.pairwise(sweep)) and sweep[-1] > sweep[0]
    slower = _share(_rising, delivered=1.5)
    assert slower.prefill_factor(3, 3 * 2000, 1500) == pytest.approx(
        1.5 * share.prefill_factor(3, 3 * 2000, 1500))
    assert slower.planned_prefill(3, 3 * 2000, 1500) == pytest.approx(
        share.prefill_factor(3, 3 * 2000, 1500))


def test_a_prompt_is_never_faster_beside_decode_than_alone():
    share = _share(lambda b, c, p: 1.1, decode=lambda b, c, p: 0.9, delivered=0.5)
    assert share.prefill_s(0.3, 2, 4000, 2000) == 0.3
    assert share.decode_factor(2, 4000, 2000) == 1.0


def test_a_batch_costs_its_own_time_beyond_its_pieces():
    """Each prefill batch the planner splits a prompt into adds the per-batch cost; the
    batches interpolate as the factors do."""
    share = _share(_rising, delivered=0.8)
    counts = tuple(1.0 if p == 1000.0 else 3.0
                   for _, _, p in itertools.product(*AXES.values()))
    costly = PlannerShare(**{**share.__dict__, "prefill_batches": counts, "per_batch_s": 0.1})
    alone = 0.4
    assert costly.prefill_s(alone, 2, 4000, 1000) == pytest.approx(
        alone * share.prefill_factor(2, 4000, 1000) + 0.1)
    assert costly.planned_batches(2, 4000, 2000) == pytest.approx(2.0)  # halfway, in logs
    assert costly.prefill_s(alone, 2, 4000, 2000) == pytest.approx(
        alone * share.prefill_factor(2, 4000, 2000) + 0.2)
    assert share.prefill_s(alone, 2, 4000, 2000) == pytest.approx(
        alone * share.prefill_factor(2, 4000, 2000))  # no cost, no counts needed
    assert share.planned_batches(2, 4000, 2000) == 0.0


@pytest.mark.parametrize("change, match", [
    ({"batches": (4.0, 1.0)}, "batches"),
    ({"prompts": (1000.0,)}, "prompts"),
    ({"contexts": (0.0, 4000.0)}, "contexts"),
    ({"prefill": (2.0,) * 7}, "8 grid points"),
    ({"decode": (0.0,) * 8}, "positive"),
    ({"delivered": -1.0}, "positive"),
    ({"per_batch_s": 0.1}, "0 prefill batch figures"),
    ({"prefill_batches": (1.0,) * 3}, "3 prefill batch figures"),
    ({"per_batch_s": -0.1, "prefill_batches": (1.0,) * 8}, "not negative"),
])
def test_a_malformed_table_is_refused(change, match):
    fields = {**AXES, "prefill": (2.0,) * 8, "decode": (2.0,) * 8, **change}
    with pytest.raises(ValueError, match=match):
        PlannerShare(**fields)


def test_which_model_runs_is_named_and_the_share_wins():
    share = _share(lambda b, c, p: 2.0)
    planner = Multiplexing(2.0, 3.0, cycle_s=0.04, share=share)
    assert (planner.model, Multiplexing(2.0, 3.0, cycle_s=0.04).model,
            Multiplexing(2.0, 3.0).model) == ("planner", "cycle", "fixed")
    # The cycle would say 4/3 for a 10 ms step; the planner's table says 2.
    assert planner.prefill_beside_s(0.5, 0.01, 2, 2 * 2000, 2000) == pytest.approx(1.0)
    cycle = Multiplexing(2.0, 3.0, cycle_s=0.04)
    assert cycle.prefill_beside_s(0.5, 0.01, 2, 2 * 2000, 2000) == pytest.approx(0.5 * 4 / 3)
    assert planner.decode_stretch(0.01, 1e-3, 2, 2 * 2000, 2000) == pytest.approx((0.02, 2e-3))
    assert planner.covers(10.0, 2, 2 * 2000) and not planner.covers(0.0, 8, 8 * 2000)


def test_the_instance_runs_the_planner_model_beside_its_decode_batch():
    """A prompt beside a decoding batch takes 1.5 times its time alone and 50 ms for its
    one batch; the batch's steps take 1.6 times theirs meanwhile, and 10 ms again once
    the prompt is done."""
    share = PlannerShare(**{**_share(lambda b, c, p: 1.5, decode=lambda b, c, p: 1.6).__dict__,
                            "prefill_batches": (1.0,) * 8, "per_batch_s": 0.05})
    first, second = GroupSim(MODEL, 1, 0, multiplexing=Multiplexing(9.0, 9.0, share=share)).run(
        [SimRequest(0.0, 100, 11), SimRequest(0.125, 100, 3)])
    assert first.first_token == pytest.approx(0.1)  # alone
    assert second.first_token == pytest.approx(0.125 + 2 * 0.1)
    # 3 steps of 10 ms to 0.13 s, then its last 7 at 16 ms beside the prompt.
    assert first.finished == pytest.approx(0.13 + 7 * 0.016)
    assert second.finished == pytest.approx(0.325 + 2 * 0.01)  # alone again
