"""The detokenizer's table look-up gives exactly the text deltas of its decode path.

Random token sequences (plain pieces, byte-fallback and partial UTF-8 byte tokens, special
and added tokens, ids past the tokenizer's vocab for the tiny model), random push sizes,
prompts, stop strings and ``skip_special_tokens``, for the tiny model's byte tokenizer and
Hugging Face tokenizers built here the way Llama 2 (SentencePiece BPE with byte fallback),
Mistral-style Metaspace and Llama 3 / Qwen2 (byte-level BPE) checkpoints ship them.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model.arch import PRESETS
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = ["hello world, the quick brown fox " * 20, "héllo wörld — ok", "世界你好，再见",
         "emoji 🎉 done", "<tool> call </tool>"]
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def _trained(pre_tokenizer, normalizer, vocab_size: int):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, trainers

    tok = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                       special_tokens=SPECIALS))
    return json.loads(tok.to_str())


def _with_byte_tokens(spec: dict) -> dict:
    """SentencePiece's vocab layout: specials, the 256 <0xNN> byte tokens, then pieces."""
    pieces = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    order = SPECIALS + BYTE_TOKENS + [p for p in pieces if p not in SPECIALS]
    spec["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    for added in spec["added_tokens"]:
        added["id"] = order.index(added["content"])
    return spec


def _llama2_spec() -> dict:
    from tokenizers import normalizers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                       normalizers.Replace(" ", "▁")])
    spec = _with_byte_tokens(_trained(None, normalizer, 120))
    spec["decoder"] = LLAMA2_DECODER
    return spec


def _metaspace_spec() -> dict:
    from tokenizers import pre_tokenizers

    spec = _with_byte_tokens(_trained(pre_tokenizers.Metaspace(), None, 120))
    spec["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                       "split": True}
    return spec


def _byte_level_spec() -> dict:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    return json.loads(tok.to_str())


def _save(folder, spec: dict) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    rust = RustTokenizer.from_str(json.dumps(spec))
    rust.add_tokens([AddedToken("<tool>", special=False)])  # added, not special: decoded
    rust.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                              "eos_token": "</s>"}))
    return load_tokenizer(str(folder))


@pytest.fixture(scope="module", params=["tiny", "llama2", "metaspace", "byte_level"])
def tokenizer_and_vocab(request, tmp_path_factory) -> tuple[Tokenizer, int]:
    if request.param == "tiny":
        return load_tokenizer(None, PRESETS["tiny"]), PRESETS["tiny"].vocab_size
    spec = {"llama2": _llama2_spec, "metaspace": _metaspace_spec,
            "byte_level": _byte_level_spec}[request.param]()
    tokenizer = _save(tmp_path_factory.mktemp(request.param), spec)
    return tokenizer, tokenizer.vocab_size


def _stream(tokenizer: Tokenizer, case: dict, use_piece_table: bool) -> tuple:
    detok = IncrementalDetokenizer(tokenizer, case["prompt"], case["stop"],
                                   case["skip_special_tokens"], use_piece_table)
    ids, sizes, pieces, start = case["ids"], case["sizes"], [], 0
    for size in sizes * len(ids):
        if start >= len(ids):
            break
        pieces.append(detok.push(ids[start:start + size]))
        start += size
    return pieces, detok.flush(), detok.stopped, detok.stop_reason


def _cases(tokenizer: Tokenizer, vocab: int):
    table = sorted(tokenizer.piece_table)
    specials = [tokenizer.bos_token_id, *tokenizer.eos_token_ids]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(table), st.sampled_from(table),
                      st.sampled_from(specials))
    stop_text = st.text(alphabet=" helowrd世界🎉\ufffd", min_size=1, max_size=3)
    return st.fixed_dictionaries({
        "prompt": st.lists(token, max_size=8), "ids": st.lists(token, max_size=40),
        "sizes": st.lists(st.integers(1, 4), min_size=1, max_size=4),
        "stop": st.lists(stop_text, max_size=2), "skip_special_tokens": st.booleans()})


def test_table_lookup_gives_the_decode_paths_deltas(tokenizer_and_vocab):
    tokenizer, vocab = tokenizer_and_vocab
    assert tokenizer.piece_table  # a fast path that never runs would prove nothing

    @settings(max_examples=400, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_cases(tokenizer, vocab))
    def check(case):
        assert _stream(tokenizer, case, True) == _stream(tokenizer, case, False)

    check()


def test_plain_text_streams_without_a_decode(tokenizer_and_vocab):
    """After a prompt ending in a table token, plain text is looked up token by token."""
    tokenizer, _ = tokenizer_and_vocab
    ids = tokenizer.encode(" the quick brown fox", add_special_tokens=False)
    assert all(i in tokenizer.piece_table for i in ids)
    calls = []
    original = tokenizer.decode
    tokenizer.decode = lambda ids, skip=True: calls.append(ids) or original(ids, skip)
    try:
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello world"))
        text = "".join(detok.push([i]) for i in ids) + detok.flush()
    finally:
        del tokenizer.decode
    assert text == tokenizer.decode(tokenizer.encode("hello world") + ids)[len("hello world"):]
    assert calls == []


@pytest.mark.parametrize("decoder", [
    # WordPiece joins tokens with spaces it decides from the neighbour.
    {"type": "WordPiece", "prefix": "##", "cleanup": True},
    # After Fuse, a Replace sees the whole text: "ab" split over two tokens still matches.
    {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Replace",
                                                         "pattern": {"String": "ab"},
                                                         "content": "X"}]},
    # A trailing strip would cut the newest token's end.
    {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Strip", "content": " ",
                                                         "start": 0, "stop": 1}]}])
def test_a_decoder_that_looks_across_tokens_gets_no_table(tmp_path, decoder):
    spec = _byte_level_spec()
    spec["decoder"] = decoder
    assert _save(tmp_path, spec).piece_table == {}
