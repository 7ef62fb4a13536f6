"""P/D instances that share a host's cores (``SharedCores``): each role slowed only while
the other works, nothing changed without it, its factors read from a calibration probe."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdserve.sim.cluster import GroupSim, LatencyModel, ServiceNoise, SharedCores, SimRequest

# 1 ms per prompt token, decode 10 ms a step whatever the batch, the KV handed over at once.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=0, decode_kv_tokens=100_000)
CORES = SharedCores(decode_slowdown=2.0, prefill_slowdown=3.0)


def test_decode_slowed_while_a_prefill_runs_and_the_prompt_while_a_batch_decodes():
    first, second = GroupSim(MODEL, 1, 1, shared_cores=CORES).run(
        [SimRequest(0.0, 100, 11), SimRequest(0.125, 100, 3)])
    assert first.first_token == pytest.approx(0.1)  # no batch decoding: 100 ms
    # Decode from 0.1 s; the second prompt starts at 0.125 s: from the next boundary
    # (0.13 s, three steps done) the first request's last 7 steps take 20 ms each.
    assert first.finished == pytest.approx(0.13 + 7 * 0.02)
    # The prompt (0.1 s alone) runs 3x slower beside the batch, 0.125-0.27 s (a third of
    # that is its own work), alone at full speed from there.
    beside = 0.27 - 0.125
    assert second.first_token == pytest.approx(0.27 + 0.1 - beside / 3)
    assert second.finished == pytest.approx(second.first_token + 2 * 0.01)  # decoding alone


def test_a_batch_ending_midway_slows_only_the_prompt_s_part_beside_it():
    """The first request's 10-token prompt ends at 0.01 s and its answer decodes beside
    the second's 100-token prompt, which starts then: the prompt runs 3x slower while the
    batch decodes (to 0.11 s), at full speed after it ended."""
    first, second = GroupSim(MODEL, 1, 1, shared_cores=CORES).run(
        [SimRequest(0.0, 10, 6), SimRequest(0.005, 100, 2)])
    assert first.first_token == pytest.approx(0.01)
    # The batch decodes from 0.01 s beside the prompt: five steps of 20 ms, to 0.11 s.
    assert first.finished == pytest.approx(0.11)
    # 0.01-0.11 s at a third of the speed (0.0333 s of its 0.1 s), the rest alone.
    assert second.first_token == pytest.approx(0.11 + 0.1 - 0.1 / 3)


def test_decode_speeds_up_again_at_the_boundary_after_the_prefill_ends():
    first, second = GroupSim(MODEL, 1, 1, shared_cores=CORES).run(
        [SimRequest(0.0, 100, 31), SimRequest(0.125, 20, 3)])
    # The 20-token prompt takes 60 ms beside the batch: 0.125-0.185 s. The batch's steps
    # take 20 ms from 0.13 s until the boundary after 0.185 s (0.19 s, six steps done),
    # where the second request joins; 10 ms steps from there.
    assert second.first_token == pytest.approx(0.185)
    assert second.finished == pytest.approx(0.19 + 2 * 0.01)
    assert first.finished == pytest.approx(0.19 + 24 * 0.01)


def test_a_prefill_starting_before_a_newcomer_joins_slows_the_steps_from_the_join():
    """A newcomer admitted at the next step boundary (0.34 s) moves the stretch's start
    there; a prompt starting before it (0.336 s) slows the steps from that boundary, not
    from the one after (the KV reaches decode 20 ms after each prefill)."""
    model = replace(MODEL, handoff_base_s=0.02)
    cores = SharedCores(decode_slowdown=2.0, prefill_slowdown=1.0)
    a, b, c = GroupSim(model, 1, 1, shared_cores=cores).run(
        [SimRequest(0.0, 100, 31), SimRequest(0.303, 10, 3), SimRequest(0.336, 10, 3)])
    # A decodes from 0.12 s; B's prompt (0.303-0.313 s) slows one step (0.31-0.33 s); B
    # joins at 0.34 s; C's prompt (0.336-0.346 s) slows the step from there to 0.36 s.
    assert b.finished == pytest.approx(0.36 + 0.01)
    assert a.finished == pytest.approx(0.36 + 8 * 0.01)
    assert c.finished == pytest.approx(0.37 + 2 * 0.01)  # joins as B leaves


def test_a_batch_starting_midway_slows_only_the_rest_of_the_prompt():
    """Two prefill instances: the second prompt (100 tokens) starts alone at 0 s; the
    first's (10 tokens, on the other instance) ends at 0.01 s and its answer decodes to
    0.11 s (five 20 ms steps beside a prefill): the second prompt's work runs 3x slower
    only then."""
    first, second = GroupSim(MODEL, 2, 1, shared_cores=CORES).run(
        [SimRequest(0.0, 10, 6), SimRequest(0.0, 100, 2)])
    assert first.finished == pytest.approx(0.11)
    done_by_then = 0.01 + 0.1 / 3
    assert second.first_token == pytest.approx(0.11 + 0.1 - done_by_then)


def _workload(seed: int) -> list[SimRequest]:
    """A prompt of 0.1 s alone about every 0.3 s, answers of up to 40 steps: batches of a
    few, prompts beside them, no queue the gateway gives up on."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.3, 200))
    return [SimRequest(float(t), int(rng.integers(10, 200)), int(rng.integers(2, 40)))
            for t in arrivals]


def _times(model: LatencyModel, **options) -> list[float]:
    done = GroupSim(model, 2, 2, **options).run(_workload(3))
    return [t - r.arrival for r in done for t in (r.first_token, r.finished)]


def test_off_without_calibrated_factors():
    """Unit factors (what an uncalibrated group would have) give the times of a group
    without shared cores, the fleet's default, to float rounding (a prefill starting or
    ending splits the decode stretch there); measured factors change them."""
    model = replace(MODEL, decode_per_request_s=2e-3, decode_per_kv_token_s=1e-6)
    assert GroupSim(model, 1, 1).shared_cores is None
    alone = _times(model)
    assert _times(model, shared_cores=SharedCores()) == pytest.approx(alone, rel=1e-12)
    slowed = _times(model, shared_cores=CORES)
    assert sum(slowed) > sum(alone) * 1.05  # both roles only ever slow down


def test_shared_cores_with_the_measured_spread_finish_every_request():
    model = replace(MODEL, decode_per_request_s=2e-3)
    noise = ServiceNoise([0.9, 1.0, 1.2], [0.8, 1.0, 1.5], seed=1, steps=1 << 14,
                         steps_per_ratio=8)
    done = GroupSim(model, 1, 2, shared_cores=CORES, noise=noise).run(_workload(4))
    assert not any(r.unserved for r in done)
    assert all(r.finished >= r.first_token + 1e-3 * (r.output_len - 1) for r in done)


def test_factors_read_from_the_calibration_probe():
    probe = {"decode_step_ms_alone": {"samples": 40, "p50": 3.0},
             "decode_step_ms_beside_prefill": {"samples": 40, "p50": 3.6},
             "prefill_beside_decode_over_alone": {"samples": 12, "p50": 1.05}}
    assert SharedCores.from_probe(probe) == SharedCores(decode_slowdown=pytest.approx(1.2),
                                                        prefill_slowdown=1.05)


def test_the_prompts_factor_taken_from_the_replays_path_where_the_probe_timed_it():
    """Prompts sent through the gateway beside a decode, each joining it, met more of the
    slowdown than prompts sent straight to the prefill instance: the group's prompts take
    the former."""
    probe = {"decode_step_ms_alone": {"samples": 40, "p50": 3.0},
             "decode_step_ms_beside_prefill": {"samples": 40, "p50": 3.6},
             "prefill_beside_decode_over_alone": {"samples": 12, "p50": 1.05},
             "prefill_on_path_beside_decode_over_alone": {"samples": 20, "p50": 1.6}}
    assert SharedCores.from_probe(probe).prefill_slowdown == 1.6


def test_not_inside_a_multiplexing_instance():
    from pdserve.sim.cluster import Multiplexing

    with pytest.raises(ValueError, match="multiplexing"):
        GroupSim(MODEL, 1, 0, multiplexing=Multiplexing(2.0, 3.0), shared_cores=CORES)


def test_held_ratios_make_consecutive_blocks_correlate_by_the_hold_probability():
    """Each 8-step block keeps the previous block's ratio with probability 0.9: consecutive
    block ratios correlate at about 0.9, the drawn ratios themselves unchanged."""
    ratios = [0.8, 1.0, 1.5]
    noise = ServiceNoise([1.0], ratios, seed=2, steps=8 << 14, first_step=0,
                         steps_per_ratio=8, hold_probability=0.9)
    blocks = np.array([noise.span(i, i + 8)[0] / 8 for i in range(0, 8 << 14, 8)])
    assert set(np.round(blocks, 9)) == set(ratios)
    assert np.corrcoef(blocks[:-1], blocks[1:])[0, 1] == pytest.approx(0.9, abs=0.02)
    free = ServiceNoise([1.0], ratios, seed=2, steps=8 << 14, first_step=0, steps_per_ratio=8)
    blocks = np.array([free.span(i, i + 8)[0] / 8 for i in range(0, 8 << 14, 8)])
    assert abs(np.corrcoef(blocks[:-1], blocks[1:])[0, 1]) < 0.02
