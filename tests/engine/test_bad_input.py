"""Invalid requests get a clear error naming the problem; the engine keeps serving others."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.messages import QueueFullError
from pdserve.sampling_params import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_model_len=128, max_waiting=8)


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    (list(range(200)), SamplingParams(), "context"),
    ([1, 2, 3], SamplingParams(max_tokens=126), "max_tokens=126"),
    ([1, 99999], SamplingParams(), "token ids"),
])
def test_bad_requests_are_refused_with_a_message(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_work()


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
])
def test_bad_sampling_values_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_engine_serves_others_after_refusals(llm):
    for bad in ([], list(range(500))):
        with pytest.raises(InvalidRequestError):
            llm.generate({"prompt_token_ids": bad})
    out = llm.generate(["fine", "also fine"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    llm.engine.check_integrity()


def test_full_queue_is_refused_then_accepts_again(llm):
    engine = llm.engine
    for i in range(8):
        engine.add_request(f"q{i}", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        engine.add_request("q8", [5, 6], SamplingParams(max_tokens=1))
    while engine.has_work():
        engine.step()
    engine.add_request("q9", [5, 6], SamplingParams(max_tokens=1))
    while engine.has_work():
        engine.step()


def test_a_failing_step_fails_only_its_requests(llm, monkeypatch):
    engine = llm.engine
    calls = {"n": 0}
    real = engine.runner.launch

    def flaky(work, waits, buffers):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(work, waits, buffers)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=3))
    updates = engine.step()
    assert [(u.request_id, u.finish_reason) for u in updates] == [("doomed", "error")]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert len(out[0].outputs[0].token_ids) == 3
    engine.check_integrity()
