"""``--mux-reweigh-spatial-batches``: the next prefill batch beside a decode step running on a
partition is weighed against every option, not only that partition's.

Without it a busy decode lane keeps prefill on its partition: each batch that ends while a
decode step runs there is followed by another on the same partition, chosen among spatial
options alone (seen on the H200 at 16 req/s ShareGPT-like: 8.6 s of spatial batches at ~4.3K
prompt tokens/s beside mixed steps that ran ~5.4K before and after). Served here on the tiny
model with a latency model where mixed steps are out of reach beside one decoding request
and far ahead beside two or more."""

from __future__ import annotations

import pytest

from pdserve.sampling_params import SamplingParams
from tests.engine.test_multiplex import StepOps, _multiplex
from tests.sched.test_prefill_delivery import SharingModel

PROMPTS = 8  # of 64 tokens each: one a batch, so each batch that ends adds one decode


class MixedStepsAtTwoDecodes(SharingModel):
    """``SharingModel``'s 132-SM GPU for the tiny model's 4 layers with prefill pieces ten
    times its cost (a split's batch delivers ~200 prompt tokens/s); a mixed step never fits
    beside one decode and costs 1 ms beside two or more, so from two decodes on mixed steps
    win even after paying for the switch."""

    def __init__(self):
        super().__init__(num_layers=4)

    def predict(self, phase, *args, **kwargs):
        ms = super().predict(phase, *args, **kwargs)
        return ms if phase == "decode" else 10 * ms

    def predict_mixed(self, prefill_tokens, prefill_context, prefill_batch, decode_batch,
                      decode_context, sms=None):
        return 1.0 if decode_batch >= 2 else 1e6


def serve(reweigh: bool) -> tuple[list, list[dict], dict]:
    """Launches complete 1 to 3 engine steps after they were issued (seeded), so pieces end
    while a decode step is still in flight, as on a GPU."""
    ops = StepOps(seed=0)
    llm = _multiplex("tiny", predictor=MixedStepsAtTwoDecodes(), ops=ops, device="cpu",
                     mux_reweigh_spatial_batches=reweigh)
    prompts = [{"prompt_token_ids": [3 + (11 * i + j) % 250 for j in range(64)]}
               for i in range(PROMPTS)]  # no two share a prefix
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, llm.engine.timeline(), llm.engine.describe()


def batches_started_on_a_split(timeline: list[dict], min_decodes: int) -> list[dict]:
    """The first decision of each prefill batch that ran as a split of the GPU beside at
    least ``min_decodes`` decoding requests."""
    seen, started = set(), []
    for entry in timeline:
        serial = entry["prefill_batch"]
        if not entry["piece_launched"] or serial in seen:
            continue
        seen.add(serial)
        if entry["mode"] == "spatial" and entry["decode_batch"] >= min_decodes:
            started.append(entry)
    return started


@pytest.fixture(scope="module")
def runs():
    return {reweigh: serve(reweigh) for reweigh in (False, True)}


def test_without_reweighing_a_busy_decode_lane_keeps_prefill_on_its_split(runs):
    _, timeline, described = runs[False]
    assert batches_started_on_a_split(timeline, min_decodes=2)
    assert described["reweigh_spatial_batches"] is False
    assert described["calibration"]["spatial_batches_declined"] == 0


def test_reweighing_lets_mixed_steps_take_over_once_they_win(runs):
    _, timeline, described = runs[True]
    assert described["reweigh_spatial_batches"] is True
    declined = described["calibration"]
    assert declined["spatial_batches_declined"] == len(declined["spatial_batches_declined_at"])
    assert declined["spatial_batches_declined"] >= 1
    assert not batches_started_on_a_split(timeline, min_decodes=2)
    assert any(e["mode"] == "temporal" and e["prefill_tokens"] > 0 for e in timeline)


def test_reweighing_changes_the_schedule_not_the_tokens(runs):
    assert runs[True][0] == runs[False][0]
