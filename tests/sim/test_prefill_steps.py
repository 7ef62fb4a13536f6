"""A prefill instance's engine steps (``PrefillSteps``): prompts in pieces of the chunk
budget, oldest first, and on a CPU each step's first tokens handed back only after the
next step ran; a prompt alone takes the unstepped model's time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdserve.sim.cluster import (
    GroupSim,
    LatencyModel,
    Multiplexing,
    PrefillSteps,
    ServiceNoise,
    SharedCores,
    SimRequest,
)

# 1 ms per prompt token, decode 10 ms a step whatever the batch, the KV handed over at once.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=0, decode_kv_tokens=100_000)


def _first_tokens(requests: list[SimRequest], steps: PrefillSteps | None,
                  model: LatencyModel = MODEL, **options) -> list[float]:
    done = GroupSim(model, 1, 1, prefill_steps=steps, **options).run(requests)
    return [r.first_token for r in done]


def test_a_prompts_pieces_add_up_to_its_time_alone():
    model = replace(MODEL, prefill_base_s=0.01, prefill_per_token_s=1e-4,
                    prefill_per_token_sq_s=1e-7)
    pieces = [model.prefill_piece_s(a, b) for a, b in ((0, 512), (512, 1024), (1024, 1100))]
    assert sum(pieces) == pytest.approx(model.prefill_s(1100))
    assert pieces[1] > pieces[0] - model.prefill_base_s  # later pieces attend to more
    (first,) = _first_tokens([SimRequest(0.0, 1100, 2)], PrefillSteps(512, True), model)
    assert first == pytest.approx(model.prefill_s(1100))


def test_a_newcomer_fills_the_budget_left_by_the_oldest_prompts_last_piece():
    """A's 150 tokens: 100 in the first step (0-0.1 s), its last 50 with B's 30 in the
    second (0.1-0.18 s): both handed back as it ends. Whole prompts: A at 0.15 s."""
    requests = [SimRequest(0.0, 150, 2), SimRequest(0.05, 30, 2)]
    assert _first_tokens(requests, PrefillSteps(100)) == pytest.approx([0.18, 0.18])
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    assert _first_tokens(fresh, None) == pytest.approx([0.15, 0.18])


def test_one_step_late_a_first_token_waits_for_the_next_prompts_first_piece():
    """A (50 tokens) ends at 0.05 s with B (200) queued: A comes back after B's first
    piece (0.05-0.15 s); B after its last (0.25 s), nothing queued behind it; C alone
    comes back as it ends."""
    requests = [SimRequest(0.0, 50, 2), SimRequest(0.01, 200, 2), SimRequest(1.0, 50, 2)]
    late = _first_tokens(requests, PrefillSteps(100, tokens_one_step_late=True))
    assert late == pytest.approx([0.15, 0.25, 1.05])
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    assert _first_tokens(fresh, PrefillSteps(100)) == pytest.approx([0.05, 0.25, 1.05])


def test_prompts_that_never_meet_take_the_unstepped_times_spread_included():
    """Prompts of up to 300 ms arriving at least 0.5 s apart: stepped (in pieces, late
    tokens) or not, every first token and finish is the same; each prompt draws once from
    the spread, for all its pieces."""
    rng = np.random.default_rng(5)
    arrivals = np.cumsum(0.5 + rng.exponential(0.3, 60))
    model = replace(MODEL, decode_per_kv_token_s=1e-6)

    def times(steps: PrefillSteps | None) -> list[float]:
        requests = [SimRequest(float(t), int(n), int(o)) for t, n, o in zip(
            arrivals, rng.integers(10, 300, 60), rng.integers(2, 30, 60), strict=True)]
        noise = ServiceNoise([0.8, 1.0, 1.5], [0.9, 1.1], seed=3)
        done = GroupSim(model, 1, 1, noise=noise, prefill_steps=steps).run(requests)
        return [t for r in done for t in (r.first_token, r.finished)]

    state = rng.bit_generator.state
    whole = times(None)
    rng.bit_generator.state = state  # the same requests again
    assert times(PrefillSteps(64, tokens_one_step_late=True)) == pytest.approx(whole,
                                                                              rel=1e-12)


def test_a_prompts_draw_of_the_spread_holds_for_all_its_pieces():
    noise = ServiceNoise([2.0], [1.0])
    (first,) = _first_tokens([SimRequest(0.0, 150, 2)], PrefillSteps(100), noise=noise)
    assert first == pytest.approx(0.3)


def test_shared_cores_slow_the_steps_only_while_a_decode_batch_runs():
    """A decodes 0.1-0.24 s. B's first piece (100 ms alone) starts at 0.155 s beside it
    and runs 3x slower until 0.24 s, at full speed after; its second (50 ms) alone. In
    steps or whole, B's 150 ms of work end at the same time."""
    cores = SharedCores(decode_slowdown=2.0, prefill_slowdown=3.0)
    requests = [SimRequest(0.0, 100, 11), SimRequest(0.155, 150, 2)]
    stepped = _first_tokens(requests, PrefillSteps(100), shared_cores=cores)
    beside = 0.24 - 0.155
    assert stepped[1] == pytest.approx(0.24 + 0.15 - beside / 3)
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    assert _first_tokens(fresh, None, shared_cores=cores)[1] == pytest.approx(stepped[1])


def test_bad_steps_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefillSteps(0)
    with pytest.raises(ValueError, match="multiplexing"):
        GroupSim(MODEL, 1, 0, multiplexing=Multiplexing(1.5, 2.0),
                 prefill_steps=PrefillSteps(512))
