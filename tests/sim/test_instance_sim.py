"""The chunked-prefill instance model on cases whose answers are known by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.sim.cluster import LatencyModel, SimRequest
from pdserve.sim.instance import ChunkedInstanceSim, mixed_step_s

# 1 ms per prompt token plus 20 ms per request around the engine; decode 10 ms a step.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=1, prefill_base_s=0.02)


def test_a_prompt_alone_takes_its_prefill_in_pieces_then_decodes():
    (request,) = ChunkedInstanceSim(MODEL, chunk_size=512).run([SimRequest(0.0, 1000, 4)])
    assert request.first_token == pytest.approx(1.0 + 0.02)  # pieces of 512 and 488 tokens
    assert request.finished == pytest.approx(1.02 + 3 * 0.01)


def test_a_prompt_arriving_mid_decode_shares_the_steps():
    first, second = ChunkedInstanceSim(MODEL, chunk_size=100).run(
        [SimRequest(0.0, 50, 20), SimRequest(0.065, 150, 2)])
    assert first.first_token == pytest.approx(0.05 + 0.02)
    # Decode steps of 10 ms from 0.05 s; the second prompt waits for the step boundary
    # at 0.07 s, then goes in pieces of 99 and 51 tokens beside one decode token: each
    # step the compute of all its tokens (100 and 52 ms), over the 10 ms weight read.
    assert second.first_token == pytest.approx(0.07 + 0.100 + 0.052 + 0.02)
    assert second.finished == pytest.approx(second.first_token + 0.01)  # one step, beside
    # The first request's 19 decode steps: 2 before, 2 in the mixed steps, 15 after
    # (its last with the second request's one step).
    assert first.finished == pytest.approx(0.05 + 2 * 0.01 + 0.100 + 0.052 + 15 * 0.01 + 0.02)


def test_the_model_as_it_was_adds_the_decode_step_to_each_piece():
    """``mixed_step="sum"``: the model of the first H200 validation (eb12b7d)."""
    first, second = ChunkedInstanceSim(MODEL, chunk_size=100, mixed_step="sum").run(
        [SimRequest(0.0, 50, 20), SimRequest(0.065, 150, 2)])
    assert second.first_token == pytest.approx(0.07 + (0.01 + 0.099) + (0.01 + 0.051) + 0.02)
    assert first.finished == pytest.approx(0.05 + 2 * 0.01 + 0.109 + 0.061 + 15 * 0.01 + 0.02)
    with pytest.raises(ValueError, match="mixed_step must be one of"):
        ChunkedInstanceSim(MODEL, mixed_step="max")


# Weights read in 20 ms plus 1 ms a request; 0.1 ms a token of compute; attention 1e-8 s
# per prompt token squared and 1 us per decode KV token.
MIXED = LatencyModel(1e-4, 1e-8, 0.02, 1e-3, 1e-6, kv_bytes_per_token=1)


def test_a_small_piece_rides_on_the_decode_steps_weight_read():
    # 104 tokens of compute (10.4 ms) < the 24 ms read; 0.1 ms of attention; 1 ms of KV.
    assert mixed_step_s(MIXED, 4, 1000, [(0, 100)]) == pytest.approx(0.024 + 1e-4 + 1e-3)


def test_a_budget_sized_piece_costs_its_compute_and_its_attention_over_the_prefix():
    # 504 tokens: 50.4 ms > 24 ms; attention 1e-8 * (1500^2 - 1000^2) = 12.5 ms.
    assert mixed_step_s(MIXED, 4, 1000, [(1000, 500)]) == pytest.approx(
        0.0504 + 0.0125 + 1e-3)
    # Two prompts' pieces in one step: their tokens add, so do their attention terms.
    assert mixed_step_s(MIXED, 0, 0, [(0, 300), (0, 200)]) == pytest.approx(
        0.05 + 1e-8 * (300 ** 2 + 200 ** 2))


@pytest.mark.parametrize("revision", ["3e2c97e", "87c05a1"])
def test_budget_filling_mixed_steps_measured_on_the_h200_within_5_percent(revision):
    """The model of the validation's chunked instance (fitted at eb12b7d to prefill and
    decode points only) against mixed steps measured apart (``bench_mixed_step.py``) of
    448-512 prompt tokens beside decodes: the steps a 512-token budget runs under load.
    The model as it was (decode step plus prefill piece) is 17-32% over on them."""
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    model = LatencyModel(**json.loads((root / "sim_validate_instance_h200_eb12b7d.json")
                                      .read_text())["schedules"]["chunk512"]["latency_model"])
    cases = json.loads((root / f"mixed_step_h200_codellama34b_{revision}.json").read_text())
    mixed = [c for c in cases["cases"] if c["prefill_tokens"] >= 448 and c["decodes"]]
    assert len(mixed) == 2
    for case in mixed:
        batch, piece = case["decodes"], [(case["prefix"], case["prefill_tokens"])]
        context = batch * case["decode_context"]
        predicted = mixed_step_s(model, batch, context, piece)
        assert predicted * 1e3 == pytest.approx(case["eager_ms"], rel=0.05)
        summed = (model.decode_step_s(batch, context)
                  + model.prefill_s(case["prefill_tokens"]) - model.prefill_base_s)
        assert summed * 1e3 > 1.15 * case["eager_ms"]
