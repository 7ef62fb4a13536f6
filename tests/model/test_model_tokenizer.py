from __future__ import annotations

import json

import jinja2
import pytest

from pdserve.model.arch import PRESETS
from pdserve.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)

TEXTS = ["hello world", "héllo wörld — ok", "世界你好，再见", "emoji 🎉👩‍👩‍👧 done",
         "mixed 日本語 🍣 text"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A small byte-level BPE: multi-byte characters stay split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox " * 20] + TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    folder = tmp_path_factory.mktemp("tok")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 299]}))
    return folder


@pytest.fixture(params=["byte", "hf"])
def tokenizer(request):
    if request.param == "byte":
        return load_tokenizer(None, PRESETS["tiny"])
    return load_tokenizer(str(request.getfixturevalue("hf_folder")))


def test_round_trip(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_specials():
    tok = ByteTokenizer()
    assert tok.encode("a</s>b", add_special_tokens=False) == [97, 257, 98]
    assert tok.decode([256, 97, 257]) == "a"
    assert tok.decode([256, 97, 257], skip_special_tokens=False) == "<s>a</s>"
    assert tok.decode([97, 5000, 98]) == "ab"  # a dummy model may sample ids past the bytes
    assert tok.decode([0xE2, 300, 0x98, 257, 0x83]) == "☃"  # skipped ids split no character
    assert tok.decode([0xE2, 257, 0x98], skip_special_tokens=False) == "\ufffd</s>\ufffd"
    assert tok.eos_token_ids == [257] and tok.vocab_size == 258
    assert tok.vocab_size <= PRESETS["tiny"].vocab_size


def test_hf_tokenizer_specials(hf_folder):
    tok = load_tokenizer(str(hf_folder))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, [1, 299])
    assert tok.vocab_size == 300


def test_default_chat_template():
    text = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_checkpoint_chat_template(hf_folder):
    tok = load_tokenizer(str(hf_folder))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[system] be brief</s>\n[user] hi</s>\n[assistant] "
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("</s>\n")
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_template_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'X' }}"}))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, ByteTokenizer) and tok.apply_chat_template([]) == "X"


def _stream(tokenizer, ids, prompt=(), stop=None, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), stop=stop)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, pieces, detok.flush()


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_streams_multibyte_text(tokenizer, chunk):
    for text in TEXTS:
        prompt = tokenizer.encode("say:")
        ids = tokenizer.encode(" " + text, add_special_tokens=False)
        _, pieces, tail = _stream(tokenizer, ids, prompt, chunk=chunk)
        assert not any("\ufffd" in p for p in pieces), pieces
        assert "".join(pieces) + tail == tokenizer.decode(ids)
        assert tail == ""


def test_detokenizer_skips_eos(tokenizer):
    ids = tokenizer.encode("ok", add_special_tokens=False) + tokenizer.eos_token_ids[:1]
    _, pieces, tail = _stream(tokenizer, ids)
    assert "".join(pieces) + tail == "ok"


def test_incomplete_char_at_end_is_flushed():
    tok = ByteTokenizer()
    ids = list("a🎉".encode())[:-1]  # generation ended mid-character
    _, pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == "a" and tail == "\ufffd"


def test_stop_string_across_token_boundaries(tokenizer):
    ids = tokenizer.encode("hello STOP world", add_special_tokens=False)
    detok, pieces, tail = _stream(tokenizer, ids, stop=["STOP"])
    assert "".join(pieces) == "hello " and tail == ""
    assert detok.stopped and detok.stop_reason == "STOP"
    assert detok.push(tokenizer.encode("more", add_special_tokens=False)) == ""


def test_stop_string_held_back_until_it_cannot_match():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["世界"])
    assert detok.push(list("ab世".encode())) == "ab"  # "世" might begin the stop string
    assert detok.push(list(b"x")) == "世x"
    assert detok.push(list("世".encode())) == ""
    assert detok.push(list("界".encode())) == ""
    assert detok.stopped and detok.stop_reason == "世界"


def test_earliest_stop_wins_and_flush_returns_held_tail():
    tok = ByteTokenizer()
    detok, pieces, _ = _stream(tok, list(b"xx END yy STOP"), stop=["STOP", "END"])
    assert "".join(pieces) == "xx " and detok.stop_reason == "END"
    detok, pieces, tail = _stream(tok, list(b"abc ST"), stop=["STOP"])
    assert "".join(pieces) == "abc " and tail == "ST" and not detok.stopped


def test_push_cost_does_not_grow_with_output():
    """Every decode call sees a short window, however long the output gets."""
    tok = ByteTokenizer()
    windows = []
    original = tok.decode
    tok.decode = lambda ids, skip=True: windows.append(len(ids)) or original(ids, skip)
    ids = list(("世界 🎉 " * 300).encode())
    _, pieces, tail = _stream(tok, ids, prompt=[256, 1, 2, 3, 4, 5, 6, 7], stop=["nope!"])
    assert "".join(pieces) + tail == "世界 🎉 " * 300
    assert max(windows) <= 12
