"""Streamed answers stay byte for byte what they were: raw SSE bodies for a set of option
combinations, compared with bodies recorded before the streaming path was optimized
(``data/sse_bodies.json``; regenerate with ``python -m tests.server.test_sse_bytes``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from pdserve.server.config import ServerConfig
from tests.server.sse_replay import split_floats, stream_bodies, tiny_core

RECORDED = Path(__file__).parent / "data" / "sse_bodies.json"
PROMPT = "The quick brown fox"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tiny model's random weights mostly pick ids that are no text; this leans it towards
# letters and spaces so that most chunks carry text, as a real model's do.
TEXTY = {str(byte): 6.0 for byte in b"abcdefghij klmnop"}


def _completion(**options) -> tuple[str, dict]:
    return ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 24,
                                "stream": True, "temperature": 0, "logit_bias": TEXTY,
                                **options})


def _chat(**options) -> tuple[str, dict]:
    return ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 24,
                                     "stream": True, "temperature": 0, "logit_bias": TEXTY,
                                **options})


CASES = {
    "completion_plain": _completion(),
    "completion_ignore_eos": _completion(ignore_eos=True),
    "completion_usage": _completion(stream_options={"include_usage": True}),
    "completion_logprobs": _completion(logprobs=3, ignore_eos=True),
    "completion_echo_logprobs": _completion(echo=True, logprobs=2, max_tokens=6),
    "completion_timing": _completion(return_engine_timing=True, ignore_eos=True),
    "completion_stop": _completion(stop=["e"], ignore_eos=True),
    "completion_n2_seeded": _completion(n=2, temperature=1.0, seed=7, ignore_eos=True),
    "completion_best_of_refused": _completion(best_of=2, temperature=1.0, seed=3),
    "chat_plain": _chat(ignore_eos=True),
    "chat_usage_logprobs": _chat(logprobs=True, top_logprobs=2, ignore_eos=True,
                                 stream_options={"include_usage": True}),
    "chat_timing_usage": _chat(return_engine_timing=True, ignore_eos=True,
                               stream_options={"include_usage": True}),
    "chat_n3": _chat(n=3, temperature=0.8, seed=11, ignore_eos=True),
    "chat_tool_named": _chat(tools=[WEATHER], max_tokens=40, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}),
    "chat_tool_required": _chat(tools=[WEATHER], max_tokens=40, tool_choice="required",
                                stream_options={"include_usage": True}),
    "chat_tool_auto": _chat(tools=[WEATHER], tool_choice="auto", ignore_eos=True),
    "chat_tool_auto_unbiased": _chat(tools=[WEATHER], tool_choice="auto", logit_bias={}),
}
STEPS_PER_BATCH = (1, 3)  # one token per chunk, and several (a server that fell behind)
CONFIG = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def record() -> dict[str, dict[str, str]]:
    core = tiny_core()
    requests = list(CASES.values())
    out = {}
    for steps in STEPS_PER_BATCH:
        bodies = asyncio.run(stream_bodies(core, requests, steps, CONFIG))
        out[str(steps)] = {name: body.decode() for name, body in zip(CASES, bodies,
                                                                     strict=True)}
    return out


@pytest.fixture(scope="module")
def bodies() -> dict[str, dict[str, str]]:
    return record()


def test_the_recording_covers_every_case():
    recorded = json.loads(RECORDED.read_text())
    assert {steps: sorted(cases) for steps, cases in recorded.items()} == {
        str(steps): sorted(CASES) for steps in STEPS_PER_BATCH}


@pytest.mark.parametrize("steps", STEPS_PER_BATCH)
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_bytes_are_unchanged(bodies, case, steps):
    recorded, recorded_floats = split_floats(json.loads(RECORDED.read_text())[str(steps)][case])
    body, floats = split_floats(bodies[str(steps)][case])
    assert body == recorded
    assert floats == pytest.approx(recorded_floats, abs=1e-4)


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(record(), indent=1, ensure_ascii=False) + "\n")
    sys.exit(0)
