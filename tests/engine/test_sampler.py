from __future__ import annotations

import re

import pytest
import torch

from pdserve.engine.sampler import SamplingBatch, sample
from pdserve.model.tokenizer import ByteTokenizer, load_tokenizer
from pdserve.ops.launch_count import count_launches
from pdserve.request import Request
from pdserve.sampling_params import GrammarSpec, InvalidRequestError, SamplingParams
from pdserve.structured.grammars import GrammarCompiler
from tests.engine.factories import make_request


def _batch(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    requests = [make_request(1) for _ in params]
    for request, p in zip(requests, params, strict=True):
        request.params = p
        request.generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return SamplingBatch.from_requests(requests, vocab, "cpu")


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0, logprobs=True)
    tokens, logprobs = sample(logits, _batch([greedy] * 3, 50))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    want = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.sampled, want)
    assert logprobs.top_ids is None


def test_top_k_one_and_tiny_top_p_pick_the_top_token():
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)]
    tokens, _ = sample(logits, _batch(params, 50))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_never_draws_outside_the_k_best():
    logits = torch.randn(1, 30)
    allowed = set(logits.topk(3).indices[0].tolist())
    batch = _batch([SamplingParams(temperature=5.0, top_k=3)], 30)
    drawn = {sample(logits, batch)[0].item() for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[:1], _batch([seeded], 100))[0].item() for _ in range(1)]
    mixed = sample(logits, _batch([seeded, SamplingParams(), SamplingParams(seed=9)], 100))[0]
    assert mixed[0].item() == alone[0]


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    batch = _batch([SamplingParams(temperature=1.0)], 4)
    torch.manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(probs.log(), batch)[0].item()] += 1
    # 4000 draws: the standard error of each share is below 0.008; 0.03 is ~4 sigma.
    assert torch.allclose(counts / 4000, probs[0], atol=0.03)


def test_worst_case_sampling_runs_every_filter():
    from pdserve.engine.sampler import worst_case_sampling

    logits = torch.randn(4, 300) * 3
    tokens, logprobs = sample(logits, worst_case_sampling(4, 300, "cpu"))
    probs = logits.softmax(-1)
    # min-p 0.05 keeps only tokens at 5% of the best one's probability or more.
    assert all(probs[i, t] >= 0.05 * probs[i].max() for i, t in enumerate(tokens.tolist()))
    assert logprobs.sampled.shape == (4,) and logprobs.top_ids.shape == (4, 20)


def _seeded_tokens(logits: torch.Tensor, params: list[SamplingParams], width) -> list[int]:
    batch = _batch(params, logits.shape[-1])
    batch.top_k_width = width
    return sample(logits, batch)[0].tolist()


def test_top_k_first_draws_the_same_tokens_as_the_full_sort():
    torch.manual_seed(0)
    logits = torch.randn(6, 4000) * 2
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, seed=100 + i)
              for i, (k, p) in enumerate([(5, 1.0), (40, 0.9), (200, 0.5), (1000, 0.95),
                                          (3, 0.3), (1, 1.0)])]
    batch = _batch(params, 4000)
    assert batch.top_k_width == 1000  # the test covers the topk path, not the sort fallback
    for _ in range(20):
        assert _seeded_tokens(logits, params, 1000) == _seeded_tokens(logits, params, None)


def test_a_row_with_top_p_but_no_top_k_sorts_the_vocabulary():
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.9)]
    assert _batch(params, 100).top_k_width is None
    assert _batch([SamplingParams(top_k=5), SamplingParams()], 100).top_k_width == 5


def test_rows_without_filters_are_untouched_on_the_top_k_path():
    logits = torch.randn(2, 64)
    params = [SamplingParams(temperature=2.0, top_k=2), SamplingParams(temperature=5.0)]
    batch = _batch(params, 64)
    drawn = {sample(logits, batch)[0][1].item() for _ in range(300)}
    assert len(drawn) > 2  # the second row samples from the whole vocabulary


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """One row, token by token, as vLLM documents the three penalties."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def _request_with(prompt: list[int], output: list[int], params: SamplingParams):
    request = make_request(1)
    request.prompt_token_ids, request.token_ids = prompt, prompt + output
    request.params = params
    return request


def test_penalties_match_a_per_token_reference():
    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(3, vocab) * 3
    rows = [([1, 2, 3, 3], [4, 4, 4, 5, 1], SamplingParams(temperature=0, presence_penalty=0.5,
                                                          frequency_penalty=0.3,
                                                          repetition_penalty=1.3)),
            ([7, 8], [9, 9], SamplingParams(temperature=0)),
            ([10], [11, 11, 12], SamplingParams(temperature=0, frequency_penalty=-1.5))]
    requests = [_request_with(*row) for row in rows]
    batch = SamplingBatch.from_requests(requests, vocab, "cpu")
    from pdserve.engine.sampler import _penalized

    got = _penalized(logits, batch.penalties)
    for i, (prompt, output, p) in enumerate(rows):
        want = _reference_penalties(logits[i], prompt, output, p.presence_penalty,
                                    p.frequency_penalty, p.repetition_penalty)
        torch.testing.assert_close(got[i], want)


def test_greedy_sees_the_penalties_and_logprobs_the_raw_logits():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 3.0
    request = _request_with([1], [4, 4], SamplingParams(temperature=0, frequency_penalty=2.0,
                                                        logprobs=True))
    tokens, logprobs = sample(logits, SamplingBatch.from_requests([request], 10, "cpu"))
    assert tokens.item() != 4  # 3 - 2 * 2 < 0: every other token now beats it
    torch.testing.assert_close(logprobs.sampled, logits.log_softmax(-1)[0, tokens])


def test_logit_bias_moves_the_greedy_choice_and_is_clamped():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 150.0
    params = [SamplingParams(temperature=0, logit_bias={7: 1000.0}),
              SamplingParams(temperature=0, logit_bias={7: 49.0})]
    assert params[0].logit_bias == {7: 100.0}
    tokens, _ = sample(logits, _batch(params, 10))
    assert tokens.tolist() == [3, 3]  # 150 beats a bias clamped to 100
    logits[:, 3] = 40.0
    assert sample(logits, _batch(params, 10))[0].tolist() == [7, 7]


def test_allowed_token_ids_restrict_only_their_rows_and_keep_raw_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[:, 9] = 30.0  # every row's greedy choice unrestricted
    params = [SamplingParams(temperature=0, allowed_token_ids=[4, 17], logprobs=True),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[2, 3, 5])]
    batch = _batch(params, 50)
    best_allowed = 4 if logits[0, 4] > logits[0, 17] else 17
    tokens, logprobs = sample(logits, batch)
    assert tokens[:2].tolist() == [best_allowed, 9]
    # the logprob is the model's, not renormalised over the allowed tokens
    torch.testing.assert_close(logprobs.sampled[0], logits.log_softmax(-1)[0, best_allowed])
    drawn = {sample(logits, batch)[0][2].item() for _ in range(200)}
    assert drawn <= {2, 3, 5} and len(drawn) > 1
    every_row = _batch([SamplingParams(temperature=0, allowed_token_ids=[t]) for t in (1, 2, 3)],
                       50)
    assert sample(logits, every_row)[0].tolist() == [1, 2, 3]


def test_bad_words_refuse_a_words_last_token_after_the_rest_of_it():
    from pdserve.engine.sampler import bad_word_token_ids

    joined = {" x": [1120]}  # a vocabulary where the space joins "x" into one token

    def encode(text, add_special_tokens):
        return joined.get(text) or [ord(c) for c in text]

    words = bad_word_token_ids(["ab", " c", "c", "x"], encode)
    # "ab" as it is; " c" stripped, so "c" repeats it; "x" also as " x" (one token)
    assert words == ((97, 98), (99,), (120,), (1120,))
    greedy = SamplingParams(temperature=0)
    request, other = make_request(2), make_request(2)
    request.params = other.params = greedy
    request.bad_words = words
    assert request.refused_by_bad_words() == {99, 120, 1120} and request.bad_words_follow_output
    request.append_token(97, None)
    assert request.refused_by_bad_words() == {98, 99, 120, 1120}
    logits = torch.zeros(2, 2000)
    logits[:, 98] = 5.0
    batch = SamplingBatch.from_requests([request, other], 2000, "cpu")
    assert batch.refused_by_bad_words.tolist() == [98, 99, 120, 1120]
    tokens, _ = sample(logits, batch)
    assert tokens[1] == 98 and tokens[0] != 98


def test_allowed_token_ids_are_checked():
    for bad in ([], [-1], [1.5], "12", 3):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    for bad in ([" "], [3], ["w"] * 65):
        with pytest.raises(InvalidRequestError, match="bad_words"):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words="no").bad_words == ["no"]
    for other in ({"allowed_token_ids": [1]}, {"grammar": GrammarSpec("regex", "a+")}):
        with pytest.raises(InvalidRequestError, match="bad_words cannot be combined"):
            SamplingParams(bad_words=["a"], **other)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        SamplingParams(allowed_token_ids=[3, 100]).check_vocab(100)
    with pytest.raises(InvalidRequestError, match="structured output"):
        SamplingParams(allowed_token_ids=[3], grammar=GrammarSpec("regex", "a+"))


def test_min_p_never_draws_below_its_floor():
    logits = torch.tensor([[4.0, 3.5, 1.0, 0.0, -1.0]])
    batch = _batch([SamplingParams(temperature=1.0, min_p=0.5)], 5)
    probs = logits.softmax(-1)[0]
    allowed = {i for i in range(5) if probs[i] >= 0.5 * probs.max()}
    drawn = {sample(logits, batch)[0].item() for _ in range(300)}
    assert drawn == allowed == {0, 1}


def test_top_logprobs_are_the_raw_distributions_best():
    logits = torch.randn(2, 100)
    params = [SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=2, presence_penalty=1)]
    _, logprobs = sample(logits, _batch(params, 100))
    want = logits.log_softmax(-1).topk(5)
    assert logprobs.top_ids.tolist() == want.indices.tolist()
    torch.testing.assert_close(logprobs.top_values, want.values)


def test_sampling_params_refuse_out_of_range_values():
    import pytest

    from pdserve.sampling_params import InvalidRequestError

    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"min_p": 1.5},
                {"repetition_penalty": 0}, {"top_logprobs": 21}, {"logit_bias": {-1: 1.0}},
                {"logit_bias": {5: float("nan")}}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)


def test_the_engine_returns_each_tokens_alternatives_and_refuses_unknown_bias_ids():
    import pytest

    from pdserve import LLM
    from pdserve.sampling_params import InvalidRequestError, TokenLogprob

    llm = LLM("tiny", max_model_len=64)
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True,
                             top_logprobs=k) for k in (3, 0)]
    with_top, without = llm.generate(["abc", "de"], params)
    for token, logprob in zip(with_top.outputs[0].token_ids, with_top.outputs[0].logprobs,
                              strict=True):
        assert isinstance(logprob, TokenLogprob) and len(logprob.top) == 3
        assert logprob.top[0] == (token, pytest.approx(float(logprob)))  # greedy: the best
    assert not any(isinstance(lp, TokenLogprob) for lp in without.outputs[0].logprobs)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.engine.add_request("bad", [1], SamplingParams(logit_bias={10**6: 1.0}))


# ---- grammars (structured output) ----

GRAMMAR_VOCAB = 320  # the tiny preset's logits: 256 bytes, BOS, EOS and unused ids


def _grammar_request(spec: GrammarSpec | None, compiler: GrammarCompiler, seed: int = 0):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, grammar=spec)
    request = Request(f"g{seed}", [65], params, eos_token_ids=[ByteTokenizer.EOS])
    request.generator = torch.Generator().manual_seed(seed)
    if spec is not None:
        request.grammar = compiler.matcher(spec)
    return request


def _run_to_stop(requests: list[Request], logits_seed: int = 0) -> None:
    """Samples random logits for the unfinished requests, appending tokens, until each stops."""
    noise = torch.Generator().manual_seed(logits_seed)
    for _ in range(64):
        live = [r for r in requests if r.check_stop(4096) is None or r.num_output_tokens == 0]
        if not live:
            return
        logits = torch.randn(len(live), GRAMMAR_VOCAB, generator=noise) * 3
        tokens, _ = sample(logits, SamplingBatch.from_requests(live, GRAMMAR_VOCAB, "cpu"))
        for request, token in zip(live, tokens.tolist(), strict=True):
            request.append_token(token, None)


def test_grammar_rows_draw_only_what_the_grammar_allows_and_stop_at_its_end():
    compiler = GrammarCompiler(ByteTokenizer(), GRAMMAR_VOCAB)
    spec = GrammarSpec("regex", "(yes|no)-[0-9]{2}", "guided_regex")
    requests = [_grammar_request(spec, compiler, seed) for seed in range(8)]
    _run_to_stop(requests)
    for request in requests:
        *text, eos = request.token_ids[1:]
        assert re.fullmatch("(yes|no)-[0-9]{2}", bytes(text).decode()), request.token_ids
        assert eos == ByteTokenizer.EOS and request.check_stop(4096) == "stop"


def test_rows_without_a_grammar_are_untouched_by_a_grammar_row():
    compiler = GrammarCompiler(ByteTokenizer(), GRAMMAR_VOCAB)
    logits = torch.randn(3, GRAMMAR_VOCAB)
    spec = GrammarSpec("choice", '["A"]', "guided_choice")
    free = [_grammar_request(None, compiler, 1), _grammar_request(None, compiler, 2)]
    alone = sample(logits[1:], SamplingBatch.from_requests(free, GRAMMAR_VOCAB, "cpu"))[0]
    free = [_grammar_request(None, compiler, 1), _grammar_request(None, compiler, 2)]
    mixed = [_grammar_request(spec, compiler, 0), *free]
    tokens = sample(logits, SamplingBatch.from_requests(mixed, GRAMMAR_VOCAB, "cpu"))[0]
    assert tokens[0].item() == ord("A")
    assert tokens[1:].tolist() == alone.tolist()


def test_compiled_grammars_are_reused_and_bad_ones_name_their_field():
    compiler = GrammarCompiler(ByteTokenizer(), GRAMMAR_VOCAB)
    spec = GrammarSpec("json", '{"type": "integer"}', "guided_json")
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert first.raw is not second.raw and len(compiler._compiled) == 1
    for bad in (GrammarSpec("regex", "a(b", "guided_regex"),
                GrammarSpec("json", '{"type": "foo"}', "response_format.json_schema.schema"),
                GrammarSpec("grammar", "start: x\nx: 'a' |", "guided_grammar")):
        with pytest.raises(InvalidRequestError, match=re.escape(bad.field)):
            compiler.matcher(bad)


def test_a_token_outside_the_grammar_fails_the_request_instead_of_hiding_it():
    compiler = GrammarCompiler(ByteTokenizer(), GRAMMAR_VOCAB)
    request = _grammar_request(GrammarSpec("regex", "ab", "guided_regex"), compiler)
    request.append_token(ord("a"), None)
    assert request.check_stop(4096) is None
    request.append_token(ord("z"), None)  # as if sampled without the mask
    assert request.check_stop(4096) == "error"


def _bpe_folder(folder) -> str:
    """A small byte-level BPE in the Hugging Face format: tokens of several characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "yes", "value": 12} no yes 0123456789 ' * 50], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return str(folder)


def test_a_hugging_face_tokenizers_grammar_rows_decode_to_matching_text(tmp_path):
    tokenizer = load_tokenizer(_bpe_folder(tmp_path))
    compiler = GrammarCompiler(tokenizer, GRAMMAR_VOCAB)  # logits wider than the table
    spec = GrammarSpec("regex", '(yes|no) [0-9]{1,3}', "guided_regex")
    requests = [_grammar_request(spec, compiler, seed) for seed in range(8)]
    for request in requests:
        request.eos_token_ids = tokenizer.eos_token_ids
    _run_to_stop(requests)
    multi = 0
    for request in requests:
        *text, eos = request.token_ids[1:]
        assert eos in tokenizer.eos_token_ids
        assert re.fullmatch("(yes|no) [0-9]{1,3}", tokenizer.decode(text)), text
        multi += any(len(tokenizer.decode([t])) > 1 for t in text)
    assert multi  # the BPE's multi-character tokens were used, not bytes only


@pytest.mark.parametrize("rows", [[SamplingParams(temperature=0)] * 2,
                                  [SamplingParams(temperature=0.7),
                                   SamplingParams(temperature=0.9, top_k=20, top_p=0.8)],
                                  [SamplingParams(temperature=0), SamplingParams(temperature=0.7)]])
def test_a_step_takes_the_greedy_argmax_only_for_greedy_rows_and_no_softmax_to_draw(rows):
    """The draw is an argmax over logits / T - log E: no probabilities unless top-p needs
    the sorted mass, and the greedy argmax only in a batch that has a greedy row."""
    logits = torch.randn(len(rows), 500, generator=torch.Generator().manual_seed(7)) * 3
    with count_launches() as count:
        sample(logits, _batch(rows, 500))
    greedy = any(p.temperature == 0 for p in rows)
    drawn = any(p.temperature > 0 for p in rows)
    assert count.by_name["aten::argmax"] == int(greedy) + int(drawn)
    assert count.by_name["aten::_softmax"] == int(any(p.top_p < 1 for p in rows))
