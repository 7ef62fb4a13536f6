"""The chunked-prefill instance model on cases whose answers are known by hand."""

from __future__ import annotations

import pytest

from pdserve.sim.cluster import LatencyModel, SimRequest
from pdserve.sim.instance import ChunkedInstanceSim

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
    # at 0.07 s, then goes in pieces of 99 and 51 tokens beside one decode token.
    assert second.first_token == pytest.approx(0.07 + (0.01 + 0.099) + (0.01 + 0.051) + 0.02)
    assert second.finished == pytest.approx(second.first_token + 0.01)  # one step, beside
    # The first request's 19 decode steps: 2 before, 2 slowed by the pieces, 15 after
    # (its last with the second request's one step).
    assert first.finished == pytest.approx(0.05 + 2 * 0.01 + 0.109 + 0.061 + 15 * 0.01 + 0.02)
