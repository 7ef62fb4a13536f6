"""``LLM.chat``, the offline chat API as vLLM's: conversations through the chat template,
BOS as the server adds it."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.sampling_params import InvalidRequestError

HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as engine:
        yield engine


def test_a_chat_is_generate_on_the_rendered_conversation(llm):
    (out,) = llm.chat(HELLO, GREEDY)
    text = llm.tokenizer.apply_chat_template(HELLO, True)
    ids = llm.tokenizer.encode(text, add_special_tokens=not llm.tokenizer.starts_with_bos(text))
    (plain,) = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].text == plain.outputs[0].text and len(out.outputs[0].token_ids) == 6


def test_several_conversations_and_text_parts(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}]}]
    other = [{"role": "user", "content": "Bye"}]
    outs = llm.chat([HELLO, parts, other], GREEDY)
    assert outs[0].outputs[0].text == outs[1].outputs[0].text  # the same conversation
    assert outs[2].prompt != outs[0].prompt
    conversation = [*HELLO, {"role": "assistant", "content": "Hi"}]
    (continued,) = llm.chat(conversation, GREEDY, add_generation_prompt=False)
    assert continued.prompt == llm.tokenizer.apply_chat_template(conversation, False)
    assert continued.prompt != llm.chat(conversation, GREEDY)[0].prompt


def test_a_message_that_is_not_text_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequestError, match="conversation"):
        llm.chat([["not a message"]])
