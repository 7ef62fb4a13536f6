"""The output processor on its own: engine updates in, text, tokens and logprobs out."""

from __future__ import annotations

from pdserve.messages import RequestUpdate
from pdserve.model.tokenizer import ByteTokenizer
from pdserve.output import OutputProcessor
from pdserve.sampling_params import SamplingParams

TOKENIZER = ByteTokenizer()


def _processor(**params) -> OutputProcessor:
    return OutputProcessor(TOKENIZER, [TOKENIZER.BOS], SamplingParams(max_tokens=64, **params))


def _update(ids: list[int], reason: str | None = None, logprobs: list[float] | None = None
            ) -> RequestUpdate:
    return RequestUpdate("r", ids, logprobs, reason is not None, reason, 1, 0)


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _run(processor: OutputProcessor, steps: list[RequestUpdate]) -> tuple[list[str], list]:
    deltas = [processor.process([u]) for u in steps]
    return [d.text for d in deltas], deltas


def test_a_stop_string_split_across_tokens_ends_the_request_where_it_starts():
    processor = _processor(stop=["END"])
    texts, deltas = _run(processor, [_update(_bytes("abE")), _update(_bytes("N")),
                                     _update(_bytes("Dxyz"))])
    # "E" and "N" could begin "END": held back, then dropped with it.
    assert texts == ["ab", "", ""]
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert deltas[-1].abort  # the engine still runs it: the caller must abort
    assert deltas[-1].token_ids == _bytes("D")  # "xyz" came after the stop: not output
    assert processor.num_generated == 5 and processor.finished  # a b E N D


def test_a_held_back_prefix_that_does_not_become_a_stop_is_released():
    processor = _processor(stop=["END"])
    texts, deltas = _run(processor, [_update(_bytes("abE")), _update(_bytes("Nx")),
                                     _update(_bytes("y"), "length")])
    assert "".join(texts) == "abENxy"
    assert texts[0] == "ab" and deltas[-1].finish_reason == "length"
    assert not any(d.abort for d in deltas)


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it():
    processor = _processor(stop=["END"], include_stop_str_in_output=True)
    texts, deltas = _run(processor, [_update(_bytes("abEN")), _update(_bytes("DEx"))])
    assert "".join(texts) == "abEND"
    assert deltas[-1].finish_reason == "stop"


def test_an_incomplete_utf8_character_is_held_until_its_last_byte():
    snow = _bytes("☃")  # three byte tokens
    processor = _processor()
    texts, _ = _run(processor, [_update(_bytes("a")), _update(snow[:1]), _update(snow[1:2]),
                                _update(snow[2:] + _bytes("b"), "length")])
    assert texts == ["a", "", "", "☃b"]


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement():
    processor = _processor()
    texts, _ = _run(processor, [_update(_bytes("a")), _update(_bytes("☃")[:2], "length")])
    assert texts == ["a", "\ufffd"]


def test_logprobs_stay_aligned_with_tokens_when_a_stop_string_cuts_a_step():
    processor = _processor(stop=["cd"], logprobs=True)
    ids = _bytes("abcdef")
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    delta = processor.process([_update(ids[:2], logprobs=logprobs[:2]),
                               _update(ids[2:], logprobs=logprobs[2:])])
    assert delta.text == "ab" and delta.finish_reason == "stop"
    assert delta.token_ids == _bytes("abcd")
    assert delta.logprobs == logprobs[:4]
    assert delta.token_texts == ["a", "b", "c", "d"]


def test_no_logprobs_unless_asked():
    delta = _processor().process([_update(_bytes("ab"), logprobs=[-1.0, -2.0])])
    assert delta.logprobs is None and delta.token_texts == []


def test_updates_after_the_finish_add_nothing():
    processor = _processor(stop=["b"])
    first = processor.process([_update(_bytes("ab"))])
    late = processor.process([_update(_bytes("cd"))])
    assert (first.text, first.finish_reason) == ("a", "stop")
    assert (late.text, late.token_ids, late.finish_reason) == ("", [], None)
    assert processor.num_generated == 2


def test_special_tokens_follow_skip_special_tokens():
    ids = _bytes("a") + [TOKENIZER.EOS]
    kept = _processor(skip_special_tokens=False).process([_update(ids, "stop")])
    skipped = _processor().process([_update(ids, "stop")])
    assert kept.text == "a</s>" and skipped.text == "a"


def test_alternatives_are_decoded_and_cut_with_the_tokens_at_a_stop_string():
    import pickle

    from pdserve.sampling_params import TokenLogprob

    processor = _processor(stop=["cd"], logprobs=True, top_logprobs=2)
    ids = _bytes("abcdef")
    logprobs = [TokenLogprob(-0.5, [(i, -0.5), (ord("z"), -1.0)]) for i in ids]
    update = pickle.loads(pickle.dumps(_update(ids, logprobs=logprobs)))  # as the pipe does
    delta = processor.process([update])
    assert delta.token_ids == _bytes("abcd")
    assert delta.top_logprobs == [[(c, -0.5), ("z", -1.0)] for c in "abcd"]
    assert _processor(logprobs=True).process([update]).top_logprobs is None
