"""SageMaker's routes as vLLM serves them: /ping as /health, /invocations dispatched by the
body's shape to the chat or the completion route (same answers, same errors); the API key
on /invocations and not on /ping: test_auth.py."""

from __future__ import annotations

import json

GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 5}


def test_ping_answers_as_health(server):
    assert server.request("GET", "/ping")[0] == 200
    assert server.request("POST", "/ping", b"")[0] == 200


def test_invocations_answer_as_the_route_the_body_names(server):
    chat = {**GREEDY, "messages": [{"role": "user", "content": "hello"}]}
    status, _, raw = server.request("POST", "/invocations", chat)
    assert status == 200
    via, direct = json.loads(raw), json.loads(server.request("POST", "/v1/chat/completions",
                                                             chat)[2])
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    text = {**GREEDY, "prompt": "The sky is"}
    via = json.loads(server.request("POST", "/invocations", text)[2])
    direct = json.loads(server.request("POST", "/v1/completions", text)[2])
    assert via["object"] == "text_completion"
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]


def test_invocations_refuse_a_body_of_neither_kind_and_bad_fields_by_name(server):
    status, _, raw = server.request("POST", "/invocations", {"model": "tiny", "input": "x"})
    assert status == 400 and "neither" in json.loads(raw)["error"]["message"]
    status, _, raw = server.request("POST", "/invocations", {**GREEDY, "prompt": "x",
                                                             "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
