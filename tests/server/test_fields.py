"""The table of request fields in docs/server.md, walked against a running server: it agrees
with the server's own field tables, every field it lists as refused is answered with a 400
naming that field, and the same field at its "off" value is accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.server import protocol as P

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 1},
        "chat": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 1}}

# A value that switches each refused feature on (what a client wanting it would send).
ACTIVE = {
    "n": 2, "best_of": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "logit_bias": {"65": 10}, "min_p": 0.1,
    "allowed_token_ids": [65, 66], "bad_words": ["x"], "logits_processors": ["m.f"],
    "use_beam_search": True, "length_penalty": 0.5, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "structured_outputs": {"choice": ["a", "b"]},
    "prompt_logprobs": 1, "truncate_prompt_tokens": 8, "spaces_between_special_tokens": False,
    "priority": 1, "suffix": "end", "top_logprobs": 2, "echo": True,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
    "documents": [{"text": "d"}], "audio": {"voice": "alloy"}, "modalities": ["audio"],
    "mm_processor_kwargs": {"a": 1}, "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "web_search_options": {}, "service_tier": "flex",
    "store": True, "metadata": {"k": "v"},
}


def doc_table() -> dict[str, dict[str, str]]:
    """field -> {"completions": cell, "chat": cell} from the docs' request field table."""
    text = DOC.read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n### ")]  # the table of these two endpoints only
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \| ([^|]+?) \|", section, re.MULTILINE)
    return {name: {"completions": done.strip(), "chat": chat.strip()}
            for name, done, chat in rows}


def _expected_cell(rules: dict[str, P.FieldRule], name: str) -> str:
    rule = rules.get(name)
    if rule is None:
        return "—"
    return "refused" if isinstance(rule, P.Refused) else "honoured"


def test_the_docs_table_is_the_servers_table():
    table = doc_table()
    code = {"completions": P.COMPLETION_FIELDS, "chat": P.CHAT_FIELDS}
    assert set(table) == set(P.COMPLETION_FIELDS) | set(P.CHAT_FIELDS)
    for name, cells in table.items():
        for endpoint, rules in code.items():
            assert cells[endpoint] == _expected_cell(rules, name), (name, endpoint)


def _refused_cases() -> list[tuple[str, str]]:
    return [(endpoint, name) for name, cells in doc_table().items()
            for endpoint in ENDPOINTS if cells[endpoint] in ("refused", "—")]


@pytest.mark.parametrize("endpoint, name", _refused_cases())
def test_every_refused_field_gets_a_400_naming_it(server, endpoint, name):
    value = ACTIVE.get(name, "x")  # a field unknown to the endpoint is refused at any value
    status, _, raw = server.request("POST", ENDPOINTS[endpoint],
                                    {**BASE[endpoint], name: value})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == name, (name, raw)
    assert name in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint, name", [
    (e, n) for e, rules in (("completions", P.COMPLETION_FIELDS), ("chat", P.CHAT_FIELDS))
    for n, rule in rules.items() if isinstance(rule, P.Refused)])
def test_a_refused_field_at_its_off_value_is_accepted(server, endpoint, name):
    rules = P.COMPLETION_FIELDS if endpoint == "completions" else P.CHAT_FIELDS
    for off in (None, *rules[name].off):
        status, _, raw = server.request("POST", ENDPOINTS[endpoint],
                                        {**BASE[endpoint], name: off})
        assert status == 200, (name, off, raw)


def test_an_unknown_field_is_refused_by_name(server):
    for endpoint in ENDPOINTS:
        status, _, raw = server.request("POST", ENDPOINTS[endpoint],
                                        {**BASE[endpoint], "temprature": 0.5})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "temprature"
        assert "unknown field 'temprature'" in error["message"]


def test_a_refused_field_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="functions"):
        server.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}],
            functions=[{"name": "f", "parameters": {"type": "object"}}])
