"""Request parsing and the channel framing, without a server."""

from __future__ import annotations

import pytest

from pdserve.messages import AbortRequests, RequestUpdate
from pdserve.server import protocol as P
from pdserve.server.channel import _FrameReader, encode


def test_completion_defaults_and_budget():
    req = P.CompletionRequest.parse({"prompt": "hi", "stop": "x", "seed": 3})
    params = req.sampling.sampling_params(10, 100, default_max_tokens=16)
    assert params.max_tokens == 16 and params.stop == ["x"] and params.seed == 3
    chat = P.ChatRequest.parse({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.sampling.sampling_params(10, 100, None).max_tokens == 90  # the rest of context


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "1"}, "temperature"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 17, "n": 64}, "prompt"),  # 1,088 generations, past 1,024
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_bad_fields_name_the_param(body, param):
    with pytest.raises(P.APIError) as err:
        P.CompletionRequest.parse(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]),
    ([1, 2], [[1, 2]]),
    (["hi"], ["hi"]),
    ([[1, 2]], [[1, 2]]),
    (["a", "b"], ["a", "b"]),
    ([[1], [2, 3], "c"], [[1], [2, 3], "c"]),
])
def test_a_prompt_or_a_batch_of_either_form(prompt, prompts):
    assert P.CompletionRequest.parse({"prompt": prompt}).prompts == prompts


def test_context_overflow_is_400():
    req = P.CompletionRequest.parse({"prompt": "x", "max_tokens": 50})
    with pytest.raises(P.APIError, match="context"):
        req.sampling.sampling_params(60, 100, 16)
    with pytest.raises(P.APIError, match="context"):
        req.sampling.sampling_params(100, 100, 16)


def test_bad_sampling_values_are_400():
    req = P.CompletionRequest.parse({"prompt": "x", "top_p": 0})
    with pytest.raises(P.APIError, match="top_p"):
        req.sampling.sampling_params(1, 100, 16)


def test_frames_survive_any_split():
    batches = [[RequestUpdate("a", [1, 2], [-0.5, -1.0], True, "length", 3, 2, 1.5)],
               [AbortRequests(["b" * 1000])]]
    wire = b"".join(encode(b) for b in batches)
    for cut in (1, 3, 4, 5, 100, len(wire) - 1):
        got: list = []
        reader = _FrameReader(got.append, lambda: None)
        reader.data_received(wire[:cut])
        reader.data_received(wire[cut:])
        # Frames read together are handed over as one batch; order and content are kept.
        assert [m for batch in got for m in batch] == [m for batch in batches for m in batch]


@pytest.mark.parametrize("kind, body, param", [
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
              "top_logprobs": 2}, "top_logprobs"),
    # The prompt is scored on the prefill instance; its logprobs do not cross.
    ("completions", {"prompt": "x", "prompt_logprobs": 0}, "prompt_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1},
     "prompt_logprobs"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 0}, "echo"),
])
def test_a_request_split_across_instances_refuses_choices_and_alternatives(kind, body, param):
    from pdserve.server.serving import Format, refuse_split_features

    parse = P.CompletionRequest.parse if kind == "completions" else P.ChatRequest.parse
    fmt = Format(kind == "chat", "id", "tiny", 0, parse(body).sampling)
    with pytest.raises(P.APIError) as err:
        refuse_split_features(fmt)
    assert err.value.status == 400 and err.value.param == param
    refuse_split_features(Format(False, "id", "tiny", 0,
                                 P.CompletionRequest.parse({"prompt": "x"}).sampling))


def test_a_priority_other_than_zero_needs_the_priority_order():
    sampling = P.CompletionRequest.parse({"prompt": "x", "priority": -3}).sampling
    P.check_priority(sampling, "priority")  # the engine orders its queue by it
    for order in ("fcfs", "slo", None):
        with pytest.raises(P.APIError) as refused:
            P.check_priority(sampling, order)
        assert refused.value.status == 400 and refused.value.param == "priority"
    P.check_priority(P.CompletionRequest.parse({"prompt": "x", "priority": 0}).sampling, "fcfs")
    assert P.CompletionRequest.parse({"prompt": "x", "priority": -3}).sampling.sampling_params(
        1, 16, None).priority == -3
