"""Fields the server honours on its own (templates, echo, stop strings kept) and the
tokenization routes, through a real server and the openai client."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"
USER = [{"role": "user", "content": "Hi there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = server.request("POST", path, body)
    return status, json.loads(raw)


def _tokens(server, body: dict) -> list[int]:
    status, answer = _post(server, "/tokenize", {"model": MODEL, **body})
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
    return answer["tokens"]


def test_tokenize_and_detokenize_round_trip(server):
    tokens = _tokens(server, {"prompt": "héllo"})
    assert tokens[0] == 256 and len(tokens) == 1 + len("héllo".encode())  # BOS + bytes
    assert _tokens(server, {"prompt": "héllo", "add_special_tokens": False}) == tokens[1:]
    status, answer = _post(server, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200 and answer == {"prompt": "héllo"}
    status, answer = _post(server, "/tokenize", {"prompt": "ab", "return_token_strs": True})
    assert answer["token_strs"] == ["<s>", "a", "b"]


def test_tokenize_refuses_bad_input_by_name(server):
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens")]:
        status, answer = _post(server, path, body)
        assert status == 400 and answer["error"]["param"] == param, (path, body, answer)


def test_version(server):
    status, _, raw = server.request("GET", "/version")
    assert status == 200 and json.loads(raw)["version"]


def _chat_prompt_tokens(server, **extra) -> int:
    out = server.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                                  extra_body=extra or None)
    return out.usage.prompt_tokens


def test_chat_prompt_is_what_tokenize_shows(server):
    for options in ({}, {"add_generation_prompt": False},
                    {"chat_template": "{{ messages[0]['content'] }}|{{ tag }}",
                     "chat_template_kwargs": {"tag": "T"}}):
        expected = _tokens(server, {"messages": USER, **options})
        assert _chat_prompt_tokens(server, **options) == len(expected), options


def test_add_generation_prompt_and_a_request_template_change_the_prompt(server):
    with_prompt = _tokens(server, {"messages": USER})
    without = _tokens(server, {"messages": USER, "add_generation_prompt": False})
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    custom = _tokens(server, {"messages": USER, "chat_template": "[{{ messages[0].content }}]"})
    assert custom == [256, *b"[Hi there]"]


def test_continue_final_message_ends_the_prompt_inside_it(server):
    messages = [*USER, {"role": "assistant", "content": "Hello, I am"}]
    tokens = _tokens(server, {"messages": messages, "add_generation_prompt": False,
                              "continue_final_message": True})
    assert bytes(tokens[1:]).decode().endswith("Hello, I am")
    status, answer = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "continue_final_message": True})
    assert status == 400 and answer["error"]["param"] == "continue_final_message"


def test_a_broken_request_template_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        server.openai().chat.completions.create(
            model=MODEL, messages=USER, extra_body={"chat_template": "{% for %}"})


def test_echo_puts_the_prompt_first(server):
    client = server.openai()
    kwargs = dict(model=MODEL, prompt="Echo me", max_tokens=6, **GREEDY)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "Echo me" + plain
    assert echoed.usage.completion_tokens == 6
    chunks = client.completions.create(echo=True, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in chunks) == "Echo me" + plain
    ids = client.completions.create(**{**kwargs, "prompt": [69, 99, 104, 111]}, echo=True)
    assert ids.choices[0].text.startswith("Echo")


def test_include_stop_str_in_output(server):
    client = server.openai()
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=24, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    visible = full.replace("\ufffd", "")
    if len(visible) < 4:
        pytest.skip("the dummy model produced too little printable text to cut")
    stop = visible[len(visible) // 2:len(visible) // 2 + 2]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    kept = client.completions.create(
        stop=[stop], **{**kwargs, "extra_body": {"ignore_eos": True,
                                                 "include_stop_str_in_output": True}}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop


def test_chat_echo_starts_the_answer_with_the_assistant_message_it_continues(server):
    client = server.openai()
    go_on = [*USER, {"role": "assistant", "content": "Well,"}]
    fields = {"model": MODEL, "max_tokens": 5, "temperature": 0,
              "extra_body": {"ignore_eos": True, "add_generation_prompt": False,
                             "continue_final_message": True}}
    plain = client.chat.completions.create(messages=go_on, **fields).choices[0].message.content
    echo_fields = {**fields, "extra_body": {**fields["extra_body"], "echo": True}}
    echoed = client.chat.completions.create(messages=go_on, **echo_fields)
    assert echoed.choices[0].message.content == "Well," + plain
    chunks = client.chat.completions.create(messages=go_on, stream=True, **echo_fields)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Well," + plain
    # The last message is the user's, not the answer's role: nothing to echo (vLLM's rule).
    asked = client.chat.completions.create(messages=USER, max_tokens=5, temperature=0,
                                           model=MODEL, extra_body={"echo": True,
                                                                    "ignore_eos": True})
    alone = client.chat.completions.create(messages=USER, max_tokens=5, temperature=0,
                                           model=MODEL, extra_body={"ignore_eos": True})
    assert asked.choices[0].message.content == alone.choices[0].message.content


def test_documents_reach_the_chat_template_and_tokenize_shows_the_chats_prompt(server):
    template = ("{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
                "{{ messages[-1]['content'] }}{% if tools %}<{{ tools|length }} tools>"
                "{% endif %}")
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"messages": USER, "chat_template": template, "documents": docs,
            "add_special_tokens": False}
    assert bytes(_tokens(server, body)).decode() == "[A: alpha][B: beta]Hi there"
    shown = _tokens(server, {**body, "tools": tools, "tool_choice": "required"})
    assert bytes(shown).decode() == "[A: alpha][B: beta]Hi there<1 tools>"
    hidden = _tokens(server, {**body, "tools": tools, "tool_choice": "none"})
    assert bytes(hidden).decode() == "[A: alpha][B: beta]Hi there"  # as the chat: not shown
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1,
        extra_body={"chat_template": template, "documents": docs})
    assert chat.usage.prompt_tokens == len(_tokens(server, {**body,
                                                            "add_special_tokens": True}))
    for bad in ([{"title": 1}], {"title": "A"}):
        status, answer = _post(server, "/v1/chat/completions",
                               {"model": MODEL, "messages": USER, "documents": bad})
        assert status == 400 and answer["error"]["param"] == "documents", answer


def test_a_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(server):
    card = server.openai().models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] > 0
    status, _, raw = server.request("GET", "/v1/models/gpt-4")
    error = json.loads(raw)["error"]
    assert status == 404 and error["code"] == "model_not_found" and "gpt-4" in error["message"]
