"""What each multiplexing option really delivered to prefill, read from a run's timeline."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pdserve.bench.timeline import piece_times, prefill_batches, prefill_delivery

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "loogle_h200"


def entry(time: float, mode: str, tokens: int = 0, *, sms: int = 132, context: int = 0,
          committed: float = 0.0, **fields) -> dict:
    return {"time": time, "mode": mode, "decode_sms": sms, "prefill_tokens": tokens,
            "prefill_context_tokens": context, "committed_tokens_per_s": committed,
            "measured_cycle_ms": fields.pop("cycle", 0.0), **fields}


def spatial_batch() -> list[dict]:
    """4,800 prompt tokens in pieces beside 16 decode SMs from t = 10 s, chosen at 6,000
    tokens/s, their last layers alone on the whole GPU; decode alone from t = 11 s."""
    return [entry(10.0, "spatial", 4800, sms=16, committed=6000.0),
            *[entry(10.0 + 0.1 * i, "spatial", 4800, sms=16) for i in range(1, 9)],
            entry(0.95 + 10.0, "prefill_only", 4800),
            entry(11.0, "decode_only", cycle=20.0)]


def test_a_batch_runs_from_its_first_decision_to_the_next_of_another_kind():
    [batch] = prefill_batches(spatial_batch())
    assert batch["seconds"] == pytest.approx(1.0)
    assert batch["realized_tokens_per_s"] == pytest.approx(4800.0)
    assert batch["option"] == "spatial:16"  # prefill alone ran its last layers only
    assert batch["options"] == {"spatial:16": 9, "prefill_only": 1}
    assert batch["switches"] == 0
    delivered = prefill_delivery(spatial_batch())["spatial:16"]
    assert delivered["realized_over_committed"] == pytest.approx(0.8)


def test_a_batch_ends_when_its_last_piece_was_seen_complete():
    """Where the timeline records pieces, nothing after the batch's end counts: here the
    next decision came 2 s after the last piece completed."""
    entries = [entry(0.0, "time_slice", 3000, committed=5000.0, piece_launched=True,
                     predicted_piece_ms=50.0, measured_piece_ms=60.0),
               entry(0.3, "time_slice", 3000, piece_launched=True, predicted_piece_ms=50.0,
                     measured_piece_ms=300.0),
               entry(2.6, "decode_only")]
    [batch] = prefill_batches(entries)
    assert batch["seconds"] == pytest.approx(0.6)
    assert prefill_delivery(entries)["time_slice"]["realized_tokens_per_s"] == 5000
    ratios = piece_times(entries)["time_slice"]
    assert ratios["n"] == 2 and ratios["measured_over_predicted_p50"] == pytest.approx(1.2)


def test_mixed_steps_count_their_chunks_over_the_run_of_them():
    entries = [entry(5.0, "temporal", 256, committed=5000.0, cycle=50.0),
               entry(5.05, "temporal", 256, committed=5000.0, cycle=50.0),
               entry(5.1, "temporal", 256, committed=4000.0, cycle=50.0),
               entry(5.15, "decode_only")]
    delivered = prefill_delivery(entries)["temporal"]
    assert delivered["tokens"] == 768 and delivered["seconds"] == pytest.approx(0.15)
    assert delivered["realized_tokens_per_s"] == 5120
    assert delivered["committed_tokens_per_s"] == round(768 / (512 / 5000 + 256 / 4000))


def test_separate_batches_and_options_stay_apart():
    later = [{**e, "time": e["time"] + 20.0, "prefill_context_tokens": 4800}
             for e in spatial_batch()]
    entries = spatial_batch() + [entry(12.0, "temporal", 512, committed=6000.0),
                                 entry(12.1, "decode_only")] + later
    assert [b["start"] for b in prefill_batches(entries)] == [10.0, 30.0]
    later[3]["decode_sms"] = 24  # one decision beside 24 decode SMs: two switches
    assert prefill_batches(later)[0]["switches"] == 2
    delivered = prefill_delivery(entries)
    assert delivered["spatial:16"]["batches"] == 2 and delivered["temporal"]["batches"] == 1


@pytest.mark.parametrize("run", ["b249c95_multiplex_rate0.5",
                                 "d698fcb_multiplex-temporal_rate0.5"])
def test_a_committed_run_accounts_every_prompt_token_once(run):
    """Over the H200 runs' timelines, the batches and mixed steps hold exactly the prompt
    tokens the client sent (its summary), each counted under one option."""
    with gzip.open(RESULTS / f"{run}_timeline.json.gz", "rt") as f:
        entries = json.load(f)
    sent = json.loads((RESULTS / f"{run}.json").read_text())["summary"]["total_input_tokens"]
    delivered = prefill_delivery(entries)
    assert sum(row["tokens"] for row in delivered.values()) == sent
    assert all(row["seconds"] > 0 and row["realized_tokens_per_s"] > 0
               for row in delivered.values())


def test_a_batch_whose_context_view_moves_between_pieces_stays_one():
    """The Mooncake trace at 6f2d50e: the planner saw a batch's cached context as 0 for its
    first piece and 512 for the rest; counting those as two batches gave the first one
    290K tokens/s."""
    entries = [entry(0.0, "spatial", 18816, sms=16, committed=7316.0),
               *[entry(0.07 * i, "spatial", 18816, sms=16, context=512, committed=3747.0)
                 for i in range(1, 47)],
               entry(3.2, "decode_only")]
    [batch] = prefill_batches(entries)
    assert batch["seconds"] == pytest.approx(3.2)
    assert batch["committed_tokens_per_s"] == 7316.0  # its first piece's


def test_numbered_batches_of_one_size_stay_apart():
    first = [entry(0.1 * i, "time_slice", 3000, prefill_batch=1) for i in range(5)]
    second = [entry(0.5 + 0.1 * i, "time_slice", 3000, prefill_batch=2) for i in range(5)]
    batches = prefill_batches(first + second + [entry(1.0, "decode_only")])
    assert [b["start"] for b in batches] == [0.0, 0.5]
    assert all(b["seconds"] == pytest.approx(0.5) for b in batches)
